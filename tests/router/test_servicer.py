"""The external servicer on a fake shard: failures of a batched call, draining, metrics labels."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from router.batch_weights import BatchWeights
from router.batcher import Batcher
from router.grpc_server import DRAINING, ConcurrencyLimiter, GenerationServicer
from router.metrics import Metrics
from router.pb import generation_pb2 as pb
from router.request_queue import RequestQueue
from router.tracing import Tracing
from router.validation import PrefixLengths, Validator
from tests.router.fakes import EOS, FakeShard


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
    metrics = Metrics(max_sequence_length=512, max_new_tokens=200)
    queue = RequestQueue(BatchWeights.from_model(shard.memory, True), 8, 1.0, metrics)
    batcher = Batcher(shard, queue, detokenizer, metrics, eos_token_id=EOS, max_waiting_tokens=2)
    validator = Validator(
        tokenizer_pool,
        PrefixLengths(shard.prefix_lookup, metrics),
        metrics,
        max_sequence_length=512,
        max_new_tokens=200,
        default_include_stop_seqs=True,
    )
    servicer = GenerationServicer(
        validator,
        queue,
        tokenizer_pool,
        ConcurrencyLimiter(8),
        metrics,
        Tracing.setup(None, "test"),
        seq2seq=False,
        max_sequence_length=512,
        max_new_tokens=200,
    )
    task = asyncio.create_task(batcher.run())
    yield servicer, shard
    task.cancel()


def batch(texts: list[str], max_new: int) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[{"text": t} for t in texts], params={"stopping": {"max_new_tokens": max_new}}
    )


async def test_a_failing_input_fails_the_call_at_once(servicer) -> None:
    s, shard = servicer
    # The second input fails at its prefill; the first would need 150 steps (0.3 s or more).
    shard.request_errors[2] = "boom"
    start = time.monotonic()
    with pytest.raises(Aborted) as error:
        await s.Generate(batch(["first", "second"], 150), FakeContext())
    elapsed = time.monotonic() - start
    assert error.value.code == grpc.StatusCode.UNKNOWN
    assert error.value.details == "Request failed during generation: boom"
    assert elapsed < 0.2, f"waited {elapsed:.2f} s for the other input"
    assert s.metrics.counters["tgi_request_failure"].get(err="generate") == 1
    # The abandoned input left the batch and its permit came back.
    assert s.limiter.in_use == 0
    await asyncio.sleep(0.05)
    assert not shard.batches


async def test_draining_refuses_new_calls(servicer) -> None:
    s, _ = servicer
    s.draining = True
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
