"""Our server's variants set against each other (variants.py): engines, prefix caching, long mix.

engines       each variant of another engine against the first engine of `--engine` (same
              prefill budget, same prefix-cache setting where both have it) at every point:
              output tok/s, p50 TTFT and mean TPOT ratios, and the engine-only baselines'
              output tok/s ratio at batch size = c
prefix_cache  for variants that differ only in prefix caching: p50 TTFT with and without, and
              their ratio (goal: with <= 1/3 of without on the shared-prefix workload)
long_mix      per variant on the long-prompt-mix workload: the decode streams' ITL p50 / p99 and
              their ratio (goal: p99 <= 2 x p50), the ITL of the gaps during long prefills, and
              the long prompts' TTFT

Each `*_rows` function reads the results dict (report.py's) and returns plain rows that
results.json keeps under `ratios` and results.md shows; none of them needs more than the points.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.markdown import fmt, table
from benchmarks.variants import OURS, split_key
from benchmarks.workload import LONG_MIX

PREFIX_CACHE_GOAL = 1 / 3  # p50 TTFT with the prefix cache / without, shared-prefix workload
ITL_SPREAD_GOAL = 2.0  # the streams' p99 ITL / p50 ITL in the long-prompt mix


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def ours_keys(results: dict[str, Any]) -> list[str]:
    """Our server's system keys, in the order they ran."""
    return [k for k in results.get("systems", {}) if split_key(k)[0] == OURS]


def variant_of(results: dict[str, Any], key: str) -> dict[str, Any]:
    """What a system of ours ran (engine, prefix_cache, prefill_budget); {} when not recorded."""
    info = results.get("systems", {}).get(key, {}).get("info", {})
    variant = info.get("variant") or {}
    if not variant and results.get("metadata", {}).get("engine"):
        variant = {"engine": results["metadata"]["engine"]}
    return dict(variant)


def engine_baseline(results: dict[str, Any], engine: str | None) -> dict[str, Any] | None:
    """The engine-only baseline of `engine` (`engine_only[ENGINE]`, or `engine_only` alone)."""
    baselines = results.get("baselines", {})
    if engine and f"engine_only[{engine}]" in baselines:
        return baselines[f"engine_only[{engine}]"]
    single = baselines.get("engine_only")
    if single is None:
        return None
    if engine and single.get("engine") not in (None, engine):
        return None
    return single


def x_label(point: dict[str, Any]) -> str:
    """The point's place on the x axis: its concurrency, or its rate for Poisson points."""
    if point.get("mode") == "rate":
        return f"{float(point['request_rate']):g}/s"
    return str(point.get("max_concurrency"))


def by_x(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {x_label(p): p for p in points if p.get("mode") != LONG_MIX}


def _points(results: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return list(results.get("systems", {}).get(key, {}).get("points", []))


def _group(results: dict[str, Any], dimension: str) -> dict[tuple[Any, ...], dict[Any, str]]:
    """Our variants grouped by everything but `dimension`: {rest: {dimension value: key}}."""
    groups: dict[tuple[Any, ...], dict[Any, str]] = {}
    for key in ours_keys(results):
        variant = variant_of(results, key)
        rest = tuple(sorted((k, str(v)) for k, v in variant.items() if k != dimension))
        groups.setdefault(rest, {})[variant.get(dimension)] = key
    return groups


def _get(point: dict[str, Any] | None, field: str) -> float | None:
    if point is None or point.get(field) is None:
        return None
    return float(point[field])


def engine_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each variant of another engine against the first engine's variant with the same prefill
    budget (and the same prefix-cache setting when it has one), per point."""
    order = list(results.get("metadata", {}).get("engines") or [])
    variants = {key: variant_of(results, key) for key in ours_keys(results)}
    named = {str(v["engine"]) for v in variants.values() if v.get("engine")}
    engines = sorted(named, key=lambda e: _rank(order, e))
    if len(engines) < 2:
        return []
    rows = []
    for key, variant in variants.items():
        if variant.get("engine") == engines[0]:
            continue
        peers = [
            k
            for k, v in variants.items()
            if v.get("engine") == engines[0] and v.get("prefill_budget") == variant.get("prefill_budget")
        ]
        same_cache = [k for k in peers if variants[k].get("prefix_cache") == variant.get("prefix_cache")]
        if not peers:
            continue
        base_key = (same_cache or peers)[0]
        rows.append(
            {"numerator": key, "denominator": base_key, "by_point": _engine_ratios(results, key, base_key)}
        )
    return rows


def _rank(order: list[str], engine: str) -> int:
    return order.index(engine) if engine in order else len(order)


def _engine_ratios(results: dict[str, Any], key: str, base_key: str) -> dict[str, dict[str, float | None]]:
    base_points = by_x(_points(results, base_key))
    base_engine = _engine_points(results, variant_of(results, base_key).get("engine", ""))
    engine_points = _engine_points(results, variant_of(results, key).get("engine", ""))
    per_x = {}
    for x, point in by_x(_points(results, key)).items():
        base = base_points.get(x)
        per_x[x] = {
            "output_throughput": ratio(_get(point, "output_throughput"), _get(base, "output_throughput")),
            "median_ttft": ratio(_get(point, "median_ttft_ms"), _get(base, "median_ttft_ms")),
            "mean_tpot": ratio(_get(point, "mean_tpot_ms"), _get(base, "mean_tpot_ms")),
            "engine_only_output_throughput": ratio(
                _get(engine_points.get(x), "output_throughput"), _get(base_engine.get(x), "output_throughput")
            ),
        }
    return per_x


def _engine_points(results: dict[str, Any], engine: str) -> dict[str, dict[str, Any]]:
    baseline = engine_baseline(results, engine) or {}
    return {str(p["batch_size"]): p for p in baseline.get("points", [])}


def prefix_cache_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """p50 TTFT with and without the prefix cache, per point, for each pair of variants."""
    rows = []
    for members in _group(results, "prefix_cache").values():
        on, off = members.get(True), members.get(False)
        if on is None or off is None:
            continue
        off_points = by_x(_points(results, off))
        for x, point in by_x(_points(results, on)).items():
            other = off_points.get(x)
            value = ratio(_get(point, "median_ttft_ms"), _get(other, "median_ttft_ms"))
            rows.append(
                {
                    "with": on,
                    "without": off,
                    "point": x,
                    "median_ttft_with_ms": _get(point, "median_ttft_ms"),
                    "median_ttft_without_ms": _get(other, "median_ttft_ms"),
                    "ratio": value,
                    "goal": f"<= {PREFIX_CACHE_GOAL:.2f}",
                    "status": "not measured"
                    if value is None
                    else "met"
                    if value <= PREFIX_CACHE_GOAL
                    else "missed",
                }
            )
    return rows


def long_mix_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per system measured on the long-prompt mix."""
    rows = []
    for key, system in results.get("systems", {}).items():
        for point in system.get("points", []):
            if point.get("mode") != LONG_MIX:
                continue
            long = point.get("long", {})
            spread = point.get("stream_itl_p99_over_p50")
            variant = variant_of(results, key)
            rows.append(
                {
                    "system": key,
                    "prefill_budget": variant.get("prefill_budget"),
                    "streams": point.get("max_concurrency"),
                    "streams_ok": point.get("completed"),
                    "long_ok": long.get("completed"),
                    "failed": int(point.get("failed", 0)) + int(long.get("failed", 0)),
                    "itl_p50_ms": point.get("p50_itl_ms"),
                    "itl_p99_ms": point.get("p99_itl_ms"),
                    "itl_max_ms": max((g for gaps in point.get("itls", []) for g in gaps), default=0.0)
                    * 1000.0,
                    "itl_p99_over_p50": spread,
                    "during_long_itl": point.get("during_long_itl", {}),
                    "overlapped_long": point.get("overlapped_long"),
                    "long_ttft_p50_ms": long.get("median_ttft_ms"),
                    "long_ttft_max_ms": max(long.get("ttfts") or [0.0]) * 1000.0,
                    "stream_tpot_mean_ms": point.get("mean_tpot_ms"),
                    "goal": f"p99 / p50 ITL <= {ITL_SPREAD_GOAL:g}",
                    "status": "not measured"
                    if spread is None
                    else "met"
                    if spread <= ITL_SPREAD_GOAL
                    else "missed",
                }
            )
    return rows


def compute(results: dict[str, Any]) -> dict[str, Any]:
    """Everything this module compares, for results['ratios']."""
    return {
        "engines": engine_rows(results),
        "prefix_cache": prefix_cache_rows(results),
        "long_mix": long_mix_rows(results),
    }


# ---- markdown -----------------------------------------------------------------------------


def engine_lines(results: dict[str, Any]) -> list[str]:
    comparisons = results.get("ratios", {}).get("engines", [])
    lines: list[str] = []
    for comparison in comparisons:
        a, b = comparison["denominator"], comparison["numerator"]
        a_points = by_x(_points(results, a))
        b_points = by_x(_points(results, b))
        a_engine = _engine_points(results, variant_of(results, a).get("engine", ""))
        b_engine = _engine_points(results, variant_of(results, b).get("engine", ""))
        header = [
            "c", f"{a} out tok/s", f"{b} out tok/s", "ratio",
            f"{a} p50 TTFT ms", f"{b} p50 TTFT ms", "ratio",
            "mean TPOT ratio", "engine-only out tok/s ratio",
        ]  # fmt: skip
        rows = []
        for x, ratios in comparison["by_point"].items():
            pa, pb = a_points.get(x), b_points.get(x)
            rows.append(
                [
                    x,
                    fmt(_get(pa, "output_throughput")),
                    fmt(_get(pb, "output_throughput")),
                    fmt(ratios["output_throughput"], 2),
                    fmt(_get(pa, "median_ttft_ms")),
                    fmt(_get(pb, "median_ttft_ms")),
                    fmt(ratios["median_ttft"], 2),
                    fmt(ratios["mean_tpot"], 2),
                    (
                        f"{fmt(ratios['engine_only_output_throughput'], 2)} "
                        f"({fmt(_get(b_engine.get(x), 'output_throughput'), 0)} / "
                        f"{fmt(_get(a_engine.get(x), 'output_throughput'), 0)})"
                        if ratios["engine_only_output_throughput"] is not None
                        else "–"
                    ),
                ]
            )
        lines += ["", f"### {b} / {a}", "", *table(header, rows)]
    if not lines:
        return []
    return ["", "## Engines side by side", "", "Ratios are the second engine over the first.", *lines]


def prefix_cache_lines(results: dict[str, Any]) -> list[str]:
    rows = results.get("ratios", {}).get("prefix_cache", [])
    if not rows:
        return []
    header = ["with / without", "c", "p50 TTFT with ms", "p50 TTFT without ms", "ratio", "goal", "status"]
    cells = [
        [
            f"{r['with']} / {r['without']}",
            r["point"],
            fmt(r["median_ttft_with_ms"]),
            fmt(r["median_ttft_without_ms"]),
            fmt(r["ratio"], 2),
            r["goal"],
            r["status"],
        ]
        for r in rows
    ]
    return ["", "## Prefix cache on / off", "", *table(header, cells)]


def long_mix_lines(results: dict[str, Any]) -> list[str]:
    rows = results.get("ratios", {}).get("long_mix", [])
    if not rows:
        return []
    header = [
        "system", "prefill budget", "streams / long ok / failed", "stream ITL ms p50 / p99 / max",
        "p99 / p50", "ITL during long prefills ms p50 / p99 (gaps)", "long TTFT ms p50 / max",
        "stream TPOT ms mean", "status (p99 <= 2 x p50)",
    ]  # fmt: skip
    cells = []
    for r in rows:
        during = r["during_long_itl"]
        cells.append(
            [
                r["system"],
                fmt(r["prefill_budget"]),
                f"{r['streams_ok']} / {r['long_ok']} / {r['failed']}",
                f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])} / {fmt(r['itl_max_ms'])}",
                fmt(r["itl_p99_over_p50"], 2),
                f"{fmt(during.get('p50'))} / {fmt(during.get('p99'))} ({during.get('count', 0)})",
                f"{fmt(r['long_ttft_p50_ms'], 0)} / {fmt(r['long_ttft_max_ms'], 0)}",
                fmt(r["stream_tpot_mean_ms"], 2),
                r["status"],
            ]
        )
    note = (
        "ITL of the decode streams only (every gap of every stream); 'during long prefills' are the "
        "stream gaps that overlap a long prompt's send -> first token."
    )
    return ["", "## Long-prompt mix", "", note, "", *table(header, cells)]
