"""CUDA graphs of the decode-only step of tgis_native, one per batch-size bucket.

Captured once at start-up (largest bucket first, one shared memory pool, time and memory
logged) over the model runner's persistent buffers (runner.DecodeBuffers) with padding rows;
each decode step then fills the buffers for its rows padded up to the smallest bucket that
holds them and replays that graph: one launch instead of hundreds. A step larger than the
largest bucket, or whose rows use a LoRA adapter, runs eagerly over the same buffers. Prompt
chunks and soft prompts never get here (runner.forward).

    buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to MAX_BATCH_SIZE (which is one)

`capture` is injectable: on CUDA it records a torch.cuda.CUDAGraph; tests on CPU pass one that
keeps the captured closure and calls it again on replay, which checks the same discipline (the
closure is built once per bucket and must read every per-step input from the buffers).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]
Capture = Callable[[Step], Step]  # captures a step's work; the result replays it


def buckets_up_to(max_rows: int) -> list[int]:
    """The batch sizes that get a graph, ascending, the last one `max_rows`."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + 32)
    return sorted({size for size in sizes if size < max_rows} | {max_rows})


def cuda_capture(device: torch.device) -> Capture:
    """Record a CUDA graph per call, every graph in one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Step) -> Step:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, allocator
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    return capture


class DecodeGraphs:
    def __init__(self, buckets: list[int]) -> None:
        self.buckets = sorted(buckets)
        self._replays: dict[int, Step] = {}

    def capture_all(self, make_step: Callable[[int], Step], capture: Capture) -> None:
        """Capture `make_step(bucket)` for every bucket, largest first (smaller graphs reuse
        the pool's blocks)."""
        started = time.perf_counter()
        cuda = torch.cuda.is_available()
        before = torch.cuda.memory_reserved() if cuda else 0
        for bucket in reversed(self.buckets):
            self._replays[bucket] = capture(make_step(bucket))
        if cuda:
            torch.cuda.synchronize()
        logger.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.0f MiB",
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - started,
            ((torch.cuda.memory_reserved() if cuda else 0) - before) / 2**20,
        )

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows (None: more rows than the largest)."""
        index = bisect.bisect_left(self.buckets, rows)
        return self.buckets[index] if index < len(self.buckets) else None

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of `bucket` over the buffers as they are; its logits [bucket, vocab]."""
        return self._replays[bucket]()
