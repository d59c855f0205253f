"""The long-prompt mix: decode streams running while long prompts arrive, and its statistics.

`drive` starts `streams` requests together (the decode streams), waits until every stream has its
first token (so that each is decoding), then sends the long prompts one after another,
`long_interval_s` apart, without waiting for their answers; it returns when every request ended.

`summarize_mix` gives the run's point: the usual statistics (stats.summarize) of the decode
streams only — their ITL p50 / p99 is what a long prefill disturbs — plus
  long                       stats.summarize of the long prompts (their TTFT above all)
  stream_itl_p99_over_p50    the streams' p99 ITL over their p50 ITL (goal: <= 2 with chunked prefill)
  during_long_itl            mean / p50 / p99 / max ITL (ms) and count of the stream gaps that
                             overlap a long prompt's prefill (its send -> its first token)
  overlapped_long            long prompts whose prefill window overlapped some stream gap
A gap spans (previous message, this message] of one stream; a prefill window is a long request's
[start, start + TTFT].
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.clients import Client
from benchmarks.stats import RequestResult, combine_repeats, summarize
from benchmarks.workload import Prompt


async def drive(
    client: Client,
    streams: Sequence[Prompt],
    longs: Sequence[Prompt],
    interval_s: float,
    first_token_timeout_s: float = 600.0,
) -> tuple[list[RequestResult], list[RequestResult], float]:
    """Run one mix; (stream results, long results, wall time from the first send to the last answer)."""
    started = time.perf_counter()
    events = [asyncio.Event() for _ in streams]
    stream_tasks = [asyncio.create_task(client.generate(p, e)) for p, e in zip(streams, events, strict=True)]
    with contextlib.suppress(TimeoutError):  # a stream stuck before its first token: send anyway
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), first_token_timeout_s)
    long_tasks = []
    for i, prompt in enumerate(longs):
        if i:
            await asyncio.sleep(interval_s)
        long_tasks.append(asyncio.create_task(client.generate(prompt)))
    stream_results = list(await asyncio.gather(*stream_tasks))
    long_results = list(await asyncio.gather(*long_tasks))
    return stream_results, long_results, time.perf_counter() - started


# ---- statistics ---------------------------------------------------------------------------


def message_times(result: RequestResult) -> list[float]:
    """Absolute times (perf_counter seconds) of a request's messages with tokens."""
    if not result.ok or result.messages == 0:
        return []
    times = [result.start + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def gaps_during(streams: Sequence[RequestResult], windows: Sequence[tuple[float, float]]) -> list[float]:
    """The stream gaps (seconds) that overlap any of `windows`."""
    found = []
    for result in streams:
        times = message_times(result)
        for before, after in itertools.pairwise(times):
            if any(before < end and after > begin for begin, end in windows):
                found.append(after - before)
    return found


def _ms(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def summarize_mix(
    streams: list[RequestResult], longs: list[RequestResult], duration: float
) -> dict[str, Any]:
    """The point of one mix run (see the module docstring)."""
    point = {"num_prompts": len(streams), **summarize(streams, duration)}
    point["long"] = {"num_prompts": len(longs), **summarize(longs, duration)}
    windows = [(r.start, r.start + r.ttft) for r in longs if r.ok]
    stream_times = [message_times(r) for r in streams]
    overlapped = sum(
        1
        for begin, end in windows
        if any(a < end and b > begin for t in stream_times for a, b in itertools.pairwise(t))
    )
    point["during_long_itl"] = _ms(gaps_during(streams, windows))
    point["overlapped_long"] = overlapped
    p50 = point["p50_itl_ms"]
    point["stream_itl_p99_over_p50"] = point["p99_itl_ms"] / p50 if p50 else None
    return point


def combine_mix(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of the mix -> one point: stream and long statistics combined as
    stats.combine_repeats does, the during-long gap statistics the medians over runs."""
    if len(runs) == 1:
        return runs[0]
    nested = ("long", "during_long_itl")
    streams = combine_repeats([{k: v for k, v in r.items() if k not in nested} for r in runs])
    streams["long"] = combine_repeats([r["long"] for r in runs])
    streams["during_long_itl"] = {
        key: float(np.median([r["during_long_itl"][key] for r in runs])) for key in runs[0]["during_long_itl"]
    }
    streams["overlapped_long"] = sum(r["overlapped_long"] for r in runs)
    ratios = [r["stream_itl_p99_over_p50"] for r in runs if r["stream_itl_p99_over_p50"] is not None]
    streams["stream_itl_p99_over_p50"] = float(np.median(ratios)) if ratios else None
    return streams
