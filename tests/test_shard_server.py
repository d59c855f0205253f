"""The shard's gRPC edge: bad input gives a clear status, per-request failures stay per-request,
and the server keeps serving afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from tests.shard_harness import Driver, make_request, running_shard
from text_generation_common.messages import HEALTH_CHECK_BATCH_ID
from text_generation_common.pb import generate_pb2 as pb
from text_generation_server.batches.inputs import UNSEEDED_MESSAGE
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.hf_transformers import HFTransformersEngine

MAX_BATCH = 4
MAX_SEQ = 64
MAX_NEW = 20


class HookedEngine(ModelEngine):
    """Delegates to a real engine; `before_step` runs first in every generate_token."""

    def __init__(self, inner: HFTransformersEngine) -> None:
        self.inner = inner
        self.info = inner.info
        self.before_step: Any = None

    def new_batch(self, batch_id, requests):
        return self.inner.new_batch(batch_id, requests)

    def generate_token(self, batch, token_budget=0):
        if self.before_step is not None:
            self.before_step()
        return self.inner.generate_token(batch, token_budget)


@pytest.fixture(scope="module")
def shard(tiny_model, tmp_path_factory) -> Iterator[tuple[HookedEngine, Any, ServerConfig]]:
    path = tiny_model("llama")
    config = ServerConfig(
        model_name=str(path),
        uds_path=str(tmp_path_factory.mktemp("s") / "shard"),
        max_batch_size=MAX_BATCH,
        max_sequence_length=MAX_SEQ,
        max_new_tokens=MAX_NEW,
        dtype="float32",
    )
    engine = HookedEngine(HFTransformersEngine(config))
    with running_shard(engine, config) as stub:
        yield engine, stub, config


@pytest.fixture
def stub(shard):
    engine, stub, _ = shard
    engine.before_step = None
    stub.ClearCache(pb.ClearCacheRequest())
    return stub


def prefill(stub, batch_id: int, requests, to_prune=()) -> pb.PrefillResponse:
    return stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=requests), to_prune=list(to_prune))
    )


def assert_status(call, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code
    assert info.value.details() == message


def assert_still_serving(stub) -> None:
    response = prefill(stub, 900, [make_request(900, [1, 5, 6], 3)])
    assert len(response.result.tokens) == 1 and response.result.batch_id == 900
    assert stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=900)])).result.batch_id == 900
    stub.ClearCache(pb.ClearCacheRequest())


def test_model_info_and_discovery(shard, stub) -> None:
    _, _, config = shard
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert info.model_type == pb.ModelInfoResponse.CAUSAL_LM
    assert (
        info.eos_token_id == 2
        and info.capacity_kind == pb.ModelInfoResponse.PADDED_WEIGHTS
        and info.vocab_size == 2000
    )
    assert info.max_sequence_length == MAX_SEQ
    # The measured memory model: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes per token.
    memory = info.memory_scaling_model
    assert memory.nexttoken_linear_coef0 == memory.nexttoken_linear_coef1 == 512
    assert memory.weight_limit > 0
    urls = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls
    assert list(urls) == [f"unix://{config.uds_path}-0"]


def test_unknown_batch_id(stub) -> None:
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=77)])),
        grpc.StatusCode.NOT_FOUND,
        "Batch ID 77 not found in cache.",
    )
    assert_status(
        lambda: prefill(stub, 1, [make_request(1, [1, 5], 2)], [pb.CachedBatch(id=78)]),
        grpc.StatusCode.NOT_FOUND,
        "Batch ID 78 not found in cache.",
    )
    assert_still_serving(stub)


def test_empty_and_oversize_batches(stub) -> None:
    assert_status(
        lambda: prefill(stub, 1, []), grpc.StatusCode.INVALID_ARGUMENT, "Prefill batch 1 has no requests"
    )
    too_many = [make_request(i, [1, 5], 2) for i in range(MAX_BATCH + 1)]
    assert_status(
        lambda: prefill(stub, 2, too_many),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Prefill batch 2 has {MAX_BATCH + 1} requests, more than max_batch_size ({MAX_BATCH})",
    )
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "NextToken needs at least one batch",
    )
    assert_still_serving(stub)


def test_merge_beyond_max_batch_size_leaves_batches_intact(stub) -> None:
    prefill(stub, 1, [make_request(i, [1, 5, 6], 8) for i in range(3)])
    prefill(stub, 2, [make_request(i, [1, 7], 8) for i in range(3, 5)])
    both = [pb.CachedBatch(id=1), pb.CachedBatch(id=2)]
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=both)),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"merging batches [1, 2] gives 5 requests, more than max_batch_size ({MAX_BATCH})",
    )
    # Nothing was changed: dropping one request makes the merge legal.
    both[0].completed_ids.append(0)
    result = stub.NextToken(pb.NextTokenRequest(batches=both)).result
    # batch 1's step ran ahead; batch 2's rows wait for the merged batch's next step
    assert [t.request_id for t in result.tokens] == [1, 2] and result.batch_id == 1
    assert list(result.pending_ids) == [3, 4]
    result = stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1)])).result
    assert [t.request_id for t in result.tokens] == [1, 2, 3, 4]


def test_duplicate_ids(stub) -> None:
    assert_status(
        lambda: prefill(stub, 1, [make_request(5, [1, 2], 2), make_request(5, [1, 3], 2)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Request ID 5 appears twice in batch 1",
    )
    prefill(stub, 1, [make_request(5, [1, 2], 4)])
    assert_status(
        lambda: prefill(stub, 2, [make_request(5, [1, 3], 2)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Request ID 5 is already running in batch 1",
    )
    assert_status(
        lambda: prefill(stub, 1, [make_request(6, [1, 3], 2)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Batch ID 1 is already in the cache",
    )
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1), pb.CachedBatch(id=1)])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Batch ID 1 is listed more than once",
    )
    # A completed id may be reused by the batch that prunes it.
    response = prefill(stub, 2, [make_request(5, [1, 3], 2)], [pb.CachedBatch(id=1, completed_ids=[5])])
    assert response.result.batch_id == 2


def test_per_request_errors_leave_the_rest_of_the_batch_alone(stub, shard) -> None:
    engine = shard[0]
    good = make_request(1, [1, 5, 6, 7], 5)
    bad = [
        make_request(2, [1, 5, 2000], 5),
        make_request(3, [], 5),
        make_request(4, list(range(1, 61)), 5),
        make_request(5, [1, 5], 5, prefix_id="my-prompt"),
        make_request(6, [1, 5], 5, temperature=-1.0),
        make_request(7, [1, 5], MAX_NEW + 1),
    ]
    driver = Driver(stub, engine.info.eos_token_id, stop_at_eos=False)
    driver.prefill([bad[0], bad[1], good])
    driver.prefill(bad[2:])
    driver.run()
    assert driver.errors == {
        2: "input token id 2000 is outside the vocabulary (size 2000)",
        3: "request has no input tokens",
        4: f"input tokens (60) plus max_new_tokens (5) must be <= {MAX_SEQ}",
        5: "Error retrieving prompt prefix 'my-prompt'",
        6: "invalid sampling parameter: temperature -1.0",
        7: f"max_new_tokens must be <= {MAX_NEW}",
    }
    alone = Driver(stub, engine.info.eos_token_id, stop_at_eos=False, next_batch_id=50)
    alone.prefill([make_request(1, [1, 5, 6, 7], 5)])
    alone.run()
    assert driver.ids(1) == alone.ids(1)


def test_all_requests_invalid_caches_nothing(stub) -> None:
    result = prefill(stub, 3, [make_request(1, [], 2)]).result
    assert not result.HasField("batch_id") and [e.request_id for e in result.errors] == [1]
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=3)])),
        grpc.StatusCode.NOT_FOUND,
        "Batch ID 3 not found in cache.",
    )


def test_health_check_batch_is_never_cached(stub) -> None:
    result = prefill(stub, HEALTH_CHECK_BATCH_ID, [make_request(HEALTH_CHECK_BATCH_ID, [1, 5], 1)]).result
    assert len(result.tokens) == 1 and not result.HasField("batch_id")
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=HEALTH_CHECK_BATCH_ID)])),
        grpc.StatusCode.NOT_FOUND,
        f"Batch ID {HEALTH_CHECK_BATCH_ID} not found in cache.",
    )


def test_clear_cache_and_stale_batches(stub) -> None:
    prefill(stub, 1, [make_request(1, [1, 5], 4)])
    prefill(stub, 2, [make_request(2, [1, 6], 4)])
    # Batch 1 is not referenced: it is stale and dropped.
    stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=2)]))
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1)])),
        grpc.StatusCode.NOT_FOUND,
        "Batch ID 1 not found in cache.",
    )
    stub.ClearCache(pb.ClearCacheRequest())
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=2)])),
        grpc.StatusCode.NOT_FOUND,
        "Batch ID 2 not found in cache.",
    )


def test_finished_batches_are_dropped(stub) -> None:
    prefill(stub, 1, [make_request(1, [1, 5], 4), make_request(2, [1, 6], 4)])
    response = stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1, completed_ids=[1, 2])]))
    assert not response.HasField("result")


def test_prefix_lookup_not_found(stub) -> None:
    assert_status(
        lambda: stub.PrefixLookup(pb.PrefixLookupRequest(prefix_id="abc")),
        grpc.StatusCode.NOT_FOUND,
        'prefix id "abc" not found',
    )
    assert_status(
        lambda: stub.PrefixLookup(pb.PrefixLookupRequest(adapter_id="lora/x")),
        grpc.StatusCode.NOT_FOUND,
        'adapter id "lora/x" not found',
    )


def test_adapter_id_is_its_own_field(stub) -> None:
    with_adapter = make_request(1, [1, 5], 2)
    with_adapter.adapter_id = "lora/x"
    response = prefill(stub, 1, [with_adapter, make_request(2, [1, 6], 2)])
    assert [(e.request_id, e.message) for e in response.result.errors] == [
        (1, "Error retrieving adapter 'lora/x'")
    ]
    assert [t.request_id for t in response.result.tokens] == [2]


def test_sampling_without_a_seed_is_refused_at_the_shard_edge(stub) -> None:
    # Tensor-parallel ranks must draw the same numbers: no per-rank random seed.
    unseeded = make_request(1, [1, 5], 2, temperature=0.8)
    response = prefill(stub, 1, [unseeded, make_request(2, [1, 6], 2, temperature=0.8, seed=5)])
    assert [(e.request_id, e.message) for e in response.result.errors] == [(1, UNSEEDED_MESSAGE)]
    assert [t.request_id for t in response.result.tokens] == [2]


def test_a_token_budget_needs_an_engine_with_chunked_prefill(stub) -> None:
    assert not stub.ModelInfo(pb.ModelInfoRequest()).chunked_prefill
    assert_status(
        lambda: stub.Prefill(
            pb.PrefillRequest(batch=pb.Batch(id=1, requests=[make_request(1, [1, 5], 2)]), token_budget=8)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_budget 8 needs chunked prefill, which this engine does not do",
    )
    assert_still_serving(stub)


def test_out_of_memory_and_unexpected_errors(shard, stub) -> None:
    engine = shard[0]

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine.before_step = oom
    with pytest.raises(grpc.RpcError) as info:
        prefill(stub, 1, [make_request(1, [1, 5], 2)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in info.value.details()

    def boom() -> None:
        raise RuntimeError("boom")

    engine.before_step = boom
    assert_status(
        lambda: prefill(stub, 2, [make_request(2, [1, 5], 2)]),
        grpc.StatusCode.UNKNOWN,
        "Unexpected <class 'RuntimeError'>: boom",
    )
    engine.before_step = None
    assert_still_serving(stub)


def test_health_answers_during_a_long_step(shard, stub) -> None:
    engine = shard[0]
    release = threading.Event()
    entered = threading.Event()

    def slow() -> None:
        entered.set()
        release.wait(10)

    engine.before_step = slow
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(prefill, stub, 1, [make_request(1, [1, 5], 2)])
        assert entered.wait(10)
        start = time.monotonic()
        stub.Health(pb.HealthRequest(), timeout=5)
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
        answered_s = time.monotonic() - start
        assert not pending.done(), "the step must still be running"
        release.set()
        assert pending.result(10).result.batch_id == 1
    assert answered_s < 5


def test_end_steps_ends_the_named_call_after_its_step_under_way(shard, stub) -> None:
    engine = shard[0]
    prefill(stub, 1, [make_request(1, [1, 5, 6], MAX_NEW)])

    def tokens_of(call: int, steps: int = 8) -> int:
        reply = stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1)], steps=steps, call=call))
        return len(reply.result.tokens)

    stub.EndSteps(pb.EndStepsRequest(call=99))
    assert tokens_of(3) == 8  # a call another call's EndSteps named runs all its steps
    release, entered = threading.Event(), threading.Event()

    def blocked() -> None:  # the step under way (maybe one run ahead of the call) waits
        entered.set()
        release.wait(10)

    engine.before_step = blocked
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(tokens_of, 4)
        assert entered.wait(10)
        engine.before_step = None
        stub.EndSteps(pb.EndStepsRequest(call=4), timeout=5)  # answered while the step runs
        release.set()
        assert 1 <= pending.result(10) <= 2  # that step (and the one run ahead before it)
    assert tokens_of(5) == 8


def test_a_join_in_next_token_is_refused_by_an_engine_that_does_not_chunk(stub) -> None:
    prefill(stub, 1, [make_request(1, [1, 5, 6], 8)])
    join = pb.Batch(id=2, requests=[make_request(2, [1, 7], 4)])
    assert_status(
        lambda: stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1)], join=join)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "joining batch 2 in a decode step needs chunked prefill, which this engine does not do",
    )
    result = stub.NextToken(pb.NextTokenRequest(batches=[pb.CachedBatch(id=1)])).result
    assert [t.request_id for t in result.tokens] == [1]
