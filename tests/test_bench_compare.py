"""Best against best: each system's fastest dtype per concurrency, and the targets on those."""

from __future__ import annotations

from benchmarks import compare


def _point(c: int, tok_s: float, tpot: float, failed: int = 0) -> dict:
    return {
        "mode": "concurrency",
        "max_concurrency": c,
        "completed": 10,
        "failed": failed,
        "output_throughput": tok_s,
        "p50_ttft_ms": 20.0,
        "mean_tpot_ms": tpot,
        "p50_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 1.2,
    }


def _results(ours: list[dict], vllm: list[dict], engine: dict[int, float]) -> dict:
    return {
        "metadata": {"host": {"cpu_model": "Test CPU", "cpus": 2, "isa": ["avx512_bf16"]}},
        "systems": {"ours": {"points": ours}, "vllm": {"points": vllm}},
        "baselines": {
            "engine_only": {"points": [{"batch_size": b, "output_throughput": t} for b, t in engine.items()]}
        },
    }


BY_DTYPE = {
    "float32": _results(
        [_point(1, 120, 8.0), _point(32, 1200, 25.0)],
        [_point(1, 190, 5.0), _point(32, 1230, 21.0)],
        {1: 200, 32: 1300},
    ),
    "bfloat16": _results(
        # ours at c = 32 failed a request in bf16: never "best", however fast
        [_point(1, 170, 5.9), _point(32, 1900, 17.0, failed=1)],
        [_point(1, 280, 3.1), _point(32, 1900, 14.0)],
        {1: 250, 32: 1200},
    ),
}


def test_each_system_gets_its_fastest_clean_dtype() -> None:
    best = compare.best_points(BY_DTYPE)
    assert {c: d for c, (d, _) in best["ours"].items()} == {1: "bfloat16", 32: "float32"}
    assert {c: d for c, (d, _) in best["vllm"].items()} == {1: "bfloat16", 32: "bfloat16"}
    assert compare.best_engine(BY_DTYPE) == {1: ("bfloat16", 250), 32: ("float32", 1300)}


def test_targets_on_the_best_configurations(tmp_path) -> None:
    rows = {t.name: t for t in compare.targets(compare.best_points(BY_DTYPE), compare.best_engine(BY_DTYPE))}
    assert rows["ours / engine-only output tok/s at c = 1"].value == 170 / 250
    assert rows["ours / vLLM-CPU output tok/s at c = 32"].value == 1200 / 1900
    assert rows["ours / vLLM-CPU output tok/s at c = 32"].status == "missed"
    assert rows["ours p99 / p50 TPOT at c = 1"].status == "met"
    paths = compare.write(tmp_path, BY_DTYPE)
    text = paths["best_markdown"].read_text()
    assert (
        "| ours (gRPC) | 32 | float32 | 1,200.0 |" in text and "bf16 matrix instructions: avx512_bf16" in text
    )
