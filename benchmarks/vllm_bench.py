"""The peer's own client: `vllm bench serve` as the load generator of the OpenAI-door systems.

With `--client vllm-bench`, every closed-loop point of `ours-openai`, `vllm` and `--openai-url`
is measured by `vllm bench serve --dataset-name random` (through the peer script's `bench`
command, from the peer's virtualenv) instead of our OpenAI client: the numbers vLLM publishes
are the numbers of that client, so ours beside them come from it too. Its prompts are its own
random token ids (`--seed` of the run, the same for every server), `--ignore-eos` makes every
output exactly `--output-len` tokens, and its warm-up requests (`--num-warmups`) run first.

`point_from_result` turns the JSON it saves (`--save-result --save-detailed`) into a point of
ours: the field names are already vLLM's (stats.py); what it does not report is derived from its
per-request lists (exact lengths) or left at 0 (tokens per message).
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.stats import METRICS, PERCENTILES, POINT_FIELDS

logger = logging.getLogger(__name__)

CLIENT = "vllm-bench"


def command(
    script: Path,
    base_url: str,
    model_dir: Path,
    *,
    input_len: int,
    output_len: int,
    concurrency: int,
    num_prompts: int,
    num_warmups: int,
    seed: int,
    result: Path,
) -> list[str]:
    """The command line of one point."""
    return [
        "bash",
        str(script),
        "bench",
        base_url,
        str(model_dir),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--num-warmups",
        str(num_warmups),
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def run_point(cmd: list[str], result: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    """Run one point's command; its saved JSON. RuntimeError with the log's tail on failure."""
    with log.open("ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if done.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}: {' | '.join(tail)}")
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


def point_from_result(result: dict[str, Any], input_len: int, output_len: int) -> dict[str, Any]:
    """A point of ours from `vllm bench serve`'s saved result (with --save-detailed)."""
    inputs = list(result.get("input_lens") or [])
    outputs = list(result.get("output_lens") or [])
    errors = [e or None for e in result.get("errors") or []]
    completed = int(result["completed"])
    point: dict[str, Any] = {key: result[key] for key in POINT_FIELDS if key in result}
    point.update(
        completed=completed,
        failed=int(result.get("failed", len(errors) - completed if errors else 0)),
        length_mismatches=sum(
            1
            for i, o, e in zip(inputs, outputs, errors or [None] * len(inputs), strict=False)
            if not e and (i != input_len or o != output_len)
        ),
        mean_tokens_per_message=0.0,  # not reported by this client
        input_lens=inputs,
        output_lens=outputs,
        ttfts=[round(t, 6) for t in result.get("ttfts") or []],
        e2els=[round(t, 6) for t in result.get("latencies") or []],
        itls=[[round(gap, 6) for gap in gaps] for gaps in result.get("itls") or []],
        errors=errors,
    )
    missing = [key for key in POINT_FIELDS if key not in point]
    if missing:
        raise RuntimeError(f"vllm bench serve's result lacks {', '.join(missing)}")
    return point
