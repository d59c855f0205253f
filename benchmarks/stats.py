"""The metrics core: one request's timings, and a point's statistics in vLLM's field names.

Definitions (../shared/reference/perf.md §1, the same as `vllm bench serve`):
  TTFT   request sent -> first message carrying generated tokens
  TPOT   per request (e2e - TTFT) / (output tokens - 1), then aggregated over requests
  ITL    gaps between consecutive messages that carry tokens, pooled over all requests
  E2E    request sent -> last message
  throughputs: tokens or requests of the completed requests / the point's wall time

`summarize` gives a point's dict: `duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `output_throughput`, `total_token_throughput`,
`{mean,median,std,p50,p90,p99}_{ttft,tpot,itl,e2el}_ms`, `max_concurrent_requests`, the raw
per-request `input_lens`, `output_lens`, `ttfts`, `e2els` (seconds), `itls`, `errors` lists,
plus ours: `length_mismatches` (completed requests whose input or output length was not the
one asked for) and `mean_tokens_per_message`.

`server_breakdown` turns two scrapes of our router's /metrics into where a point's time went:
shard calls, model forward, router token processing, per method (prefill / next_token).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
# Every field a point's dict has (besides the run-mode fields added by the load generator).
POINT_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std")),
    *(f"p{p}_{m}_ms" for m in METRICS for p in PERCENTILES),
    "max_concurrent_requests",
    "length_mismatches",
    "mean_tokens_per_message",
    "input_lens",
    "output_lens",
    "ttfts",
    "e2els",
    "itls",
    "errors",
)


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (times in seconds, from time.perf_counter)."""

    expected_input_len: int
    expected_output_len: int
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    input_len: int = 0  # as the server reported it (or the prompt's, when it reports none)
    output_len: int = 0
    messages: int = 0  # messages that carried generated tokens
    error: str = ""  # "" = success

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def exact(self) -> bool:
        return self.input_len == self.expected_input_len and self.output_len == self.expected_output_len


def _ms_stats(name: str, values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    empty = arr.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(arr.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(arr)),
        f"std_{name}_ms": 0.0 if empty else float(arr.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def max_in_flight(results: Iterable[RequestResult]) -> int:
    events = sorted(
        [(r.start, 1) for r in results if r.start] + [(r.end, -1) for r in results if r.end],
        key=lambda e: (e[0], e[1]),
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """A point's statistics over `results` measured in `duration` seconds of wall time."""
    ok = [r for r in results if r.ok]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    messages = sum(r.messages for r in ok)
    point: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    point.update(_ms_stats("ttft", [r.ttft for r in ok]))
    point.update(_ms_stats("tpot", tpots))
    point.update(_ms_stats("itl", [gap for r in ok for gap in r.itl]))
    point.update(_ms_stats("e2el", [r.latency for r in ok]))
    point["max_concurrent_requests"] = max_in_flight(results)
    point["length_mismatches"] = sum(1 for r in ok if not r.exact)
    point["mean_tokens_per_message"] = total_output / messages if messages else 0.0
    point["input_lens"] = [r.input_len for r in results]
    point["output_lens"] = [r.output_len for r in results]
    point["ttfts"] = [round(r.ttft, 6) for r in results]
    point["e2els"] = [round(r.latency, 6) for r in results]
    point["itls"] = [[round(gap, 6) for gap in r.itl] for r in results]
    point["errors"] = [r.error for r in results]
    return point


COUNT_FIELDS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "length_mismatches")
RAW_FIELDS = ("input_lens", "output_lens", "ttfts", "e2els", "itls", "errors")
MEDIAN_FIELDS = frozenset(POINT_FIELDS) - frozenset(COUNT_FIELDS) - frozenset(RAW_FIELDS)


def combine_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one point -> one point: counts summed, raw lists concatenated, throughputs
    and latency statistics the medians over runs, the rest (mode, loadavg, server breakdown) the
    first run's; each run's own values are kept under `runs`."""
    if len(runs) == 1:
        return runs[0]
    point = dict(runs[0])
    for key in runs[0]:
        values = [run[key] for run in runs]
        if key in COUNT_FIELDS:
            point[key] = sum(values)
        elif key in RAW_FIELDS:
            point[key] = [item for run_values in values for item in run_values]
        elif key in MEDIAN_FIELDS:
            point[key] = float(np.median(values))
    point["num_prompts"] = sum(run["num_prompts"] for run in runs)
    point["runs"] = [{k: v for k, v in run.items() if k not in RAW_FIELDS} for run in runs]
    return point


# ---- the whole machine, from /proc/stat ---------------------------------------------------


def cpu_times() -> list[int]:
    """The aggregate `cpu` line of /proc/stat (jiffies), or [] where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def cpu_shares(before: list[int], after: list[int]) -> dict[str, float]:
    """Shares of all CPUs' time between two cpu_times(): busy (user, nice, system, irq, softirq),
    idle (idle, iowait) and steal (taken by the hypervisor: another tenant's load)."""
    if len(before) < 8 or len(after) < 8:
        return {}
    delta = [a - b for a, b in zip(after[:8], before[:8], strict=True)]
    total = sum(delta)
    if total <= 0:
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = delta
    return {
        "busy": (user + nice + system + irq + softirq) / total,
        "idle": (idle + iowait) / total,
        "steal": steal / total,
    }


# ---- server-side breakdown from our router's Prometheus metrics -----------------------------

BREAKDOWN_HISTOGRAMS = {
    "call": "tgi_batch_inference_duration",  # whole shard call incl. the RPC
    "forward": "tgi_batch_inference_forward_duration",  # model forward, as the shard timed it
    "tokproc": "tgi_batch_inference_tokproc_duration",  # router token processing
    "guided": "tgi_batch_inference_guided_mask_duration",  # guided-decoding masks (constrained calls)
    "batch_size": "tgi_batch_inference_batch_size",
}
QUEUE_HISTOGRAM = "tgi_request_queue_duration"
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


ROUTER_CPU = "process_cpu_seconds_total"  # the router process's (prometheus_client's process_*)


def parse_metrics(text: str) -> Scrape:
    """Prometheus text -> {(sample name, sorted labels): value} for the histograms we read, and
    the router's CPU seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {*BREAKDOWN_HISTOGRAMS.values(), QUEUE_HISTOGRAM}
    samples: Scrape = {}
    for family in text_string_to_metric_families(text):
        if family.name == ROUTER_CPU.removesuffix("_total"):
            samples.update({(s.name, ()): s.value for s in family.samples if s.name == ROUTER_CPU})
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k == "method"))
                samples[(sample.name, labels)] = samples.get((sample.name, labels), 0.0) + sample.value
    return samples


def server_breakdown(before: Scrape, after: Scrape, duration: float) -> dict[str, Any]:
    """Where the point's wall time went, per shard method, from two scrapes."""

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        key = (name, labels)
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, Any] = {}
    for method in ("prefill", "next_token"):
        labels = (("method", method),)
        calls = delta(f"{BREAKDOWN_HISTOGRAMS['call']}_count", labels)
        entry: dict[str, float] = {"calls": calls}
        if calls:
            entry["mean_batch_size"] = delta(f"{BREAKDOWN_HISTOGRAMS['batch_size']}_sum", labels) / calls
            forwards = delta(f"{BREAKDOWN_HISTOGRAMS['forward']}_count", labels) or calls  # one per forward
            entry["steps_per_call"] = forwards / calls
            for key in ("call", "forward", "tokproc", "guided"):
                total = delta(f"{BREAKDOWN_HISTOGRAMS[key]}_sum", labels)
                entry[f"mean_{key}_ms"] = 1000.0 * total / (forwards if key == "forward" else calls)
                entry[f"{key}_share"] = total / duration if duration > 0 else 0.0
        out[method] = entry
    queued = delta(f"{QUEUE_HISTOGRAM}_count")
    out["mean_queue_ms"] = 1000.0 * delta(f"{QUEUE_HISTOGRAM}_sum") / queued if queued else 0.0
    busy = sum(
        out[m].get("call_share", 0.0) + out[m].get("tokproc_share", 0.0) for m in ("prefill", "next_token")
    )
    out["idle_share"] = max(0.0, 1.0 - busy)
    if (ROUTER_CPU, ()) in after:  # the router process's CPU seconds (its process_* metrics)
        out["router_cpu_s"] = delta(ROUTER_CPU)
        out["router_cpu_share"] = out["router_cpu_s"] / duration if duration > 0 else 0.0
    return out
