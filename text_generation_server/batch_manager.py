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

Pipelined steps (engines whose `launch` queues a step without waiting for it: tgis_native on a
GPU, PIPELINE_STEPS): running ahead launches the next step on the batch *before* reading back
the one to deliver, so the device computes step N + 1 while the host reads step N, answers the
router and takes its next call; a cached batch may then carry a step in flight (`InFlight`),
read by the next run ahead (after launching the one after it) or by the call that needs it.
What a call prunes is dropped from the step in flight when it is read; requests that join
beside a step in flight are answered as pending until a step covers them.

Several steps per call (NextToken's `steps`): the call's step is followed by more steps on
the batch it leaves cached, each taken as a step run ahead is (rows that had max_new_tokens
leave first; no step once every request has ended, by max_new_tokens or EOS), their tokens
answered together, so that one round trip with the router carries
several tokens per request. A step that fails there is reported by the next call, as a step
that failed ahead; the tokens before it are answered. A call the router names (`call`) ends
after the step it is computing once `end_steps` names it (from the server's event-loop thread:
a request waits to join), so a join waits for one step, not for the rest of the call. A call
also ends after a step that gives a request one of its `call_end_ids`, the tokens that may
complete one of its stop sequences: the router, which finds stop sequences in the text, then
sees that step's tokens at once instead of after the rest of the call.

After every call (and ClearCache) the manager tells the engine which requests left its batches
(`engine.release`): finished and cancelled ones pruned, rows that failed, batches dropped as
stale or lost with a failed step, the health check's request. What an engine keeps for a
request outside its batches (KV blocks) has that one release point.

Not thread-safe: server.py calls it from its single worker thread only, but for `end_steps`
(one attribute written, read by the worker between steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    NewBatch,
    RequestError,
    StepOutput,
)
from text_generation_server.batches.batch import Batch
from text_generation_server.engines.base import Launched, ModelEngine
from text_generation_server.errors import BatchNotFoundError, InvalidBatchError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """Steps launched on the device and not read back yet (ModelEngine.launch), over `batch` (as
    they leave it, pruned since): their tokens for `dropped` (pruned since they were launched)
    are dropped when read, and the batch's requests that no launched step covers (`waiting`:
    they joined after) are answered as pending."""

    launched: list[Launched]
    batch: Batch
    dropped: set[int] = field(default_factory=set)
    waiting: list[int] = field(default_factory=list)

    @property
    def request_ids(self) -> list[int]:
        return self.batch.request_ids

    def prune(self, completed_ids: set[int]) -> InFlight | None:
        """Drop the given requests; None when none of the batch is left (the steps' tokens are
        then not wanted either)."""
        batch = self.batch.prune(completed_ids)
        if batch is None:
            return None
        waiting = [r for r in self.waiting if r not in completed_ids]
        return InFlight(self.launched, batch, self.dropped | completed_ids, waiting)


@dataclass(slots=True)
class Ahead:
    """A decode step run before the router asked for it: the output still to deliver and the
    batch after the step (None when no request is left in it), or the error the step raised;
    `next`: the step launched after it on that batch, in flight (pipelined steps)."""

    output: StepOutput
    batch: Batch | None
    error: Exception | None = None
    next: InFlight | None = None

    @property
    def request_ids(self) -> list[int]:
        return self.output.request_ids

    def may_generate(self) -> bool:
        return self.error is None and self.batch is not None and _may_generate(self.batch)

    def prune(self, completed_ids: set[int]) -> Ahead | None:
        """Drop the given requests; None when nothing is left to deliver."""
        if self.error is not None:
            return self
        output = self.output.without(completed_ids)
        if not output.request_ids:
            return None
        following = self.next.prune(completed_ids) if self.next is not None else None
        if following is not None:
            return Ahead(output, following.batch, next=following)
        batch = self.batch.prune(completed_ids) if self.batch is not None else None
        return Ahead(output, batch)

    def carried(self) -> Batch | InFlight | None:
        """What stays cached once the output is delivered."""
        return self.next if self.next is not None else self.batch


Cached = Batch | Ahead | InFlight


def _may_generate(batch: Batch) -> bool:
    """A step of `batch` may give a request a token the router keeps."""
    return batch.remaining() > 0 and not batch.ended()


def _batch_of(cached: Cached) -> Batch | None:
    return cached.batch if isinstance(cached, Ahead | InFlight) else cached


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
        self._ended_call = 0  # the last call named by end_steps
        self._call_ends: dict[int, frozenset[int]] = {}  # request id -> its call_end_ids (if any)

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self._settle()

    @staticmethod
    def _live_ids(cached: Cached) -> list[int]:
        batch = _batch_of(cached)
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
            for request_id in gone:
                self._call_ends.pop(request_id, None)
            self.engine.release(gone)

    def _note_call_ends(self, requests: Sequence[GenerationRequest]) -> None:
        """Keep the call-ending tokens of arriving requests (until _settle sees them gone)."""
        for request in requests:
            if request.call_end_ids:
                self._call_ends[request.id] = request.call_end_ids

    def _ends_call(self, output: StepOutput) -> bool:
        """Whether a request got one of its call-ending tokens in `output`."""
        ends = self._call_ends
        return bool(ends) and any(g.token.token_id in ends.get(g.request_id, ()) for g in output.generations)

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

    def _store(self, output: StepOutput, cached: Batch | InFlight | None) -> StepOutput:
        batch = _batch_of(cached) if cached is not None else None
        if cached is not None and batch is not None and batch.batch_id != HEALTH_CHECK_BATCH_ID:
            self._cache[batch.batch_id] = cached
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
            output, survivor = self.engine.generate_token(batch, self._token_budget)
        except Exception as exc:
            if self._on_step_failure is not None:
                self._on_step_failure(exc)
            raise
        output.steps = 1
        return output, survivor

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
            self._note_call_ends(requests)
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
        self,
        refs: Sequence[CachedBatchRef],
        token_budget: int = 0,
        join: NewBatch | None = None,
        steps: int = 1,
        call: int = 0,
    ) -> StepOutput | None:
        """Prune and merge the referenced batches and run one decode step (or deliver the step
        run ahead on them); `token_budget` as in prefill. `join` (engines with chunked prefill):
        new requests merged in after them without a forward of their own: their prompts are
        computed in this step, or answered as pending when the step was run ahead. `steps`:
        up to that many steps in all, answered together (module docstring); `call` names them
        for `end_steps` (0: not named).

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
            if output is not None and steps > 1:
                output = self._more_steps(output, steps - 1, call)
        finally:
            self._settle(join.requests if join is not None else ())
        return self._with_kv_state(output) if output is not None else None

    def end_steps(self, call: int) -> None:
        """End the call named `call` after the step it is computing (or after its first step,
        when it has not started yet); no effect once it has ended. Any thread."""
        self._ended_call = call

    def _more_steps(self, output: StepOutput, steps: int, call: int = 0) -> StepOutput:
        """`output` followed by up to `steps` more steps of the batch it left cached, while any
        of its requests may generate, `end_steps` has not named `call` and no request got one of
        its call-ending tokens; their tokens merged in step order."""
        batch_id = output.batch_id
        outputs = [output]
        while (
            batch_id is not None
            and len(outputs) <= steps
            and not (call and call == self._ended_call)
            and not self._ends_call(outputs[-1])
        ):
            cached = self._cache.get(batch_id)
            if cached is None or isinstance(cached, Ahead) or not self._may_step(cached):
                break
            del self._cache[batch_id]
            if isinstance(cached, InFlight):
                ahead = self._read(cached, launch_next=True)
            else:
                batch = cached.without_done()
                assert batch is not None, "a batch that may step has a request that may generate"
                ahead = self._step_ahead(batch)
            if ahead.error is not None:  # reported by the next call that references the batch
                self._cache[batch_id] = ahead
                break
            outputs.append(ahead.output)
            carried = ahead.carried()
            if carried is None:
                batch_id = None
            else:
                self._cache[batch_id] = carried
        merged = StepOutput.merged(outputs)
        merged.batch_id = batch_id
        return merged

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
        taken = [self._read(c) if isinstance(c, InFlight) else c for c in taken]  # the step asked for
        for cached in taken:
            if isinstance(cached, Ahead) and cached.error is not None:
                raise cached.error  # the referenced batches are lost, as when the step fails now
        errors: list[RequestError] = []
        if join is not None:
            self._note_call_ends(join.requests)
            joined, errors = self.engine.new_batch(join.batch_id, join.requests)
            if joined is not None:
                taken.append(joined)
        if not taken:
            return StepOutput(errors=errors) if errors else None
        if not any(isinstance(c, Ahead) for c in taken):
            output, survivor = self._step([c for c in taken if isinstance(c, Batch)])
            output.errors[:0] = errors
            return self._store(output, survivor)
        # this step ran ahead: fresh rows wait for the next
        outputs = [c.output if isinstance(c, Ahead) else StepOutput(pending=c.request_ids) for c in taken]
        carried = [c.carried() if isinstance(c, Ahead) else c for c in taken]
        output = StepOutput.merged(outputs)
        output.errors[:0] = errors
        return self._store(output, self._merge([c for c in carried if c is not None]))

    def _merge(self, parts: Sequence[Batch | InFlight]) -> Batch | InFlight | None:
        """One cached entry of `parts` in order (the merged batch keeps the first one's id):
        steps in flight over some of them go on over the merged batch, its other requests
        waiting for the step after them."""
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        batches = [p.batch if isinstance(p, InFlight) else p for p in parts]
        merged = self.engine.concatenate(batches)
        flights = [p for p in parts if isinstance(p, InFlight)]
        if not flights:
            return merged
        covered = {rid for f in flights for launched in f.launched for rid in launched.request_ids}
        return InFlight(
            [launched for f in flights for launched in f.launched],
            merged,
            set().union(*(f.dropped for f in flights)),
            [rid for rid in merged.request_ids if rid not in covered],
        )

    def _step(self, batches: Sequence[Batch]) -> tuple[StepOutput, Batch | None]:
        batch = batches[0] if len(batches) == 1 else self.engine.concatenate(batches)
        return self._generate(batch)

    def _read(self, flight: InFlight, launch_next: bool = False) -> Ahead:
        """Read back the steps in flight: their output to deliver, as an Ahead. `launch_next`:
        first launch the step after them on the batch (when it may still generate), so that
        the device runs it while this host reads and answers. A failure in either loses the
        batch (reported by the next call that references it)."""
        following = None
        try:
            if launch_next and flight.batch.remaining() > 0:
                launched = self.engine.launch(flight.batch, self._token_budget)
                if launched is not None:
                    following = InFlight([launched], launched.batch)
            outputs = [self.engine.finish(launched) for launched in flight.launched]
        except Exception as exc:
            return self._failed_ahead(exc)
        for one in outputs:
            one.steps = 1
        output = StepOutput.merged(outputs)
        if flight.dropped:
            output = output.without(flight.dropped)
        output.pending += [r for r in flight.waiting if r not in output.pending]
        failed = {e.request_id for e in output.errors}
        if following is not None:
            following = following.prune(failed) if failed else following
            return Ahead(output, following.batch if following else None, next=following)
        batch = flight.batch.prune(failed) if failed else flight.batch
        return Ahead(output, batch)

    def _failed_ahead(self, exc: Exception) -> Ahead:
        """A step that failed ahead: reported by the next call that references its batch."""
        if self._on_step_failure is not None:
            self._on_step_failure(exc)
        return Ahead(StepOutput(), None, exc)

    def run_ahead(self) -> None:
        """Run the next decode step of the cached batch, when it is the only one whose requests
        may still generate and it was not stepped ahead yet. With more than one, the router's
        next call merges them: one step over the merged batch is one forward, where stepping
        each now would be one forward each. Where the engine pipelines steps, the step after
        it is launched before it is read back (module docstring)."""
        active = [(batch_id, cached) for batch_id, cached in self._cache.items() if self._may_step(cached)]
        if len(active) != 1 or isinstance(active[0][1], Ahead):
            return
        batch_id, cached = active[0]
        assert not isinstance(cached, Ahead)
        if isinstance(cached, InFlight):
            self._cache[batch_id] = self._read(cached, launch_next=True)
        else:
            self._cache[batch_id] = self._step_ahead(cached)
        self._settle()  # rows that failed ahead, and the requests of a batch whose step failed

    def _step_ahead(self, batch: Batch) -> Ahead:
        try:
            launched = self.engine.launch(batch, self._token_budget)
        except Exception as exc:
            return self._failed_ahead(exc)
        if launched is not None:
            return self._read(InFlight([launched], launched.batch), launch_next=True)
        try:
            output, survivor = self._generate(batch)
        except Exception as exc:  # reported by the next call that references the batch
            return Ahead(StepOutput(), None, exc)
        return Ahead(output, survivor)

    @staticmethod
    def _may_step(cached: Cached) -> bool:
        if isinstance(cached, InFlight):
            return True  # its step is still to read
        if isinstance(cached, Ahead):
            return cached.may_generate()
        return _may_generate(cached)
