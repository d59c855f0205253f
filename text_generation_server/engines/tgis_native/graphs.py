"""CUDA graphs of the steps of tgis_native, one per token-count bucket.

Captured once at start-up (largest bucket first, one shared memory pool, time and memory
logged) over the model runner's persistent buffers (runner.DecodeBuffers) with padding rows.
Every token of a step is one row of the paged decode attention (a prompt token at position p
is a row with p + 1 keys, its own K/V written first: causal attention), so a step's shape is
its token count alone: each step fills the buffers for its tokens padded up to the smallest
bucket that holds them and replays that graph, one launch instead of hundreds, whether it
decodes, prefills or both. A step larger than the largest bucket, or one with LoRA rows, soft
prompts or prompt-token details, runs eagerly (runner.forward / runner.decode).

    buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to MAX_BATCH_SIZE (decode steps),
             then every 64 to 512, every 128 to 1024, every 256 beyond, up to MAX_BATCH_SIZE +
             MAX_BATCH_PREFILL_TOKENS (steps with prompt tokens); the last one is the maximum

A prompt token's row reads all of its keys on its own, where a prefill kernel would read a
block of keys once for many queries: a chunk of n tokens after c cached ones reads
n * c + n * (n + 1) / 2 keys. Steps whose prompt rows read more than MAX_GRAPHED_PROMPT_KEYS
run eagerly (SDPA over the chunk; long prompts and long contexts), where the graph would cost
more than the eager step's launches (about 12 ms for the 1 B model on an H200). The bound is
an estimate from that, not yet measured on a GPU.

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

MAX_GRAPHED_PROMPT_KEYS = 1 << 20  # e.g. a 1,400-token chunk from position 0, 8 prompts of 500

Step = Callable[[], torch.Tensor]
Capture = Callable[[Step], Step]  # captures a step's work; the result replays it


def buckets_up_to(max_rows: int, max_tokens: int | None = None) -> list[int]:
    """The token counts that get a graph, ascending: the decode batch sizes up to `max_rows`,
    then coarser steps up to `max_tokens` (default `max_rows`), which is the last one."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + 32)
    decode = {size for size in sizes if size < max_rows} | {max_rows}
    top = max(max_rows, max_tokens or max_rows)
    size, larger = max_rows, set()
    while size < top:
        size += 64 if size < 512 else 128 if size < 1024 else 256
        larger.add(min(size, top))
    return sorted(decode | larger)


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


class StepGraphs:
    """The graphs of one engine. Each returns the logits of `kept(bucket)` of its rows (the
    rows the step chooses tokens from, listed in the buffers): at most `max_kept`, the most
    rows a step can choose from (each sequence's row and its speculative candidates)."""

    def __init__(
        self, buckets: list[int], max_kept: int, max_prompt_keys: int = MAX_GRAPHED_PROMPT_KEYS
    ) -> None:
        self.buckets = sorted(buckets)
        self.max_kept = max_kept
        self.max_prompt_keys = max_prompt_keys
        self._replays: dict[int, Step] = {}

    def kept(self, bucket: int) -> int:
        return min(bucket, self.max_kept)

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
            "CUDA graphs: %d step sizes (%s tokens) captured in %.1f s, %.0f MiB",
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - started,
            ((torch.cuda.memory_reserved() if cuda else 0) - before) / 2**20,
        )

    def bucket_for(self, tokens: int, kept: int = 0, prompt_keys: int = 0) -> int | None:
        """The smallest bucket that holds `tokens` rows of which `kept` give logits and whose
        prompt rows read `prompt_keys` keys (None: more than the largest, more kept rows than a
        graph returns, or prompt rows better attended eagerly)."""
        if kept > self.max_kept or prompt_keys > self.max_prompt_keys:
            return None
        index = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[index] if index < len(self.buckets) else None

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of `bucket` over the buffers as they are; its logits [kept(bucket), vocab]."""
        return self._replays[bucket]()
