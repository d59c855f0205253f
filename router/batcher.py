"""The continuous-batching loop: the only owner of the running batch.

One asyncio task (`run`). While requests run it alternates decode steps (NextToken) with
prefills of waiting requests that join the running batch; the shard merges the new batch in at
the next step. A join happens when the queue has entries that fit, and at most every other
prefill's duration (so decoding keeps going); the number of entries a join needs shrinks as
decode steps pass, down to one after MAX_WAITING_TOKENS steps (TGIS's policy). Finished
requests are pruned on the next call. Per-token work (decoding, stopping, outputs) is in
entry.py.

    idle:   wait for the queue -> PREFILL(new)
    busy:   [maybe PREFILL(new, prune=current)] -> NEXT_TOKEN(current [+ new]) -> ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.detokenizer import Detokenizer
from router.entry import Entry
from router.metrics import Metrics
from router.request_queue import RequestQueue
from router.shard_client import ShardCallError, ShardClient
from text_generation_server.outputs import CachedBatchRef, StepOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunningBatch:
    """A batch cached in the shard: its live requests and those to drop at the next call."""

    batch_id: int
    entries: list[Entry]
    completed: list[int] = field(default_factory=list)

    @property
    def all_completed(self) -> bool:
        return len(self.completed) == len(self.entries)

    def ref(self) -> CachedBatchRef:
        return CachedBatchRef(self.batch_id, tuple(self.completed))

    def pruned(self) -> RunningBatch | None:
        """This batch once the shard dropped the completed requests."""
        live = [e for e in self.entries if e.id not in set(self.completed)]
        return RunningBatch(self.batch_id, live) if live else None


class Batcher:
    def __init__(
        self,
        client: ShardClient,
        queue: RequestQueue,
        detokenizer: Detokenizer,
        metrics: Metrics,
        *,
        eos_token_id: int,
        max_waiting_tokens: int,
    ) -> None:
        self.client = client
        self.queue = queue
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.eos_token_id = eos_token_id
        self.max_waiting_tokens = max_waiting_tokens
        self.generation_healthy: bool | None = None  # None until a first step ran
        self.running = False  # the loop is alive (liveness)
        self.last_shard_answer = 0.0  # time.monotonic() of the last successful shard call (readiness)
        self._next_batch_id = 1
        self._next_request_id = 1

    async def run(self) -> None:
        """Serve the queue forever."""
        self.running = True
        try:
            await self._serve()
        finally:
            self.running = False

    async def _serve(self) -> None:
        while True:
            entries = self.queue.next_batch([], 1)
            if entries is None:
                await self.queue.wait()
                continue
            current, _ = await self._prefill(entries, [])
            await self._run_batch(current)
            self.metrics.batch_state(0, 0, 0, 0.0)

    async def _run_batch(self, current: RunningBatch | None) -> None:
        """Run a busy period: decode steps with joins, until nothing is left."""
        steps_since_join = 1
        earliest_next_join: float | None = None
        while current is not None:
            group = [current]
            live = [e for e in current.entries if e.id not in set(current.completed)]
            remaining = sum(e.out_tokens for e in live)
            self._publish_state(live, remaining)
            now = time.monotonic()
            if remaining >= 2 and (earliest_next_join is None or now > earliest_next_join):
                need = self._join_size(len(live), steps_since_join)
                entries = self.queue.next_batch(live, need)
                if entries:
                    start = time.monotonic()
                    to_prune = [current] if current.completed else []
                    added, pruned = await self._prefill(entries, to_prune)
                    took = time.monotonic() - start
                    if pruned and to_prune:
                        current = current.pruned()
                    if added is not None and current is not None:
                        self.metrics.inc("tgi_batch_concatenation_count")
                    steps_since_join = 1
                    earliest_next_join = time.monotonic() + took / 2
                    group = [b for b in (current, added) if b is not None]
                    if not group:
                        return
                else:
                    earliest_next_join = None
            current = await self._next_token(group)
            steps_since_join += 1

    def _publish_state(self, live: Sequence[Entry], remaining: int) -> None:
        weights = self.queue.weights
        loads = [(e.in_tokens, e.out_tokens) for e in live]
        usage = len(live) / self.queue.max_batch_size
        if weights.limit:
            usage = max(usage, weights.max_weight(loads) / weights.limit)
        self.metrics.batch_state(len(live), weights.batch_tokens(loads), remaining, usage)

    def _join_size(self, running: int, steps_since_join: int) -> int:
        """How many waiting entries make a join worth a prefill now (TGIS's policy)."""
        if running <= 1 or steps_since_join >= self.max_waiting_tokens:
            return 1
        return max(1, running * (self.max_waiting_tokens - steps_since_join) // self.max_waiting_tokens)

    # ---- shard calls ------------------------------------------------------------------------

    async def _prefill(
        self, entries: list[Entry], to_prune: list[RunningBatch]
    ) -> tuple[RunningBatch | None, bool]:
        """Prefill `entries` as a new batch, pruning `to_prune` first. Returns the new batch and
        whether the call succeeded (only then were the pruned requests dropped for sure; on
        failure they are listed again next time, which is harmless if they were dropped)."""
        batch_id, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
        now = time.monotonic()
        for new in entries:
            new.start(self._next_request_id, self.detokenizer, now)
            self._next_request_id += 1
        requests = [e.request.shard_request(e.id) for e in entries]
        loads = [(e.in_tokens, e.out_tokens) for e in entries]
        self.metrics.shard_call("prefill", len(entries), self.queue.weights.batch_tokens(loads))
        try:
            output = await self.client.prefill(batch_id, requests, [b.ref() for b in to_prune])
        except ShardCallError as exc:
            self._fail("prefill", entries, exc)
            return None, False
        self._answered()
        by_id = {e.id: e for e in entries}
        for item in output.input_tokens:
            if (entry := by_id.get(item.request_id)) is not None:
                entry.on_input_tokens(list(item.tokens))
        return self._process("prefill", now, output, entries), True

    async def _next_token(self, batches: Sequence[RunningBatch]) -> RunningBatch | None:
        live = [e for b in batches for e in b.entries if e.id not in set(b.completed)]
        start = time.monotonic()
        self.metrics.shard_call("next_token", len(live))
        try:
            output = await self.client.next_token([b.ref() for b in batches])
        except ShardCallError as exc:
            self._fail("next_token", [e for b in batches for e in b.entries if not e.finished], exc)
            return None
        self._answered()
        if output is None:  # every request had completed: the shard dropped the batch
            self.metrics.shard_call_succeeded("next_token", time.monotonic() - start, 0.0, 0.0)
            return None
        return self._process("next_token", start, output, live)

    def _answered(self) -> None:
        self.generation_healthy = True
        self.last_shard_answer = time.monotonic()

    def _fail(self, method: str, entries: Sequence[Entry], exc: ShardCallError) -> None:
        logger.error("shard call failed (%s): %s", exc.reason, exc)
        self.metrics.shard_call_failed(method, exc.reason)
        self.generation_healthy = False
        for entry in entries:
            entry.fail(str(exc))

    def _process(
        self, method: str, started: float, output: StepOutput, entries: Sequence[Entry]
    ) -> RunningBatch | None:
        """Hand every token to its entry; the batch (as cached in the shard) with its finished
        requests marked, or None when the shard cached nothing."""
        by_id = {e.id: e for e in entries}
        now = time.monotonic()
        for error in output.errors:
            if (entry := by_id.pop(error.request_id, None)) is not None:
                entry.fail(error.message, request_error=True)
        completed = []
        live = []
        for generation in output.generations:
            entry = by_id.get(generation.request_id)
            if entry is None:
                continue
            live.append(entry)
            if entry.cancelled:
                entry.cancel()  # counted by the servicer, which saw its client leave
                logger.debug("request %d cancelled after %d tokens", entry.id, entry.generated)
            else:
                if entry.last_token_at is None:
                    self.metrics.observe(
                        "tgi_request_time_to_first_token_duration", now - entry.request.received_at
                    )
                else:
                    self.metrics.observe("tgi_request_inter_token_duration", now - entry.last_token_at)
                entry.last_token_at = now
                try:
                    if not entry.on_token(generation.token, self.eos_token_id, self.detokenizer, now):
                        continue
                except BaseException as exc:  # tokenizers panics are BaseExceptions
                    if isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                        raise
                    logger.exception("request %d: decoding failed", entry.id)
                    entry.fail_detokenization(str(exc) or type(exc).__name__)
            completed.append(entry.id)
        self.metrics.shard_call_succeeded(
            method, now - started, output.forward_ns / 1e9, time.monotonic() - now
        )
        if output.batch_id is None:
            return None
        return RunningBatch(output.batch_id, live, completed)
