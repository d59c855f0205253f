"""BatchManager: owns the shard's cached batches and runs prefill / next-token calls on them.

The router refers to batches by id; this class keeps them (with their KV caches) between calls,
prunes finished requests, merges batches, and runs the engine. Every call validates its whole
input before changing anything, so a rejected call (ShardError) leaves the cache as it was.
A call that fails inside the engine loses the batches it was running (the router fails them).

Running ahead: after answering a call, the server has `run_ahead` step every cached batch
whose requests may still generate, while the answer travels to the router and the router
hands the tokens out. The router's next NextToken then finds the step done and is answered at
once, so the round trip (about a millisecond at batch size 1, more with a large batch) is no
longer between two forwards. The tokens are those the router's call would have produced:
every request keeps its own sampling state, and a step computed ahead of a prune gives
the requests pruned by that call one token too many, which is dropped here (the router already
drops tokens past a request's end). A step that fails ahead is reported by the next call that
references its batch, with the error the call itself would have raised.

One forward per step: a batch is run ahead only when no other cached batch may still generate.
Requests that joined beside a batch already stepped ahead (a Prefill's new batch, or NextToken's
`join` on engines that chunk prompts) are answered as pending by the call that merges them; the
merged batch's next step, run ahead, computes their tokens (or prompt chunks) with everyone
else's, instead of a forward of the new rows alone.

After every call (and ClearCache) the manager tells the engine which requests left its batches
(`engine.release`): finished and cancelled ones pruned, rows that failed, batches dropped as
stale or lost with a failed step, the health check's request. What an engine keeps for a
request outside its batches (KV blocks) has that one release point.

Not thread-safe: server.py calls it from its single worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    NewBatch,
    RequestError,
    StepOutput,
)
from text_generation_server.batches.batch import Batch
from text_generation_server.engines.base import ModelEngine
from text_generation_server.errors import BatchNotFoundError, InvalidBatchError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Ahead:
    """A decode step run before the router asked for it: the output still to deliver and the
    batch after the step (None when no request is left in it), or the error the step raised."""

    output: StepOutput
    batch: Batch | None
    error: Exception | None = None

    @property
    def request_ids(self) -> list[int]:
        return self.output.request_ids

    def may_generate(self) -> bool:
        return self.error is None and self.batch is not None and self.batch.remaining() > 0

    def prune(self, completed_ids: set[int]) -> Ahead | None:
        """Drop the given requests; None when nothing is left to deliver."""
        if self.error is not None:
            return self
        output = self.output.without(completed_ids)
        if not output.request_ids:
            return None
        batch = self.batch.prune(completed_ids) if self.batch is not None else None
        return Ahead(output, batch)


Cached = Batch | Ahead


class BatchManager:
    def __init__(
        self,
        engine: ModelEngine,
        max_batch_size: int,
        on_step_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        """`on_step_failure`: called with the exception of a step that raised, before it
        propagates (tensor-parallel shards stop there: server.py)."""
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._on_step_failure = on_step_failure
        self._cache: dict[int, Cached] = {}
        self._token_budget = 0  # of the last call; run-ahead steps use it too
        self._live: set[int] = set()  # request ids of the cached batches after the last call

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self._settle()

    @staticmethod
    def _live_ids(cached: Cached) -> list[int]:
        batch = cached.batch if isinstance(cached, Ahead) else cached
        return batch.request_ids if batch is not None else []

    def _settle(self, arrived: Sequence[GenerationRequest] = (), keep: set[int] | None = None) -> None:
        """Release the requests (known before, or `arrived` in this call) that neither a cached
        batch nor `keep` (the batches a call has taken out to step) holds any more."""
        live = set(keep or ())
        for cached in self._cache.values():
            live.update(self._live_ids(cached))
        gone = (self._live | {r.id for r in arrived}) - live
        self._live = live
        if gone:
            self.engine.release(gone)

    # ---- validation (no side effects) -------------------------------------------------------

    def _check_refs(self, refs: Sequence[CachedBatchRef]) -> int:
        """Check that the referenced batches exist; returns their total size after pruning."""
        seen: set[int] = set()
        total = 0
        for ref in refs:
            if ref.batch_id in seen:
                raise InvalidBatchError(f"Batch ID {ref.batch_id} is listed more than once")
            seen.add(ref.batch_id)
            batch = self._cache.get(ref.batch_id)
            if batch is None:
                raise BatchNotFoundError(ref.batch_id)
            completed = set(ref.completed_ids)
            total += sum(1 for rid in batch.request_ids if rid not in completed)
        return total

    def _check_new(
        self, batch_id: int, requests: Sequence[GenerationRequest], refs: Sequence[CachedBatchRef]
    ) -> None:
        if not requests:
            raise InvalidBatchError(f"Prefill batch {batch_id} has no requests")
        if len(requests) > self.max_batch_size:
            raise InvalidBatchError(
                f"Prefill batch {batch_id} has {len(requests)} requests, "
                f"more than max_batch_size ({self.max_batch_size})"
            )
        if batch_id != HEALTH_CHECK_BATCH_ID and batch_id in self._cache:
            raise InvalidBatchError(f"Batch ID {batch_id} is already in the cache")
        completed = {rid for ref in refs for rid in ref.completed_ids}
        live = {
            rid: bid
            for bid, batch in self._cache.items()
            for rid in batch.request_ids
            if rid not in completed
        }
        ids: set[int] = set()
        for request in requests:
            if request.id in ids:
                raise InvalidBatchError(f"Request ID {request.id} appears twice in batch {batch_id}")
            if request.id in live:
                raise InvalidBatchError(
                    f"Request ID {request.id} is already running in batch {live[request.id]}"
                )
            ids.add(request.id)

    # ---- calls ------------------------------------------------------------------------------

    def _take(self, refs: Sequence[CachedBatchRef]) -> list[tuple[int, Cached]]:
        """Pop the referenced batches, pruned, with their ids; fully completed ones are dropped."""
        kept = []
        for ref in refs:
            cached = self._cache.pop(ref.batch_id)
            pruned = cached.prune(set(ref.completed_ids)) if ref.completed_ids else cached
            if pruned is not None:
                kept.append((ref.batch_id, pruned))
        return kept

    def _with_kv_state(self, output: StepOutput) -> StepOutput:
        """`output` with the KV cache as the call left it (a step run ahead reported the cache
        before this call's prunes and joins)."""
        state = self.engine.kv_state()
        if state is not None:
            output.kv_cache = state
        return output

    def _store(self, output: StepOutput, batch: Batch | None) -> StepOutput:
        if batch is not None and batch.batch_id != HEALTH_CHECK_BATCH_ID:
            self._cache[batch.batch_id] = batch
            output.batch_id = batch.batch_id
        return output

    def _drop_stale(self) -> None:
        """Drop the cached batches no call referenced (the router no longer tracks them)."""
        if not self._cache:
            return
        logger.warning("dropping stale cached batches %s", sorted(self._cache))
        for cached in self._cache.values():
            if isinstance(cached, Ahead) and cached.error is not None:
                logger.warning("a step run ahead on a stale batch had failed: %r", cached.error)
        self._cache.clear()

    def _check_budget(self, token_budget: int) -> None:
        if token_budget and not self.engine.info.chunked_prefill:
            raise InvalidBatchError(
                f"token_budget {token_budget} needs chunked prefill, which this engine does not do"
            )

    def _generate(self, batch: Batch) -> tuple[StepOutput, Batch | None]:
        try:
            return self.engine.generate_token(batch, self._token_budget)
        except Exception as exc:
            if self._on_step_failure is not None:
                self._on_step_failure(exc)
            raise

    def prefill(
        self,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        to_prune: Sequence[CachedBatchRef],
        token_budget: int = 0,
    ) -> StepOutput:
        """Prune `to_prune`, then build batch `batch_id` and run its first step (computing at
        most `token_budget` prompt tokens when the engine chunks prefills; 0 = all)."""
        self._check_budget(token_budget)
        self._check_refs(to_prune)
        self._check_new(batch_id, requests, to_prune)
        self._token_budget = token_budget
        try:
            for pruned_id, pruned in self._take(to_prune):
                self._cache[pruned_id] = pruned
            self._settle()  # the pruned requests' blocks are free for the new ones
            batch, errors = self.engine.new_batch(batch_id, requests)
            if batch is None:
                output = StepOutput(errors=errors)
            else:
                output, survivor = self._generate(batch)
                output.errors[:0] = errors
                self._store(output, survivor)
        finally:
            self._settle(requests)
        return self._with_kv_state(output)

    def next_token(
        self, refs: Sequence[CachedBatchRef], token_budget: int = 0, join: NewBatch | None = None
    ) -> StepOutput | None:
        """Prune and merge the referenced batches and run one decode step (or deliver the step
        run ahead on them); `token_budget` as in prefill. `join` (engines with chunked prefill):
        new requests merged in after them without a forward of their own: their prompts are
        computed in this step, or answered as pending when the step was run ahead.

        Returns None when every referenced request had completed and none joined. Cached batches
        that are not referenced are stale (the router no longer tracks them) and are dropped.
        """
        if not refs:
            raise InvalidBatchError("NextToken needs at least one batch")
        self._check_budget(token_budget)
        total = self._check_refs(refs)
        if join is not None:
            self._check_join(join, refs)
            total += len(join.requests)
        if total > self.max_batch_size:
            raise InvalidBatchError(
                f"merging batches {[r.batch_id for r in refs]} gives {total} requests, "
                f"more than max_batch_size ({self.max_batch_size})"
            )
        self._token_budget = token_budget
        try:
            output = self._next_token(refs, join)
        finally:
            self._settle(join.requests if join is not None else ())
        return self._with_kv_state(output) if output is not None else None

    def _check_join(self, join: NewBatch, refs: Sequence[CachedBatchRef]) -> None:
        if not self.engine.info.chunked_prefill:
            raise InvalidBatchError(
                f"joining batch {join.batch_id} in a decode step needs chunked prefill, which this "
                "engine does not do"
            )
        if join.batch_id == HEALTH_CHECK_BATCH_ID:
            raise InvalidBatchError("the health-check batch cannot join a decode step")
        self._check_new(join.batch_id, join.requests, refs)

    def _next_token(self, refs: Sequence[CachedBatchRef], join: NewBatch | None) -> StepOutput | None:
        taken = [cached for _, cached in self._take(refs)]
        self._drop_stale()
        live = {rid for cached in taken for rid in self._live_ids(cached)}
        self._settle(keep=live)  # the pruned and stale requests' blocks are free for this step
        for cached in taken:
            if isinstance(cached, Ahead) and cached.error is not None:
                raise cached.error  # the referenced batches are lost, as when the step fails now
        errors: list[RequestError] = []
        if join is not None:
            joined, errors = self.engine.new_batch(join.batch_id, join.requests)
            if joined is not None:
                taken.append(joined)
        if not taken:
            return StepOutput(errors=errors) if errors else None
        parts: list[tuple[StepOutput, Batch | None]]
        if any(isinstance(c, Ahead) for c in taken):  # this step ran ahead: fresh rows wait for the next
            parts = [
                (c.output, c.batch) if isinstance(c, Ahead) else (StepOutput(pending=c.request_ids), c)
                for c in taken  # in the order of the refs: the merged batch keeps the first id
            ]
        else:
            parts = [self._step([c for c in taken if isinstance(c, Batch)])]
        survivors = [b for _, b in parts if b is not None]
        merged = None
        if survivors:
            merged = survivors[0] if len(survivors) == 1 else self.engine.concatenate(survivors)
        output = StepOutput.merged([o for o, _ in parts])
        output.errors[:0] = errors
        return self._store(output, merged)

    def _step(self, batches: Sequence[Batch]) -> tuple[StepOutput, Batch | None]:
        batch = batches[0] if len(batches) == 1 else self.engine.concatenate(batches)
        return self._generate(batch)

    def run_ahead(self) -> None:
        """Run the next decode step of the cached batch, when it is the only one whose requests
        may still generate and it was not stepped ahead yet. With more than one, the router's
        next call merges them: one step over the merged batch is one forward, where stepping
        each now would be one forward each."""
        active = [
            (batch_id, cached)
            for batch_id, cached in self._cache.items()
            if (cached.may_generate() if isinstance(cached, Ahead) else cached.remaining() > 0)
        ]
        if len(active) != 1 or isinstance(active[0][1], Ahead):
            return
        batch_id, batch = active[0]
        assert isinstance(batch, Batch)
        try:
            output, survivor = self._generate(batch)
        except Exception as exc:  # reported by the next call that references the batch
            self._cache[batch_id] = Ahead(StepOutput(), None, exc)
        else:
            self._cache[batch_id] = Ahead(output, survivor)
        self._settle()  # rows that failed ahead, and the requests of a batch whose step failed
