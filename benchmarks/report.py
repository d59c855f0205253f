"""A run's outputs: results.json, results.md (tables), throughput.png and latency.png.

The JSON holds `metadata`, `systems` (per server: `info` and `points`, each point in vLLM's
`bench serve` field names), `baselines` (engine_only, hf_generate: per batch size) and `ratios`
(`targets`: each target of issue 6 with its value and status; `by_concurrency`: every ratio at
every concurrency measured by both sides).

Targets (128/128 on the reference model, one run):
  server overhead      ours / engine-only output tok/s at c = 32      >= 0.9
  throughput vs vLLM   ours / vLLM output tok/s at c = 32             >= 1.0 (stretch 1.5)
  TTFT vs vLLM         ours / vLLM median TTFT at c = 32              <= 1.0
  TPOT vs vLLM         ours / vLLM mean TPOT at c = 1                 <= 1.0
  vs HF generate       ours / HF generate output tok/s at c = 32      >= 1.5 (perf.md)
  errors               failed requests over all points                == 0
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import comparisons
from benchmarks.markdown import fmt, table
from benchmarks.variants import OURS_OPENAI, split_key
from benchmarks.workload import LONG_MIX

SYSTEM_LABELS = {
    "ours": "ours (gRPC)",
    "ours-openai": "ours (OpenAI door)",
    "vllm": "vLLM-CPU",
    "openai": "OpenAI endpoint",
}
BASELINE_LABELS = {"engine_only": "engine-only loop", "hf_generate": "HF generate (static)"}
SHAPE_LABELS = (
    ("hidden_size", "hidden"),
    ("num_hidden_layers", "layers"),
    ("num_attention_heads", "heads"),
    ("num_key_value_heads", "KV heads"),
    ("intermediate_size", "FFN"),
    ("vocab_size", "vocab"),
)
TARGET_C = 32
TARGET_C_LATENCY = 1


def x_key(point: dict[str, Any]) -> float:
    """The x of a point: its concurrency (closed loop) or its request rate (Poisson)."""
    if point.get("mode") == "rate":
        return float(point["request_rate"])
    return float(point["max_concurrency"])


def _by_concurrency(points: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(p["max_concurrency"]): p for p in points if p.get("mode") == "concurrency"}


def _baseline_by_size(baseline: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    if not baseline:
        return {}
    return {int(p["batch_size"]): p for p in baseline.get("points", [])}


def _target(
    name: str, value: float | None, goal: str, ok: Callable[[float], bool], note: str = ""
) -> dict[str, Any]:
    if value is None:
        return {"target": name, "goal": goal, "value": None, "status": "not measured", "note": note}
    return {
        "target": name,
        "goal": goal,
        "value": value,
        "status": "met" if ok(value) else "missed",
        "note": note,
    }


_Table = dict[int, dict[str, Any]]


def _compared(results: dict[str, Any], key: str) -> tuple[_Table, _Table, _Table, _Table]:
    """By concurrency or batch size: our system `key`, vLLM, the engine-only loop of its
    engine, HF generate."""
    systems = results.get("systems", {})
    engine = comparisons.engine_baseline(results, comparisons.variant_of(results, key).get("engine"))
    return (
        _by_concurrency(systems.get(key, {}).get("points", [])),
        _by_concurrency(systems.get("vllm", {}).get("points", [])),
        _baseline_by_size(engine),
        _baseline_by_size(results.get("baselines", {}).get("hf_generate")),
    )


def _variant_ratios(results: dict[str, Any], key: str) -> dict[str, dict[str, float | None]]:
    """Ratios of our system `key` against the baselines and the peer at each concurrency."""
    ours, vllm, engine, generate = _compared(results, key)

    def get(table: dict[int, dict[str, Any]], c: int, field: str) -> float | None:
        point = table.get(c)
        return None if point is None else float(point[field])

    by_c: dict[str, dict[str, float | None]] = {}
    for c in sorted(ours):

        def vs(other: dict[int, dict[str, Any]], field: str, c: int = c) -> float | None:
            return comparisons.ratio(get(ours, c, field), get(other, c, field))

        by_c[str(c)] = {
            "vs_engine_only_output_throughput": vs(engine, "output_throughput"),
            "vs_hf_generate_output_throughput": vs(generate, "output_throughput"),
            "vs_vllm_output_throughput": vs(vllm, "output_throughput"),
            "vs_vllm_median_ttft": vs(vllm, "median_ttft_ms"),
            "vs_vllm_mean_tpot": vs(vllm, "mean_tpot_ms"),
        }
    return by_c


def _variant_targets(
    results: dict[str, Any], key: str, by_c: dict[str, dict[str, float | None]]
) -> list[dict[str, Any]]:
    """Issue 6's targets for our system `key` (named after it when the run has several)."""
    ours, vllm, engine, generate = _compared(results, key)
    prefix = "" if key == "ours" else f"{key}: "

    def at(c: int, field: str) -> float | None:
        return by_c.get(str(c), {}).get(field)

    rate_mode = results.get("metadata", {}).get("mode", "concurrency") != "concurrency"

    def why(c: int, other: dict[int, dict[str, Any]], other_name: str) -> str:
        if rate_mode:
            return "targets are defined on the closed-loop concurrency sweep"
        if c not in ours:
            return f"c = {c} not in this run's sweep"
        if c not in other:
            return f"{other_name} not measured at {'batch' if 'base' in other_name else 'c'} = {c}"
        return ""

    return [
        _target(
            f"{prefix}server overhead: ours / engine-only output tok/s at c = {TARGET_C}",
            at(TARGET_C, "vs_engine_only_output_throughput"), ">= 0.90", lambda v: v >= 0.9,
            why(TARGET_C, engine, "engine-only baseline"),
        ),
        _target(
            f"{prefix}ours / vLLM-CPU output tok/s at c = {TARGET_C} (stretch 1.5)",
            at(TARGET_C, "vs_vllm_output_throughput"), ">= 1.00", lambda v: v >= 1.0,
            why(TARGET_C, vllm, "vLLM-CPU"),
        ),
        _target(
            f"{prefix}ours / vLLM-CPU median TTFT at c = {TARGET_C}",
            at(TARGET_C, "vs_vllm_median_ttft"), "<= 1.00", lambda v: v <= 1.0,
            why(TARGET_C, vllm, "vLLM-CPU"),
        ),
        _target(
            f"{prefix}ours / vLLM-CPU mean TPOT at c = {TARGET_C_LATENCY}",
            at(TARGET_C_LATENCY, "vs_vllm_mean_tpot"), "<= 1.00", lambda v: v <= 1.0,
            why(TARGET_C_LATENCY, vllm, "vLLM-CPU"),
        ),
        _target(
            f"{prefix}ours / HF generate output tok/s at c = {TARGET_C}",
            at(TARGET_C, "vs_hf_generate_output_throughput"), ">= 1.50", lambda v: v >= 1.5,
            why(TARGET_C, generate, "HF generate baseline"),
        ),
    ]  # fmt: skip


def _openai_keys(results: dict[str, Any]) -> list[str]:
    return [k for k in results.get("systems", {}) if split_key(k)[0] == OURS_OPENAI]


def compute_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 6's targets and ratios for each system of ours (`by_concurrency` is the first's,
    `by_variant` every one's), and the comparisons between them (comparisons.py)."""
    systems = results.get("systems", {})
    # the gRPC door's systems; in a run of the OpenAI door alone (vLLM's client), that door's
    keys = comparisons.ours_keys(results) or _openai_keys(results) or ["ours"]
    by_variant = {key: _variant_ratios(results, key) for key in keys}
    sweep = results.get("metadata", {}).get("mode") != LONG_MIX  # the mix has its own goal (comparisons)
    targets = [t for key in keys if sweep for t in _variant_targets(results, key, by_variant[key])]
    failed = [
        int(p.get("failed", 0)) + int(p.get("long", {}).get("failed", 0))
        for s in systems.values()
        for p in s.get("points", [])
    ]
    targets.append(
        _target(
            "failed requests, all systems and points",
            sum(failed) if failed else None,
            "== 0",
            lambda v: v == 0,
        )
    )
    return {
        "targets": targets,
        "by_concurrency": by_variant[keys[0]],
        "by_variant": by_variant,
        **comparisons.compute(results),
    }


# ---- markdown -----------------------------------------------------------------------------


def _host(shares: dict[str, float] | None) -> str:
    if not shares:
        return "–"
    return f"{100 * shares['busy']:.0f}% / {100 * shares['steal']:.0f}%"


def _triple(point: dict[str, Any], metric: str) -> str:
    return " / ".join(fmt(point[f"{stat}_{metric}_ms"]) for stat in ("mean", "median", "p99"))


def markdown(results: dict[str, Any]) -> str:
    meta = results["metadata"]
    model = meta.get("model", {})
    git, host, pinning = meta.get("git", {}), meta.get("host", {}), meta.get("pinning", {})
    lines = [f"# Benchmark {meta.get('date', '')}", ""]
    shape = ", ".join(f"{label} {model[k]}" for k, label in SHAPE_LABELS if k in model)
    params = model.get("parameters")
    lines += [
        f"- model: {model.get('name', model.get('dir', '?'))} ({shape}"
        + (f"; {params / 1e6:.1f} M parameters" if params else "")
        + ")",
        f"- dtype: {meta.get('dtype') or 'unknown'}"
        + (f" (asked: {meta['dtype_requested']})" if meta.get("dtype_requested") else " (server default)")
        + (f"; QUANTIZE={meta['quantize']} (ours and the baselines)" if meta.get("quantize") else ""),
        f"- workload: {meta.get('workload_description', '')}; mode: {meta.get('mode', '')}",
        f"- engine(s): {', '.join(meta.get('engines') or [meta.get('engine') or 'server default'])}"
        + (
            "; our variants: " + "; ".join(f"{k} = {_variant_text(v)}" for k, v in meta["variants"].items())
            if len(meta.get("variants") or {}) > 1
            else ""
        ),
        f"- git {git.get('sha', '?')[:12]}{' (dirty)' if git.get('dirty') else ''};"
        f" host: {host.get('cpu_model', '?')}, {host.get('cpus', '?')} CPUs;"
        + (f" GPU: {', '.join(host['gpus'])};" if host.get("gpus") else "")
        + f" torch threads {meta.get('threads', {}).get('torch_threads', '?')};"
        f" pinning: client {pinning.get('client') or 'none'}, servers {pinning.get('servers') or 'none'}",
        "",
    ]
    mode_rate = meta.get("mode") == "rate"
    x_name = "req/s in" if mode_rate else "streams" if meta.get("mode") == LONG_MIX else "c"
    lines += ["## Serving", ""]
    header = [
        "system", x_name, "ok / failed", "req/s", "out tok/s", "total tok/s",
        "TTFT ms mean / p50 / p99", "TPOT ms mean / p50 / p99", "ITL ms mean / p50 / p99",
        "E2E ms p50 / p99", "load1", "host busy / steal", "client CPU",
    ]  # fmt: skip
    rows = []
    for key, system in results.get("systems", {}).items():
        for p in system.get("points", []):
            rows.append(
                [
                    SYSTEM_LABELS.get(key, key),
                    fmt(p["request_rate"]) if mode_rate else str(p["max_concurrency"]),
                    f"{p['completed']} / {p['failed']}",
                    fmt(p["request_throughput"], 2),
                    fmt(p["output_throughput"]),
                    fmt(p["total_token_throughput"]),
                    _triple(p, "ttft"),
                    _triple(p, "tpot"),
                    _triple(p, "itl"),
                    f"{fmt(p['median_e2el_ms'], 0)} / {fmt(p['p99_e2el_ms'], 0)}",
                    fmt(p.get("loadavg_before", [None])[0], 2),
                    _host(p.get("host_cpu")),
                    f"{100 * p['client_cpu_s'] / p['duration']:.0f}%" if p.get("duration") else "–",
                ]
            )
    lines += table(header, rows) if rows else ["(no server measured)"]
    skipped = {k: s["skipped"] for k, s in results.get("systems", {}).items() if s.get("skipped")}
    skipped.update(results.get("skipped", {}))
    for key, reason in skipped.items():
        lines.append(f"\n{SYSTEM_LABELS.get(key, key)} skipped: {reason}")
    lines += comparisons.engine_lines(results)
    lines += comparisons.prefix_cache_lines(results)
    lines += comparisons.long_mix_lines(results)
    lines += _baseline_lines(results) + _breakdown_lines(results) + _ratio_lines(results)
    return "\n".join(lines) + "\n"


def _variant_text(variant: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in variant.items())


def baseline_label(key: str) -> str:
    """'engine_only' -> 'engine-only loop'; 'engine_only[tgis_native]' -> 'engine-only loop [tgis_native]'."""
    base, _, rest = key.partition("[")
    label = BASELINE_LABELS.get(base, base)
    return f"{label} [{rest}" if rest else label


def _baseline_lines(results: dict[str, Any]) -> list[str]:
    baselines = results.get("baselines", {})
    if not baselines:
        return []
    sizes = sorted({int(p["batch_size"]) for b in baselines.values() for p in b.get("points", [])})
    header = ["batch"]
    for key in baselines:
        label = baseline_label(key)
        header += [f"{label} out tok/s", f"{label} prefill ms", f"{label} ms/step"]
    rows = []
    for size in sizes:
        row = [str(size)]
        for baseline in baselines.values():
            point = _baseline_by_size(baseline).get(size)
            row += (
                [fmt(point["output_throughput"]), fmt(point["prefill_ms"]), fmt(point["decode_step_ms"], 2)]
                if point
                else ["–", "–", "–"]
            )
        rows.append(row)
    first = next(iter(baselines.values()))
    note = (
        f"static batches of {first['points'][0]['input_len']} in / {first['points'][0]['output_len']} out, "
        f"no server; dtype {first.get('dtype')}, torch threads {first.get('torch_threads')}"
        + ("; steps pipelined (launched before the one before is read back)" if _pipelined(first) else "")
        if first.get("points")
        else ""
    )
    return ["", "## Baselines", "", note, "", *table(header, rows)]


def _router_cpu(breakdown: dict[str, Any], point: dict[str, Any]) -> str:
    """The router process's CPU over the point: its share of one core, and per output token."""
    seconds = breakdown.get("router_cpu_s")
    tokens = point.get("total_output_tokens")
    if seconds is None:
        return "–"
    per_token = f"{1e6 * seconds / tokens:.0f}" if tokens else "–"
    return f"{100 * breakdown.get('router_cpu_share', 0.0):.0f}% / {per_token}"


def _pipelined(baseline: dict[str, Any]) -> bool:
    return any(p.get("pipelined") for p in baseline.get("points", []))


def _breakdown_lines(results: dict[str, Any]) -> list[str]:
    keys = comparisons.ours_keys(results)
    points = [(key, p) for key in keys for p in results["systems"][key].get("points", [])]
    rows = []
    for key, p in points:
        b = p.get("server_breakdown")
        if not b:
            continue
        pre, nxt = b.get("prefill", {}), b.get("next_token", {})
        rows.append(
            ([key] if len(keys) > 1 else [])
            + [
                fmt(p["request_rate"]) if p.get("mode") == "rate" else str(p["max_concurrency"]),
                " / ".join(
                    [
                        str(int(pre.get("calls", 0))),
                        fmt(pre.get("mean_batch_size")),
                        fmt(pre.get("mean_call_ms")),
                    ]
                ),
                " / ".join(
                    [
                        str(int(nxt.get("calls", 0))),
                        fmt(nxt.get("mean_batch_size")),
                        fmt(nxt.get("steps_per_call")),
                    ]
                ),
                " / ".join(fmt(nxt.get(f"mean_{k}_ms"), 2) for k in ("call", "forward", "guided", "tokproc")),
                " / ".join(
                    f"{100 * (pre.get(k, 0.0) + nxt.get(k, 0.0)):.0f}%"
                    for k in ("forward_share", "call_share", "tokproc_share")
                ),
                f"{100 * b.get('idle_share', 0.0):.0f}%",
                fmt(b.get("mean_queue_ms")),
                _router_cpu(b, p),
            ]
        )
    if not rows:
        return []
    header = (["system"] if len(keys) > 1 else []) + [
        "c", "prefill calls / mean batch / ms", "decode calls / mean batch / steps per call",
        "decode ms: shard call / forward (per step) / guided mask / router tokproc",
        "wall share: forward / shard calls / tokproc",
        "batcher idle", "queue ms", "router CPU: share / µs per out token",
    ]  # fmt: skip
    return [
        "",
        "## Where our server's time goes (router /metrics, deltas per point)",
        "",
        "shard call = the whole router->shard RPC incl. the forward; tokproc = router token processing "
        "after each call; idle = wall time outside shard calls and token processing.",
        "",
        *table(header, rows),
    ]


def _ratio_lines(results: dict[str, Any]) -> list[str]:
    ratios = results.get("ratios", {})
    lines = ["", "## Targets (issue 6)", ""]
    rows = [
        [
            t["target"],
            fmt(t["value"], 2),
            t["goal"],
            t["status"] + (f" ({t['note']})" if t.get("note") else ""),
        ]
        for t in ratios.get("targets", [])
    ]
    lines += table(["target", "value", "goal", "status"], rows)
    by_variant = ratios.get("by_variant") or {"ours": ratios.get("by_concurrency", {})}
    keys = [
        ("vs_engine_only_output_throughput", "tok/s vs engine-only"),
        ("vs_hf_generate_output_throughput", "tok/s vs HF generate"),
        ("vs_vllm_output_throughput", "tok/s vs vLLM"),
        ("vs_vllm_median_ttft", "p50 TTFT vs vLLM"),
        ("vs_vllm_mean_tpot", "mean TPOT vs vLLM"),
    ]
    for system, by_c in by_variant.items():
        if not by_c:
            continue
        rows = [[c] + [fmt(row.get(k), 2) for k, _ in keys] for c, row in by_c.items()]
        lines += ["", f"Ratios {system} / other at each concurrency:", ""]
        lines += table(["c"] + [label for _, label in keys], rows)
    return lines


# ---- plots --------------------------------------------------------------------------------


def _concurrency_axis(ax: Any, systems: dict[str, Any]) -> None:
    """log2 x axis with the measured concurrencies as plain tick labels."""
    ticks = sorted({x_key(p) for s in systems.values() for p in s["points"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {k: s for k, s in results.get("systems", {}).items() if s.get("points")}
    if not systems or results["metadata"].get("mode") == LONG_MIX:  # one point per system: the table says it
        return []
    rate_mode = results["metadata"].get("mode") == "rate"
    x_label = "request rate (req/s)" if rate_mode else "concurrency (closed loop)"
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, system in systems.items():
        pts = sorted(system["points"], key=x_key)
        ax.plot(
            [x_key(p) for p in pts],
            [p["output_throughput"] for p in pts],
            marker="o",
            label=SYSTEM_LABELS.get(key, key),
        )
    if not rate_mode:
        for key, baseline in results.get("baselines", {}).items():
            pts = sorted(baseline.get("points", []), key=lambda p: p["batch_size"])
            if pts:
                ax.plot(
                    [p["batch_size"] for p in pts], [p["output_throughput"] for p in pts],
                    linestyle="--", marker="x", label=baseline_label(key) + " (batch = c)",
                )  # fmt: skip
        _concurrency_axis(ax, systems)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(x_label)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, system in systems.items():
        pts = sorted(system["points"], key=x_key)
        xs = [x_key(p) for p in pts]
        label = SYSTEM_LABELS.get(key, key)
        (line,) = ttft_ax.plot(xs, [p["median_ttft_ms"] for p in pts], marker="o", label=f"{label} p50")
        ttft_ax.plot(
            xs, [p["p99_ttft_ms"] for p in pts], linestyle=":", color=line.get_color(), label=f"{label} p99"
        )
        (line,) = tpot_ax.plot(xs, [p["median_tpot_ms"] for p in pts], marker="o", label=f"{label} p50")
        tpot_ax.plot(
            xs, [p["p99_tpot_ms"] for p in pts], linestyle=":", color=line.get_color(), label=f"{label} p99"
        )
    for ax, title in ((ttft_ax, "TTFT (ms)"), (tpot_ax, "TPOT (ms)")):
        if not rate_mode:
            _concurrency_axis(ax, systems)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(x_label)
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write(results: dict[str, Any], out_dir: Path, with_plots: bool = True) -> dict[str, Path]:
    """results.json, results.md and the plots; their paths by kind."""
    results["ratios"] = compute_ratios(results)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown(results))
    if with_plots:
        for path in plots(results, out_dir):
            paths[path.stem] = path
    return paths
