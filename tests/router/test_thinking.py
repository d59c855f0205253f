"""A reasoning model's thinking held to a budget: the phases of one answer's thinking as its ids
come, and the batcher ending it at the budget over a fake shard (the request goes on from the
closing ids, resumed)."""

from __future__ import annotations

import functools

import pytest

from router.core.stopping import StopReason
from router.core.thinking import Phase, ThinkingBudget, ThinkingMarkers, ThinkingWatch
from tests.router.fakes import FakeShard
from tests.router.harness import make_request

OPENED = ThinkingMarkers(True, ((7, 8),), ((9,), (10, 11)))  # deepseek_r1's kind: the prompt opens it
ANSWER_OPENS = ThinkingMarkers(False, ((7, 8),), ((9,),))  # qwen3's kind: the answer opens it


def fed(watch: ThinkingWatch, ids: list[int]) -> list[tuple[Phase, int | None, bool]]:
    states = []
    for end in range(1, len(ids) + 1):
        watch.feed(ids[:end])
        states.append((watch.phase, watch.left, watch.over))
    return states


def test_an_answer_thinks_until_it_closes_or_its_budget_is_spent() -> None:
    assert fed(ThinkingWatch(ThinkingBudget(3, OPENED)), [1, 10, 11, 5]) == [
        (Phase.OPEN, 2, False),
        (Phase.OPEN, 1, False),
        (Phase.DONE, None, False),  # closed by the second of the closing markers
        (Phase.DONE, None, False),
    ]
    assert [s[2] for s in fed(ThinkingWatch(ThinkingBudget(2, OPENED)), [1, 2, 3])] == [False, True, True]
    assert ThinkingWatch(ThinkingBudget(2, OPENED)).closing == (9,)


def test_where_the_answer_opens_its_thinking_only_an_opened_one_counts() -> None:
    opens = fed(ThinkingWatch(ThinkingBudget(3, ANSWER_OPENS)), [7, 8, 1, 2])
    assert [s[0] for s in opens] == [Phase.UNDECIDED, Phase.OPEN, Phase.OPEN, Phase.OPEN]
    assert opens[-1][2]  # the opening marker counts
    plain = fed(ThinkingWatch(ThinkingBudget(1, ANSWER_OPENS)), [7, 3, 4])
    assert [s[0] for s in plain] == [Phase.UNDECIDED, Phase.DONE, Phase.DONE] and not any(s[2] for s in plain)


def test_markers_are_tokenized_once_the_closing_ones_after_a_space_too(tokenizer_pool) -> None:
    markers = ThinkingMarkers.of(False, ["<a>"], ["</a>", "end"], lambda texts: [[len(t)] for t in texts])
    assert markers == ThinkingMarkers(False, ((3,),), ((4,), (3,), (5,)))
    encode = functools.partial(tokenizer_pool.encode_batch_sync, special=False)
    end = "Here is my response:"  # granite's: text, tokenized otherwise after a space
    granite = ThinkingMarkers.of(False, ["Here is my thought process:"], [end], encode)
    assert granite.ends[0] == tuple(encode([end])[0]) and len(granite.ends) == 2
    watch = ThinkingWatch(ThinkingBudget(None, granite))
    watch.feed(encode(["Here is my thought process: it is fine. " + end])[0])
    assert watch.phase is Phase.DONE and watch.thought > 0


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-joins", "joins-in-steps"])
async def test_the_batcher_ends_thinking_at_the_budget_and_the_request_goes_on(
    make_harness, detokenizer, chunked: bool, steps: int
) -> None:
    """The fake model never closes its thinking: after exactly the budget's tokens the closing ids
    come, then the request goes on in the shard from them (resumed), beside another request that
    thinks within its budget, and a plain one; streamed, the text is the unary one's."""
    shard = FakeShard(latency_s=0.002, chunked_prefill=chunked)
    h = make_harness(shard, max_decode_steps=steps, max_prefill_tokens=64)
    limited = make_request(max_new=12, thinking=ThinkingBudget(4, OPENED))
    roomy = make_request(max_new=6, thinking=ThinkingBudget(50, OPENED))
    entries = [
        h.submit(limited, stream=True),
        h.submit(limited),
        h.submit(roomy),
        h.submit(make_request(max_new=6)),
    ]
    outputs = [await h.all_outputs(e) for e in entries]
    expected = [600, 601, 602, 603, 9, 605, 606, 607, 608, 609, 610, 611]
    assert entries[0].token_ids == entries[1].token_ids == expected
    assert entries[2].token_ids == entries[3].token_ids == list(range(600, 606))
    assert outputs[1][-1].generated_tokens == 12 and outputs[1][-1].stop_reason is StopReason.MAX_TOKENS
    assert "".join(o.text for o in outputs[0]) == outputs[1][-1].text == detokenizer.decode(expected)
    resumed = [r for r in shard.sent if r.generated_ids]
    assert [r.generated_ids for r in resumed] == [tuple(expected[:5])] * 2
    assert all(not r.details.input_tokens for r in resumed)
    assert entries[2].thinking is not None and entries[2].thinking.left == 44
    assert h.queue.metrics.counters["tgi_request_thinking_ended"].get() == 2


async def test_a_closing_that_reaches_max_new_tokens_ends_the_request(make_harness) -> None:
    h = make_harness(FakeShard(latency_s=0.002))
    entry = h.submit(make_request(max_new=4, thinking=ThinkingBudget(3, OPENED)))
    out = await h.final(entry)
    assert entry.token_ids == [600, 601, 602, 9] and out.stop_reason is StopReason.MAX_TOKENS
    assert not [r for r in h.shard.sent if r.generated_ids]


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-joins", "joins-in-steps"])
async def test_a_request_alone_goes_on_after_its_thinking_is_ended(make_harness, chunked: bool) -> None:
    h = make_harness(FakeShard(latency_s=0.002, chunked_prefill=chunked), max_prefill_tokens=64)
    entry = h.submit(make_request(max_new=6, thinking=ThinkingBudget(2, OPENED)))
    out = await h.final(entry)
    assert entry.token_ids == [600, 601, 9, 603, 604, 605] and out.generated_tokens == 6
