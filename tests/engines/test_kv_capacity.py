"""Admission by KV blocks, end to end: the paged engine reports its cache with every step, the
router's KVBlockCapacity admits only what fits beside it, and a request the whole cache cannot
hold is refused at validation. Unit tests of the policy are in tests/router/test_capacity.py."""

from __future__ import annotations

import random

import pytest
import torch

from router.core.capacity import KVBlockCapacity, Load, capacity_for
from router.core.metrics import Metrics
from router.core.tokenizer import load_tokenizer
from tests.engines.conformance import LocalShard, alone, through_batcher, validated_request
from text_generation_common.messages import CachedBatchRef, GenerationRequest, KvBlocks, StepOutput
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.tgis_native import TgisNativeEngine

BLOCK = 4


def small_config(model_dir, **overrides) -> ServerConfig:
    # 2 sequences of 64 tokens + the block held back: 2 * 16 + 1 = 33 blocks of 4 tokens (the
    # CPU's default size, set here so that a GPU gets the same cache)
    values = {
        "max_batch_size": 2,
        "max_sequence_length": 64,
        "max_new_tokens": 32,
        "dtype": "float32",
        "kv_cache_blocks": 33,
    }
    return ServerConfig(model_name=str(model_dir), kv_block_size=BLOCK, **{**values, **overrides})


def small_engine(model_dir, **overrides) -> TgisNativeEngine:
    return TgisNativeEngine(small_config(model_dir, **overrides))


@pytest.fixture(scope="module")
def engine(tiny_model) -> TgisNativeEngine:
    return small_engine(tiny_model("llama"))


def prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(5, 1000) for _ in range(length))


def test_the_engine_reports_its_cache_with_every_step(engine) -> None:
    info = engine.info
    assert info.capacity == KvBlocks(BLOCK, 33)
    manager = BatchManager(engine, 8)
    # 10 + 6 tokens at their longest = 4 blocks, 3 of them taken by the prompt (its last block
    # partly filled) and the first token; 21 + 3 = 6 blocks, 6 taken
    output = manager.prefill(
        1, [GenerationRequest(1, prompt(1, 10), 6), GenerationRequest(2, prompt(2, 21), 3)], []
    )
    state = output.kv_cache
    assert state is not None and state.total_blocks == 33
    assert (state.used_blocks, state.reserved_blocks) == (3 + 6, 1 + 0)
    assert state.committed_blocks == 4 + 6
    step = manager.next_token([CachedBatchRef(1)])
    assert step is not None and step.kv_cache is not None and step.kv_cache.committed_blocks == 10
    manager.clear()
    assert engine.kv_state().committed_blocks == 0


def test_prefix_cache_totals_count_the_tokens_looked_up_and_found(engine) -> None:
    before = engine.kv_state()
    shared = prompt(3, 20)
    alone(engine, GenerationRequest(1, (*shared, 1), 2))
    alone(engine, GenerationRequest(2, (*shared, 2), 2))
    after = engine.kv_state()
    # each prompt of 21 tokens looks up its 5 full blocks (the last token is always computed)
    assert after.prefix_query_tokens - before.prefix_query_tokens == 2 * 20
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 20
    assert after.cached_blocks >= 5


def test_a_cache_salt_shares_prefix_blocks_only_with_its_own(engine) -> None:
    """vLLM's cache_salt: the same prompt under another salt (or none) finds nothing cached;
    under the same salt it finds its blocks."""
    shared = prompt(4, 20)
    before = engine.kv_state()
    alone(engine, GenerationRequest(1, (*shared, 1), 2, cache_salt="tenant-a"))
    alone(engine, GenerationRequest(2, (*shared, 2), 2, cache_salt="tenant-b"))
    alone(engine, GenerationRequest(3, (*shared, 3), 2))
    assert engine.kv_state().prefix_hit_tokens == before.prefix_hit_tokens
    alone(engine, GenerationRequest(4, (*shared, 4), 2, cache_salt="tenant-a"))
    alone(engine, GenerationRequest(5, (*shared, 5), 2))
    assert engine.kv_state().prefix_hit_tokens - before.prefix_hit_tokens == 2 * 20


class WatchedShard(LocalShard):
    """Records the blocks committed after every call (they must stay within the cache)."""

    def __init__(self, engine: TgisNativeEngine) -> None:
        super().__init__(engine)
        self.committed: list[int] = []
        self.live: list[int] = []

    def _seen(self, output: StepOutput | None) -> StepOutput | None:
        if output is not None and output.kv_cache is not None:
            self.committed.append(output.kv_cache.committed_blocks)
            self.live.append(len(output.running_ids))
        return output

    async def prefill(self, batch_id, requests, to_prune, token_budget=0):  # type: ignore[no-untyped-def]
        return self._seen(await super().prefill(batch_id, requests, to_prune, token_budget))

    async def next_token(self, batches, token_budget=0, join=None, steps=1, call=0):  # type: ignore[no-untyped-def, override]
        return self._seen(await super().next_token(batches, token_budget, join, steps, call))


async def test_the_router_admits_by_blocks_and_no_request_runs_out(engine, tiny_model) -> None:
    shard = WatchedShard(engine)
    info = await shard.model_info()
    capacity = capacity_for(info, 1.0)
    assert isinstance(capacity, KVBlockCapacity)
    metrics = Metrics(max_batch_size=8)
    tokenizer = load_tokenizer(str(tiny_model("llama")))
    # 10 requests of 40 tokens at their longest (10 blocks): 3 fit in the 32 usable blocks
    requests = [GenerationRequest(i + 1, prompt(10 + i, 20), 20) for i in range(10)]
    expected = [alone(engine, r) for r in requests]
    # exactly max_new tokens each: their longest length
    validated = [
        (validated_request(r.input_ids, r.max_new_tokens, r.max_new_tokens), False) for r in requests
    ]
    outputs = await through_batcher(
        shard, tokenizer, validated, capacity, metrics, max_prefill_tokens=16, chunked_prefill=True
    )
    answers = [o[-1] for o in outputs]
    assert [[t.token_id for t in a.tokens] for a in answers] == expected
    assert all(a.error is None for a in answers)
    assert isinstance(info.capacity, KvBlocks)
    assert max(shard.committed) <= info.capacity.total_blocks - KVBlockCapacity.HELD_BACK_BLOCKS
    assert max(shard.live) == 3  # held back by blocks, not by the batch size of 8
    text = metrics.exposition().decode()
    assert "tgi_kv_cache_blocks_total 33.0" in text
    totals = engine.kv_state()  # the router counts what the shard reports since its start
    assert f"tgi_prefix_cache_queries_total {float(totals.prefix_query_tokens)}" in text
    assert f"tgi_prefix_cache_hits_total {float(totals.prefix_hit_tokens)}" in text
    assert totals.prefix_hit_tokens > 0  # the alone runs above cached every prompt


def test_a_request_larger_than_the_whole_cache_is_refused(engine) -> None:
    capacity = capacity_for(engine.info, 1.0)
    assert capacity.refusal(Load(60, 68)) is None  # 128 tokens: the 32 usable blocks
    assert capacity.refusal(Load(60, 69)) == (
        "input tokens plus max_new_tokens (60 + 69) need 33 KV-cache blocks of 4 tokens; "
        "the whole cache holds 32"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the default cache takes the free GPU memory")
def test_by_default_the_cpu_cache_holds_max_batch_size_sequences(tiny_model) -> None:
    engine = small_engine(tiny_model("llama"), kv_cache_blocks=0)
    assert engine.kv.pool.num_blocks == 2 * (64 // BLOCK) + 1


def test_kv_cache_blocks_beyond_the_memory_there_is_are_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match=r"^KV_CACHE_BLOCKS=1000000000 needs [0-9.]+ GiB, more than the "):
        small_engine(tiny_model("llama"), kv_cache_blocks=10**9)
    with pytest.raises(ValueError, match="set KV_CACHE_BLOCKS or CPU_KV_CACHE_SPACE, not both"):
        small_config(tiny_model("llama"), cpu_kv_cache_space=1.0)
