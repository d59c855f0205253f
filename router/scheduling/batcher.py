"""The continuous-batching loop: the only owner of the running batch.

One asyncio task (`run`). While requests run it sends decode steps (NextToken), and waiting
requests that fit join the running batch in one of two ways, by what the engine can do:
  - engines with chunked prefill (`join_in_step`): as NextToken's `join`, no forward of their
    own, their prompt chunks ride with the decode rows under the step's token budget; at every
    step where requests wait and fit (vLLM's rule), or, where decode-only steps replay captured
    graphs but a step that carries prompt chunks runs eagerly, several times slower
    (`eager_joins`), when as many wait as TGIS's rule below asks;
  - the others: with a prefill of the new requests (every running request waits for it), at
    most every other prefill's duration, and only when enough wait: the number a join needs
    shrinks as decode steps pass, down to one after MAX_WAITING_TOKENS steps (TGIS's policy);
    the shard merges the new batch in at the next step.
Finished requests are pruned on the next call. Per-token work (decoding, stopping, outputs) is
in entry.py; how many tokens a streamed message carries is the shared StreamPacing's interval,
judged here at every decode step when adaptive (MAX_STREAM_INTERVAL, pacing.py).

    idle:   wait for the queue -> PREFILL(new)
    busy, join_in_step:  NEXT_TOKEN(current, join=[new]) -> ...
    busy, otherwise:     [maybe PREFILL(new, prune=current)] -> NEXT_TOKEN(current [+ new]) -> ...

Every live request of a call must come back with a token, an error, or a pending entry (still
running, no token this step: its prompt is only partly computed under chunked prefill); one the
shard answers with none of these fails with MISSING_ANSWER rather than vanish. Engines with
chunked prefill get MAX_BATCH_PREFILL_TOKENS as the per-step prompt-token budget of each call.

Preemption (SCHEDULING_POLICY=priority, decoder-only models): before a join, running requests
that the queue names (`RequestQueue.victims`) make room for the first waiting request of a
lower priority value: their entries keep their text and stop state and leave the batch (the
shard drops them at the next call), and wait again; once taken back they are sent with the ids
they generated (`GenerationRequest.generated_ids`), which the shard computes after the prompt,
going on as if they had never stopped. A deadline that passes while they wait ends them with
what they generated. A request whose thinking reached its budget (router/core/thinking.py)
leaves and comes back the same way, at once, with the closing marker's ids added.

The batcher is the one owner of model calls: the /health deep check's one-token prefill
(`probe`) runs between the loop's own calls, so every shard (every tensor-parallel rank) sees
all calls in one order.

Several steps per call: while no request waits in the queue (nor a health check), every running
request has had its first token and none joins, a NextToken asks the shard for up to
MAX_DECODE_STEPS steps, as many as fit in MAX_DECODE_CALL_MS by the forward time per step of
the last calls (an average); their tokens come back in one answer. Each call costs both
processes a message and its wake-ups, which at small batches is a large share of a step on a
CPU. A request (or health check) that arrives meanwhile ends a call of NAMED_CALL_STEPS or more
after the step the shard is computing (EndSteps names the call; one shard only), so it waits
one step to join, not the rest of the call; a shorter call is left to end (the wait it would
save is at most a step, the EndSteps call costs both processes about as much as a step's
message).

Decode steps overlap with token processing: as soon as step k's tokens arrive, step k+1 is
sent, and step k's tokens are decoded, checked and streamed while the shard computes. Requests
that surely finish with step k (max_new_tokens reached, cancelled, deadline passed) are pruned
in step k+1; those that stop on EOS or a stop sequence are known only after processing, so the
shard computes one token too many for them, which is dropped, and they are pruned in step k+2.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.core.detokenizer import Detokenizer
from router.core.entry import Entry, Failure
from router.core.metrics import Metrics
from router.core.pacing import ONE_PER_TOKEN, StreamPacing
from router.scheduling.request_queue import RequestQueue, entry_load
from router.scheduling.shard_client import ShardCallError, ShardClient
from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    NewBatch,
    StepOutput,
)

logger = logging.getLogger(__name__)

NAMED_CALL_STEPS = 4  # the fewest steps of a call that a new arrival ends early (EndSteps)

# ShardCallError.reason -> what the requests of the failed call report
CALL_FAILURES = {"connection": Failure.SHARD_UNAVAILABLE, "oom": Failure.OUT_OF_MEMORY}
MISSING_ANSWER = "the shard returned neither a token nor an error for this request"
STEP_TIME_WEIGHT = 0.25  # of the last call in the average forward time per step


def step_time(average: float | None, per_step: float) -> float:
    """The average forward time per decode step once a call took `per_step` a step."""
    return per_step if average is None else average + STEP_TIME_WEIGHT * (per_step - average)


def steps_that_fit(step_s: float, max_steps: int, max_call_s: float) -> int:
    """The decode steps of a call that fit in `max_call_s` at `step_s` a step, 1 to `max_steps`."""
    fit = int(max_call_s / step_s) if step_s > 0 else max_steps
    return max(1, min(max_steps, fit))


@dataclass(slots=True)
class _Step:
    """A decode step whose tokens are not handed out yet."""

    output: StepOutput
    entries: list[Entry]  # the requests the call ran
    started: float
    call_s: float


@dataclass(slots=True)
class RunningBatch:
    """A batch cached in the shard: its live requests and those to drop at the next call."""

    batch_id: int
    entries: list[Entry]
    completed: list[int] = field(default_factory=list)
    # ids of requests that left the batch to run again later (preempted, or their thinking
    # ended), their entries no longer here: an entry gets a new id when it runs again
    left: list[int] = field(default_factory=list)

    def ref(self) -> CachedBatchRef:
        return CachedBatchRef(self.batch_id, (*self.completed, *self.left))

    def leave(self, entries: Sequence[Entry]) -> None:
        """`entries` leave the batch (the shard drops them at the next call)."""
        self.left += [e.id for e in entries]
        self.entries = [e for e in self.entries if e not in entries]

    def live(self) -> list[Entry]:
        """The entries not marked completed."""
        done = set(self.completed)
        return [e for e in self.entries if e.id not in done]

    def pruned(self) -> RunningBatch | None:
        """This batch once the shard dropped the completed requests."""
        live = self.live()
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
        extra_eos_token_ids: Sequence[int] = (),
        join_in_step: bool = False,
        eager_joins: bool = False,
        pacing: StreamPacing = ONE_PER_TOKEN,
        max_decode_steps: int = 1,
        max_decode_call_s: float = 0.0,
        preemption: bool = False,
    ) -> None:
        """`join_in_step`: new requests join in decode steps (the engine chunks prompts);
        `eager_joins`: the shard's decode-only steps replay captured graphs, its steps with
        prompt chunks do not; `pacing`: the streams' tokens per message, adapted here at every
        decode step when adaptive; `max_decode_steps`, `max_decode_call_s`: the most decode
        steps one call may ask for, and the longest their forwards may take (module docstring);
        `extra_eos_token_ids`: the model's other EOS ids, each ending a request as EOS does;
        `preemption`: running requests leave the batch for a waiting one of a lower priority
        value that does not fit beside them (SCHEDULING_POLICY=priority, a decoder-only model)."""
        self.client = client
        self.queue = queue
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.eos_token_ids = frozenset((eos_token_id, *extra_eos_token_ids))
        self.max_waiting_tokens = max_waiting_tokens
        self.join_in_step = join_in_step
        self.eager_joins = eager_joins
        self.pacing = pacing
        self.max_decode_steps = max_decode_steps
        self.max_decode_call_s = max_decode_call_s
        self.preemption = preemption
        self.step_s: float | None = None  # forward time per decode step, averaged over calls
        metrics.set("tgi_stream_interval", pacing.interval)
        self.generation_healthy: bool | None = None  # None until a first step ran
        self.running = False  # the loop is alive (liveness)
        self.last_shard_answer = 0.0  # time.monotonic() of the last successful shard call (readiness)
        self._next_batch_id = 1
        self._next_request_id = 1
        self._calls = 0  # decode calls of several steps named so far (EndSteps)
        self._live: Sequence[Entry] = ()  # the running requests, as the last step left them
        self._probes: list[tuple[GenerationRequest, asyncio.Future[bool]]] = []
        self._ended = False  # the loop ran and stopped: nothing will answer a probe

    @property
    def token_budget(self) -> int:
        """The prompt tokens a call may compute (chunked prefill); 0 = whole prompts."""
        return self.queue.max_prefill_tokens if self.queue.chunked_prefill else 0

    async def probe(self, request: GenerationRequest) -> bool:
        """Run `request` as a one-token prefill of the health-check batch (never cached) between
        the loop's own calls; True when it produced its token."""
        if self._ended:
            return False
        future = asyncio.get_running_loop().create_future()
        self._probes.append((request, future))
        self.queue.poke()
        return await future

    async def _run_probes(self) -> None:
        while self._probes:
            request, future = self._probes.pop(0)
            try:
                output = await self.client.prefill(HEALTH_CHECK_BATCH_ID, [request], [])
            except ShardCallError as exc:
                logger.warning("health check prefill failed: %s", exc)
                ok = False
            else:
                ok = not output.errors and len(output.generations) == 1
            self.generation_healthy = ok
            if not future.done():
                future.set_result(ok)

    async def run(self) -> None:
        """Serve the queue forever."""
        self.running = True
        try:
            await self._serve()
        finally:
            self.running = False
            self._ended = True
            for _, future in self._probes:
                future.cancel()

    async def _serve(self) -> None:
        while True:
            await self._run_probes()
            entries = self.queue.next_batch([], 1)
            if entries is None:
                await self.queue.wait()
                continue
            self.queue.busy = True
            self.pacing.restart()
            self.metrics.set("tgi_stream_interval", self.pacing.interval)
            try:
                current, _ = await self._prefill(entries, [])
                await self._run_batch(current)
            finally:
                self.queue.busy = False
            self.metrics.batch_state(0, 0, 0, 0.0)
            self._live = ()

    async def _run_batch(self, current: RunningBatch | None) -> None:
        """Run a busy period: decode steps with joins, until nothing is left."""
        steps_since_join = 1
        earliest_next_join: float | None = None
        unprocessed: _Step | None = None
        while current is not None:
            await self._run_probes()
            resumed = self._end_thinking(current, unprocessed)  # before their step's tokens count
            if unprocessed is not None:
                current.completed.extend(self._surely_finished(unprocessed, current))
            for entry in self.queue.take_expired(time.monotonic()):  # ran, left, and waited too long
                entry.time_out(self.detokenizer)
            live = current.live()
            if not live:  # only the call that drops the batch is left: nothing runs any more, so
                self.queue.busy = False  # a waiting request is scheduled, not expired in the queue
            remaining = sum(e.out_tokens for e in live)
            self._publish_state(live, remaining)
            group = [current]
            now = time.monotonic()
            if self.join_in_step:
                need = self._join_size(len(live), steps_since_join) if self.eager_joins and not resumed else 1
                if need == 1 and live:
                    live, unprocessed = self._make_room(current, live, unprocessed)
                join = self.queue.next_batch(live, need) if live else None
                steps_since_join = 1 if join else steps_since_join
                current, unprocessed = await self._decode(group, unprocessed, join)
                steps_since_join += 1
                continue
            if resumed or (remaining >= 2 and (earliest_next_join is None or now > earliest_next_join)):
                need = 1 if resumed else self._join_size(len(live), steps_since_join)
                if need == 1:
                    live, unprocessed = self._make_room(current, live, unprocessed)
                entries = self.queue.next_batch(live, need)
                if entries:
                    if unprocessed is not None:  # the prefill prunes: settle the last step first
                        current.completed.extend(self._late_finishers(self._hand_out(unprocessed), current))
                        unprocessed = None
                    start = time.monotonic()
                    to_prune = [current] if current.completed or current.left else []
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
            current, unprocessed = await self._decode(group, unprocessed)
            steps_since_join += 1
        if unprocessed is not None:
            self._hand_out(unprocessed)

    def _end_thinking(self, current: RunningBatch, unprocessed: _Step | None) -> bool:
        """End the thinking of the running requests that have thought their budget (thinking.py):
        the closing ids are given to them here, and each leaves the batch at the next call, to
        join again at once, resumed from its ids. A token of theirs in the step not handed out
        yet is dropped (one past the budget). True when any is to join again."""
        over = [e for e in current.live() if e.thinking is not None and e.thinking.over]
        if not over:
            return False
        if unprocessed is not None:
            unprocessed.entries = [e for e in unprocessed.entries if e not in over]
        now = time.monotonic()
        current.leave(over)
        again = [e for e in over if not e.end_thinking(self.detokenizer, now)]
        self.queue.requeue(again)
        self.metrics.inc("tgi_request_thinking_ended", len(over))
        return bool(again)

    def _make_room(
        self, current: RunningBatch, live: list[Entry], unprocessed: _Step | None
    ) -> tuple[list[Entry], _Step | None]:
        """Preempt the running requests the queue names (`RequestQueue.victims`) so that the
        first waiting request fits: they are dropped from the batch at the next call and wait
        again, to resume from the ids they generated (the shard computes those after the prompt
        and goes on as if they had never stopped). The step not handed out yet is handed out
        first, so that each one's ids are complete. Returns the live entries and that step."""
        if not self.preemption or not self.queue.victims(live):
            return live, unprocessed
        if unprocessed is not None:
            current.completed.extend(self._late_finishers(self._hand_out(unprocessed), current))
            unprocessed = None
            self._end_thinking(current, None)  # those the step took to their budget end it first
            live = current.live()
        victims = self.queue.victims(live)
        if not victims:
            return live, None
        for entry in victims:
            entry.preempt()
            logger.info(
                "request %d (priority %d) preempted after %d tokens",
                entry.id,
                entry.request.priority,
                entry.generated,
            )
        current.leave(victims)
        self.queue.requeue(victims)
        self.metrics.inc("tgi_request_preemption", len(victims))
        return current.live(), None

    async def _decode(
        self, group: Sequence[RunningBatch], unprocessed: _Step | None, join: list[Entry] | None = None
    ) -> tuple[RunningBatch | None, _Step | None]:
        """Send one NextToken over `group`, with `join` joining it; hand out `unprocessed` while
        it runs. Returns the batch as the shard now caches it and this step's tokens, still to
        be handed out."""
        new = self._start(join) if join else None
        if self.pacing.step():
            self.metrics.set("tgi_stream_interval", self.pacing.interval)
        entries = [e for b in group for e in b.live()] + (join or [])
        steps = self._steps(entries, unprocessed)
        name = 0
        if steps >= NAMED_CALL_STEPS:
            self._calls += 1
            name = self._calls
        started = time.monotonic()
        self.metrics.shard_call("next_token", len(entries))
        if join:
            self.metrics.inc("tgi_batch_concatenation_count")
        refs = [b.ref() for b in group]
        call = asyncio.ensure_future(self.client.next_token(refs, self.token_budget, new, steps, name))
        # The call's send is scheduled; one turn of the loop runs it before the hand-out below
        # wakes every stream of the batch. Otherwise the request waits behind all of their
        # writes: router send -> shard receive was 5.6 ms of a 48 ms step at 32 streams.
        await asyncio.sleep(0)
        late = self._hand_out(unprocessed) if unprocessed is not None else []
        try:
            output = await (self._ended_on_arrival(call, name) if name else call)
        except ShardCallError as exc:
            running = [e for b in group for e in b.entries if not e.finished]
            self._fail("next_token", running + (join or []), exc)
            return None, None
        finally:
            call.cancel()  # only matters when this coroutine itself is cancelled
        self._answered(output)
        call_s = time.monotonic() - started
        if output is not None and output.steps:
            self.step_s = step_time(self.step_s, output.forward_ns / output.steps / 1e9)
        if output is None:  # every request had completed: the shard dropped the batch
            self.metrics.shard_call_succeeded("next_token", call_s, 0.0, 0.0)
            return None, None
        step = _Step(output, entries, started, call_s)
        if output.batch_id is None:  # every request failed in the shard
            return None, step
        rows = output.running_ids
        batch = RunningBatch(output.batch_id, [e for e in entries if e.id in rows])
        batch.completed.extend(self._late_finishers(late, batch))
        return batch, step

    async def _ended_on_arrival(
        self, call: asyncio.Future[StepOutput | None], name: int
    ) -> StepOutput | None:
        """`call`'s answer; should a request or a health check arrive first, the shard is asked
        to end the call after its step in progress."""
        if not (len(self.queue) or self._probes):
            await asyncio.wait((call, self.queue.arrival()), return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            await self.client.end_steps(name)
        return await call

    def _steps(self, entries: Sequence[Entry], unprocessed: _Step | None = None) -> int:
        """The decode steps the next call over `entries` asks for (module docstring): none past
        a request's thinking budget, counting the tokens of `unprocessed` it has not had yet."""
        if self.max_decode_steps <= 1 or self.step_s is None or len(self.queue) or self._probes:
            return 1
        if any(e.last_token_at is None for e in entries):  # joining, or a prompt still computed
            return 1
        steps = steps_that_fit(self.step_s, self.max_decode_steps, self.max_decode_call_s)
        thinking = [
            (e.id, left) for e in entries if e.thinking is not None and (left := e.thinking.left) is not None
        ]
        if not thinking:
            return steps
        coming = Counter(g.request_id for g in unprocessed.output.generations) if unprocessed else Counter()
        return max(1, min(steps, *(left - coming[i] for i, left in thinking)))

    @staticmethod
    def _late_finishers(finished: Sequence[int], batch: RunningBatch) -> list[int]:
        """Of the requests that finished when their tokens were handed out, those the batch
        still holds and that are not already marked."""
        rows = {e.id for e in batch.entries}
        marked = set(batch.completed)
        return [i for i in finished if i in rows and i not in marked]

    @staticmethod
    def _surely_finished(step: _Step, batch: RunningBatch) -> list[int]:
        """Requests of `batch` that finish with `step`'s tokens whatever those are: known before
        the tokens are handed out."""
        now = time.monotonic()
        done = []
        got = Counter(g.request_id for g in step.output.generations)  # several: speculative decoding
        for entry in batch.entries:
            st = entry.request.stopping
            deadline = entry.request.deadline
            if (
                entry.finished
                or entry.cancelled
                or (entry.id in got and entry.generated + got[entry.id] >= st.max_new_tokens)
                or (deadline is not None and now > deadline)
            ) and entry.id not in batch.completed:
                done.append(entry.id)
        return done

    def adapters_in_use(self) -> tuple[set[str], set[str]]:
        """The adapters (adapter_id or prefix_id) of the running requests and of the waiting ones."""
        running = {e.request.adapter for e in self._live if not e.finished} - {""}
        return running, self.queue.adapters()

    def _publish_state(self, live: Sequence[Entry], remaining: int) -> None:
        self._live = live
        capacity = self.queue.capacity
        loads = [entry_load(e) for e in live]
        usage = max(len(live) / self.queue.max_batch_size, capacity.usage(loads))
        self.metrics.batch_state(len(live), capacity.prefill_tokens(loads), remaining, usage)

    def _join_size(self, running: int, steps_since_join: int) -> int:
        """How many waiting entries make a join worth a prefill now (TGIS's policy)."""
        if running <= 1 or steps_since_join >= self.max_waiting_tokens:
            return 1
        return max(1, running * (self.max_waiting_tokens - steps_since_join) // self.max_waiting_tokens)

    # ---- shard calls ------------------------------------------------------------------------

    def _start(self, entries: Sequence[Entry]) -> NewBatch:
        """Give `entries` their request ids and batch id: the batch the shard is to build."""
        batch_id, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
        now = time.monotonic()
        for new in entries:
            new.start(self._next_request_id, self.detokenizer, now)
            self._next_request_id += 1
        loads = [entry_load(e) for e in entries]
        self.metrics.observe("tgi_batch_next_tokens", self.queue.capacity.prefill_tokens(loads))
        return NewBatch(batch_id, tuple(e.shard_request() for e in entries))

    async def _prefill(
        self, entries: list[Entry], to_prune: list[RunningBatch]
    ) -> tuple[RunningBatch | None, bool]:
        """Prefill `entries` as a new batch, pruning `to_prune` first. Returns the new batch and
        whether the call succeeded (only then were the pruned requests dropped for sure; on
        failure they are listed again next time, which is harmless if they were dropped)."""
        new = self._start(entries)
        now = time.monotonic()
        self.metrics.shard_call("prefill", len(entries))
        try:
            output = await self.client.prefill(
                new.batch_id, list(new.requests), [b.ref() for b in to_prune], self.token_budget
            )
        except ShardCallError as exc:
            self._fail("prefill", entries, exc)
            return None, False
        self._answered(output)
        step = _Step(output, entries, now, time.monotonic() - now)
        finished = self._hand_out(step, "prefill")
        if output.batch_id is None:
            return None, True
        rows = output.running_ids
        return RunningBatch(output.batch_id, [e for e in entries if e.id in rows], finished), True

    def _answered(self, output: StepOutput | None) -> None:
        """A loop call succeeded: learn the state the shard reports with `output`."""
        self.generation_healthy = True
        self.last_shard_answer = time.monotonic()
        if output is not None and output.kv_cache is not None:
            self.queue.capacity.observe(output)
            self.metrics.kv_cache(output.kv_cache)
        if output is not None:
            self.metrics.speculation(output.speculation)

    def _fail(self, method: str, entries: Sequence[Entry], exc: ShardCallError) -> None:
        logger.error("shard call failed (%s): %s", exc.reason, exc)
        self.metrics.shard_call_failed(method, exc.reason)
        self.generation_healthy = False
        failure = CALL_FAILURES.get(exc.reason, Failure.ENGINE_FAULT)
        for entry in entries:
            entry.fail(str(exc), failure)

    def _hand_out(self, step: _Step, method: str = "next_token") -> list[int]:
        """Give every token of `step` to its request, in order (a request may have several:
        speculative decoding); returns the ids of the requests that finished (those still in
        the shard's batch, for pruning)."""
        output = step.output
        by_id = {e.id: e for e in step.entries}
        now = time.monotonic()
        for item in output.input_tokens:  # a prompt's details come with its first token
            if (entry := by_id.get(item.request_id)) is not None:
                entry.on_input_tokens(list(item.tokens))
        for request_id, cached in output.cached_prompts:
            if (entry := by_id.get(request_id)) is not None:
                entry.on_cached_prompt(cached)
        for error in output.errors:
            if (entry := by_id.pop(error.request_id, None)) is not None:
                entry.fail(error.message, Failure.ENGINE_FAULT, request_error=True)
        for missing in set(by_id) - set(output.request_ids):
            entry = by_id.pop(missing)
            logger.error("request %d: %s", entry.id, MISSING_ANSWER)
            if not entry.finished:
                entry.fail(MISSING_ANSWER, Failure.ENGINE_FAULT, request_error=True)
        finished: dict[int, None] = {}  # in order, once each
        for request_id in output.pending:  # no token this step (a prompt still being computed, or
            entry = by_id.get(request_id)  # rows joining a step run ahead): it may end all the same
            if entry is None or entry.finished:
                continue
            deadline = entry.request.deadline
            if entry.cancelled:
                entry.cancel()
            elif deadline is not None and now > deadline:
                entry.time_out(self.detokenizer)
            else:
                continue
            finished[entry.id] = None
        for generation in output.generations:
            entry = by_id.get(generation.request_id)
            if entry is None:
                continue
            if entry.finished:
                pass  # one token past its end (it finished when the step was already sent)
            elif entry.cancelled:
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
                    if not entry.on_token(generation.token, self.eos_token_ids, self.detokenizer, now):
                        continue
                except BaseException as exc:  # tokenizers panics are BaseExceptions
                    if isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                        raise
                    logger.exception("request %d: decoding failed", entry.id)
                    entry.fail_detokenization(str(exc) or type(exc).__name__)
            finished[entry.id] = None
        self.metrics.shard_call_succeeded(
            method,
            step.call_s,
            output.forward_ns / 1e9,
            time.monotonic() - now,
            output.guided_mask_ns / 1e9,
            output.steps,
        )
        return list(finished)
