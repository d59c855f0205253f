"""Stream pacing (MAX_STREAM_INTERVAL): the interval follows how busy the event loop is (and,
where the engine computes on the router's CPUs, how much CPU the router takes), within its
bounds, judged over whole windows; the loop's selector counts the time it waits."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from router.config import RouterConfig
from router.core.pacing import (
    BUSY_HIGH,
    BUSY_LOW,
    CPU_HIGH,
    CPU_LOW,
    WINDOW_S,
    IdleTimingSelector,
    StreamPacing,
    shares_cpus,
)


class LoopClock:
    """A fake clock, idle counter and CPU counter: `run(busy, cpu)` passes one window at that
    busy fraction of the loop, the router using `cpu` of a core."""

    def __init__(self) -> None:
        self.now = 0.0
        self.idle = 0.0
        self.cpu = 0.0

    def run(self, busy: float, seconds: float = WINDOW_S * 1.001, cpu: float = 0.0) -> None:
        self.now += seconds
        self.idle += seconds * (1.0 - busy)
        self.cpu += seconds * cpu


def paced(least: int, most: int, shares_cpus: bool = False) -> tuple[StreamPacing, LoopClock]:
    clock = LoopClock()
    cpu_s = (lambda: clock.cpu) if shares_cpus else None
    pacing = StreamPacing(least, most, lambda: clock.idle, clock=lambda: clock.now, cpu_s=cpu_s)
    assert pacing.shares_cpus is shares_cpus
    assert not pacing.step()  # the first step opens a window
    return pacing, clock


def test_a_saturated_loop_raises_the_interval_one_window_at_a_time_up_to_the_bound() -> None:
    pacing, clock = paced(2, 5)
    seen = []
    for _ in range(5):
        clock.run(busy=0.97)
        assert pacing.step() == (pacing.interval != (seen[-1] if seen else 2))
        seen.append(pacing.interval)
    assert seen == [3, 4, 5, 5, 5]


def test_a_light_load_lowers_it_back_and_the_band_between_holds_it() -> None:
    pacing, clock = paced(1, 4)
    for _ in range(3):
        clock.run(busy=1.0)
        pacing.step()
    assert pacing.interval == 4
    clock.run(busy=(BUSY_HIGH + BUSY_LOW) / 2)
    assert not pacing.step() and pacing.interval == 4
    for expected in (3, 2, 1, 1):
        clock.run(busy=BUSY_LOW - 0.1)
        pacing.step()
        assert pacing.interval == expected


def test_steps_within_a_window_change_nothing_and_restart_goes_back_to_the_least() -> None:
    pacing, clock = paced(1, 8)
    for _ in range(9):  # 9 steps of a tenth of a window each: still one window
        clock.run(busy=1.0, seconds=WINDOW_S / 10)
        assert not pacing.step()
    clock.run(busy=1.0, seconds=WINDOW_S / 5)
    assert pacing.step() and pacing.interval == 2
    pacing.restart()
    assert pacing.interval == 1
    clock.run(busy=1.0, seconds=10 * WINDOW_S)  # the idle time between busy periods is not judged
    assert not pacing.step() and pacing.interval == 1


def test_sharing_the_forwards_cpus_the_routers_cpu_share_raises_and_holds_the_interval() -> None:
    """A CPU shard on the router's cores: a loop far from saturated but a router taking more
    than CPU_HIGH of a core (what the forward loses) paces like a saturated loop; the interval
    comes down only when both the loop and the router's CPU are light."""
    pacing, clock = paced(1, 4, shares_cpus=True)
    for expected in (2, 3, 4, 4):
        clock.run(busy=0.2, cpu=CPU_HIGH * 1.5)
        pacing.step()
        assert pacing.interval == expected
    clock.run(busy=0.2, cpu=(CPU_HIGH + CPU_LOW) / 2)  # between the bounds: held
    assert not pacing.step() and pacing.interval == 4
    clock.run(busy=BUSY_HIGH + 0.1, cpu=0.0)  # the loop alone still counts
    assert not pacing.step() and pacing.interval == 4
    clock.run(busy=(BUSY_HIGH + BUSY_LOW) / 2, cpu=0.0)  # a light router but a busy loop: held
    assert not pacing.step() and pacing.interval == 4
    for expected in (3, 2, 1, 1):
        clock.run(busy=0.2, cpu=CPU_LOW / 2)
        pacing.step()
        assert pacing.interval == expected


def test_without_sharing_the_routers_cpu_is_not_read() -> None:
    """A GPU shard (or one on other cores): only the loop's saturation paces."""
    pacing, clock = paced(1, 4)
    for _ in range(3):
        clock.run(busy=0.2, cpu=1.0)
        assert not pacing.step()
    assert pacing.interval == 1


def test_sharing_means_a_cpu_in_both_sets() -> None:
    mine = os.sched_getaffinity(0)
    assert shares_cpus(tuple(mine)) and shares_cpus((min(mine), max(mine) + 64))
    assert not shares_cpus(()) and not shares_cpus((max(mine) + 1, max(mine) + 2))


def test_fixed_pacing_never_changes_and_adaptive_pacing_needs_the_loop() -> None:
    fixed = StreamPacing(3)
    assert not fixed.adaptive and not fixed.step() and fixed.interval == 3
    assert StreamPacing(3, 3).adaptive is False
    with pytest.raises(ValueError, match="needs the event loop's idle time"):
        StreamPacing(1, 4)
    with pytest.raises(ValueError, match="1 <= least <= most, got 4 and 2"):
        StreamPacing(4, 2, lambda: 0.0)
    with pytest.raises(
        ValueError, match=r"max_stream_interval \(2\) must be 0 or at least stream_interval \(3\)"
    ):
        RouterConfig(tokenizer_path="/tok", stream_interval=3, max_stream_interval=2)


def test_the_selector_counts_the_loop_waiting_and_not_the_loop_working() -> None:
    selector = IdleTimingSelector()

    async def wait_then_work() -> None:
        await asyncio.sleep(0.2)  # waits in select
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:  # works: ready callbacks only, select polls
            await asyncio.sleep(0)

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        runner.run(wait_then_work())
    assert 0.18 <= selector.idle_s < 0.35, selector.idle_s
