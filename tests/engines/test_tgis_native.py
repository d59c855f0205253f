"""What the conformance suite does not cover of the paged `tgis_native` engine: every KV block
comes back after any workload, the causal mask is aligned to the end of the keys (chunks) and
honours a sliding window, and models it does not serve are refused with one clear line."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest
import torch

from tests.engines.conformance import Runner, alone, transformers_oracle
from text_generation_common.messages import (
    CachedBatchRef,
    GenerationRequest,
    RequestedDetails,
    SamplingParams,
)
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.paged_attention import StepLayout
from text_generation_server.engines.paged_kv import BlockPool, PagedKVCache, SequenceKV, prefix_keys
from text_generation_server.engines.tgis_native import TgisNativeEngine


def config_for(model_dir, **overrides) -> ServerConfig:
    values = {"max_batch_size": 8, "max_sequence_length": 128, "max_new_tokens": 32, "dtype": "float32"}
    return ServerConfig(model_name=str(model_dir), kv_block_size=4, **{**values, **overrides})


@pytest.fixture(scope="module")
def engine(tiny_model) -> TgisNativeEngine:
    return TgisNativeEngine(config_for(tiny_model("llama")))


def free_blocks(engine: TgisNativeEngine) -> int:
    gc.collect()
    return engine.kv.pool.free


@dataclass
class Cancelling(Runner):
    """A runner whose requests are also cancelled at random (pruned before their end)."""

    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def _finished(self, request_id: int) -> bool:
        return super()._finished(request_id) or self.rng.random() < 0.08


@pytest.mark.parametrize("seed", range(4))
def test_every_block_comes_back_after_joins_prunes_cancels_and_errors(engine, seed: int) -> None:
    rng = random.Random(seed)
    total = engine.kv.pool.num_blocks
    schedule: dict[int, list[GenerationRequest]] = {}
    next_id = 1
    for step in sorted(rng.sample(range(12), 5)):
        requests = []
        for _ in range(rng.randint(1, 2)):
            params = SamplingParams(temperature=0.9, seed=next_id) if rng.random() < 0.4 else SamplingParams()
            if rng.random() < 0.15:
                params = SamplingParams(temperature=0.9)  # unseeded: refused, a per-request error
            prompt = tuple(rng.randrange(5, 1000) for _ in range(rng.randint(1, 30)))
            requests.append(GenerationRequest(next_id, prompt, rng.randint(1, 10), params=params))
            next_id += 1
        schedule[step] = requests
    runner = Cancelling(engine, token_budget=rng.choice([0, 3, 7]), rng=rng)
    runner.run(schedule)
    del runner
    assert free_blocks(engine) == total


def test_clearing_the_cache_frees_the_blocks(engine) -> None:
    total = engine.kv.pool.num_blocks
    manager = BatchManager(engine, 8)
    manager.prefill(1, [GenerationRequest(1, tuple(range(5, 30)), 8)], [])
    manager.next_token([CachedBatchRef(1)])
    assert free_blocks(engine) < total
    manager.clear()
    assert free_blocks(engine) == total


def test_the_pool_and_block_tables() -> None:
    pool = BlockPool(3, 4)
    sequence = SequenceKV(pool)
    sequence.reserve(5)
    assert sequence.blocks == [0, 1] and pool.free == 1
    sequence.length = 5
    assert sequence.slots(3, 6) == [3, 4, 5]
    with pytest.raises(MemoryError, match="needs 2 more blocks and has 1 free"):
        sequence.reserve(8)
    del sequence
    gc.collect()
    assert pool.free == 3


def test_masks_align_to_the_end_of_the_keys_and_honour_the_window() -> None:
    cache = PagedKVCache(BlockPool(4, 4), torch.device("cpu"))
    # a 3-token chunk after 2 cached tokens, and a single decode token of a 6-token sequence
    layout = StepLayout(cache, torch.arange(4), [(0, 3), (3, 4)], [torch.arange(5), torch.arange(6)])
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )  # lower-right: query i sees keys up to 2 + i
    assert torch.equal(layout.mask(0, None), expected)
    assert layout.mask(1, None) is None
    windowed = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(layout.mask(0, 2), windowed)
    assert torch.equal(layout.mask(1, 2), torch.tensor([[0, 0, 0, 0, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize("arch", ["t5", "bloom"])
def test_models_it_does_not_serve_are_refused_with_one_line(tiny_model, arch: str) -> None:
    with pytest.raises(ValueError, match=r"the tgis_native engine serves .* models run on hf_transformers"):
        TgisNativeEngine(config_for(tiny_model(arch)))


# ---- prefix caching ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return transformers_oracle(tiny_model("llama"))


def prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(5, 1000) for _ in range(length))


def hits(engine: TgisNativeEngine, request: GenerationRequest) -> int:
    batch, _ = engine.new_batch(999, [request])
    assert batch is not None
    return batch.states[request.id].hit_tokens


def test_a_repeated_prefix_skips_its_prefill_and_gives_the_same_tokens(engine, oracle) -> None:
    shared = prompt(1, 30)
    first = GenerationRequest(1, shared + prompt(2, 5), 8)
    assert alone(engine, first) == oracle(first.input_ids, 8)
    again = GenerationRequest(2, shared + prompt(3, 7), 8)  # same 30 first tokens: 7 full blocks of 4
    assert hits(engine, again) == 28
    assert alone(engine, again) == oracle(again.input_ids, 8)
    # chunked, and several requests sharing the prefix in one batch
    together = [GenerationRequest(10 + i, shared + prompt(20 + i, 3 + i), 6) for i in range(3)]
    got = Runner(engine, token_budget=5).run({0: together})
    assert got == {r.id: oracle(r.input_ids, 6) for r in together}
    assert free_blocks(engine) == engine.kv.pool.num_blocks


def test_details_of_every_prompt_token_are_computed_not_taken_from_the_cache(engine) -> None:
    shared = prompt(4, 24)
    alone(engine, GenerationRequest(1, (*shared, 7), 2))
    details = RequestedDetails(input_tokens=True, logprobs=True)
    assert hits(engine, GenerationRequest(2, (*shared, 8), 2, details=details)) == 0
    assert hits(engine, GenerationRequest(3, (*shared, 8), 2)) == 24


def test_cached_blocks_are_evicted_when_the_pool_needs_them(tiny_model, oracle) -> None:
    small = TgisNativeEngine(config_for(tiny_model("llama"), max_batch_size=2, max_sequence_length=64))
    pool = small.kv.pool
    for i in range(12):  # 12 prompts of 10 full blocks each, through a pool of 34 blocks
        request = GenerationRequest(i + 1, prompt(100 + i, 41), 4)
        assert alone(small, request) == oracle(request.input_ids, 4)
    assert 0 < pool.cached <= pool.num_blocks and free_blocks(small) == pool.num_blocks
    last = GenerationRequest(99, prompt(111, 41), 4)
    assert hits(small, last) == 40  # the most recent prompt is still cached


def test_prefix_caching_can_be_switched_off(tiny_model) -> None:
    plain = TgisNativeEngine(config_for(tiny_model("llama"), prefix_caching=False))
    request = GenerationRequest(1, prompt(5, 30), 3)
    alone(plain, request)
    assert hits(plain, request) == 0 and plain.kv.pool.cached == 0


def test_prefix_keys_chain_the_whole_prefix() -> None:
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1] and c[1] != a[1]
