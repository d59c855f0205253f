"""The continuous-batching loop against a fake shard, on CPU, in seconds: joins, pruning,
budgets, batch size, cancellation, deadlines, failures, chunked prefill, health probes.

Tests wait on events (a call reaching the fake shard, an output), never on wall-clock sleeps;
the fake shard's latency only stands in for model time."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import replace

import pytest

from router.core.pacing import WINDOW_S, StreamPacing
from router.core.stopping import StopReason
from router.scheduling.batcher import MISSING_ANSWER, NAMED_CALL_STEPS
from router.scheduling.shard_client import ShardCallError
from tests.router.fakes import EOS, FakeShard
from tests.router.harness import make_request
from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    GenerationRequest,
    MemoryScalingModel,
)


async def test_single_request_runs_to_max_new_tokens(make_harness) -> None:
    h = make_harness()
    entry = h.submit(make_request(max_new=4))
    out = await h.final(entry)
    assert out.generated_tokens == 4 and out.stop_reason is StopReason.MAX_TOKENS
    await h.calls(5)
    # prefill = token 1; three steps = tokens 2-4; one more call drops the finished batch.
    assert h.methods() == ["prefill", "next_token", "next_token", "next_token", "next_token"]
    assert h.shard.calls[-1].refs[0].completed_ids == (entry.id,)
    assert not h.shard.batches
    assert h.batcher.generation_healthy


async def test_capped_request_reports_token_limit(make_harness) -> None:
    h = make_harness()
    out = await h.final(h.submit(make_request(max_new=3, capped=True)))
    assert out.stop_reason is StopReason.TOKEN_LIMIT and out.generated_tokens == 3


async def test_new_requests_join_the_running_batch(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    first = h.submit(make_request(max_new=30))
    await h.calls(3)
    second = h.submit(make_request(prompt_len=3, max_new=3))
    out2 = await h.final(second)
    out1 = await h.final(first)
    assert out1.generated_tokens == 30 and out2.generated_tokens == 3
    prefills = [c for c in h.shard.calls if c.method == "prefill"]
    assert [c.request_ids for c in prefills] == [[first.id], [second.id]]
    merged = [c for c in h.shard.calls if c.method == "next_token" and len(c.refs) == 2]
    assert merged and {r.batch_id for r in merged[0].refs} == {prefills[0].batch_id, prefills[1].batch_id}
    # The second request's completion is reported on the next call, and the batch goes on.
    pruned = [c for c in h.shard.calls if any(second.id in r.completed_ids for r in c.refs)]
    assert pruned and pruned[0].method == "next_token"


async def test_prefill_prunes_finished_requests_first(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    long = h.submit(make_request(max_new=40))
    short = h.submit(make_request(max_new=2))
    await h.calls(2)  # the first decode step (short's last token) is under way
    late = h.submit(make_request(max_new=2))
    await h.final(late)
    await h.final(long)
    (late_prefill,) = [c for c in h.shard.calls if c.method == "prefill" and late.id in c.request_ids]
    # The join's prefill itself drops the request that finished with the step before it.
    first_batch = h.shard.calls[0].batch_id
    assert [(r.batch_id, r.completed_ids) for r in late_prefill.refs] == [(first_batch, (short.id,))]
    later = h.shard.calls[h.shard.calls.index(late_prefill) + 1 :]
    assert all(short.id not in r.completed_ids for c in later for r in c.refs), "pruned once"


async def test_max_batch_size_holds_requests_back(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.002), max_batch_size=2)
    entries = [h.submit(make_request(max_new=6)) for _ in range(3)]
    outs = [await h.final(e) for e in entries]
    assert all(o.generated_tokens == 6 for o in outs)
    prefills = [c.request_ids for c in h.shard.calls if c.method == "prefill"]
    assert prefills[0] == [entries[0].id, entries[1].id]
    assert [entries[2].id] in prefills[1:]
    # Never more than two live requests in the shard, at any call.
    assert h.shard.peak_live == 2


@pytest.mark.parametrize("by_priority", [False, True], ids=["fcfs", "priority"])
async def test_waiting_requests_are_taken_by_priority_where_the_policy_says(
    make_harness, by_priority: bool
) -> None:
    h = make_harness(FakeShard(latency_s=0.002), max_batch_size=1, by_priority=by_priority)
    running = h.submit(make_request(max_new=6))
    await h.calls(1)  # it holds the one place: the others wait in line
    priorities = [5, 0, 5, -2, 0]
    waiting = [h.submit(make_request(max_new=2, priority=p)) for p in priorities]
    assert [e.request.priority for e in h.queue._entries] == (
        sorted(priorities) if by_priority else priorities
    )
    for entry in [running, *waiting]:
        assert (await h.final(entry)).generated_tokens in (2, 6)
    prefills = [c.request_ids[0] for c in h.shard.calls if c.method == "prefill"][1:]
    order = [waiting[i] for i in (3, 1, 4, 0, 2)] if by_priority else waiting  # arrival within a value
    assert prefills == [e.id for e in order]


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-joins", "joins-in-steps"])
async def test_a_waiting_request_of_a_lower_priority_value_preempts_a_running_one(
    make_harness, detokenizer, chunked: bool
) -> None:
    """Two places, both held by priority 5; a priority 0 request arrives: the later of the two
    leaves the batch at the next call, waits ahead of the other 5s, and resumes once a place is
    free with the ids it generated (prompt details not asked again); its answer, streamed or
    not, is the one it would have had. An arrival of an equal value preempts nothing."""
    shard = FakeShard(latency_s=0.003, chunked_prefill=chunked)
    h = make_harness(shard, max_batch_size=2, by_priority=True, preemption=True, max_prefill_tokens=64)
    first = h.submit(make_request(max_new=30, priority=5, details=True))
    second = h.submit(make_request(max_new=12, priority=5, details=True), stream=True)
    await h.until(lambda: second.generated >= 3)
    equal = h.submit(make_request(max_new=2, priority=5))
    urgent = h.submit(make_request(max_new=3, priority=0))
    await h.until(lambda: second.preemptions == 1)
    assert [e.request.priority for e in h.queue._entries] == [5, 5] and h.queue._entries[0] is second
    old_id = second.id
    urgent_out = await h.final(urgent)
    outputs = await h.all_outputs(second)
    first_out, equal_out = await h.final(first), await h.final(equal)
    assert (urgent_out.generated_tokens, first_out.generated_tokens, equal_out.generated_tokens) == (3, 30, 2)
    assert first.preemptions == 0 and second.preemptions == 1
    assert outputs[-1].generated_tokens == 12 and outputs[-1].stop_reason is StopReason.MAX_TOKENS
    assert second.token_ids == list(range(600, 612))  # on from where it left off
    assert "".join(o.text for o in outputs) == detokenizer.decode(list(range(600, 612)))
    dropped = [c for c in h.shard.calls if any(old_id in r.completed_ids for r in c.refs)]
    assert dropped and dropped[0].request_ids[-1:] == [urgent.id]  # dropped in the call that admits it
    sent = [r for r in h.shard.sent if r.id == second.id]
    assert len(sent) == 1 and second.id != old_id
    (resumed,) = sent
    assert resumed.generated_ids and resumed.generated_ids == tuple(
        range(600, 600 + len(resumed.generated_ids))
    )
    assert not resumed.details.input_tokens and resumed.details.logprobs
    assert h.queue.metrics.counters["tgi_request_preemption"].get() == 1


async def test_a_preempted_request_whose_deadline_passes_while_it_waits_ends_with_its_tokens(
    make_harness, detokenizer
) -> None:
    h = make_harness(FakeShard(latency_s=0.003), max_batch_size=1, by_priority=True, preemption=True)
    slow = h.submit(make_request(max_new=50, priority=1, deadline_s=0.5))
    await h.until(lambda: slow.generated >= 2)
    urgent = h.submit(make_request(max_new=400, priority=0))
    out = await h.final(slow)
    assert slow.preemptions == 1 and out.stop_reason is StopReason.TIME_LIMIT
    assert out.generated_tokens == slow.generated >= 2 and not urgent.finished
    assert out.text == detokenizer.decode(slow.token_ids)  # its text so far


async def test_the_adapters_of_running_and_waiting_requests(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.002), max_batch_size=1)
    assert h.batcher.adapters_in_use() == (set(), set())
    running = h.submit(replace(make_request(max_new=6), adapter_id="a"))
    await h.calls(2)
    waiting = [h.submit(replace(make_request(max_new=2), **field)) for field in ({"prefix_id": "p"}, {})]
    assert h.batcher.adapters_in_use() == ({"a"}, {"p"})
    for entry in [running, *waiting]:
        await h.final(entry)
    for _ in range(200):  # the loop lets the batch go after the answers
        if h.batcher.adapters_in_use() == (set(), set()):
            break
        await asyncio.sleep(0.01)
    assert h.batcher.adapters_in_use() == (set(), set())


async def test_prefill_token_limit_splits_a_burst_in_arrival_order(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.002), max_prefill_tokens=25, max_waiting_tokens=1)
    # Padded prefill tokens = batch size x longest prompt: 10 + 10 fit in 25, a third does not.
    burst = [h.submit(make_request(prompt_len=10, max_new=6)) for _ in range(5)]
    huge = h.submit(make_request(prompt_len=40, max_new=3))  # alone over the limit: still runs
    outs = [await h.final(e) for e in [*burst, huge]]
    assert all(o.generated_tokens == 6 for o in outs[:5]) and outs[5].generated_tokens == 3
    prefills = [c.request_ids for c in h.shard.calls if c.method == "prefill"]
    assert prefills == [
        [burst[0].id, burst[1].id],
        [burst[2].id, burst[3].id],
        [burst[4].id],
        [huge.id],
    ]


async def test_weight_limit_delays_a_request_that_would_not_fit(make_harness) -> None:
    # Padded weight = (max_in + max_out) * bs tokens; the limit fits one request of 10 + 10.
    memory = MemoryScalingModel(1.0, 0.0, 0.0, 1.0, 1.0, 25)
    h = make_harness(FakeShard(memory=memory, latency_s=0.002))
    first = h.submit(make_request(prompt_len=10, max_new=10))
    await h.calls(2)
    second = h.submit(make_request(prompt_len=10, max_new=10))
    await h.final(first)
    await h.final(second)
    prefills = [c for c in h.shard.calls if c.method == "prefill"]
    assert [c.request_ids for c in prefills] == [[first.id], [second.id]]
    second_prefill = h.shard.calls.index(prefills[1])
    # The second request started only once the first one had finished.
    first_done = next(
        i for i, c in enumerate(h.shard.calls) if any(first.id in r.completed_ids for r in c.refs)
    )
    assert first_done < second_prefill


async def test_queue_jump_when_a_later_request_fits(make_harness) -> None:
    memory = MemoryScalingModel(1.0, 0.0, 0.0, 1.0, 1.0, 60)
    h = make_harness(FakeShard(memory=memory, latency_s=0.003))
    running = h.submit(make_request(prompt_len=10, max_new=20))
    await h.calls(2)
    big = h.submit(make_request(prompt_len=30, max_new=20))  # would not fit beside `running`
    small = h.submit(make_request(prompt_len=2, max_new=3))  # fits: jumps the queue
    await h.final(small)
    assert big.started_at is None, "the big request must still wait"
    await h.final(big)
    await h.final(running)
    assert h.queue.metrics.counters["tgi_queue_jump"].get() >= 1


async def test_cancelled_request_leaves_at_the_next_step(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    stay = h.submit(make_request(max_new=20))
    leave = h.submit(make_request(max_new=20))
    await h.until(lambda: leave.generated >= 3)
    leave.cancelled = True
    generated_then = leave.generated
    await h.final(stay)
    assert leave.stop_reason is StopReason.CANCELLED
    assert leave.generated <= generated_then + 1
    assert leave.outputs.empty(), "a cancelled unary request gets no output"
    assert any(leave.id in r.completed_ids for c in h.shard.calls for r in c.refs)


async def test_cancelled_while_queued_never_runs(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005), max_batch_size=1)
    busy = h.submit(make_request(max_new=5))
    waiting = h.submit(make_request(max_new=5))
    waiting.cancelled = True
    await h.final(busy)
    await h.until(lambda: h.shard.calls[-1].method == "next_token" and not h.shard.batches)
    assert h.queue.next_batch([], 1) is None  # dropped, not waiting
    assert waiting.id == 0 and len(h.queue) == 0
    assert [c.request_ids for c in h.shard.calls if c.method == "prefill"] == [[busy.id]]


async def test_the_call_that_only_drops_a_finished_batch_does_not_count_as_busy(make_harness) -> None:
    # A request queued meanwhile must not expire there (TGIS: an idle server schedules it).
    h = make_harness(FakeShard(latency_s=0.05))
    await h.final(h.submit(make_request(max_new=1)))  # finished by its prefill
    assert h.shard.calls[-1].method == "next_token"  # the drop call is in flight
    assert not h.queue.busy


async def test_deadline_stops_a_running_request(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.01))
    entry = h.submit(make_request(max_new=200, min_new=200, deadline_s=0.05))
    out = await h.final(entry)
    assert out.stop_reason is StopReason.TIME_LIMIT
    assert 1 <= out.generated_tokens < 200


async def test_eos_and_min_new_tokens(make_harness) -> None:
    script = lambda request, step: EOS if step >= 1 else 600  # noqa: E731
    h = make_harness(FakeShard(script=script))
    out = await h.final(h.submit(make_request(max_new=10)))
    assert out.stop_reason is StopReason.EOS_TOKEN and out.generated_tokens == 2
    # EOS is masked by the shard before min_new_tokens; the router does not stop on it either.
    out = await h.final(h.submit(make_request(max_new=10, min_new=3)))
    assert out.stop_reason is StopReason.EOS_TOKEN and out.generated_tokens == 3


async def test_each_of_the_models_eos_ids_ends_a_request(make_harness) -> None:
    """A model with several EOS ids (an instruct model's end of turn beside its end of text):
    each ends a request as EOS does, and none is part of its text."""
    end_of_turn = 640
    script = lambda request, step: end_of_turn if step >= 2 else 600 + step  # noqa: E731
    h = make_harness(FakeShard(script=script), extra_eos_token_ids=(end_of_turn, 641))
    out = await h.final(h.submit(make_request(max_new=10)))
    assert out.stop_reason is StopReason.EOS_TOKEN and out.generated_tokens == 3
    alone = make_harness(FakeShard(script=script))  # without it, the id is text like any other
    longer = await alone.final(alone.submit(make_request(max_new=10)))
    assert longer.stop_reason is StopReason.MAX_TOKENS and longer.text.startswith(out.text)
    assert len(longer.text) > len(out.text)


async def test_a_requests_own_stop_token_ids_end_it_as_eos(make_harness) -> None:
    """...keeping the stop token's text, as vLLM does (the model's EOS stays out of it)."""
    script = lambda request, step: 600 + step  # noqa: E731
    h = make_harness(FakeShard(script=script))
    four = await h.final(h.submit(make_request(max_new=4)))  # 600 .. 603
    request = make_request(max_new=10)
    request = replace(request, sampling=replace(request.sampling, stop_token_ids=(603, 700)))
    out = await h.final(h.submit(request))
    assert out.stop_reason is StopReason.EOS_TOKEN and out.generated_tokens == 4
    assert out.text == four.text
    streamed = await h.all_outputs(h.submit(request, stream=True))
    assert "".join(o.text for o in streamed) == four.text


async def test_streamed_outputs_add_up_to_the_unary_text(make_harness, detokenizer) -> None:
    h = make_harness()
    unary = await h.final(h.submit(make_request(max_new=8)))
    outs = await h.all_outputs(h.submit(make_request(max_new=8), stream=True))
    assert "".join(o.text for o in outs) == unary.text
    counts = [o.generated_tokens for o in outs]
    assert counts == sorted(counts) and counts[-1] == 8
    assert outs[-1].stop_reason is StopReason.MAX_TOKENS


async def test_stop_sequence_cuts_the_text(make_harness, detokenizer) -> None:
    h = make_harness()
    full = await h.final(h.submit(make_request(max_new=8)))
    assert len(full.text) > 6
    stop = full.text[3:5]
    first_at = full.text.find(stop)
    cut = await h.final(h.submit(make_request(max_new=8, stop=(stop,), include_stop=False)))
    assert cut.stop_reason is StopReason.STOP_SEQUENCE and cut.stop_sequence == stop
    assert cut.text == full.text[:first_at]
    kept = await h.final(h.submit(make_request(max_new=8, stop=(stop,), include_stop=True)))
    assert kept.text == full.text[: first_at + len(stop)]
    streamed = await h.all_outputs(h.submit(make_request(max_new=8, stop=(stop,)), stream=True))
    assert "".join(o.text for o in streamed) == cut.text


async def test_prefill_failure_fails_only_the_new_requests(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    running = h.submit(make_request(max_new=30))
    await h.calls(3)
    h.shard.fail_prefill = ShardCallError("oom", "GPU out of memory")
    doomed = h.submit(make_request(max_new=5))
    out = await h.final(doomed)
    assert out.error == "Request failed during generation: GPU out of memory"
    assert (await h.final(running)).generated_tokens == 30


async def test_step_failure_fails_the_batch_and_health(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    entry = h.submit(make_request(max_new=30))
    await h.until(lambda: entry.generated >= 3)
    h.shard.fail_next_token = ShardCallError(
        "connection", "Could not connect to Text Generation server: gone"
    )
    out = await h.final(entry)
    assert out.error is not None and out.error.startswith(
        "Request failed during generation: Could not connect"
    )
    assert h.batcher.generation_healthy is False
    # The loop goes on serving.
    assert (await h.final(h.submit(make_request(max_new=2)))).generated_tokens == 2


async def test_per_request_error_spares_the_neighbours(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.005))
    ok = h.submit(make_request(max_new=10))
    bad = h.submit(make_request(max_new=10))
    await h.until(lambda: bad.generated >= 2)
    h.shard.request_errors[bad.id] = "Token decoding error: boom"
    out = await h.final(bad)
    assert (
        out.error
        == "Request failed during generation: Error after generating 2 tokens: Token decoding error: boom"
    )
    assert (await h.final(ok)).generated_tokens == 10


async def test_join_size_shrinks_with_waiting_steps(make_harness) -> None:
    h = make_harness(max_waiting_tokens=4)
    assert h.batcher._join_size(1, 1) == 1
    assert h.batcher._join_size(8, 1) == 6
    assert h.batcher._join_size(8, 3) == 2
    assert h.batcher._join_size(8, 4) == 1


async def test_details_and_input_tokens(make_harness) -> None:
    h = make_harness()
    request = replace(make_request(max_new=3, details=True))
    out = await h.final(h.submit(request))
    assert [t.token_id for t in out.input_tokens] == list(request.input_ids)
    assert len(out.tokens) == 3 and all(t.logprob == -0.5 for t in out.tokens)
    streamed = await h.all_outputs(h.submit(request, stream=True))
    assert streamed[0].input_tokens is not None
    assert all(len(o.tokens) == 1 for o in streamed[1:])


# --- steps count tokens: pending requests, missing answers ------------------------------------


async def test_a_request_whose_prompt_is_chunked_stays_live_until_its_tokens_come(make_harness) -> None:
    h = make_harness(FakeShard(chunked_prefill=True, latency_s=0.001), max_prefill_tokens=8)
    entry = h.submit(make_request(prompt_len=20, max_new=3))
    out = await h.final(entry)
    assert out.generated_tokens == 3 and out.stop_reason is StopReason.MAX_TOKENS
    # 8 + 8 + 4 prompt tokens: two steps without a token, then the first token.
    assert h.methods()[:4] == ["prefill", "next_token", "next_token", "next_token"]
    assert set(h.shard.budgets) == {8}


async def test_without_chunked_prefill_no_budget_is_sent(make_harness) -> None:
    h = make_harness(FakeShard(), max_prefill_tokens=8)
    await h.final(h.submit(make_request(prompt_len=20, max_new=3)))
    assert set(h.shard.budgets) == {0}


async def test_a_chunked_prompt_joins_beside_running_requests(make_harness) -> None:
    # With chunked prefill a prompt may start while the prompts before it leave some budget.
    h = make_harness(FakeShard(chunked_prefill=True), max_prefill_tokens=10, max_waiting_tokens=1)
    burst = [h.submit(make_request(prompt_len=6, max_new=4)) for _ in range(3)]
    outs = [await h.final(e) for e in burst]
    assert all(o.generated_tokens == 4 for o in outs)
    prefills = [c.request_ids for c in h.shard.calls if c.method == "prefill"]
    assert prefills == [[burst[0].id, burst[1].id]]  # 6 < 10: the second one starts in part
    # the third joins in a decode step once the budget has room again
    (join,) = [c for c in h.shard.calls if c.method == "next_token" and c.request_ids]
    assert join.request_ids == [burst[2].id]


async def test_with_chunked_prefill_a_request_joins_at_the_next_step_without_a_prefill(make_harness) -> None:
    h = make_harness(FakeShard(chunked_prefill=True, latency_s=0.002), max_prefill_tokens=64)
    first = h.submit(make_request(max_new=30))
    await h.calls(3)
    calls_before = len(h.shard.calls)
    second = h.submit(make_request(prompt_len=3, max_new=3))
    assert (await h.final(second)).generated_tokens == 3
    assert (await h.final(first)).generated_tokens == 30
    assert h.methods().count("prefill") == 1  # only the idle loop's first call prefills
    joins = [c for c in h.shard.calls if c.method == "next_token" and c.request_ids]
    assert [c.request_ids for c in joins] == [[second.id]]
    # waiting costs at most the step under way when it arrived (TGIS's rule would wait for
    # MAX_WAITING_TOKENS steps with a batch of one running)
    assert h.shard.calls.index(joins[0]) <= calls_before + 1
    assert [r.batch_id for r in joins[0].refs] == [h.shard.calls[0].batch_id]


async def test_a_request_the_shard_does_not_answer_fails_instead_of_vanishing(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.001))
    ok = h.submit(make_request(max_new=6))
    lost = h.submit(make_request(max_new=6))
    await h.until(lambda: lost.generated >= 1)
    h.shard.forget.add(lost.id)
    out = await h.final(lost)
    prefix = f"Request failed during generation: Error after generating {out.generated_tokens} tokens"
    assert out.error == f"{prefix}: {MISSING_ANSWER}"
    assert (await h.final(ok)).generated_tokens == 6


@pytest.mark.parametrize("seed", range(6))
async def test_no_live_request_disappears_without_a_token_or_an_error(make_harness, seed: int) -> None:
    """Invariant: whatever mix of chunked prompts, joins, per-request errors, cancels, missing
    answers and calls of several steps, every request ends with all its tokens, or an error, or
    its cancel."""
    rng = random.Random(seed)
    shard = FakeShard(chunked_prefill=rng.random() < 0.7, latency_s=0.0005)
    h = make_harness(
        shard,
        max_batch_size=6,
        max_prefill_tokens=rng.choice([5, 12, 40]),
        max_decode_steps=1 if seed < 3 else rng.choice([2, 5]),
    )
    entries = []
    for _ in range(24):
        entries.append(h.submit(make_request(prompt_len=rng.randint(1, 30), max_new=rng.randint(1, 8))))
        if rng.random() < 0.5:
            await h.shard.next_call()
        running = [e for e in entries if e.started_at is not None and not e.finished]
        if running and rng.random() < 0.3:
            victim = rng.choice(running)
            match rng.randint(0, 2):
                case 0:
                    shard.request_errors[victim.id] = "Token decoding error: injected"
                case 1:
                    shard.forget.add(victim.id)
                case 2:
                    victim.cancelled = True
    for entry, outputs in await h.answers(entries):
        out, max_new = outputs[-1], entry.request.stopping.max_new_tokens
        assert out.error is not None or out.generated_tokens == max_new, (entry.id, out)
    assert shard.peak_live <= 6


@pytest.mark.parametrize("seed", range(12))
async def test_preemptions_and_ended_thinking_keep_every_answer_whole(make_harness, seed: int) -> None:
    """Invariant under SCHEDULING_POLICY=priority: whatever mix of priorities (running requests
    preempted, resumed later, maybe again), thinking budgets (ended for them, resumed at once),
    chunked prompts, calls of several steps and cancels, every request not cancelled ends with
    exactly the tokens it would have had alone: the fake model counts on from the ids a resumed
    request brings, so a lost, repeated or reordered token shows."""
    from router.core.thinking import ThinkingBudget, ThinkingMarkers

    closing = 9
    markers = ThinkingMarkers(True, ((7,),), ((closing,),))
    rng = random.Random(seed)
    shard = FakeShard(chunked_prefill=rng.random() < 0.6, latency_s=0.0005)
    h = make_harness(
        shard,
        max_batch_size=rng.choice([2, 3, 4]),
        max_prefill_tokens=rng.choice([5, 12, 40]),
        max_decode_steps=rng.choice([1, 3]),
        by_priority=True,
        preemption=True,
    )
    entries = []
    for _ in range(20):
        budget = rng.choice([None, None, 1, 3, 6])
        request = make_request(
            prompt_len=rng.randint(1, 20),
            max_new=rng.randint(2, 12),
            priority=rng.randint(-2, 2),
            thinking=ThinkingBudget(budget, markers) if budget else None,
        )
        entries.append(h.submit(request, stream=rng.random() < 0.3))
        if rng.random() < 0.6:
            await h.shard.next_call()
        running = [e for e in entries if e.started_at is not None and not e.finished]
        if running and rng.random() < 0.1:
            rng.choice(running).cancelled = True
    for entry, outputs in await h.answers(entries):
        max_new = entry.request.stopping.max_new_tokens
        thinking = entry.request.thinking
        budget = thinking.budget if thinking is not None else None
        expected = [closing if i == budget else 600 + i for i in range(max_new)]
        assert outputs[-1].error is None and entry.token_ids == expected, (seed, entry.id, entry.token_ids)
    assert shard.peak_live <= h.queue.max_batch_size


# --- one owner of model calls: the health probe ----------------------------------------------


def probe_request() -> GenerationRequest:
    return GenerationRequest(id=HEALTH_CHECK_BATCH_ID, input_ids=(10, 11), max_new_tokens=1)


async def test_the_health_probe_runs_between_the_loops_own_calls(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.002))
    entry = h.submit(make_request(max_new=20))
    await h.calls(3)
    assert await h.batcher.probe(probe_request())  # the fake shard asserts calls never overlap
    assert (await h.final(entry)).generated_tokens == 20
    probes = [i for i, c in enumerate(h.shard.calls) if c.batch_id == HEALTH_CHECK_BATCH_ID]
    assert len(probes) == 1 and h.shard.calls[probes[0] + 1].method == "next_token"


async def test_the_health_probe_wakes_an_idle_loop_and_reports_failure(make_harness) -> None:
    h = make_harness(FakeShard())
    assert await h.batcher.probe(probe_request())
    assert h.batcher.generation_healthy is True
    h.shard.fail_prefill = ShardCallError("connection", "Could not connect to Text Generation server")
    assert not await h.batcher.probe(probe_request())
    assert h.batcher.generation_healthy is False
    assert h.methods() == ["prefill", "prefill"]


async def test_a_deadline_that_passes_while_the_prompt_is_computed_ends_the_request(make_harness) -> None:
    h = make_harness(FakeShard(chunked_prefill=True, latency_s=0.002), max_prefill_tokens=2)
    running = h.submit(make_request(max_new=40))
    await h.calls(2)
    late = h.submit(make_request(prompt_len=200, max_new=3, deadline_s=0.02))  # ~100 pending steps
    out = await h.final(late)
    assert out.stop_reason is StopReason.TIME_LIMIT and out.generated_tokens == 0
    assert (await h.final(running)).generated_tokens == 40


@pytest.mark.parametrize("eager", [False, True])
async def test_where_joins_run_eagerly_between_graphed_steps_they_wait_for_tgis_rule(
    make_harness, eager: bool
) -> None:
    """Where a step that carries prompt chunks runs eagerly while the shard's decode steps replay
    graphs, in-step joins wait until as many requests wait as TGIS's rule asks."""
    h = make_harness(
        FakeShard(chunked_prefill=True, latency_s=0.001),
        max_prefill_tokens=64,
        max_waiting_tokens=50,
        eager_joins=eager,
    )
    running = [h.submit(make_request(max_new=60)) for _ in range(4)]
    await h.calls(2)
    submitted_at = len(h.shard.calls)
    late = h.submit(make_request(prompt_len=3, max_new=3))
    assert (await h.final(late)).generated_tokens == 3
    for entry in running:
        assert (await h.final(entry)).generated_tokens == 60
    (join,) = [c for c in h.shard.calls if c.method == "next_token" and c.request_ids]
    waited = h.shard.calls.index(join) - submitted_at
    # 4 running: one waiting request is enough once 4 * (50 - steps) // 50 <= 1, after 26 steps
    assert waited >= 20 if eager else waited <= 1


async def test_adaptive_pacing_raises_the_streams_interval_while_the_loop_is_saturated(make_harness) -> None:
    """MAX_STREAM_INTERVAL: the batcher judges the loop at every decode step; a loop that never
    waits raises the interval one step at a time up to its bound (tgi_stream_interval follows),
    so a stream's later messages carry several tokens, with the text of one message per token;
    the next busy period starts from STREAM_INTERVAL again."""
    ticks = itertools.count()
    pacing = StreamPacing(1, 3, lambda: 0.0, clock=lambda: next(ticks) * WINDOW_S * 1.001)
    h = make_harness(pacing=pacing)
    outputs = await h.all_outputs(h.submit(make_request(max_new=16), stream=True))
    counts = [o.generated_tokens for o in outputs]
    assert counts[:2] == [1, 2] and counts[-1] == 16 and counts == sorted(set(counts))
    assert all(b - a == 3 for a, b in itertools.pairwise(counts[-4:-1])), counts
    assert pacing.interval == 3
    assert "tgi_stream_interval 3.0" in h.batcher.metrics.exposition().decode()
    fixed = make_harness()
    each = await fixed.all_outputs(fixed.submit(make_request(max_new=16), stream=True))
    assert "".join(o.text for o in outputs) == "".join(o.text for o in each) and len(outputs) < len(each)
    await h.final(h.submit(make_request(max_new=1), stream=True))
    assert pacing.interval == 1  # restarted, and one token needs no decode step


# --- several decode steps per call -------------------------------------------------------------


async def test_calls_run_several_steps_while_nothing_waits_and_tokens_stay_in_order(
    make_harness, detokenizer
) -> None:
    h = make_harness(FakeShard(latency_s=0.001), max_decode_steps=4)
    streamed = h.submit(make_request(max_new=11), stream=True)
    unary = h.submit(make_request(max_new=7))
    outs = await h.all_outputs(streamed)
    out = await h.final(unary)
    assert out.generated_tokens == 7 and outs[-1].generated_tokens == 11
    assert "".join(o.text for o in outs) == detokenizer.decode(list(range(600, 611)))
    decodes = [c.steps for c in h.shard.calls if c.method == "next_token"]
    # the first decode call knows no step time yet; then 4 steps a call, fewer asked for none
    # (the shard stops where every request ends): tokens 2-11 in 1 + 4 + 4 + 1 steps
    assert decodes[:3] == [1, 4, 4] and len(decodes) <= 5
    assert h.batcher.step_s == pytest.approx(0.001)


async def test_the_call_budget_bounds_the_steps(make_harness) -> None:
    h = make_harness(FakeShard(forward_ns=4_000_000), max_decode_steps=8, max_decode_call_s=0.01)
    assert (await h.final(h.submit(make_request(max_new=12)))).generated_tokens == 12
    assert {c.steps for c in h.shard.calls if c.method == "next_token"} == {1, 2}  # 10 ms / 4 ms


async def test_a_call_is_one_step_while_a_request_waits_or_joins(make_harness) -> None:
    shard = FakeShard(chunked_prefill=True, latency_s=0.002)
    h = make_harness(shard, max_prefill_tokens=64, max_decode_steps=4)
    first = h.submit(make_request(max_new=40))
    await h.until(lambda: any(c.steps == 4 for c in shard.calls))
    second = h.submit(make_request(prompt_len=3, max_new=3))
    assert (await h.final(second)).generated_tokens == 3
    assert (await h.final(first)).generated_tokens == 40
    join = next(i for i, c in enumerate(shard.calls) if c.request_ids == [second.id])
    assert shard.calls[join].steps == 1  # the join, then its first token handed out: one step
    assert shard.calls[join + 1].steps == 1
    assert any(c.steps == 4 for c in shard.calls[join + 2 :])  # then several again


async def test_a_request_that_arrives_ends_the_call_after_its_step_under_way(make_harness) -> None:
    shard = FakeShard(step_latency_s=0.02)
    h = make_harness(shard, max_decode_steps=8)
    first = h.submit(make_request(max_new=60))
    await h.until(lambda: any(c.steps == 8 for c in shard.calls))
    long_call = next(c for c in shard.calls if c.steps == 8)
    second = h.submit(make_request(prompt_len=3, max_new=3))
    assert (await h.final(second)).generated_tokens == 3
    assert (await h.final(first)).generated_tokens == 60
    assert shard.ended[0] == long_call.name and long_call.name > 0
    assert 1 <= long_call.ran <= 2  # the steps before the arrival's EndSteps, not 8
    prefill = next(c for c in shard.calls if c.method == "prefill" and c.request_ids == [second.id])
    assert shard.calls.index(prefill) == shard.calls.index(long_call) + 1
    names = [c.name for c in shard.calls if c.steps > 1]
    assert len(set(names)) == len(names) and all(names)  # every call of 4 steps or more is named
    assert all(c.name == 0 for c in shard.calls if c.method == "next_token" and c.steps == 1)


async def test_a_call_of_fewer_steps_than_named_ones_runs_them_when_a_request_arrives(make_harness) -> None:
    shard = FakeShard(step_latency_s=0.02)
    h = make_harness(shard, max_decode_steps=NAMED_CALL_STEPS - 1)
    first = h.submit(make_request(max_new=20))
    await h.until(lambda: any(c.steps == NAMED_CALL_STEPS - 1 for c in shard.calls))
    short_call = next(c for c in shard.calls if c.steps > 1)
    second = h.submit(make_request(prompt_len=3, max_new=3))
    assert (await h.final(second)).generated_tokens == 3
    assert (await h.final(first)).generated_tokens == 20
    assert not shard.ended and short_call.name == 0 and short_call.ran == NAMED_CALL_STEPS - 1


async def test_a_call_that_no_request_interrupts_runs_its_steps(make_harness) -> None:
    shard = FakeShard(step_latency_s=0.001)
    h = make_harness(shard, max_decode_steps=4)
    assert (await h.final(h.submit(make_request(max_new=12)))).generated_tokens == 12
    assert not shard.ended and [c.ran for c in shard.calls if c.steps == 4][:2] == [4, 4]
