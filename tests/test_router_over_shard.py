"""The router's batcher over the internal gRPC protocol to a real shard server running the fake
engine (no weights): prompts computed over several calls under a token budget come back
"pending" and then with their tokens and input details, the same as whole prompts; the health
probe runs between the batcher's calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from router.core.capacity import capacity_for
from router.core.detokenizer import Detokenizer
from router.core.entry import Entry, Output
from router.core.metrics import Metrics
from router.core.tokenizer import load_tokenizer
from router.core.validation import ValidatedRequest
from router.scheduling.batcher import Batcher
from router.scheduling.request_queue import RequestQueue
from router.scheduling.shard_client import GrpcShardClient, ShardCallError
from tests.engines.conformance import validated_request
from tests.shard_harness import running_shard
from text_generation_common import convert
from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    CachedBatchRef,
    GenerationRequest,
    NewBatch,
    SamplingParams,
)
from text_generation_common.pb import generate_pb2 as pb
from text_generation_common.pb import generate_pb2_grpc
from text_generation_server.config import ServerConfig
from text_generation_server.testing.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def shard(tiny_model, tmp_path_factory) -> Iterator[tuple[ServerConfig, Path]]:
    model = tiny_model("llama")
    config = ServerConfig(
        model_name=str(model), uds_path=str(tmp_path_factory.mktemp("s") / "shard"), max_batch_size=8
    )
    with running_shard(FakeEngine(config), config):
        yield config, model


def request(prompt_len: int, max_new: int, seed: int | None = None) -> ValidatedRequest:
    sampling = SamplingParams(temperature=1.0, seed=seed) if seed is not None else None
    return validated_request(tuple(range(20, 20 + prompt_len)), max_new, sampling=sampling, input_tokens=True)


async def serve(shard, requests: list[ValidatedRequest], budget: int, probe: bool = False) -> list[Output]:
    config, model = shard
    client = await GrpcShardClient.connect(config.socket_path)
    await client.clear_cache()  # as the router does at start-up: a previous run may have left batches
    info = await client.model_info()
    metrics = Metrics(max_batch_size=8)
    queue = RequestQueue(capacity_for(info, 1.0), 8, metrics, max_prefill_tokens=budget, chunked_prefill=True)
    tokenizer = load_tokenizer(str(model))
    batcher = Batcher(
        client,
        queue,
        Detokenizer(tokenizer),
        metrics,
        eos_token_id=10**6,
        max_waiting_tokens=2,
        join_in_step=info.chunked_prefill,
    )
    task = asyncio.create_task(batcher.run())
    entries = [Entry(r, False) for r in requests]
    try:
        queue.append(entries)
        if probe:
            ids = (20, 21, 22)
            assert await batcher.probe(GenerationRequest(HEALTH_CHECK_BATCH_ID, ids, max_new_tokens=1))
        return [await asyncio.wait_for(e.outputs.get(), 30) for e in entries]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


async def test_chunked_prompts_answer_pending_then_give_the_same_tokens(shard) -> None:
    requests = [request(30, 6), request(5, 8, seed=3), request(45, 4, seed=9)]
    whole = await serve(shard, requests, budget=0)
    chunked = await serve(shard, requests, budget=8, probe=True)
    for a, b in zip(whole, chunked, strict=True):
        assert a.error is None and b.error is None
        assert [t.token_id for t in a.tokens] == [t.token_id for t in b.tokens]
        assert b.input_tokens is not None and [t.token_id for t in b.input_tokens] == [
            t.token_id for t in a.input_tokens or ()
        ]
    assert [len(o.tokens) for o in chunked] == [6, 8, 4]


async def test_decode_steps_share_one_stream_and_a_failed_step_ends_only_its_own(shard) -> None:
    """Steps are messages of one NextTokens stream; a step the shard refuses (a batch it does
    not hold) fails with the shard's message and ends that stream; the next step opens a new
    one and the batch goes on."""
    config, _ = shard
    client = await GrpcShardClient.connect(config.socket_path)
    try:
        await client.clear_cache()
        requests = [GenerationRequest(1, (20, 21, 22), max_new_tokens=8)]
        first = await client.prefill(5, requests, [])
        assert first.batch_id == 5 and len(first.generations) == 1
        stream = client._steps[0]
        ref = CachedBatchRef(5)
        assert (await client.next_token([ref])).batch_id == 5
        call = stream._call
        assert call is not None and (await client.next_token([ref])).batch_id == 5
        assert stream._call is call  # the same stream
        with pytest.raises(ShardCallError, match=r"^Batch ID 99 not found in cache\.$") as failed:
            await client.next_token([CachedBatchRef(99)])
        assert failed.value.reason == "error" and stream._call is None
        output = await client.next_token([ref])
        assert output is not None and output.batch_id == 5 and len(output.generations) == 1
        assert stream._call is not None and stream._call is not call
    finally:
        await client.close()


async def test_with_two_shards_a_step_one_refuses_leaves_neither_stream_with_an_answer_due(
    tiny_model, tmp_path
) -> None:
    """Shard 0 holds a batch the other does not: the step fails with shard 1's message once both
    answered, and the steps of a new batch both hold then read their own answers."""
    configs = [
        ServerConfig(model_name=str(tiny_model("llama")), uds_path=str(tmp_path / f"s{i}"), max_batch_size=4)
        for i in range(2)
    ]
    with (
        running_shard(FakeEngine(configs[0]), configs[0]) as first,
        running_shard(FakeEngine(configs[1]), configs[1]),
    ):
        channels = [grpc.aio.insecure_channel(f"unix://{c.socket_path}") for c in configs]
        client = GrpcShardClient([generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels], channels)
        try:
            only_first = pb.PrefillRequest(
                batch=convert.new_batch_to_pb(
                    NewBatch(7, (GenerationRequest(2, (30, 31), max_new_tokens=8),))
                )
            )
            first.Prefill(only_first)  # shard 0 alone caches batch 7
            with pytest.raises(ShardCallError, match=r"^Batch ID 7 not found in cache\.$"):
                await client.next_token([CachedBatchRef(7)])
            await client.clear_cache()  # as the router does after a failed step
            again = [GenerationRequest(3, (40, 41, 42), max_new_tokens=8)]
            assert (await client.prefill(9, again, [])).batch_id == 9
            for _ in range(3):  # each step reads its own answers on both streams
                output = await client.next_token([CachedBatchRef(9)])
                assert output is not None and output.batch_id == 9
                assert [g.request_id for g in output.generations] == [3]
        finally:
            await client.close()
