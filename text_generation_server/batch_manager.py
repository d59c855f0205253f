"""BatchManager: owns the shard's cached batches and runs prefill / next-token calls on them.

The router refers to batches by id; this class keeps them (with their KV caches) between calls,
prunes finished requests, merges batches, and runs the engine. Every call validates its whole
input before changing anything, so a rejected call (ShardError) leaves the cache as it was.
A call that fails inside the engine loses the batches it was running (the router fails them).

Not thread-safe: server.py calls it from its single worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from text_generation_server.batch import Batch
from text_generation_server.engines.base import ModelEngine
from text_generation_server.errors import BatchNotFoundError, InvalidBatchError
from text_generation_server.outputs import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    StepOutput,
)

logger = logging.getLogger(__name__)


class BatchManager:
    def __init__(self, engine: ModelEngine, max_batch_size: int) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._cache: dict[int, Batch] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    def cached_ids(self) -> list[int]:
        return list(self._cache)

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
    ):
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

    def _take(self, refs: Sequence[CachedBatchRef]) -> list[Batch]:
        """Pop the referenced batches, pruned; fully completed ones are dropped."""
        kept = []
        for ref in refs:
            batch = self._cache.pop(ref.batch_id)
            pruned = batch.prune(set(ref.completed_ids)) if ref.completed_ids else batch
            if pruned is not None:
                kept.append(pruned)
        return kept

    def _store(self, output: StepOutput, batch: Batch | None) -> StepOutput:
        if batch is not None and batch.batch_id != HEALTH_CHECK_BATCH_ID:
            self._cache[batch.batch_id] = batch
            output.batch_id = batch.batch_id
        return output

    def prefill(
        self, batch_id: int, requests: Sequence[GenerationRequest], to_prune: Sequence[CachedBatchRef]
    ) -> StepOutput:
        """Prune `to_prune`, then build batch `batch_id` and run its first step."""
        self._check_refs(to_prune)
        self._check_new(batch_id, requests, to_prune)
        for pruned in self._take(to_prune):
            self._cache[pruned.batch_id] = pruned
        batch, errors = self.engine.new_batch(batch_id, requests)
        if batch is None:
            return StepOutput(errors=errors)
        output, survivor = self.engine.generate_token(batch, first=True)
        output.errors[:0] = errors
        return self._store(output, survivor)

    def next_token(self, refs: Sequence[CachedBatchRef]) -> StepOutput | None:
        """Prune and merge the referenced batches and run one decode step.

        Returns None when every referenced request had completed. Cached batches that are not
        referenced are stale (the router no longer tracks them) and are dropped.
        """
        if not refs:
            raise InvalidBatchError("NextToken needs at least one batch")
        total = self._check_refs(refs)
        if total > self.max_batch_size:
            raise InvalidBatchError(
                f"merging batches {[r.batch_id for r in refs]} gives {total} requests, "
                f"more than max_batch_size ({self.max_batch_size})"
            )
        batches = self._take(refs)
        if self._cache:
            logger.warning("dropping stale cached batches %s", sorted(self._cache))
            self._cache.clear()
        if not batches:
            return None
        batch = batches[0] if len(batches) == 1 else self.engine.concatenate(batches)
        output, survivor = self.engine.generate_token(batch, first=False)
        return self._store(output, survivor)
