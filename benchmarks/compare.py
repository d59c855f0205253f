"""Best against best: each system at its fastest dtype, side by side.

`--dtype best` runs the whole suite once per dtype (into OUT/float32/ and OUT/bfloat16/, each a
complete same-dtype report) and then writes OUT/best.md and OUT/best.json: for every system and
concurrency, the dtype that gave the most output tokens per second and what it measured there,
and the targets for CPU speed computed on those best configurations. Which dtype is faster depends on
the CPU (bf16 matrix instructions or not), so a comparison that fixes one dtype for everybody can
flatter either side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import SYSTEM_LABELS

DTYPES = ("float32", "bfloat16")


def _points(results: dict[str, Any], system: str) -> dict[int, dict[str, Any]]:
    entry = results.get("systems", {}).get(system) or {}
    return {int(p["max_concurrency"]): p for p in entry.get("points", []) if p.get("mode") == "concurrency"}


def _engine_rows(results: dict[str, Any]) -> dict[int, float]:
    points = (results.get("baselines", {}).get("engine_only") or {}).get("points", [])
    return {int(p["batch_size"]): float(p["output_throughput"]) for p in points if "output_throughput" in p}


def best_points(by_dtype: dict[str, dict[str, Any]]) -> dict[str, dict[int, tuple[str, dict[str, Any]]]]:
    """system -> concurrency -> (dtype, point) with the highest output throughput (no failures)."""
    best: dict[str, dict[int, tuple[str, dict[str, Any]]]] = {}
    for dtype, results in by_dtype.items():
        for system in results.get("systems", {}):
            for c, point in _points(results, system).items():
                if point.get("failed") or not point.get("completed"):
                    continue
                held = best.setdefault(system, {}).get(c)
                if held is None or point["output_throughput"] > held[1]["output_throughput"]:
                    best[system][c] = (dtype, point)
    return best


def best_engine(by_dtype: dict[str, dict[str, Any]]) -> dict[int, tuple[str, float]]:
    best: dict[int, tuple[str, float]] = {}
    for dtype, results in by_dtype.items():
        for batch, tok_s in _engine_rows(results).items():
            if batch not in best or tok_s > best[batch][1]:
                best[batch] = (dtype, tok_s)
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float | None
    goal: str  # e.g. ">= 0.9"

    @property
    def status(self) -> str:
        if self.value is None:
            return "not measured"
        op, bound = self.goal.split()
        ok = self.value >= float(bound) if op == ">=" else self.value <= float(bound)
        return "met" if ok else "missed"


def targets(
    best: dict[str, dict[int, tuple[str, dict[str, Any]]]], engine: dict[int, tuple[str, float]]
) -> list[Target]:
    """Issue 11's targets, each system at its best dtype."""

    def value(system: str, c: int, key: str) -> float | None:
        found = best.get(system, {}).get(c)
        return float(found[1][key]) if found else None

    rows = []
    for c, goal in ((1, "0.85"), (32, "0.9")):
        engine_c = engine.get(c)
        ours = value("ours", c, "output_throughput")
        rows.append(
            Target(
                f"ours / engine-only output tok/s at c = {c}",
                _ratio(ours, engine_c[1] if engine_c else None),
                f">= {goal}",
            )
        )
    p99_p50 = _ratio(value("ours", 1, "p99_tpot_ms"), value("ours", 1, "p50_tpot_ms"))
    rows.append(Target("ours p99 / p50 TPOT at c = 1", p99_p50, "<= 1.5"))
    tok_s = _ratio(value("ours", 32, "output_throughput"), value("vllm", 32, "output_throughput"))
    rows.append(Target("ours / vLLM-CPU output tok/s at c = 32", tok_s, ">= 1.0"))
    tpot = _ratio(value("ours", 1, "mean_tpot_ms"), value("vllm", 1, "mean_tpot_ms"))
    rows.append(Target("ours / vLLM-CPU mean TPOT at c = 1", tpot, "<= 1.3"))
    return rows


def markdown(by_dtype: dict[str, dict[str, Any]]) -> str:
    best = best_points(by_dtype)
    engine = best_engine(by_dtype)
    host = next(iter(by_dtype.values())).get("metadata", {}).get("host", {})
    bf16 = [f for f in host.get("isa", []) if f in ("amx_bf16", "avx512_bf16")]
    lines = [
        "# Best against best",
        "",
        f"- dtypes measured: {', '.join(by_dtype)} (same-dtype reports: "
        f"{', '.join(f'{d}/results.md' for d in by_dtype)})",
        f"- host: {host.get('cpu_model', '?')}, {host.get('cpus', '?')} CPUs; "
        f"bf16 matrix instructions: {', '.join(bf16) or 'none'}",
        "",
        "| system | c | best dtype | out tok/s | TTFT p50 ms | TPOT mean / p50 / p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for system, points in best.items():
        for c in sorted(points):
            dtype, p = points[c]
            tpot = f"{p['mean_tpot_ms']:.1f} / {p['p50_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f}"
            lines.append(
                f"| {SYSTEM_LABELS.get(system, system)} | {c} | {dtype} | {p['output_throughput']:,.1f} | "
                f"{p['p50_ttft_ms']:,.1f} | {tpot} |"
            )
    for batch in sorted(engine):
        dtype, tok_s = engine[batch]
        lines.append(f"| engine-only loop | {batch} | {dtype} | {tok_s:,.1f} | | |")
    lines += ["", "| target | value | goal | status |", "|---|---|---|---|"]
    for t in targets(best, engine):
        value = "–" if t.value is None else f"{t.value:.2f}"
        lines.append(f"| {t.name} | {value} | {t.goal} | {t.status} |")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, by_dtype: dict[str, dict[str, Any]]) -> dict[str, Path]:
    best = best_points(by_dtype)
    summary = {
        "best": {
            s: {str(c): {"dtype": d, "point": p} for c, (d, p) in pts.items()} for s, pts in best.items()
        },
        "engine_only": {
            str(b): {"dtype": d, "output_throughput": t} for b, (d, t) in best_engine(by_dtype).items()
        },
        "targets": [
            {"target": t.name, "value": t.value, "goal": t.goal, "status": t.status}
            for t in targets(best, best_engine(by_dtype))
        ],
    }
    paths = {"best_markdown": out_dir / "best.md", "best_json": out_dir / "best.json"}
    paths["best_markdown"].write_text(markdown(by_dtype))
    paths["best_json"].write_text(json.dumps(summary, indent=1, default=str))
    return paths


def load(out_dir: Path, dtypes: tuple[str, ...] = DTYPES) -> dict[str, dict[str, Any]]:
    return {
        d: json.loads((out_dir / d / "results.json").read_text())
        for d in dtypes
        if (out_dir / d / "results.json").exists()
    }
