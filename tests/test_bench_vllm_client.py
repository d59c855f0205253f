"""The peer's client in the harness (`--client vllm-bench`): its command line and the point
made from the result it saves. Running it needs the peer installed; CI has no peer."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import vllm_bench
from benchmarks.stats import METRICS, PERCENTILES, POINT_FIELDS


def saved_result(input_lens: list[int], output_lens: list[int], errors: list[str]) -> dict:
    """What `vllm bench serve --save-result --save-detailed --metric-percentiles 50,90,99` saves."""
    result: dict = {
        "duration": 2.0,
        "completed": sum(1 for e in errors if not e),
        "failed": sum(1 for e in errors if e),
        "total_input_tokens": sum(input_lens),
        "total_output_tokens": sum(output_lens),
        "request_throughput": 1.5,
        "output_throughput": 96.0,
        "total_token_throughput": 192.0,
        "max_concurrent_requests": 2,
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [0.0201234567, 0.03],
        "itls": [[0.008, 0.009], [0.0085]],
        "latencies": [1.1, 1.2],
        "errors": errors,
        "generated_texts": ["a", "b"],
    }
    for m in METRICS:
        for stat in ("mean", "median", "std"):
            result[f"{stat}_{m}_ms"] = 1.0
        for p in PERCENTILES:
            result[f"p{p}_{m}_ms"] = 2.0
    return result


def test_a_saved_result_becomes_a_point_with_every_field() -> None:
    point = vllm_bench.point_from_result(saved_result([128, 128], [128, 127], ["", ""]), 128, 128)
    assert set(POINT_FIELDS) <= set(point)
    assert point["completed"] == 2 and point["failed"] == 0
    assert point["length_mismatches"] == 1  # 127 of 128 output tokens
    assert point["errors"] == [None, None] and point["ttfts"][0] == 0.020123
    assert point["e2els"] == [1.1, 1.2] and point["output_throughput"] == 96.0


def test_a_result_without_its_percentiles_is_refused() -> None:
    result = saved_result([128], [128], [""])
    del result["p90_tpot_ms"]
    with pytest.raises(RuntimeError, match="lacks p90_tpot_ms"):
        vllm_bench.point_from_result(result, 128, 128)


def test_the_command_asks_for_what_the_point_needs(tmp_path: Path) -> None:
    cmd = vllm_bench.command(
        Path("peer.sh"), "http://127.0.0.1:3000", tmp_path, input_len=128, output_len=64,
        concurrency=32, num_prompts=128, num_warmups=32, seed=7, result=tmp_path / "r.json",
    )  # fmt: skip
    text = " ".join(cmd)
    assert cmd[:5] == ["bash", "peer.sh", "bench", "http://127.0.0.1:3000", str(tmp_path)]
    for part in (
        "--random-input-len 128",
        "--random-output-len 64",
        "--ignore-eos",
        "--max-concurrency 32",
        "--num-prompts 128",
        "--num-warmups 32",
        "--seed 7",
        "--metric-percentiles 50,90,99",
        "--save-detailed",
        f"--result-dir {tmp_path}",
        "--result-filename r.json",
    ):
        assert part in text
