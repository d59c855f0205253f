"""call_ends.py: the tokens that may complete a stop sequence, against the definition over every
text of real vocabularies; Detokenizer.token_texts against decoding a token after another."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from router.core import call_ends
from router.core.call_ends import CallEnds
from router.core.detokenizer import REPLACEMENT_CHAR, Detokenizer
from router.core.tokenizer import load_tokenizer

STOPS = ("\n\n", "\n", "def ", "return", " the", "ing", "é", ")\n", "zzzz", "x" * 40, "()")


def completes(text: str, stop: str) -> bool:
    """The definition: some text before the token (only a proper prefix of `stop` matters) and
    the token's text hold `stop`, ending inside the token's text."""
    return any(stop in stop[:j] + text for j in range(len(stop)))


@pytest.fixture(scope="module", params=["byte_level", "metaspace", "wordpiece"])
def detok(request, tmp_path_factory: pytest.TempPathFactory) -> Detokenizer:
    from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

    out = tmp_path_factory.mktemp(request.param)
    write_tokenizer(out, ARCHITECTURES["llama"], kind=request.param)
    return Detokenizer(load_tokenizer(str(out)))


def test_token_texts_read_as_after_another_token(detok: Detokenizer) -> None:
    texts = detok.token_texts()
    if texts is None:
        assert detok.traits.last_token_differs
        return
    assert len(texts) == len(detok._classes)
    rng = random.Random(0)
    plain = [i for i, text in enumerate(texts) if text and REPLACEMENT_CHAR not in text]
    assert len(plain) > len(texts) // 2
    for token in rng.sample(plain, 300):
        before = rng.choice(plain)
        head = detok.decode([before])
        both = detok.decode([before, token])
        assert both.startswith(head) and both[len(head) :] == texts[token], (before, token)


def test_the_ids_are_the_definitions_over_every_text(detok: Detokenizer) -> None:
    texts = detok.token_texts()
    if texts is None:
        pytest.skip("this decoder's token texts depend on the next token")
    ends = CallEnds(texts)
    unknown = {i for i, t in enumerate(texts) if t is None or "\0" in t}
    partial = {i for i, t in enumerate(texts) if t is not None and REPLACEMENT_CHAR in t}
    for stop in STOPS:
        always = unknown | (partial if not stop.isascii() else set())
        expected = {i for i, t in enumerate(texts) if i not in unknown and completes(t, stop)} | always
        if len(expected) > ends.cap:
            assert ends.compute((stop,)) == frozenset(), stop
        else:
            assert ends.compute((stop,)) == expected, stop
    assert ends.compute(("\n\n", "def(")) == ends.compute(("\n\n",)) | ends.compute(("def(",))


def test_crafted_texts() -> None:
    texts = [
        "",
        "ab",
        "b",
        "xab",
        "a",
        "bc",
        REPLACEMENT_CHAR,
        None,
        "a\0b",
        "abab",
        "cab",
        "zz",
        "b\n",
        "b\ufffd",
    ]
    ends = CallEnds(texts)
    unknown = {7, 8}  # unknown, a text holding the separator
    assert ends.compute(("ab",)) == {1, 2, 3, 5, 9, 10, 12, 13} | unknown  # "b..." after "a"
    assert ends.compute(("b",)) == {1, 2, 3, 5, 9, 10, 12, 13} | unknown
    assert ends.compute(("zab",)) == {1, 2, 5, 9, 12, 13} | unknown  # "ab..." after "z", "b..." after "za"
    assert ends.compute(("q" * 50 + "ab",)) == {1, 2, 5, 9, 12, 13} | unknown  # longer than every text
    assert ends.compute(("zz",)) == {11} | unknown
    assert ends.compute(("zz", "é")) == {6, 11, 13} | unknown  # parts of characters: beyond ASCII
    assert ends.compute(()) == frozenset()
    for stop in ("ab", "b", "zab", "q" * 50 + "ab", "a\n", "cabab"):
        expected = {i for i, t in enumerate(texts) if i not in unknown and completes(t or "", stop)} | unknown
        assert ends.compute((stop,)) == expected, stop


def test_the_cap_is_a_share_of_the_vocabulary() -> None:
    assert CallEnds(["a"] * 8192).cap == 8192 // call_ends.VOCABULARY_SHARE
    assert CallEnds(["a"] * 10**6).cap == call_ends.MAX_CALL_END_IDS
    assert CallEnds(["a"] * 10).cap == call_ends.MIN_CAP


def test_too_many_ids_are_none() -> None:
    ends = CallEnds(["a", "ba", "ca", "da", "x"], cap=3)
    assert ends.compute(("a",)) == frozenset()  # four texts hold it
    assert ends.compute(("xa",)) == {0}
    assert ends.compute(("x",)) == {4}


async def test_the_cache_keeps_the_latest_sets(monkeypatch) -> None:
    monkeypatch.setattr(call_ends, "CACHED_STOP_SETS", 2)
    ends = CallEnds(["a", "b", "c"])
    assert await ends.ids(()) == frozenset()
    first = await ends.ids(("a",))
    assert await ends.ids(["a"]) is first  # cached, whatever the sequence type
    await ends.ids(("b",))
    assert await ends.ids(("a",)) is first  # used again: the latest
    await ends.ids(("c",))  # pushes out ("b",)
    assert list(ends._cache) == [("a",), ("c",)]


async def test_the_router_validates_requests_with_their_call_ends(
    tokenizer_pool, tokenizer_dir: Path
) -> None:
    """As router/server.py wires it (not where calls run one step): validation gives each request
    the ids of its stop sequences, and they travel through the internal protocol to the shard."""
    from router.core.metrics import Metrics
    from router.core.validation import PrefixLengths, RequestParams, StoppingSpec, Validator
    from router.server import _call_ends
    from text_generation_common.convert import request_from_pb, request_to_pb

    detok = Detokenizer(load_tokenizer(str(tokenizer_dir)))
    assert _call_ends(detok, max_decode_steps=1) is None
    ends = _call_ends(detok, max_decode_steps=16)
    assert ends is not None
    metrics = Metrics(max_sequence_length=128, max_new_tokens=32)

    async def no_prefixes(prefix_id: str, adapter: bool) -> int:
        raise AssertionError("no prefix here")

    validator = Validator(
        tokenizer_pool,
        PrefixLengths(no_prefixes, metrics),
        metrics,
        max_sequence_length=128,
        max_new_tokens=32,
        vocab_size=tokenizer_pool.tokenizer.get_vocab_size(with_added_tokens=True),
        call_ends=ends,
    )
    threads = []
    compute = ends.compute

    def counted(stop_sequences):
        threads.append(threading.current_thread())
        return compute(stop_sequences)

    ends.compute = counted  # type: ignore[method-assign]
    stopping = RequestParams(stopping=StoppingSpec(16, stop_sequences=("\n\n", "return")))
    with_stops, again, without = [
        (await validator.validate(["def f(x):"], params, "", 0.0))[0]
        for params in (stopping, stopping, RequestParams())
    ]
    assert len(threads) == 1 and threads[0] is not threading.current_thread()  # once, off the loop
    assert with_stops.call_end_ids == again.call_end_ids == compute(("\n\n", "return")) != frozenset()
    assert ends.compute(("def ",)) == frozenset()  # every text that starts with a space: over the cap
    assert without.call_end_ids == frozenset()
    request = with_stops.shard_request(7)
    assert request.call_end_ids == with_stops.call_end_ids
    assert request_from_pb(request_to_pb(request)) == request
