"""What the adapter tests share: an engine serving a tiny model with an adapter store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.engines.conformance import joined, sharding
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class
from text_generation_server.engines.base import ModelEngine


def engine_with_store(name: str, model_dir: Path, store: Path, **overrides) -> ModelEngine:
    config = ServerConfig(
        model_name=str(model_dir),
        deployment_framework=name,
        max_batch_size=8,
        max_sequence_length=256,
        max_new_tokens=32,
        dtype="float32",
        prefix_store_path=str(store),
        speculator_batch_gate="fixed",  # speculation at every batch size, not timed
        **sharding(),
        **overrides,
    )
    return get_engine_class(name)(joined(config))


def peft_generate(
    base_dir: Path, adapter: Path | None, ids: Sequence[int], max_new: int, merged: bool = False
) -> list[int]:
    """Greedy new tokens of the model in `base_dir` through PEFT with the adapter saved in
    `adapter` (None: the base model; `merged`: after merge_and_unload)."""
    import peft
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(base_dir)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload()
    input_ids = torch.tensor([list(ids)])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    # seq2seq: after the decoder start; causal: after the prompt (PEFT leaves virtual tokens out)
    return (out[0, 1:] if seq2seq else out[0, len(ids) :]).tolist()
