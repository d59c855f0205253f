"""What the shard reads of a model beside its weights (engines/loading.py build_context): every
end-of-sequence id it names, and the sampling parameters its generation_config.json sets."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from text_generation_server.config import ServerConfig
from text_generation_server.engines import loading


def context_of(model: Path) -> loading.ModelContext:
    config = ServerConfig(model_name=str(model))
    hf_config = loading.load_hf_config(model, config)
    tokenizer = loading.load_tokenizer(model, config)
    generation = loading.load_generation_config(model)
    return loading.build_context(
        hf_config,
        tokenizer,
        generation,
        int(hf_config.vocab_size),
        config,
        torch.device("cpu"),
        seq2seq=False,
        accepts_position_ids=True,
        accepts_logits_to_keep=True,
    )


def test_every_eos_id_and_the_sampling_defaults_of_the_generation_config(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tmp_path / "llama"
    shutil.copytree(tiny_model("llama"), model)
    plain = context_of(model)
    eos = plain.eos_token_id
    assert plain.extra_eos_token_ids == () and plain.sampling_defaults == ()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [eos, 40]}))
    generation = {"eos_token_id": [41, eos, 40, 10**9], "temperature": 0.6, "top_k": 20, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(generation))
    context = context_of(model)
    # config.json's first id stays the EOS; the others in order, once, inside the vocabulary
    assert context.eos_token_id == eos and context.extra_eos_token_ids == (40, 41)
    assert context.sampling_defaults == (("temperature", 0.6), ("top_k", 20.0))
