"""Engine-level step timings of two configurations interleaved in one process: `tgis_native`
against `hf_transformers` (`--compare engines`, the default), tgis_native's C++ decoder stack
against the model's modules (`--compare cpu-forward`: CPU_FORWARD=layers / modules), or every
linear in oneDNN's packed layout against our panels (`--compare layouts`: LINEAR_LAYOUT=onednn /
panels, float32 on AVX2 CPUs), or float32 against bfloat16 (`--compare dtypes`, each with its
measured layouts; --dtype is then ignored).

Both load the same model with the same ServerConfig (float32 unless told, max batch 32) and
run the router's call sequence without a router: `new_batch` -> `generate_token` (the prefill)
-> `generate_token` per decode step. For each batch size the two configurations' steps
alternate (A, B, A, B, ...), so a load change on a shared machine hits both; medians of the
timed steps after a warm-up. Prefill: a fresh batch of B prompts per repeat (new random prompts
each time: no prefix-cache hit), also alternating.

    .venv/bin/python -m benchmarks.engine_step                 # the reference model, fp32
    .venv/bin/python -m benchmarks.engine_step --batch 1,16 --steps 50 --json out.json
    .venv/bin/python -m benchmarks.engine_step --compare cpu-forward --reference tiny-gpt-neox-512x8
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.reference_model import NAME as REFERENCE_NAME
from benchmarks.reference_model import SHAPES

logger = logging.getLogger(__name__)
# --compare -> the two configurations, A then B: (name, engine, ServerConfig overrides)
COMPARISONS: dict[str, tuple[tuple[str, str, dict[str, Any]], ...]] = {
    "engines": (("hf_transformers", "hf_transformers", {}), ("tgis_native", "tgis_native", {})),
    "cpu-forward": (
        ("modules", "tgis_native", {"cpu_forward": "modules"}),
        ("layers", "tgis_native", {"cpu_forward": "layers"}),
    ),
    "layouts": (
        ("onednn", "tgis_native", {"linear_layout": "onednn"}),
        ("panels", "tgis_native", {"linear_layout": "panels"}),
    ),
    "dtypes": (
        ("float32", "tgis_native", {"dtype": "float32"}),
        ("bfloat16", "tgis_native", {"dtype": "bfloat16"}),
    ),
}


def _requests(rng: random.Random, first_id: int, count: int, prompt: int, new: int, vocab: int) -> list[Any]:
    from text_generation_common.messages import GenerationRequest

    return [
        GenerationRequest(first_id + i, tuple(rng.randrange(10, vocab) for _ in range(prompt)), new)
        for i in range(count)
    ]


def _timed(engine: Any, batch: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    _, batch = engine.generate_token(batch)
    return (time.perf_counter() - start) * 1e3, batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.reference_model import ensure_reference_model
    from text_generation_server.config import ServerConfig
    from text_generation_server.engines import get_engine_class

    model = Path(args.model) if args.model else ensure_reference_model(name=args.reference)
    torch.set_num_threads(args.threads)
    engines = {}
    for name, engine_name, overrides in COMPARISONS[args.compare]:
        config = ServerConfig(
            model_name=str(model),
            deployment_framework=engine_name,
            max_batch_size=max(32, *args.batch, args.prefill_batch),
            max_new_tokens=args.warmup + args.steps + 2,
            **{"dtype": args.dtype, **overrides},
        )
        engines[name] = get_engine_class(engine_name)(config)
    vocab = next(iter(engines.values())).info.vocab_size
    rng = random.Random(0)
    next_id = 1
    result: dict[str, Any] = {"decode": {}, "prefill": {}}
    for size in args.batch:
        batches = {}
        for name, engine in engines.items():
            batch, errors = engine.new_batch(
                next_id, _requests(rng, next_id, size, args.prompt, args.warmup + args.steps + 2, vocab)
            )
            assert batch is not None and not errors, errors
            _, batches[name] = engine.generate_token(batch)
            next_id += size
        times: dict[str, list[float]] = {name: [] for name in engines}
        for step in range(args.warmup + args.steps):
            for name, engine in engines.items():
                ms, batches[name] = _timed(engine, batches[name])
                if step >= args.warmup:
                    times[name].append(ms)
        result["decode"][size] = {name: statistics.median(t) for name, t in times.items()}
        for name, batch in batches.items():  # what a BatchManager does when requests leave
            if batch is not None:
                engines[name].release(batch.request_ids)
        del batches
        gc.collect()
        logger.info("decode bs %d: %s", size, _line(result["decode"][size]))
    times = {name: [] for name in engines}
    for repeat in range(args.prefill_warmup + args.prefill_repeats):
        for name, engine in engines.items():
            requests = _requests(rng, next_id, args.prefill_batch, args.prompt, 1, vocab)
            next_id += args.prefill_batch
            batch, _ = engine.new_batch(next_id, requests)
            ms, batch = _timed(engine, batch)
            engine.release(r.id for r in requests)
            del batch
            gc.collect()
            if repeat >= args.prefill_warmup:
                times[name].append(ms)
    result["prefill"][f"{args.prefill_batch}x{args.prompt}"] = {
        n: statistics.median(t) for n, t in times.items()
    }
    logger.info(
        "prefill %dx%d: %s", args.prefill_batch, args.prompt, _line(next(iter(result["prefill"].values())))
    )
    return result


def _line(medians: dict[str, float]) -> str:
    (a_name, a), (b_name, b) = medians.items()
    return f"{a_name} {a:.2f} ms, {b_name} {b:.2f} ms, {b_name}/{a_name} {b / a:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: the reference model)")
    parser.add_argument(
        "--reference",
        default=REFERENCE_NAME,
        choices=sorted(SHAPES),
        help="the reference model without --model",
    )
    parser.add_argument("--compare", default="engines", choices=sorted(COMPARISONS), help="what A and B are")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 32])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prefill-batch", type=int, default=16)
    parser.add_argument("--prefill-repeats", type=int, default=30)
    parser.add_argument("--prefill-warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run(args)
    (a, _, _), (b, _, _) = COMPARISONS[args.compare]
    rows = [f"| step | {a} ms | {b} ms | {b}/{a} |", "|---|---|---|---|"]
    for size, m in result["decode"].items():
        rows.append(f"| decode bs {size} | {m[a]:.2f} | {m[b]:.2f} | {m[b] / m[a]:.3f} |")
    for shape, m in result["prefill"].items():
        rows.append(f"| prefill {shape} | {m[a]:.1f} | {m[b]:.1f} | {m[b] / m[a]:.3f} |")
    sys.stdout.write("\n".join(rows) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
