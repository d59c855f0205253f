"""How many tokens a streamed message carries: fixed (STREAM_INTERVAL) or adapted to the load.

Every streamed message costs the router's one event loop about as much as all the per-token work
of its token (the gRPC write alone is ~30 µs of Python and a syscall), so with many streams the
loop, not the engine, sets the pace: the engine waits for the router's next call. Adaptive pacing
(MAX_STREAM_INTERVAL above STREAM_INTERVAL) watches how busy the loop is, from the time its
selector waits for events (`IdleTimingSelector`), over windows of WINDOW_S during decode steps:
  - busy above BUSY_HIGH: one token more per message (up to MAX_STREAM_INTERVAL);
  - busy below BUSY_LOW: one token fewer (down to STREAM_INTERVAL).
Where the engine computes on the CPUs the router runs on (a CPU shard on the same host: the
shard reports its CPUs, `ModelInfo.compute_cpus`), the router's CPU time is taken from the
forward itself, whose threads all wait for the one that lost its core: a window in which the
router (all its threads) used more than CPU_HIGH of a core counts as saturated too, and one
token fewer needs both the loop below BUSY_LOW and the router below CPU_LOW of a core.
Tokens wait at most interval - 1 steps for their message, and only while the router is what
holds the engine back; a lightly loaded server streams one message per STREAM_INTERVAL tokens.
A new busy period starts at STREAM_INTERVAL.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable, Collection

WINDOW_S = 0.1  # the loop's load is judged over windows this long
BUSY_HIGH = 0.85  # busier than this: the loop holds the engine back
BUSY_LOW = 0.6  # less busy than this: messages can come more often
CPU_HIGH = 0.05  # sharing the forward's CPUs: the router's CPU seconds per second above which
CPU_LOW = 0.025  # ... messages carry one more token, and below which one fewer


def shares_cpus(compute_cpus: Collection[int]) -> bool:
    """Whether this process may run on a CPU that the engine's forward computes on."""
    return bool(compute_cpus) and not os.sched_getaffinity(0).isdisjoint(compute_cpus)


class IdleTimingSelector(selectors.DefaultSelector):
    """The event loop's selector, counting the time the loop waits for events: the loop is
    busy for the rest (running callbacks, or ready to but not given a core)."""

    def __init__(self) -> None:
        super().__init__()
        self.idle_s = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:  # the loop has work ready: a poll, not a wait
            return super().select(timeout)
        start = time.perf_counter()
        try:
            return super().select(timeout)
        finally:
            self.idle_s += time.perf_counter() - start


class StreamPacing:
    """Tokens per streamed message after the first (`interval`), shared by the streams of the
    doors whose messages may carry several (gRPC, OpenAI); the batcher calls `step` at every
    decode step and `restart` when a busy period begins."""

    def __init__(
        self,
        least: int = 1,
        most: int = 0,
        loop_idle_s: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_s: Callable[[], float] | None = None,
    ) -> None:
        """`least`: STREAM_INTERVAL; `most`: MAX_STREAM_INTERVAL (0 or `least`: fixed);
        `loop_idle_s`: the loop's idle seconds so far (IdleTimingSelector.idle_s), needed when
        adaptive; `cpu_s`: the router process's CPU seconds so far, given where the engine
        computes on the router's CPUs (module docstring)."""
        most = most or least
        if least < 1 or most < least:
            raise ValueError(f"stream intervals must satisfy 1 <= least <= most, got {least} and {most}")
        if most > least and loop_idle_s is None:
            raise ValueError("adaptive stream pacing needs the event loop's idle time")
        self.least = least
        self.most = most
        self.interval = least
        self._loop_idle_s = loop_idle_s
        self._cpu_s = cpu_s
        self._clock = clock
        self._window: tuple[float, float, float] | None = None  # (start, idle s, CPU s at its start)

    @property
    def adaptive(self) -> bool:
        return self.most > self.least

    @property
    def shares_cpus(self) -> bool:
        """The router's CPU time counts against the engine's (module docstring)."""
        return self._cpu_s is not None

    def restart(self) -> None:
        """A busy period begins: one message per `least` tokens until the load says otherwise."""
        self.interval = self.least
        self._window = None

    def step(self) -> bool:
        """A decode step is sent: judge the window that ends now, if it is long enough. True when
        the interval changed."""
        if not self.adaptive:
            return False
        assert self._loop_idle_s is not None
        now, idle = self._clock(), self._loop_idle_s()
        cpu = self._cpu_s() if self._cpu_s is not None else 0.0
        if self._window is None:
            self._window = (now, idle, cpu)
            return False
        start, idle_at_start, cpu_at_start = self._window
        if now - start < WINDOW_S:
            return False
        self._window = (now, idle, cpu)
        busy = 1.0 - (idle - idle_at_start) / (now - start)
        cpu_share = (cpu - cpu_at_start) / (now - start)
        before = self.interval
        if busy > BUSY_HIGH or cpu_share > CPU_HIGH:
            self.interval = min(self.most, before + 1)
        elif busy < BUSY_LOW and cpu_share < CPU_LOW:
            self.interval = max(self.least, before - 1)
        return self.interval != before


ONE_PER_TOKEN = StreamPacing()  # streams whose messages carry one token each (TGI's events)
