"""Baselines without a server, for the same model, dtype and shape, at the same batch sizes.

engine    the server's own engine (HFTransformersEngine) in a tight loop with no router, no
          gRPC and no detokenization: new_batch -> generate_token(first=True) -> output_len - 1
          x generate_token(first=False). The server's overhead ratio is its output tok/s at
          concurrency c over this loop's at batch size c.
generate  transformers `model.generate` on a static batch, greedy, min_new_tokens =
          max_new_tokens = output_len (prefill timed by a separate 1-token generate).

Prompts are `input_len` random ids (BOS first when the model has one), all of one length, so no
padding. Each batch size is run once to warm up, then `repeats` times; the median run is kept.
Each baseline runs in its own process so that torch never loads into the load generator:

    python -m benchmarks.baselines engine --model DIR --batch-sizes 1,8,32 --out engine.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import cpu_shares, cpu_times

logger = logging.getLogger(__name__)

KINDS = ("engine", "generate")
REPO_ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(model_dir: Path, count: int, length: int, seed: int) -> list[list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    bos = config.get("bos_token_id")
    rng = random.Random(f"baseline:{seed}")
    first = [int(bos)] if isinstance(bos, int) else []
    return [first + [rng.randrange(4, vocab) for _ in range(length - len(first))] for _ in range(count)]


Runner = Callable[[list[list[int]], int], dict[str, float]]


def engine_runner(model_dir: Path, dtype: str | None, max_batch: int, max_new: int) -> tuple[Runner, str]:
    from text_generation_common.messages import GenerationRequest, SamplingParams
    from text_generation_server.config import ServerConfig
    from text_generation_server.engines.hf_transformers import HFTransformersEngine

    config = ServerConfig(
        model_name=str(model_dir), dtype=dtype, max_batch_size=max_batch, max_new_tokens=max(max_new, 1)
    )
    engine = HFTransformersEngine(config)
    batch_ids = iter(range(1, 1 << 30))

    def run(prompts: list[list[int]], output_len: int) -> dict[str, float]:
        requests = [
            GenerationRequest(
                id=i,
                input_ids=tuple(ids),
                max_new_tokens=output_len,
                params=SamplingParams(min_new_tokens=output_len),
            )
            for i, ids in enumerate(prompts)
        ]
        start = time.perf_counter()
        batch, errors = engine.new_batch(next(batch_ids), requests)
        if errors or batch is None:
            raise RuntimeError(f"the engine refused the batch: {errors}")
        step, cached = engine.generate_token(batch, first=True)
        prefilled = time.perf_counter()
        tokens = len(step.generations)
        for _ in range(output_len - 1):
            assert cached is not None
            step, cached = engine.generate_token(cached, first=False)
            tokens += len(step.generations)
        end = time.perf_counter()
        return {"duration": end - start, "prefill": prefilled - start, "output_tokens": tokens}

    return run, str(engine.dtype).removeprefix("torch.")


def generate_runner(model_dir: Path, dtype: str | None) -> tuple[Runner, str]:
    import torch
    import transformers

    from text_generation_server.engines.hf_transformers import select_device, select_dtype

    device = select_device(0)
    torch_dtype, _ = select_dtype(dtype, device)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, local_files_only=True
    )
    model.to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id

    def generate(ids: Any, new_tokens: int) -> Any:
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
            )

    def run(prompts: list[list[int]], output_len: int) -> dict[str, float]:
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        start = time.perf_counter()
        generate(ids, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = generate(ids, output_len)
        duration = time.perf_counter() - start
        produced = (out.shape[1] - ids.shape[1]) * out.shape[0]
        return {"duration": duration, "prefill": prefill, "output_tokens": produced}

    return run, str(torch_dtype).removeprefix("torch.")


def measure(
    kind: str,
    model_dir: Path,
    dtype: str | None,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    seed: int = 0,
    repeats: int = 1,
) -> dict[str, Any]:
    import torch

    if kind == "engine":
        run, resolved = engine_runner(model_dir, dtype, max(batch_sizes), output_len)
    elif kind == "generate":
        run, resolved = generate_runner(model_dir, dtype)
    else:
        raise ValueError(f"unknown baseline {kind!r}; choose one of {', '.join(KINDS)}")
    points = []
    for size in batch_sizes:
        prompts = prompt_ids(model_dir, size, input_len, seed)
        run(prompts, output_len)  # warm-up
        timed: list[dict[str, Any]] = []
        for _ in range(max(1, repeats)):
            before = cpu_times()
            result = run(prompts, output_len)
            timed.append({**result, "host_cpu": cpu_shares(before, cpu_times())})
        runs = sorted(timed, key=lambda r: r["duration"])
        best = runs[len(runs) // 2]
        tokens = best["output_tokens"]
        decode = (best["duration"] - best["prefill"]) / (output_len - 1) if output_len > 1 else 0.0
        point = {
            "batch_size": size,
            "input_len": input_len,
            "output_len": output_len,
            "duration": best["duration"],
            "output_tokens": tokens,
            "output_throughput": tokens / best["duration"],
            "total_token_throughput": (tokens + size * input_len) / best["duration"],
            "prefill_ms": 1000.0 * best["prefill"],
            "decode_step_ms": 1000.0 * decode,
            "durations": [r["duration"] for r in runs],
            "duration_spread": (runs[-1]["duration"] / runs[0]["duration"] - 1.0) if len(runs) > 1 else 0.0,
            "host_cpu": best["host_cpu"],
            "loadavg": list(os.getloadavg()),
        }
        logger.info(
            "%s baseline, batch %d: %.0f tok/s (prefill %.1f ms, %.2f ms/step)",
            kind, size, point["output_throughput"], point["prefill_ms"], point["decode_step_ms"],
        )  # fmt: skip
        points.append(point)
    return {
        "kind": kind,
        "dtype": resolved,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "repeats": max(1, repeats),
        "points": points,
    }


def run_in_child(
    kind: str,
    model_dir: Path,
    out: Path,
    *,
    dtype: str | None,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    seed: int,
    repeats: int,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> dict[str, Any]:
    """Run one baseline in a child process (its log next to `out`); its results."""
    command = [
        sys.executable, "-m", "benchmarks.baselines", kind,
        "--model", str(model_dir),
        "--batch-sizes", ",".join(str(b) for b in batch_sizes),
        "--input-len", str(input_len),
        "--output-len", str(output_len),
        "--seed", str(seed),
        "--repeats", str(repeats),
        "--out", str(out),
        *(["--dtype", dtype] if dtype else []),
    ]  # fmt: skip
    log_path = out.with_suffix(".log")
    logger.info("running the %s baseline (batch sizes %s)", kind, ", ".join(map(str, batch_sizes)))

    def child_setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=REPO_ROOT,
            preexec_fn=child_setup,
        )
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the {kind} baseline failed ({process.returncode}); log {log_path}:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["command"] = command
    result["log"] = str(log_path)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--model", type=Path, required=True, help="model directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per batch size (median kept)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    result = measure(
        args.kind, args.model, args.dtype, sizes, args.input_len, args.output_len, args.seed, args.repeats
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
