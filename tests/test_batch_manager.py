"""BatchManager running ahead: a decode step run before the router's call must give every request
the tokens the calls would have computed, drop what the call prunes, report its failure to the
call, and never spend a forward on a joining batch alone. Every request leaving the manager's
batches is released to the engine once, before the call's step runs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    NewBatch,
    SamplingParams,
    StepOutput,
)
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.hf_transformers import HFTransformersEngine
from text_generation_server.engines.tgis_native import TgisNativeEngine
from text_generation_server.errors import InvalidBatchError
from text_generation_server.testing.fake_engine import FakeEngine


class CountingEngine(ModelEngine):
    """A real engine that counts its steps and can be made to fail the next one."""

    def __init__(self, inner: HFTransformersEngine) -> None:
        self.inner = inner
        self.info = inner.info
        self.steps = 0
        self.stepped: list[tuple[bool, list[int]]] = []  # (first, request ids) of every step
        self.fail_next: Exception | None = None
        self.released: list[int] = []  # every id the manager released, in order

    def new_batch(self, batch_id, requests):
        return self.inner.new_batch(batch_id, requests)

    def release(self, request_ids):
        self.released += sorted(request_ids)

    def generate_token(self, batch, token_budget=0):
        self.steps += 1
        self.stepped.append((batch.unprefilled, list(batch.request_ids)))
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return self.inner.generate_token(batch, token_budget)


@pytest.fixture(scope="module")
def inner_engine(tiny_model) -> HFTransformersEngine:
    config = ServerConfig(
        model_name=str(tiny_model("llama")), max_batch_size=8, max_new_tokens=32, dtype="float32"
    )
    return HFTransformersEngine(config)


@pytest.fixture
def engine(inner_engine) -> CountingEngine:
    return CountingEngine(inner_engine)


def request(request_id: int, max_new: int, **params: Any) -> GenerationRequest:
    prompt = tuple(5 + (request_id * 7 + i * 3) % 90 for i in range(3 + request_id))
    return GenerationRequest(request_id, prompt, max_new, params=SamplingParams(**params))


def summary(output: StepOutput | None) -> Any:
    if output is None:
        return None
    tokens = sorted((g.request_id, g.token.token_id) for g in output.generations)
    errors = sorted((e.request_id, e.message) for e in output.errors)
    return output.batch_id, tokens, errors


def drive(manager: BatchManager, ahead: str, steps: int = 1) -> dict[int, list[int]]:
    """Play a router: two batches that join, greedy and seeded sampling rows, requests that
    finish at different steps and are pruned by the next call; returns every request's tokens.
    `ahead`: when the manager runs ahead: never, always (after every call, as the server does),
    or not after the join (the merged call finds one batch stepped ahead and one not); `steps`:
    decode steps per NextToken."""
    answers: list[Any] = []
    tokens: dict[int, list[int]] = {}
    generated: dict[int, int] = {}
    limits: dict[int, int] = {}
    live: dict[int, list[int]] = {}  # batch id -> its live requests

    def absorb(output: StepOutput | None, join: bool = False) -> None:
        answers.append(summary(output))
        if ahead == "always" or (ahead == "not after the join" and not join):
            manager.run_ahead()
        if output is None:
            return
        assert not output.errors
        for g in output.generations:
            if generated.get(g.request_id, 0) == limits[g.request_id]:
                continue  # past its end: stepped ahead of the call that prunes it
            generated[g.request_id] = generated.get(g.request_id, 0) + 1
            tokens.setdefault(g.request_id, []).append(g.token.token_id)

    def refs(batch_ids: list[int]) -> list[CachedBatchRef]:
        out = []
        for bid in batch_ids:
            done = tuple(r for r in live[bid] if generated[r] >= limits[r])
            out.append(CachedBatchRef(bid, done))
            live[bid] = [r for r in live[bid] if r not in done]
        return out

    def prefill(batch_id: int, requests: list[GenerationRequest], prune: list[int]) -> None:
        limits.update({r.id: r.max_new_tokens for r in requests})
        output = manager.prefill(batch_id, requests, refs(prune))
        live[batch_id] = sorted(output.running_ids)
        absorb(output, join=bool(prune))

    def step(batch_ids: list[int]) -> int | None:
        output = manager.next_token(refs(batch_ids), steps=steps)
        absorb(output)
        if output is None or output.batch_id is None:
            return None
        live[output.batch_id] = sorted(output.running_ids)
        return output.batch_id

    prefill(1, [request(1, 6), request(2, 9, temperature=0.9, top_k=20, seed=7), request(3, 3)], [])
    running = step([1])
    running = step([1])
    assert running == 1
    prefill(2, [request(4, 5, repetition_penalty=1.3), request(5, 2, temperature=1.1, seed=3)], [1])
    current: int | None = step([1, 2])
    while current is not None:
        current = step([current])
    assert len(answers) > 8 // steps and answers[-1] is None  # the run went to its end
    assert all(generated[r] == limits[r] for r in limits)
    return tokens


@pytest.mark.parametrize("ahead", ["always", "not after the join"])
def test_running_ahead_gives_the_tokens_of_the_calls(engine, ahead) -> None:
    expected = drive(BatchManager(engine, 8), "never")
    engine.stepped.clear()
    assert drive(BatchManager(engine, 8), ahead) == expected
    # the joining batch's rows never had a decode step of their own: they waited for the merge
    assert all(ids != [4, 5] for first, ids in engine.stepped if not first)


@pytest.mark.parametrize("ahead", ["never", "always"])
def test_calls_of_several_steps_give_the_tokens_of_single_steps(engine, ahead) -> None:
    expected = drive(BatchManager(engine, 8), "never")
    past_their_end: list[int] = []
    inner = engine.generate_token

    def checking(batch, token_budget=0):
        past_their_end.extend(batch.done_ids())
        return inner(batch, token_budget)

    engine.generate_token = checking  # type: ignore[method-assign]
    assert drive(BatchManager(engine, 8), ahead, steps=3) == expected
    if ahead == "never":  # (a step run ahead may take a row one past its end: its K/V fits)
        assert past_their_end == []  # no step of a call takes a row that had all its tokens


def test_a_call_of_several_steps_reports_them_and_stops_where_every_request_ends(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 3), request(2, 5)], [])  # each has its first token
    steps = engine.steps
    output = manager.next_token([CachedBatchRef(1)], steps=8)
    assert output is not None and output.batch_id == 1
    assert [g.request_id for g in output.generations] == [1, 2, 1, 2, 2, 2]  # step after step
    assert output.steps == engine.steps - steps == 4 and output.forward_ns > 0
    assert engine.stepped[-2:] == [(False, [2]), (False, [2])]  # request 1 left with its 3rd token
    assert engine.released == [1]
    assert manager.next_token([CachedBatchRef(1, (1, 2))], steps=8) is None and len(manager) == 0


def test_end_steps_ends_the_call_it_names_after_its_step_under_way(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 12)], [])
    manager.end_steps(5)  # before the call starts: it ends after its first step
    output = manager.next_token([CachedBatchRef(1)], steps=8, call=5)
    assert output is not None and output.steps == 1 and output.batch_id == 1
    output = manager.next_token([CachedBatchRef(1)], steps=4, call=6)  # another call runs them all
    assert output is not None and output.steps == 4
    inner = engine.generate_token

    def ended_within(batch, token_budget=0):
        if len(engine.stepped) == 8:  # the third step of call 7
            manager.end_steps(7)
        return inner(batch, token_budget)

    engine.generate_token = ended_within  # type: ignore[method-assign]
    output = manager.next_token([CachedBatchRef(1)], steps=6, call=7)
    assert output is not None and output.steps == 3 and len(output.generations) == 3


@pytest.fixture(params=["plain", "ahead", "pipelined"])
def stepping(request) -> tuple[str, Any]:
    """How a call's steps run: plainly, after a step run ahead, or pipelined (tgis_native)."""
    if request.param == "pipelined":
        return request.param, Pipelined(request.getfixturevalue("native_engine"))
    return request.param, request.getfixturevalue("engine")


def test_a_call_ends_after_the_step_that_gives_a_request_one_of_its_call_end_ids(stepping) -> None:
    """A token that may complete a stop sequence (the router's to find) ends a call of several
    steps after its step, in the call, its first step run ahead, or a step in flight; the next
    call goes on, and the ids leave with their request."""
    kind, engine = stepping
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 12), request(2, 12)], [])
    output = manager.next_token([CachedBatchRef(1)], steps=8)
    assert output is not None and output.steps == 8
    row = [g.token.token_id for g in output.generations if g.request_id == 2]
    at = next(i for i in range(1, 8) if row[i] not in row[:i])  # the first step giving a new token
    manager.clear()

    ends = frozenset({row[at]})
    first = [request(1, 12), GenerationRequest(2, request(2, 12).input_ids, 12, call_end_ids=ends)]
    manager.prefill(1, first, [])
    if kind != "plain":
        manager.run_ahead()
    output = manager.next_token([CachedBatchRef(1)], steps=8)
    assert output is not None and output.steps == at + 1 and output.batch_id == 1
    assert [g.token.token_id for g in output.generations if g.request_id == 2] == row[: at + 1]
    assert manager._call_ends == {2: ends}
    if kind != "plain":
        manager.run_ahead()
    following = manager.next_token([CachedBatchRef(1)], steps=2)  # unless its token comes again
    assert following is not None and following.steps in (1, 2)
    manager.next_token([CachedBatchRef(1, (1, 2))])
    assert manager._call_ends == {} and len(manager) == 0
    if kind == "pipelined":
        assert engine.inner.kv.pool.used == 0  # every request's blocks went back


def test_no_step_once_every_request_has_ended_nor_one_ahead(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 12)], [])
    inner = engine.generate_token

    def ends_at_third(batch, token_budget=0):
        output, survivor = inner(batch, token_budget)
        if len(engine.stepped) == 3 and survivor is not None:  # as if its token were EOS
            survivor.ended = lambda: True  # type: ignore[method-assign]
        return output, survivor

    engine.generate_token = ends_at_third  # type: ignore[method-assign]
    output = manager.next_token([CachedBatchRef(1)], steps=8)
    assert output is not None and output.steps == 2 and output.batch_id == 1
    manager.run_ahead()
    assert len(engine.stepped) == 3  # nothing run ahead either


def test_a_step_failing_within_a_call_fails_the_next_call_and_the_tokens_before_it_come(engine) -> None:
    seen: list[Exception] = []
    manager = BatchManager(engine, 8, on_step_failure=seen.append)
    manager.prefill(1, [request(1, 6)], [])
    failure = RuntimeError("engine fault")
    inner = engine.generate_token

    def second_fails(batch, token_budget=0):
        if engine.steps == 2:
            engine.fail_next = failure
        return inner(batch, token_budget)

    engine.generate_token = second_fails  # type: ignore[method-assign]
    output = manager.next_token([CachedBatchRef(1)], steps=4)
    assert output is not None and [g.request_id for g in output.generations] == [1]
    assert output.steps == 1 and output.batch_id == 1 and seen == [failure]
    with pytest.raises(RuntimeError) as info:
        manager.next_token([CachedBatchRef(1)])
    assert info.value is failure and len(manager) == 0


def test_rows_that_join_a_step_run_ahead_are_pending_and_step_with_the_others(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 6)], [])
    manager.run_ahead()
    manager.prefill(2, [request(2, 6)], [])
    manager.run_ahead()  # two batches that may generate: the next call merges them, nothing runs
    steps = engine.steps
    output = manager.next_token([CachedBatchRef(1), CachedBatchRef(2)])
    assert engine.steps == steps  # the call delivers the step run ahead on batch 1
    assert [g.request_id for g in output.generations] == [1] and output.pending == [2]
    manager.run_ahead()
    assert engine.stepped[-1] == (False, [1, 2])  # one forward for both
    output = manager.next_token([CachedBatchRef(1)])
    assert [g.request_id for g in output.generations] == [1, 2]


def test_the_call_after_a_step_run_ahead_does_not_step_again(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 5)], [])
    manager.run_ahead()
    steps = engine.steps
    output = manager.next_token([CachedBatchRef(1)])
    assert engine.steps == steps and [g.request_id for g in output.generations] == [1]
    manager.run_ahead()
    assert engine.steps == steps + 1


def test_a_pruned_request_loses_its_token_run_ahead(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 5), request(2, 5)], [])
    manager.run_ahead()
    output = manager.next_token([CachedBatchRef(1, (2,))])
    assert [g.request_id for g in output.generations] == [1]
    manager.run_ahead()
    assert [g.request_id for g in manager.next_token([CachedBatchRef(1)]).generations] == [1]
    # every request completed: nothing is delivered and nothing stays cached
    manager.run_ahead()
    assert manager.next_token([CachedBatchRef(1, (1,))]) is None and len(manager) == 0


def test_nothing_runs_ahead_once_every_request_reached_its_limit(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 2)], [])
    manager.run_ahead()  # token 2 of 2
    manager.next_token([CachedBatchRef(1)])
    steps = engine.steps
    manager.run_ahead()
    assert engine.steps == steps


def test_a_step_that_fails_ahead_fails_the_next_call_that_references_it(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 6)], [])
    failure = RuntimeError("engine fault")
    engine.fail_next = failure
    manager.run_ahead()
    manager.prefill(2, [request(2, 6)], [CachedBatchRef(1)])  # pruning keeps the failure
    with pytest.raises(RuntimeError) as info:
        manager.next_token([CachedBatchRef(1), CachedBatchRef(2)])
    assert info.value is failure
    assert len(manager) == 0  # the call's batches are lost, as when the step fails in the call


def test_a_failed_step_on_a_stale_batch_is_logged_when_dropped(engine, caplog) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 6)], [])
    engine.fail_next = RuntimeError("engine fault")
    manager.run_ahead()  # batch 1 fails
    manager.prefill(2, [request(2, 6)], [])
    with caplog.at_level(logging.WARNING):
        output = manager.next_token([CachedBatchRef(2)])
    assert [g.request_id for g in output.generations] == [2]
    assert "had failed: RuntimeError('engine fault')" in caplog.text


def test_every_failed_step_reaches_the_failure_hook_in_the_call_or_ahead(engine) -> None:
    """Sharded shards stop on the hook (distributed.end_shard); here it records."""
    seen: list[Exception] = []
    manager = BatchManager(engine, 8, on_step_failure=seen.append)
    manager.prefill(1, [request(1, 6)], [])
    ahead, now = RuntimeError("ahead"), RuntimeError("in the call")
    engine.fail_next = ahead
    manager.run_ahead()
    assert seen == [ahead]
    manager.prefill(2, [request(2, 6)], [])
    engine.fail_next = now
    with pytest.raises(RuntimeError, match="in the call"):
        manager.next_token([CachedBatchRef(2)])
    assert seen == [ahead, now]


def test_every_request_is_released_once_when_it_leaves_and_before_the_step(engine) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 6), request(2, 6)], [])
    assert engine.released == []
    manager.next_token([CachedBatchRef(1, (2,))])  # pruned
    assert engine.released == [2]
    steps_before = engine.steps
    seen_at_step: list[list[int]] = []
    inner = engine.generate_token

    def recording(batch, token_budget=0):
        seen_at_step.append(list(engine.released))
        return inner(batch, token_budget)

    engine.generate_token = recording  # type: ignore[method-assign]
    manager.prefill(2, [request(3, 6)], [CachedBatchRef(1, (1,))])  # 1 pruned by the prefill
    assert seen_at_step == [[2, 1]] and engine.steps == steps_before + 1  # released before the step
    engine.generate_token = inner  # type: ignore[method-assign]
    manager.prefill(3, [request(4, 6)], [])
    engine.fail_next = RuntimeError("engine fault")
    with pytest.raises(RuntimeError):
        manager.next_token([CachedBatchRef(2)])  # batch 2 is lost with its step; batch 3 is stale
    assert engine.released == [2, 1, 4, 3]  # the stale batch before the step, the lost one after
    manager.prefill(4, [request(5, 6)], [])
    manager.prefill(2**64 - 1, [request(6, 1)], [])  # a health check: never cached
    assert engine.released[-1:] == [6]
    manager.clear()
    assert engine.released == [2, 1, 4, 3, 6, 5] and len(manager) == 0


@pytest.fixture(scope="module")
def chunking_engine(tiny_model) -> FakeEngine:
    return FakeEngine(ServerConfig(model_name=str(tiny_model("llama")), max_batch_size=8, max_new_tokens=32))


def tokens_of(output: StepOutput | None, into: dict[int, list[int]]) -> None:
    assert output is not None and not output.errors
    for g in output.generations:
        into.setdefault(g.request_id, []).append(g.token.token_id)


@pytest.mark.parametrize("ahead", [True, False])
def test_requests_join_a_decode_step_without_a_forward_of_their_own(chunking_engine, ahead) -> None:
    manager = BatchManager(chunking_engine, 8)
    first, joining = request(1, 6), request(2, 5)
    got: dict[int, list[int]] = {}
    tokens_of(manager.prefill(1, [first], []), got)
    if ahead:
        manager.run_ahead()
    output = manager.next_token([CachedBatchRef(1)], 3, NewBatch(2, (joining,)))
    tokens_of(output, got)
    # run ahead, the step was computed before the join: the new request waits for the next one;
    # else its first 3 prompt tokens (of 5) ride with this step
    assert output is not None and output.pending == [2] and output.batch_id == 1
    while output is not None and output.batch_id is not None:
        done = tuple(r for r, t in got.items() if len(t) == {1: 6, 2: 5}[r])
        if ahead:
            manager.run_ahead()
        output = manager.next_token([CachedBatchRef(1, done)], 3)
        if output is not None:
            tokens_of(output, got)
    assert got == {
        1: chunking_engine.reference(first.input_ids, 6),
        2: chunking_engine.reference(joining.input_ids, 5),
    }


def test_a_join_is_refused_where_the_engine_does_not_chunk_or_the_batch_is_invalid(
    engine, chunking_engine
) -> None:
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 6)], [])
    with pytest.raises(InvalidBatchError, match="needs chunked prefill, which this engine does not do"):
        manager.next_token([CachedBatchRef(1)], 0, NewBatch(2, (request(2, 4),)))
    manager = BatchManager(chunking_engine, 2)
    manager.prefill(1, [request(1, 6)], [])
    with pytest.raises(InvalidBatchError, match="is already running in batch 1"):
        manager.next_token([CachedBatchRef(1)], 0, NewBatch(2, (request(1, 4),)))
    with pytest.raises(InvalidBatchError, match="health-check batch cannot join"):
        manager.next_token([CachedBatchRef(1)], 0, NewBatch(HEALTH_CHECK_BATCH_ID, (request(2, 4),)))
    with pytest.raises(InvalidBatchError, match="more than max_batch_size"):
        manager.next_token([CachedBatchRef(1)], 0, NewBatch(2, (request(2, 4), request(3, 4))))
    # nothing changed: the batch runs on
    output = manager.next_token([CachedBatchRef(1)], 0, NewBatch(2, (request(2, 4),)))
    assert output is not None and [g.request_id for g in output.generations] == [1, 2]


# ---- pipelined steps: launched before the step before them is read back -------------------------


class Pipelined(ModelEngine):
    """tgis_native with PIPELINE_STEPS on the CPU, recording its launches: how many steps were in
    flight at once, and any sequence that grew past the blocks its request reserved."""

    def __init__(self, inner: TgisNativeEngine, pipelined: bool = True) -> None:
        self.inner = inner
        self.info = inner.info
        self.pipelined = pipelined
        self.in_flight = 0
        self.most_in_flight = 0
        self.launches = 0
        self.fail_finish: Exception | None = None

    def new_batch(self, batch_id, requests):
        return self.inner.new_batch(batch_id, requests)

    def release(self, request_ids):
        self.inner.release(request_ids)

    def kv_state(self):
        return self.inner.kv_state()

    def generate_token(self, batch, token_budget=0):
        return self.inner.generate_token(batch, token_budget)

    def launch(self, batch, token_budget=0):
        self.inner.pipelined = self.pipelined
        launched = self.inner.launch(batch, token_budget)
        if launched is not None:
            self.launches += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            for state in launched.batch.states.values():
                assert len(state.kv.blocks) <= state.kv.max_blocks, "a step wrote past the reserved blocks"
        return launched

    def finish(self, launched):
        self.in_flight -= 1
        if self.fail_finish is not None:
            exc, self.fail_finish = self.fail_finish, None
            raise exc
        return self.inner.finish(launched)


@pytest.fixture(scope="module")
def native_engine(tiny_model) -> TgisNativeEngine:
    config = ServerConfig(
        model_name=str(tiny_model("llama")), max_batch_size=8, max_new_tokens=32, dtype="float32"
    )
    return TgisNativeEngine(config)


@pytest.mark.parametrize(("ahead", "steps"), [("always", 1), ("not after the join", 1), ("always", 3)])
def test_pipelined_steps_give_the_tokens_of_the_calls(native_engine, ahead, steps) -> None:
    """Greedy, seeded and penalised rows, requests ending at different steps (pruned while the
    step after theirs is in flight), batches merging beside a step in flight; `steps` per call."""
    expected = drive(BatchManager(Pipelined(native_engine, pipelined=False), 8), "always")
    engine = Pipelined(native_engine)
    assert drive(BatchManager(engine, 8), ahead, steps) == expected
    # one batch's step in flight and the next launched before it is read; with several steps a
    # call, the joining batch runs ahead while the last step of the first is still in flight
    assert engine.launches >= 8 and engine.most_in_flight == (2 if steps == 1 else 3)
    assert engine.in_flight == 0
    assert native_engine.kv.pool.used == 0  # every request's blocks went back


def test_requests_that_join_beside_a_step_in_flight_wait_for_a_step_that_covers_them(native_engine) -> None:
    def run(pipelined: bool) -> tuple[dict[int, list[int]], list[list[int]]]:
        manager = BatchManager(Pipelined(native_engine, pipelined), 8)
        first, joining = request(1, 7, repetition_penalty=1.2), request(2, 5, temperature=0.8, seed=11)
        got: dict[int, list[int]] = {}
        pending: list[list[int]] = []
        tokens_of(manager.prefill(1, [first], []), got)
        manager.run_ahead()
        output = manager.next_token([CachedBatchRef(1)], 3, NewBatch(2, (joining,)))
        while output is not None:
            tokens_of(output, got)
            pending.append(list(output.pending))
            if output.batch_id is None:
                break
            manager.run_ahead()
            done = tuple(r for r, t in got.items() if len(t) == {1: 7, 2: 5}[r])
            output = manager.next_token([CachedBatchRef(1, done)], 3)
        assert len(manager) == 0
        return got, pending

    expected, pending_then = run(False)
    got, pending = run(True)
    assert got == expected
    # running ahead, the join waits one step; with a step in flight too, one more
    assert pending_then[:2] == [[2], [2]] and pending[:3] == [[2], [2], [2]]


def test_a_step_that_fails_in_flight_fails_the_next_call(native_engine) -> None:
    seen: list[Exception] = []
    engine = Pipelined(native_engine)
    manager = BatchManager(engine, 8, on_step_failure=seen.append)
    manager.prefill(1, [request(1, 6), request(2, 6)], [])
    manager.run_ahead()  # steps 2 (read) and 3 (in flight)
    manager.next_token([CachedBatchRef(1)])
    failure = RuntimeError("device fault")
    engine.fail_finish = failure
    manager.run_ahead()
    assert seen == [failure]
    with pytest.raises(RuntimeError) as info:
        manager.next_token([CachedBatchRef(1)])
    assert info.value is failure and len(manager) == 0
    assert native_engine.kv.pool.used == 0


def test_a_step_in_flight_is_dropped_with_its_batch_and_its_blocks_return(native_engine, caplog) -> None:
    engine = Pipelined(native_engine)
    manager = BatchManager(engine, 8)
    manager.prefill(1, [request(1, 9), request(2, 9)], [])
    manager.run_ahead()  # a step read ahead and the one after it in flight
    assert engine.in_flight == 1 and native_engine.kv.pool.used > 0
    manager.clear()  # ClearCache
    assert len(manager) == 0 and native_engine.kv.pool.used == 0
    manager.prefill(2, [request(3, 9)], [])
    manager.run_ahead()
    manager.next_token([CachedBatchRef(2)])  # delivers; the next step stays in flight
    manager.prefill(3, [request(4, 9)], [])
    with caplog.at_level(logging.WARNING):
        output = manager.next_token([CachedBatchRef(3)])  # batch 2 is no longer referenced
    assert "dropping stale cached batches [2]" in caplog.text
    assert output is not None and [g.request_id for g in output.generations] == [4]
    manager.clear()
    assert native_engine.kv.pool.used == 0


def test_a_row_that_fails_while_the_next_step_is_in_flight_fails_alone(tiny_model) -> None:
    """NaN logits for one request at step 3: it fails with TGIS's message when step 3 is read
    back, its token of step 4 (already in flight) is dropped, and the others go on unchanged."""
    import torch

    from text_generation_server.engines.step import NAN_LOGITS_MESSAGE

    config = ServerConfig(
        model_name=str(tiny_model("llama")),
        max_batch_size=8,
        max_new_tokens=32,
        dtype="float32",
        cpu_forward="modules",  # the LM head's module runs (its hook poisons a row)
    )
    native = TgisNativeEngine(config)
    forwards = {"count": 0, "poison_at": -1}

    def poison(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        forwards["count"] += 1
        if forwards["count"] == forwards["poison_at"]:
            output = output.clone()
            output.view(-1, output.shape[-1])[0, 7] = float("nan")  # the first row: request 1
        return output

    native.model.get_output_embeddings().register_forward_hook(poison)

    def run(pipelined: bool, poison_at: int) -> tuple[dict[int, list[int]], dict[int, str]]:
        forwards.update(count=0, poison_at=poison_at)
        manager = BatchManager(Pipelined(native, pipelined), 8)
        got: dict[int, list[int]] = {}
        errors: dict[int, str] = {}
        output = manager.prefill(1, [request(1, 8), request(2, 8), request(3, 8)], [])
        while output is not None:
            errors.update({e.request_id: e.message for e in output.errors})
            for g in output.generations:
                got.setdefault(g.request_id, []).append(g.token.token_id)
            if output.batch_id is None:
                break
            manager.run_ahead()
            done = tuple(r for r, t in got.items() if len(t) == 8 and r not in errors)
            output = manager.next_token([CachedBatchRef(1, done)])
        assert len(manager) == 0 and native.kv.pool.used == 0
        return got, errors

    clean, _ = run(False, -1)
    got, errors = run(True, 3)
    assert errors == {1: NAN_LOGITS_MESSAGE}
    assert got[1] == clean[1][:2]  # two tokens, then the failure; the token in flight dropped
    assert got[2] == clean[2] and got[3] == clean[3]
