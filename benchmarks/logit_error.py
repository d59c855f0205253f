"""Logit error of quantization: final logits of a quantized model against the same model unquantized.

Both sides are loaded as the shard loads them (`load_pretrained`: a pre-quantized checkpoint is read
into our layers, QUANTIZE=int8 / bitsandbytes quantize at load) in the same dtype, then each of
`--prompts` random prompts (seeded, ids above the special tokens) runs once through both; the
report gives the mean and lowest cosine similarity of the last position's logits and how often
the two pick the same greedy token.

    .venv/bin/python -m benchmarks.logit_error --base MODEL --quantize int8
    .venv/bin/python -m benchmarks.logit_error --base MODEL --quantized GPTQ_DIR --prompts 32
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _model(path: Path, dtype: str, quantize: str | None) -> Any:
    from text_generation_server.config import ServerConfig
    from text_generation_server.engines.loading import load_pretrained

    config = ServerConfig(
        model_name=str(path), deployment_framework="tgis_native", dtype=dtype, quantize=quantize
    )
    return load_pretrained(config).model


def measure(
    base: Path, quantized: Path | None, quantize: str | None, dtype: str, prompts: int, length: int
) -> dict[str, Any]:
    """Mean and lowest cosine of the final logits, and greedy agreement, over `prompts` prompts."""
    import torch

    reference = _model(base, dtype, None)
    candidate = _model(quantized or base, dtype, quantize)
    vocab = int(reference.config.vocab_size)
    rng = random.Random(0)
    cosines, agree = [], 0
    with torch.inference_mode():
        for _ in range(prompts):
            ids = torch.tensor([[rng.randrange(10, vocab) for _ in range(length)]], device=reference.device)
            a = reference(ids).logits[0, -1].float()
            b = candidate(ids).logits[0, -1].float()
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=0).item())
            agree += int(a.argmax() == b.argmax())
    from text_generation_server.quantization import resident_bytes

    return {
        "base": str(base),
        "quantized": str(quantized) if quantized else f"QUANTIZE={quantize}",
        "dtype": dtype,
        "prompts": prompts,
        "prompt_tokens": length,
        "mean_cosine": statistics.fmean(cosines),
        "min_cosine": min(cosines),
        "greedy_agreement": agree / prompts,
        "weights_mib": {
            "base": resident_bytes(reference) / 2**20,
            "quantized": resident_bytes(candidate) / 2**20,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the unquantized model directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--quantized", type=Path, help="a pre-quantized checkpoint of the same model")
    source.add_argument("--quantize", help="QUANTIZE applied to the base at load (int8, bitsandbytes, ...)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = measure(args.base, args.quantized, args.quantize, args.dtype, args.prompts, args.input_len)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
