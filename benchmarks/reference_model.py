"""The reference models of the benchmarks, built offline and deterministically.

tiny-llama-512x8 (the default): a Llama with hidden 512, 8 layers, 8 heads / 2 KV heads (head
dim 64), FFN 1376, vocabulary 8192, untied embeddings, about 30.5 M parameters.
llama-1b (`--reference llama-1b`, for GPUs): hidden 2048, 16 layers, 32 heads / 8 KV heads (head
dim 64), FFN 8192, vocabulary 8192, untied, about 1.0 B parameters (2 GB in bfloat16).
tiny-gpt2-512x8, tiny-gpt-bigcode-512x8 (multi-query), tiny-gpt-neox-512x8: the same widths (hidden
512, 8 layers, 8 heads, FFN 1376, vocabulary 8192) in the LayerNorm architectures, for the C++
decoder stack's other op (`python -m benchmarks.engine_step --compare cpu-forward --reference ...`).
tiny-llama-512x8-stdlib: tiny-llama-512x8's shape and initial weights, trained on the standard
library's sources (reference_training.py, about 20 minutes on two cores): a small code model
whose outputs have structure, for measuring speculation's acceptance (`--reference`).
All start from random weights drawn from a fixed seed and are saved in bfloat16 (exact in float32 too),
and a byte-level BPE tokenizer trained on this Python's standard-library sources, with the
training recipe of the tiny test models (text_generation_server/testing/tiny_models.py) at
vocabulary 8192.

The build imports torch and transformers, so the harness runs it in a child process
(`ensure_reference_model`) and stays light itself:

    python -m benchmarks.reference_model [--name llama-1b] --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.reference_training import TrainingRecipe

logger = logging.getLogger(__name__)

NAME = "tiny-llama-512x8"  # the default
RECIPE_VERSION = 1  # bump when the recipe changes: cached builds are then rebuilt
# the config.json fields of each reference model; "architecture" is its model_type (llama if absent)
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1376,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
}
SHAPES: dict[str, dict[str, Any]] = {
    NAME: TINY_LLAMA,
    f"{NAME}-stdlib": TINY_LLAMA,  # trained (TRAINED)
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 8192,
        "max_position_embeddings": 2048,
    },
    "tiny-gpt2-512x8": {
        "architecture": "gpt2",
        "n_embd": 512,
        "n_layer": 8,
        "n_head": 8,
        "n_inner": 1376,
        "vocab_size": 8192,
        "n_positions": 2048,
    },
    "tiny-gpt-bigcode-512x8": {
        "architecture": "gpt_bigcode",
        "n_embd": 512,
        "n_layer": 8,
        "n_head": 8,
        "n_inner": 1376,
        "multi_query": True,
        "vocab_size": 8192,
        "n_positions": 2048,
    },
    "tiny-gpt-neox-512x8": {
        "architecture": "gpt_neox",
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "intermediate_size": 1376,
        "vocab_size": 8192,
        "max_position_embeddings": 2048,
    },
}
# the reference models trained after their random initialisation (reference_training.py)
TRAINED: dict[str, TrainingRecipe] = {f"{NAME}-stdlib": TrainingRecipe()}
SEED = 1234
INIT_STD = 0.02
SAVED_DTYPE = "bfloat16"
STAMP_FILE = "reference_model.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / ".cache" / "bench-models"
DEFAULT_DIR = MODELS_DIR / NAME


def build(out: Path, name: str = NAME) -> dict[str, Any]:
    """Write the config, weights and tokenizer of reference model `name` into `out`; returns
    what the stamp file records."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from text_generation_server.testing import tiny_models

    hf_logging.disable_progress_bar()
    shape = dict(SHAPES[name])
    architecture = shape.pop("architecture", "llama")
    out.mkdir(parents=True, exist_ok=True)
    tiny_models.write_tokenizer(out, tiny_models.ARCHITECTURES["llama"], vocab_size=shape["vocab_size"])
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = shape.get("max_position_embeddings") or shape["n_positions"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")

    config = transformers.AutoConfig.for_model(
        architecture,
        **shape,
        **({"rms_norm_eps": 1e-5} if architecture == "llama" else {}),
        tie_word_embeddings=False,
        bos_token_id=tiny_models.BOS_ID,
        eos_token_id=tiny_models.EOS_ID,
        pad_token_id=tiny_models.PAD_ID,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
            elif param_name.endswith("weight"):
                param.fill_(1.0)  # norm scales
            else:
                param.zero_()
    params = sum(p.numel() for p in model.parameters())
    training = None
    if name in TRAINED:
        from benchmarks.reference_training import train

        training = train(model, out / "tokenizer.json", tiny_models.EOS_ID, TRAINED[name])
    model.to(getattr(torch, SAVED_DTYPE)).save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    stamp = {
        "name": name,
        "recipe_version": RECIPE_VERSION,
        "architecture": architecture,
        **shape,
        "parameters": params,
        "saved_dtype": SAVED_DTYPE,
        "seed": SEED,
        "init_std": INIT_STD,
        **({"training": training} if training else {}),
        "tokenizer": "byte-level BPE trained on the Python standard library",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return stamp


def is_built(path: Path, name: str = NAME) -> bool:
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    trained = name not in TRAINED or stamp.get("training", {}).get("recipe") == asdict(TRAINED[name])
    return bool(
        stamp.get("recipe_version") == RECIPE_VERSION
        and stamp.get("name") == name
        and trained
        and (path / "config.json").exists()
    )


def ensure_reference_model(path: Path | None = None, name: str = NAME) -> Path:
    """The directory of reference model `name` (default: under MODELS_DIR), built first (in a
    child process) when missing or stale."""
    path = path or MODELS_DIR / name
    if is_built(path, name):
        logger.info("reference model %s: %s", name, path)
        return path
    logger.info("building the reference model %s into %s", name, path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.reference_model", "--name", name, "--out", str(path)],
        check=True,
        cwd=REPO_ROOT,
        env=env,
    )
    if not is_built(path, name):
        raise RuntimeError(f"building the reference model into {path} left no {STAMP_FILE}")
    return path


CONTEXT_FILES = ("config.json", "tokenizer_config.json", STAMP_FILE)  # rewritten, the rest linked


def with_context(path: Path, positions: int) -> Path:
    """The model at `path` with `max_position_embeddings = positions`: a sibling directory
    `PATH-ctxN` whose config files say so and whose other files (weights, tokenizer) are links to
    the original's. The weights are the same (Llama has RoPE, no learned positions), so the
    result is as deterministic as the original; it is remade when the original's stamp changes."""
    out = path.with_name(f"{path.name}-ctx{positions}")
    base_stamp = (path / STAMP_FILE).read_text() if (path / STAMP_FILE).exists() else ""
    try:
        if json.loads((out / STAMP_FILE).read_text()).get("base_stamp") == base_stamp:
            return out
    except (OSError, ValueError):
        pass
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    for item in sorted(path.iterdir()):
        if item.is_file() and item.name not in CONTEXT_FILES:
            (staging / item.name).symlink_to(item.resolve())
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer_config_path = path / "tokenizer_config.json"
    if tokenizer_config_path.exists():
        tokenizer_config = json.loads(tokenizer_config_path.read_text())
        tokenizer_config["model_max_length"] = positions
        (staging / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
        )
    stamp = json.loads(base_stamp) if base_stamp else {}
    stamp.update(max_position_embeddings=positions, context_of=str(path), base_stamp=base_stamp)
    if "name" in stamp:
        stamp["name"] = f"{stamp['name']}-ctx{positions}"
    (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    logger.info("%s: %s with %d positions", out, path.name, positions)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--name", choices=sorted(SHAPES), default=NAME, help=f"which model (default {NAME})")
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (created); default: MODELS_DIR/NAME"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = args.out or MODELS_DIR / args.name
    stamp = build(out, args.name)
    logger.info("built %s (%d parameters) in %s", args.name, stamp["parameters"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
