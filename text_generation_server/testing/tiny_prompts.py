"""An adapter store for a tiny model (integration tests and the demo): TGIS's formats with
seeded random tensors, including the broken ones the tests expect errors for.

    sentiment/            PEFT prompt tuning: adapter_config.json + adapter_model.safetensors
                          (`prompt_embeddings`, 4 virtual tokens); encoder.pt for encoder-decoders
    nested/style/         decoder.pt (3 virtual tokens; encoder.pt for encoder-decoders)
    wide/                 one column more than the model's hidden size
    not-finite/           a NaN
    too-long/             `too_long` virtual tokens (more than the server allows)
    lora/                 a PEFT LoRA adapter (rank 4, every attention and MLP projection)

    python -m text_generation_server.testing.tiny_prompts MODEL_DIR OUT [--too-long N]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def hidden_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(next(config[k] for k in ("hidden_size", "n_embd", "d_model") if k in config))


def build_prompt_store(model_dir: Path, out: Path, too_long: int = 101) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    seq2seq = bool(config.get("is_encoder_decoder"))
    hidden = hidden_size(model_dir)
    part = "encoder.pt" if seq2seq else "decoder.pt"

    def tensor(rows: int, seed: int, width: int = hidden) -> torch.Tensor:
        return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 0.5

    def write(prefix_id: str, value: torch.Tensor, name: str = part) -> None:
        (out / prefix_id).mkdir(parents=True, exist_ok=True)
        torch.save(value, out / prefix_id / name)

    if seq2seq:
        write("sentiment", tensor(4, 1))
    else:
        (out / "sentiment").mkdir(parents=True, exist_ok=True)
        save_file({"prompt_embeddings": tensor(4, 1)}, str(out / "sentiment" / "adapter_model.safetensors"))
        adapter = {"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 4}
        (out / "sentiment" / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    write("nested/style", tensor(3, 2))
    write("wide", tensor(2, 3, hidden + 1))
    broken = tensor(2, 4)
    broken[1, 0] = float("nan")
    write("not-finite", broken)
    write("too-long", tensor(too_long, 5))
    build_lora(model_dir, out / "lora", seed=6)
    return out


LORA_TARGETS = {  # the projections of each family's attention and MLP
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "t5": ["q", "k", "v", "o", "wi", "wo"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_bigcode": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def build_lora(
    model_dir: Path, out: Path, seed: int, rank: int = 4, targets: list[str] | None = None
) -> Path:
    """A PEFT LoRA adapter of the model in `model_dir` with seeded non-zero A and B (PEFT
    starts B at zero, which would make the adapter a no-op), saved the way PEFT saves it."""
    import peft
    import torch
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    seq2seq = bool(config.get("is_encoder_decoder"))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32)
    family = config.get("model_type", "llama")
    lora = peft.LoraConfig(
        task_type="SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM",
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or LORA_TARGETS.get(family, LORA_TARGETS["llama"]),
    )
    tuned = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    tuned.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--too-long", type=int, default=101)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    build_prompt_store(args.model_dir, args.out, args.too_long)
    logger.info("soft prompts for %s in %s", args.model_dir, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
