"""Per-request token processing: streamed text always adds up to the unary text, whatever the
tokens, stop sequences and tokenizer; decoding failures stay with their request."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest

from router.core.detokenizer import Detokenizer
from router.core.entry import Entry, Output
from router.core.pacing import StreamPacing
from router.core.stopping import StopReason
from router.core.tokenizer import load_tokenizer
from router.core.validation import ResponseSpec, StoppingSpec, ValidatedRequest
from text_generation_common.messages import SamplingParams, TokenInfo
from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

EOS = 2


def request(stop: list[str], include: bool, max_new: int) -> ValidatedRequest:
    return ValidatedRequest(
        text="p",
        input_ids=(1,),
        input_length=1,
        truncate_input_tokens=0,
        prefix_id="",
        prefix_length=0,
        sampling=SamplingParams(),
        stopping=StoppingSpec(max_new, 0, tuple(stop), include),
        response=ResponseSpec(),
        received_at=time.monotonic(),
    )


def feed(
    entry: Entry, ids: list[int], detokenizer: Detokenizer, intervals: list[int] | None = None
) -> list[Output]:
    """The entry's outputs for `ids`; `intervals`: its pacing's interval before each token."""
    entry.start(1, detokenizer, time.monotonic())
    for step, token in enumerate(ids):
        if intervals is not None:
            entry.pacing.interval = intervals[step]
        if entry.on_token(TokenInfo(token), {EOS}, detokenizer, time.monotonic()):
            break
    outputs = []
    while not entry.outputs.empty():
        outputs.append(entry.outputs.get_nowait())
    return outputs


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def detokenizer(request, tmp_path_factory) -> Detokenizer:
    path = tmp_path_factory.mktemp(request.param)
    write_tokenizer(path, ARCHITECTURES["llama"], kind=request.param)
    return Detokenizer(load_tokenizer(str(path)))


def random_case(
    rng: random.Random, detokenizer: Detokenizer, *, most_tokens: int, stops: range, longest_cut: int
) -> tuple[list[int], list[str]]:
    """Random ids and stop sequences, most of them cut from the ids' own text."""
    ids = [rng.randrange(3, 2000) for _ in range(rng.randint(1, most_tokens))]
    full = detokenizer.decode(ids)
    found = []
    for _ in range(rng.choice(stops)):
        if full and rng.random() < 0.75:
            start = rng.randrange(len(full))
            found.append(full[start : start + rng.randint(1, longest_cut)])
        else:
            found.append(rng.choice(["zz", "é", " ", "\ufffd", "a longer stop sequence"]))
    return ids, found


def test_stream_equals_unary_for_random_tokens_and_stop_sequences(detokenizer: Detokenizer) -> None:
    rng = random.Random(7)
    for _ in range(1500):
        ids, stops = random_case(rng, detokenizer, most_tokens=20, stops=range(1, 4), longest_cut=6)
        include = rng.random() < 0.5
        (unary,) = feed(Entry(request(stops, include, len(ids)), stream=False), ids, detokenizer)
        streamed = feed(Entry(request(stops, include, len(ids)), stream=True), ids, detokenizer)
        context = (ids, stops, include)
        assert "".join(o.text for o in streamed) == unary.text, context
        assert streamed[-1].stop_reason == unary.stop_reason, context
        assert streamed[-1].generated_tokens == unary.generated_tokens, context
        counts = [o.generated_tokens for o in streamed]
        assert counts == sorted(set(counts)), context
        if unary.stop_reason is StopReason.MAX_TOKENS:
            assert unary.text == detokenizer.decode(ids), context


def test_decoding_failure_fails_only_its_request(tmp_path) -> None:
    import asyncio

    from router.core.batch_weights import BatchWeights
    from router.core.capacity import WeightCapacity
    from router.core.metrics import Metrics
    from router.scheduling.batcher import Batcher
    from router.scheduling.request_queue import RequestQueue
    from tests.router.fakes import FakeShard

    write_tokenizer(tmp_path, ARCHITECTURES["llama"])
    detokenizer = Detokenizer(load_tokenizer(str(tmp_path)))

    class RaisingDecoder:
        def push(self, token_id: int) -> str:
            raise RuntimeError("lost the placeholder")

        def flush(self) -> str:
            return ""

    class Broken(Detokenizer):
        def incremental(self):  # type: ignore[override]
            return RaisingDecoder()

    broken = Broken(load_tokenizer(str(tmp_path)))

    async def run() -> tuple[Output, Output]:
        shard = FakeShard(latency_s=0.002)
        metrics = Metrics()
        queue = RequestQueue(WeightCapacity(BatchWeights.from_model(shard.memory, True), 1.0), 8, metrics)
        batcher = Batcher(shard, queue, broken, metrics, eos_token_id=EOS, max_waiting_tokens=2)
        task = asyncio.create_task(batcher.run())
        fine = Entry(
            request([], False, 4), stream=False
        )  # unary without stop sequences: no incremental decode
        doomed = Entry(request([], False, 4), stream=True)
        queue.append([fine, doomed])
        outs = []
        for entry in (doomed, fine):
            while not (out := await asyncio.wait_for(entry.outputs.get(), 5)).final:
                pass
            outs.append(out)
        task.cancel()
        return outs[0], outs[1]

    failed, ok = asyncio.run(run())
    assert failed.error == "Request failed during detokenization: lost the placeholder"
    assert (
        ok.error is None and ok.generated_tokens == 4 and ok.text == detokenizer.decode(list(range(600, 604)))
    )


def test_a_token_with_overlapping_stop_matches_cuts_at_the_first(detokenizer: Detokenizer) -> None:
    """A single token that completes a stop sequence more than once ("   " with "  "): the output
    is cut at the first match, the cut a stream of the same characters makes."""
    found = next(
        (
            (i, text, char)
            for i in range(3, 2000)
            for text in [detokenizer.decode([i])]
            for char in dict.fromkeys(text)
            if char * 3 in text
        ),
        None,
    )
    assert found is not None, "the tiny tokenizer has a token with a character three times in a row"
    token, text, char = found
    first = text.index(char * 2)
    for include, expected in ((False, text[:first]), (True, text[: first + 2])):
        (unary,) = feed(Entry(request([char * 2], include, 5), stream=False), [token], detokenizer)
        streamed = feed(Entry(request([char * 2], include, 5), stream=True), [token], detokenizer)
        assert unary.stop_reason is StopReason.STOP_SEQUENCE and unary.text == expected, (text, include)
        assert "".join(o.text for o in streamed) == expected


@pytest.mark.parametrize("interval", [2, 3])
def test_a_stream_interval_sends_the_first_token_then_one_message_per_interval(
    detokenizer: Detokenizer, interval: int
) -> None:
    """STREAM_INTERVAL: the same text, stop reason and token details as one message per token,
    in fewer messages: the first token at once, then at most one message per `interval` tokens."""
    rng = random.Random(interval)
    for _ in range(300):
        ids = [rng.randrange(3, 2000) for _ in range(rng.randint(1, 24))]
        stops = [rng.choice(["zz", "é", " "])] if rng.random() < 0.4 else []
        spec = request(stops, rng.random() < 0.5, len(ids))
        spec = dataclasses.replace(spec, response=ResponseSpec(generated_tokens=True))
        each = feed(Entry(spec, stream=True), ids, detokenizer)
        fewer = feed(Entry(spec, stream=True, pacing=StreamPacing(interval)), ids, detokenizer)
        context = (ids, stops)
        assert "".join(o.text for o in fewer) == "".join(o.text for o in each), context
        assert [t for o in fewer for t in o.tokens] == [t for o in each for t in o.tokens], context
        assert fewer[-1].stop_reason == each[-1].stop_reason and fewer[-1].final, context
        counts = [o.generated_tokens for o in fewer]
        assert counts[0] == 1 and counts == sorted(set(counts)), context
        assert all(b - a >= interval for a, b in itertools.pairwise(counts[:-1])), (
            context
        )  # the last may be sooner
        assert len(fewer) <= 2 + (len(ids) - 1) // interval, context


def test_an_adaptive_interval_changing_mid_stream_keeps_text_and_details(detokenizer: Detokenizer) -> None:
    """MAX_STREAM_INTERVAL: the interval the batcher picks may change between any two tokens;
    the messages still add up to the text and token details of one message per token, and none
    holds more tokens than the interval in force when it went out allows."""
    rng = random.Random(11)
    for _ in range(300):
        ids = [rng.randrange(3, 2000) for _ in range(rng.randint(1, 24))]
        stops = [rng.choice(["zz", "é", " "])] if rng.random() < 0.4 else []
        spec = request(stops, rng.random() < 0.5, len(ids))
        spec = dataclasses.replace(spec, response=ResponseSpec(generated_tokens=True))
        intervals = [rng.randint(1, 5) for _ in ids]
        each = feed(Entry(spec, stream=True), ids, detokenizer)
        paced = feed(
            Entry(spec, stream=True, pacing=StreamPacing(1, 5, lambda: 0.0)), ids, detokenizer, intervals
        )
        context = (ids, stops, intervals)
        assert "".join(o.text for o in paced) == "".join(o.text for o in each), context
        assert [t for o in paced for t in o.tokens] == [t for o in each for t in o.tokens], context
        assert paced[-1].stop_reason == each[-1].stop_reason and paced[-1].final, context
        counts = [o.generated_tokens for o in paced]
        assert counts[0] == 1 and counts == sorted(set(counts)), context
        for before, after in itertools.pairwise(counts[:-1]):
            assert after - before >= intervals[before - 1], context  # due as set by the message before


def outputs_as_tuples(outputs: list[Output]) -> list[tuple]:
    return [(o.generated_tokens, o.text, o.stop_reason, o.stop_sequence) for o in outputs]


def test_settled_text_gives_the_outputs_of_unsettled_text(detokenizer: Detokenizer, monkeypatch) -> None:
    """Long answers keep the text no reader looks into again as settled pieces (output_text.py);
    settling every few characters must give the same messages, cuts and answers as never."""
    rng = random.Random(11)
    cases = []
    for _ in range(400):
        ids, stops = random_case(rng, detokenizer, most_tokens=60, stops=range(4), longest_cut=12)
        intervals = [rng.choice([1, 1, 2, 5]) for _ in ids]
        cases.append((ids, stops, rng.random() < 0.5, intervals))

    def run(settle_at: int) -> tuple[list, int]:
        monkeypatch.setattr("router.core.output_text.SETTLE_AT", settle_at)
        results, settled = [], 0
        for ids, stops, include, intervals in cases:
            for stream in (False, True):
                entry = Entry(request(stops, include, len(ids)), stream=stream, pacing=StreamPacing(1))
                outputs = feed(entry, ids, detokenizer, intervals if stream else None)
                results.append(outputs_as_tuples(outputs))
                settled += bool(entry._text is not None and entry._text._pieces)
        return results, settled

    never, none_settled = run(10**9)
    often, settled = run(8)
    assert none_settled == 0 and settled > 300  # the case this test is for happened
    assert often == never


def test_a_long_answer_keeps_a_short_tail(detokenizer: Detokenizer) -> None:
    """4,000 tokens streamed with a stop sequence: the unsettled text stays near SETTLE_AT (the
    text is not copied whole at every token) and the messages add up to the unary answer."""
    from router.core.output_text import SETTLE_AT

    rng = random.Random(3)
    ids = [rng.randrange(3, 2000) for _ in range(4000)]
    stops = ["never in this text \u2603"]
    longest_tail = 0
    entries = {stream: Entry(request(stops, False, len(ids)), stream=stream) for stream in (False, True)}
    for entry in entries.values():
        entry.start(1, detokenizer, time.monotonic())
        for token in ids:
            entry.on_token(TokenInfo(token), {EOS}, detokenizer, time.monotonic())
            assert entry._text is not None
            longest_tail = max(longest_tail, len(entry._text._tail))
    assert longest_tail <= SETTLE_AT + 64
    texts = {}
    for stream, entry in entries.items():
        outputs = []
        while not entry.outputs.empty():
            outputs.append(entry.outputs.get_nowait())
        texts[stream] = "".join(o.text for o in outputs)
        assert outputs[-1].stop_reason == StopReason.MAX_TOKENS
    assert texts[True] == texts[False] == detokenizer.decode(ids).rstrip("\ufffd")
    assert len(texts[True]) > 3 * SETTLE_AT
