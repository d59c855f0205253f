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

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.detokenizer import Detokenizer
from router.entry import Entry
from router.request_queue import RequestQueue
from router.shard_client import ShardCallError, ShardClient
from router.stopping import StopReason
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
        *,
        eos_token_id: int,
        max_waiting_tokens: int,
    ) -> None:
        self.client = client
        self.queue = queue
        self.detokenizer = detokenizer
        self.eos_token_id = eos_token_id
        self.max_waiting_tokens = max_waiting_tokens
        self.generation_healthy: bool | None = None  # None until a first step ran
        self._next_batch_id = 1
        self._next_request_id = 1

    async def run(self) -> None:
        """Serve the queue forever."""
        while True:
            entries = self.queue.next_batch([], 1)
            if entries is None:
                await self.queue.wait()
                continue
            current, _ = await self._prefill(entries, [])
            await self._run_batch(current)

    async def _run_batch(self, current: RunningBatch | None) -> None:
        """Run a busy period: decode steps with joins, until nothing is left."""
        steps_since_join = 1
        earliest_next_join: float | None = None
        while current is not None:
            group = [current]
            live = [e for e in current.entries if e.id not in set(current.completed)]
            remaining = sum(e.out_tokens for e in live)
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
                    steps_since_join = 1
                    earliest_next_join = time.monotonic() + took / 2
                    group = [b for b in (current, added) if b is not None]
                    if not group:
                        return
                else:
                    earliest_next_join = None
            current = await self._next_token(group)
            steps_since_join += 1

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
        try:
            output = await self.client.prefill(batch_id, requests, [b.ref() for b in to_prune])
        except ShardCallError as exc:
            self._fail(entries, exc)
            return None, False
        self.generation_healthy = True
        by_id = {e.id: e for e in entries}
        for item in output.input_tokens:
            if (entry := by_id.get(item.request_id)) is not None:
                entry.on_input_tokens(list(item.tokens))
        return self._process(output, entries), True

    async def _next_token(self, batches: Sequence[RunningBatch]) -> RunningBatch | None:
        try:
            output = await self.client.next_token([b.ref() for b in batches])
        except ShardCallError as exc:
            self._fail([e for b in batches for e in b.entries if not e.finished], exc)
            return None
        self.generation_healthy = True
        if output is None:
            return None
        return self._process(output, [e for b in batches for e in b.entries if e.id not in set(b.completed)])

    def _fail(self, entries: Sequence[Entry], exc: ShardCallError) -> None:
        logger.error("shard call failed (%s): %s", exc.reason, exc)
        self.generation_healthy = False
        for entry in entries:
            entry.fail(str(exc))

    def _process(self, output: StepOutput, entries: Sequence[Entry]) -> RunningBatch | None:
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
                entry.cancel()
                logger.info("request %d cancelled after %d tokens", entry.id, entry.generated)
            elif not entry.on_token(generation.token, self.eos_token_id, self.detokenizer, now):
                continue
            completed.append(entry.id)
            _log_finished(entry)
        if output.batch_id is None:
            return None
        return RunningBatch(output.batch_id, live, completed)


def _log_finished(entry: Entry) -> None:
    if entry.stop_reason is StopReason.CANCELLED:
        return
    r = entry.request
    logger.info(
        "request %d: generated %d tokens before %s (input %d tokens, queue %.3fs, total %.3fs)",
        entry.id,
        entry.generated,
        entry.stop_reason.name,
        r.input_length,
        (entry.started_at or entry.queued_at) - entry.queued_at,
        time.monotonic() - r.received_at,
    )
