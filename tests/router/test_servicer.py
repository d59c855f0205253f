"""The external servicer on a fake shard: failures of a batched call and their status codes,
draining, metrics labels, Tokenize's lanes and limits."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from router.api.auth import AuthConfig, Authenticator
from router.api.service import DRAINING
from router.core.pacing import StreamPacing
from router.core.tokenizer import BUSY_MESSAGE, TokenizerPool
from router.grpc.grpc_server import MAX_TOKENIZE_TEXTS, GenerationServicer
from router.pb import generation_pb2 as pb
from router.scheduling.shard_client import CONNECTION_MESSAGE, OOM_MESSAGE, ShardCallError
from tests.router.fakes import FakeShard
from tests.router.stacks import service_over


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    def invocation_metadata(self) -> tuple:
        return (("x-correlation-id", "test"),)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


@pytest.fixture
async def servicer(detokenizer, tokenizer_pool):
    shard = FakeShard(latency_s=0.002)
    service, batcher = service_over(
        shard, detokenizer, tokenizer_pool, max_batch_size=8, permits=8, max_new_tokens=200
    )
    servicer = GenerationServicer(
        service,
        tokenizer_pool,
        service.metrics,
        Authenticator(AuthConfig()),
        seq2seq=False,
        max_sequence_length=512,
        max_new_tokens=200,
        default_include_stop_seqs=True,
    )
    task = asyncio.create_task(batcher.run())
    yield servicer, shard
    task.cancel()


def batch(texts: list[str], max_new: int) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[{"text": t} for t in texts], params={"stopping": {"max_new_tokens": max_new}}
    )


async def test_a_failing_input_fails_the_call_at_once(servicer, caplog) -> None:
    s, shard = servicer
    caplog.set_level(logging.INFO, "router.api.service")
    # The second input fails at its prefill; the first would need 150 steps (3 s or more).
    shard.latency_s = 0.02
    shard.request_errors[2] = "boom"
    start = time.monotonic()
    with pytest.raises(Aborted) as error:
        await s.Generate(batch(["first", "second"], 150), FakeContext())
    elapsed = time.monotonic() - start
    assert error.value.code == grpc.StatusCode.INTERNAL  # an engine fault
    assert error.value.details == "Request failed during generation: boom"
    # The abandoned sibling is logged as what it was: the first of two.
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Sub-request 1 from batch of 2 generated") for line in lines), lines
    assert elapsed < 1.0, f"waited {elapsed:.2f} s for the other input"
    assert s.metrics.counters["tgi_request_failure"].get(err="generate") == 1
    # The abandoned input left the batch and its permit came back.
    assert s.service.limiter.in_use == 0
    for _ in range(100):  # the shard's batch goes at the next step's end
        if not shard.batches:
            break
        await asyncio.sleep(0.02)
    assert not shard.batches


async def test_draining_refuses_new_calls(servicer) -> None:
    s, _ = servicer
    s.service.draining = True
    with pytest.raises(Aborted) as error:
        await s.Generate(batch(["x"], 3), FakeContext())
    assert (error.value.code, error.value.details) == (grpc.StatusCode.UNAVAILABLE, DRAINING)
    assert s.metrics.counters["tgi_queue_rejected"].get(reason="draining") == 1


async def test_success_counts_by_kind(servicer) -> None:
    s, _ = servicer
    reply = await s.Generate(batch(["a", "b"], 4), FakeContext())
    assert [r.generated_token_count for r in reply.responses] == [4, 4]
    assert s.metrics.counters["tgi_request_success"].get(stop_reason="MAX_TOKENS", kind="batch") == 2
    assert s.metrics.counters["tgi_request_count"].get(kind="batch") == 1


async def _stream(s: GenerationServicer, text: str, max_new: int) -> list[pb.GenerationResponse]:
    request = pb.SingleGenerationRequest(
        request={"text": text}, params={"stopping": {"max_new_tokens": max_new}}
    )
    return [m async for m in s.GenerateStream(request, FakeContext())]


async def test_a_stream_interval_sends_the_tokens_in_fewer_messages(servicer) -> None:
    """STREAM_INTERVAL 3 on the gRPC door: the first token at once, then one message per three
    tokens carrying their details; the text is the one of a message per token."""
    s, _ = servicer
    request = pb.SingleGenerationRequest(
        request={"text": "hello"},
        params={"stopping": {"max_new_tokens": 10}, "response": {"generated_tokens": True}},
    )
    each = [m async for m in s.GenerateStream(request, FakeContext())]
    s.service.pacing = StreamPacing(3)
    fewer = [m async for m in s.GenerateStream(request, FakeContext())]
    assert [m.generated_token_count for m in fewer[1:]] == [1, 4, 7, 10]
    assert [len(m.tokens) for m in fewer[1:]] == [1, 3, 3, 3]
    assert "".join(m.text for m in fewer[1:]) == "".join(m.text for m in each[1:])
    assert [t.text for m in fewer for t in m.tokens] == [t.text for m in each for t in m.tokens]
    assert fewer[-1].stop_reason == each[-1].stop_reason == pb.StopReason.MAX_TOKENS


CALL_FAILURES = [
    (ShardCallError("connection", f"{CONNECTION_MESSAGE}: Socket closed"), grpc.StatusCode.UNAVAILABLE),
    (ShardCallError("oom", OOM_MESSAGE), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShardCallError("error", "engine exploded"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize("step", ["prefill", "next_token"])
@pytest.mark.parametrize("kind", ["single", "batch", "stream"])
@pytest.mark.parametrize(("failure", "code"), CALL_FAILURES, ids=["gone", "oom", "fault"])
async def test_shard_call_failures_have_actionable_codes(servicer, step, kind, failure, code) -> None:
    """The same status through unary, batch and stream: never UNKNOWN."""
    s, shard = servicer
    setattr(shard, f"fail_{step}", failure)
    with pytest.raises(Aborted) as error:
        if kind == "stream":
            await _stream(s, "hello", 5)
        else:
            await s.Generate(batch(["hello"] if kind == "single" else ["hello", "there"], 5), FakeContext())
    assert error.value.code == code
    assert error.value.details == f"Request failed during generation: {failure}"
    assert s.service.limiter.in_use == 0
    # The server goes on: the next request is answered.
    reply = await s.Generate(batch(["again"], 3), FakeContext())
    assert reply.responses[0].generated_token_count == 3


async def test_generation_does_not_wait_behind_tokenize(servicer) -> None:
    """A Tokenize of a few MiB runs in its own lane: a small Generate started after it is
    validated, run and answered while the Tokenize is still working."""
    s, _ = servicer
    big = "hello world, " * 200_000  # 2.6 MB: about a second of tokenization
    tokenize = asyncio.ensure_future(
        s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": big}], return_offsets=True), FakeContext())
    )
    await asyncio.sleep(0.05)  # it has started
    reply = await s.Generate(batch(["small"], 3), FakeContext())
    assert reply.responses[0].generated_token_count == 3
    assert not tokenize.done(), "the Generate waited for the Tokenize"
    answer = await tokenize
    assert answer.responses[0].token_count > 100_000


async def test_tokenize_limits(servicer, tokenizer_dir) -> None:
    s, _ = servicer
    with pytest.raises(Aborted) as error:
        await s.Tokenize(
            pb.BatchedTokenizeRequest(requests=[{"text": ""}] * (MAX_TOKENIZE_TEXTS + 1)), FakeContext()
        )
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details == f"a Tokenize call may carry at most {MAX_TOKENIZE_TEXTS} texts, got 4097"
    assert s.metrics.counters["tgi_tokenize_request_count"].get() == 1  # refused, but counted
    assert s.metrics.counters["tgi_tokenize_request_input_count"].get() == 4097
    # A lane holding its budget refuses more at once, and frees it when its job ends.
    from router.core.tokenizer import load_tokenizer

    s.tokenizer = TokenizerPool(load_tokenizer(str(tokenizer_dir)), 1, tokenize_budget_bytes=4096)
    try:
        first = asyncio.ensure_future(
            s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "a" * 3000}]), FakeContext())
        )
        await asyncio.sleep(0)
        with pytest.raises(Aborted) as error:
            await s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "b" * 2000}]), FakeContext())
        assert (error.value.code, error.value.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_MESSAGE)
        await first
        again = await s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "b" * 2000}]), FakeContext())
        assert again.responses[0].token_count > 0
    finally:
        s.tokenizer.close()


async def test_a_tokenizer_panic_is_the_inputs_error(servicer, monkeypatch) -> None:
    s, _ = servicer

    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panic(texts, *, tokens, offsets):
        raise PanicException("index out of bounds")

    monkeypatch.setattr(s.tokenizer, "tokenize_sync", panic)
    with pytest.raises(Aborted) as error:
        await s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "x"}]), FakeContext())
    assert (error.value.code, error.value.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenizer error index out of bounds",
    )


class AuthContext(FakeContext):
    def __init__(self, authorization: str | None) -> None:
        self.authorization = authorization

    def invocation_metadata(self) -> tuple:
        extra = (("authorization", self.authorization),) if self.authorization is not None else ()
        return (("x-correlation-id", "test"), *extra)


async def test_every_call_needs_a_token_when_authentication_is_on(servicer) -> None:
    s, _ = servicer
    s.auth = Authenticator(AuthConfig(api_keys=("k",)))
    calls = {
        "Generate": lambda c: s.Generate(batch(["hi"], 2), c),
        "Tokenize": lambda c: s.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "hi"}]), c),
        "ModelInfo": lambda c: s.ModelInfo(pb.ModelInfoRequest(), c),
    }
    for name, run in calls.items():
        for header, message in [(None, "missing bearer token"), ("Bearer x", "invalid API key")]:
            with pytest.raises(Aborted) as error:
                await run(AuthContext(header))
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED, name
            assert error.value.details.startswith(message), name
        await run(AuthContext("Bearer k"))  # answered
    stream = s.GenerateStream(pb.SingleGenerationRequest(request={"text": "hi"}), AuthContext(None))
    with pytest.raises(Aborted) as error:
        await anext(stream)
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert s.service.limiter.in_use == 0


GRPC_REFUSALS = [  # (method, request, status): every way the gRPC door refuses a generate call
    (
        "Generate",
        {"requests": [{"text": "hi"}], "params": {"stopping": {"max_new_tokens": 500}}},
        "INVALID_ARGUMENT",
    ),
    (
        "Generate",
        {"requests": [{"text": "hi"}], "params": {"method": "SAMPLE", "sampling": {"top_p": 2.0}}},
        "INVALID_ARGUMENT",
    ),
    (
        "Generate",
        {"requests": [{"text": "hi"}], "params": {"decoding": {"repetition_penalty": 3.0e39}}},
        "INVALID_ARGUMENT",
    ),
    (
        "Generate",
        {"requests": [{"text": "hi"}], "params": {"stopping": {"stop_sequences": ["a"] * 7}}},
        "INVALID_ARGUMENT",
    ),
    ("Generate", {"requests": [{"text": "hi " * 600}]}, "INVALID_ARGUMENT"),  # longer than the model
    ("Generate", {"requests": [{"text": "hi"}] * 9}, "RESOURCE_EXHAUSTED"),  # more inputs than permits
    (
        "GenerateStream",
        {"request": {"text": "hi"}, "params": {"method": "SAMPLE", "sampling": {"temperature": 0.01}}},
        "INVALID_ARGUMENT",
    ),
    ("GenerateStream", {}, "INVALID_ARGUMENT"),  # no request
]


@pytest.mark.parametrize(
    ("method", "fields", "status"), GRPC_REFUSALS, ids=[f"{m} {f}" for m, f, _ in GRPC_REFUSALS]
)
async def test_every_refusal_of_the_grpc_door_is_one_counted_call(servicer, method, fields, status) -> None:
    """One path for every door: a refused call counts once (its kind), its failure once (its
    cause), and gives its permits back."""
    s, _ = servicer
    with pytest.raises(Aborted) as error:
        if method == "Generate":
            await s.Generate(pb.BatchedGenerationRequest(**fields), FakeContext())
        else:
            async for _ in s.GenerateStream(pb.SingleGenerationRequest(**fields), FakeContext()):
                pass
    assert error.value.code == grpc.StatusCode[status]
    kind = "stream" if method == "GenerateStream" else ("single" if len(fields["requests"]) == 1 else "batch")
    calls = s.metrics.counters["tgi_request_count"]
    assert {k: calls.get(kind=k) for k in ("single", "batch", "stream")} == {
        k: int(k == kind) for k in ("single", "batch", "stream")
    }
    cause = "validation" if status == "INVALID_ARGUMENT" else "conc_limit"
    assert s.metrics.counters["tgi_request_failure"].get(err=cause) == 1
    assert s.service.limiter.in_use == 0


async def test_a_stream_without_its_request_is_refused_and_counted(servicer) -> None:
    s, _ = servicer
    with pytest.raises(Aborted) as error:
        async for _ in s.GenerateStream(pb.SingleGenerationRequest(), FakeContext()):
            pass
    assert (error.value.code, error.value.details) == (grpc.StatusCode.INVALID_ARGUMENT, "missing request")
    assert s.metrics.counters["tgi_request_failure"].get(err="validation") == 1
    with pytest.raises(Aborted) as error:  # repetition_penalty past float32's range: infinite in the shard
        await s.Generate(
            pb.BatchedGenerationRequest(
                requests=[{"text": "hi"}], params={"decoding": {"repetition_penalty": 3.0e38 * 10}}
            ),
            FakeContext(),
        )
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert s.metrics.counters["tgi_request_failure"].get(err="validation") == 2
