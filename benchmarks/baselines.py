"""Baselines without a server, for the same model, dtype and shape, at the same batch sizes.

engine    one of the server's engines (`--engine`, from the registry) in a tight loop with no
          router, no gRPC and no detokenization, through the shard's BatchManager as the router
          calls it: prefill -> next_token with finished requests pruned, until every request has
          output_len tokens; engines with chunked prefill get the router's token budget per call
          (`--token-budget`, default the router's MAX_BATCH_PREFILL_TOKENS), so a big batch's
          prompts may take several steps. The server's overhead ratio is its output tok/s at
          concurrency c over this loop's at batch size c.
generate  transformers `model.generate` on a static batch, greedy, min_new_tokens =
          max_new_tokens = output_len (prefill timed by a separate 1-token generate).

Prompts are `input_len` random ids (BOS first when the model has one), all of one length, so no
padding, and new ones for every run (no prefix-cache hit). Each batch size is run once to warm
up, then `repeats` times; the median run is kept.
Each baseline runs in its own process so that torch never loads into the load generator:

    python -m benchmarks.baselines engine --model DIR --batch-sizes 1,8,32 --out engine.json
    python -m benchmarks.baselines engine --engine tgis_native --model DIR --out native.json
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
from router.config import DEFAULT_MAX_BATCH_PREFILL_TOKENS as DEFAULT_PREFILL_BUDGET
from router.config import DEFAULT_MAX_DECODE_CALL_MS, DEFAULT_MAX_DECODE_STEPS
from router.scheduling.batcher import step_time, steps_that_fit
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK as DEFAULT_ENGINE

logger = logging.getLogger(__name__)

KINDS = ("engine", "generate")
REPO_ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(model_dir: Path, count: int, length: int, seed: int, salt: str = "") -> list[list[int]]:
    """`count` prompts of `length` random ids; a new `salt` gives new prompts."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    bos = config.get("bos_token_id")
    rng = random.Random(f"baseline:{seed}:{salt}" if salt else f"baseline:{seed}")
    first = [int(bos)] if isinstance(bos, int) else []
    return [first + [rng.randrange(4, vocab) for _ in range(length - len(first))] for _ in range(count)]


Runner = Callable[[list[list[int]], int], dict[str, float]]


def call_steps(step_s: float | None) -> int:
    """The decode steps the router's next call asks for while nothing waits, by its defaults:
    one until a decode step was timed."""
    if step_s is None:
        return 1
    return steps_that_fit(step_s, DEFAULT_MAX_DECODE_STEPS, DEFAULT_MAX_DECODE_CALL_MS / 1000)


def engine_runner(
    model_dir: Path,
    dtype: str | None,
    max_batch: int,
    max_new: int,
    engine_name: str = DEFAULT_ENGINE,
    token_budget: int | None = None,
    max_sequence_length: int | None = None,
    quantize: str | None = None,
) -> tuple[Runner, str]:
    """The engine `engine_name` from the registry, driven through the shard's BatchManager as
    the router drives it: prefill, then next_token with the finished requests pruned, each call
    with the token budget when the engine chunks prefills (None: the router's default) and, as
    the router asks while nothing waits, for as many decode steps as its defaults allow
    (MAX_DECODE_STEPS, within MAX_DECODE_CALL_MS of the steps' average forward time). Where
    the engine pipelines steps (tgis_native on a GPU) the loop runs ahead after every call as
    the shard does, so that each step is launched before the one before it is read back."""
    from text_generation_common.messages import CachedBatchRef, GenerationRequest, SamplingParams
    from text_generation_server.batch_manager import BatchManager
    from text_generation_server.config import ServerConfig
    from text_generation_server.engines import get_engine_class

    config = ServerConfig(
        model_name=str(model_dir),
        deployment_framework=engine_name,
        dtype=dtype,
        max_batch_size=max_batch,
        max_new_tokens=max(max_new, 1),
        max_sequence_length=max_sequence_length,
        quantize=quantize,
    )
    engine = get_engine_class(engine_name)(config)
    manager = BatchManager(engine, max_batch)
    ahead = engine.pipelined
    budget = 0
    if engine.info.chunked_prefill:
        budget = DEFAULT_PREFILL_BUDGET if token_budget is None else token_budget
    batch_ids = iter(range(1, 1 << 30))
    request_ids = iter(range(1, 1 << 62))

    def run(prompts: list[list[int]], output_len: int) -> dict[str, float]:
        requests = [
            GenerationRequest(
                id=next(request_ids),
                input_ids=tuple(ids),
                max_new_tokens=output_len,
                params=SamplingParams(min_new_tokens=output_len),
            )
            for ids in prompts
        ]
        counts = dict.fromkeys((r.id for r in requests), 0)
        start = time.perf_counter()
        output = manager.prefill(next(batch_ids), requests, [], budget)
        if ahead:
            manager.run_ahead()
        if output.errors:
            raise RuntimeError(f"the engine refused requests: {output.errors}")
        prefilled: float | None = None
        steps = decode_steps = 0
        calls = 1  # the prefill's
        step_s: float | None = None  # forward time per decode step, averaged as the router does
        while True:
            steps += max(1, output.steps)
            if prefilled is not None:
                decode_steps += max(1, output.steps)
                step_s = step_time(step_s, output.forward_ns / max(1, output.steps) / 1e9)
            for generation in output.generations:
                counts[generation.request_id] += 1
            if output.errors:
                raise RuntimeError(f"a step failed requests: {output.errors}")
            if prefilled is None and all(counts.values()):
                prefilled = time.perf_counter()
            done = tuple(rid for rid, n in counts.items() if n >= output_len)
            if output.batch_id is None or len(done) == len(counts):
                break
            next_output = manager.next_token(
                [CachedBatchRef(output.batch_id, done)], budget, None, call_steps(step_s)
            )
            calls += 1
            if ahead:
                manager.run_ahead()
            if next_output is None:
                break
            output = next_output
        end = time.perf_counter()
        manager.clear()
        return {
            "duration": end - start,
            "prefill": (prefilled or end) - start,
            "output_tokens": sum(min(n, output_len) for n in counts.values()),
            "steps": steps,
            "decode_steps": decode_steps,
            "calls": calls,
            "token_budget": budget,
            "pipelined": ahead,
        }

    return run, engine.info.dtype or str(getattr(engine, "dtype", "")).removeprefix("torch.")


def generate_runner(model_dir: Path, dtype: str | None, quantize: str | None = None) -> tuple[Runner, str]:
    import torch
    import transformers

    from text_generation_server import quantization
    from text_generation_server.engines.loading import select_device, select_dtype

    device = select_device(0)
    torch_dtype, _ = select_dtype(dtype, device)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, local_files_only=True
    )
    model.to(device).eval()
    quantization.check(quantize, "hf_transformers", device)
    quantization.quantize_model(model, quantize)
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
    engine: str = DEFAULT_ENGINE,
    token_budget: int | None = None,
    max_sequence_length: int | None = None,
    quantize: str | None = None,
) -> dict[str, Any]:
    import torch

    if kind == "engine":
        run, resolved = engine_runner(
            model_dir,
            dtype,
            max(batch_sizes),
            output_len,
            engine,
            token_budget,
            max_sequence_length,
            quantize,
        )
    elif kind == "generate":
        run, resolved = generate_runner(model_dir, dtype, quantize)
    else:
        raise ValueError(f"unknown baseline {kind!r}; choose one of {', '.join(KINDS)}")
    points = []
    for size in batch_sizes:
        run(prompt_ids(model_dir, size, input_len, seed, f"{size}:warmup"), output_len)
        timed: list[dict[str, Any]] = []
        for repeat in range(max(1, repeats)):
            prompts = prompt_ids(model_dir, size, input_len, seed, f"{size}:{repeat}")
            before = cpu_times()
            result = run(prompts, output_len)
            timed.append({**result, "host_cpu": cpu_shares(before, cpu_times())})
        runs = sorted(timed, key=lambda r: r["duration"])
        best = runs[len(runs) // 2]
        tokens = best["output_tokens"]
        decode_steps = best.get("decode_steps", output_len - 1)  # generate: output_len - 1
        decode = (best["duration"] - best["prefill"]) / decode_steps if decode_steps > 0 else 0.0
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
            "steps": best.get("steps", output_len),
            **({"token_budget": best["token_budget"]} if "token_budget" in best else {}),
            **({"pipelined": True} if best.get("pipelined") else {}),
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
        # the budget each call got (0 = whole prompts: the engine does not chunk, or asked for)
        **({"engine": engine, "token_budget": points[0].get("token_budget")} if kind == "engine" else {}),
        "dtype": resolved,
        **({"quantize": quantize} if quantize else {}),
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
    engine: str | None = None,
    token_budget: int | None = None,
    max_sequence_length: int | None = None,
    quantize: str | None = None,
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
        *(["--engine", engine] if engine else []),
        *(["--token-budget", str(token_budget)] if token_budget is not None else []),
        *(["--max-sequence-length", str(max_sequence_length)] if max_sequence_length else []),
        *(["--quantize", quantize] if quantize else []),
    ]  # fmt: skip
    log_path = out.with_suffix(".log")
    logger.info(
        "running the %s baseline%s (batch sizes %s)",
        kind, f" on {engine}" if engine else "", ", ".join(map(str, batch_sizes)),
    )  # fmt: skip

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
    parser.add_argument("--engine", default=DEFAULT_ENGINE, help="engine: a DEPLOYMENT_FRAMEWORK name")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="prompt tokens per call for chunked-prefill engines (0 = whole prompts; "
        f"default: the router's {DEFAULT_PREFILL_BUDGET})",
    )
    parser.add_argument("--max-sequence-length", type=int, default=None, help="default: the model's")
    parser.add_argument("--quantize", default=None, help="QUANTIZE of the engine / model (e.g. int8)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    result = measure(
        args.kind, args.model, args.dtype, sizes, args.input_len, args.output_len, args.seed, args.repeats,
        args.engine, args.token_budget, args.max_sequence_length, args.quantize,
    )  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
