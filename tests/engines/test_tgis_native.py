"""What the conformance suite does not cover of the paged `tgis_native` engine: every KV block
comes back after any workload, the causal mask is aligned to the end of the keys (chunks) and
honours a sliding window, and models it does not serve are refused with one clear line."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest
import torch

from tests.engines.conformance import Runner
from text_generation_common.messages import CachedBatchRef, GenerationRequest, SamplingParams
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.paged_attention import StepLayout
from text_generation_server.engines.paged_kv import BlockPool, PagedKVCache, SequenceKV
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
