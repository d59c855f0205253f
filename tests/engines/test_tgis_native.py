"""What the conformance suite does not cover of the paged `tgis_native` engine: every KV block
comes back after any workload, the causal mask is aligned to the end of the keys (chunks) and
honours a sliding window, and models it does not serve are refused with one clear line."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.engines.conformance import Runner, alone, transformers_oracle
from text_generation_common.messages import (
    CachedBatchRef,
    GenerationRequest,
    RequestedDetails,
    SamplingParams,
)
from text_generation_server.attention.layout import Piece, StepLayout, chunk_mask, piece_slots
from text_generation_server.attention.sdpa import GatherPlan, SdpaBackend, decode_mask
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.tgis_native import TgisNativeEngine, sliding_window
from text_generation_server.kv.paged_kv import (
    BlockPool,
    KVAllocations,
    PagedKVCache,
    SequenceKV,
    prefix_keys,
)


def config_for(model_dir, **overrides) -> ServerConfig:
    values = {"max_batch_size": 8, "max_sequence_length": 128, "max_new_tokens": 32, "dtype": "float32"}
    # speculation's mechanics at every batch size up to SPECULATOR_MAX_BATCH_SIZE, not timed ones
    values["speculator_batch_gate"] = "fixed"
    values = {**values, **overrides}
    # the CPU's default cache size (MAX_BATCH_SIZE sequences + 1 block), also on a GPU
    values.setdefault(
        "kv_cache_blocks", values["max_batch_size"] * -(-values["max_sequence_length"] // 4) + 1
    )
    return ServerConfig(model_name=str(model_dir), kv_block_size=4, **values)


@pytest.fixture(scope="module")
def engine(tiny_model) -> TgisNativeEngine:
    return TgisNativeEngine(config_for(tiny_model("llama")))


def free_blocks(engine: TgisNativeEngine) -> int:
    return engine.kv.pool.free  # no garbage collection: the engine frees what the manager releases


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
    sequence.free()
    assert pool.free == 3 and sequence.blocks == []


def test_allocations_own_the_blocks_by_request_id() -> None:
    pool = BlockPool(6, 4)
    owners = KVAllocations(pool)
    first = owners.open(1, [], max_tokens=12)  # at most 3 blocks
    first.reserve(5)
    second = owners.open(2, [], max_tokens=4)
    second.reserve(4)
    assert pool.free == 3 and owners.reserved_blocks == 1 + 0 and len(owners) == 2
    with pytest.raises(ValueError, match="request 1 already holds KV blocks"):
        owners.open(1, [], 4)
    owners.release([1, 99])  # an id that holds nothing is ignored
    assert pool.free == 5 and len(owners) == 1
    owners.release([2])
    assert pool.free == 6 and owners.reserved_blocks == 0


def test_masks_align_to_the_end_of_the_keys_and_honour_the_window() -> None:
    cpu = torch.device("cpu")
    # a 3-token chunk after 2 cached tokens, and a single decode token of a 6-token sequence
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )  # lower-right: query i sees keys up to 2 + i
    assert torch.equal(chunk_mask(3, 5, None, cpu), expected)
    assert chunk_mask(1, 6, None, cpu) is None
    windowed = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(chunk_mask(3, 5, 2, cpu), windowed)
    assert torch.equal(chunk_mask(1, 6, 2, cpu), torch.tensor([[0, 0, 0, 0, 1, 1]], dtype=torch.bool))


def slow_decode_mask(lengths: list[int], window: int | None) -> torch.Tensor:
    mask = torch.full((len(lengths), 1, 1, max(lengths)), float("-inf"))
    for row, length in enumerate(lengths):
        for col in range(length):
            if window is None or col >= length - window:
                mask[row, 0, 0, col] = 0.0
    return mask


@pytest.mark.parametrize("window", [None, 3, 100])
def test_the_decode_mask_pads_each_row_and_cuts_the_window(window: int | None) -> None:
    for lengths in ([5], [5, 5, 5], [1, 7, 3, 7], [9, 2]):
        got = decode_mask(torch.tensor(lengths), max(lengths), window, torch.float32)
        assert torch.equal(got, slow_decode_mask(lengths, window))


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_piece_slots_follow_the_block_table(block_size: int) -> None:
    blocks = [7, 2, 9, 0, 5, 11, 3]
    for start, end in ((0, 0), (0, 1), (2, 9), (3, 4), (0, 7 * block_size), (block_size, 2 * block_size + 1)):
        end = min(end, len(blocks) * block_size)
        slow = [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert piece_slots(blocks, start, end, block_size) == slow


def test_the_step_layout_groups_single_tokens_and_pads_their_block_tables() -> None:
    cache = PagedKVCache(BlockPool(16, 4), torch.device("cpu"))
    pieces = [
        Piece([3, 1], 5, 1),  # decode: 6 tokens, blocks 3, 1
        Piece([2], 1, 1),  # decode: 2 tokens
        Piece([4, 5, 6], 0, 9),  # a whole prompt
        Piece([7, 8], 4, 3),  # a chunk after 4 cached tokens
        Piece([9], 0, 1),  # a one-token prompt: single, but not next to the other single tokens
    ]
    layout = StepLayout.build(cache, SdpaBackend(), pieces, None, torch.float32, torch.device("cpu"))
    assert layout.slots.tolist() == [1 * 4 + 1, 2 * 4 + 1, *range(16, 25), 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 36]
    rows = layout.decode
    assert rows is not None and rows.rows == 3 and (rows.max_length, rows.min_length) == (6, 1)
    assert rows.tokens.tolist() == [0, 1, 14]  # type: ignore[union-attr]
    assert rows.tables.tolist() == [[3, 1], [2, 0], [9, 0]] and rows.lengths.tolist() == [6, 2, 1]
    plan = layout.plan
    assert isinstance(plan, GatherPlan) and plan.blocks.tolist() == [3, 1, 2, 0, 9, 0] and plan.keys == 6
    assert torch.equal(plan.mask, slow_decode_mask([6, 2, 1], None))  # type: ignore[arg-type]
    whole, chunk = layout.others
    assert (whole.start, whole.end, whole.blocks, whole.keys, whole.mask) == (2, 11, None, 9, None)
    assert (chunk.start, chunk.end, chunk.keys) == (11, 14, 7) and chunk.blocks.tolist() == [7, 8]
    assert torch.equal(chunk.mask, chunk_mask(3, 7, None, torch.device("cpu")))
    decode_only = StepLayout.build(cache, SdpaBackend(), pieces[:2], None, torch.float32, torch.device("cpu"))
    assert (
        decode_only.decode is not None and decode_only.decode.tokens == slice(0, 2) and not decode_only.others
    )
    assert decode_only.plan.mask is not None  # lengths 6 and 2
    same = StepLayout.build(
        cache,
        SdpaBackend(),
        [Piece([3, 1], 5, 1), Piece([2, 4], 5, 1)],
        None,
        torch.float32,
        torch.device("cpu"),
    )
    assert same.plan.mask is None  # every row has all its keys


@pytest.mark.parametrize("arch", ["t5", "bloom"])
def test_models_it_does_not_serve_are_refused_with_one_line(tiny_model, arch: str) -> None:
    with pytest.raises(ValueError, match=r"the tgis_native engine serves .* models run on hf_transformers"):
        TgisNativeEngine(config_for(tiny_model(arch)))


def test_one_window_for_every_layer_or_a_clear_refusal() -> None:
    import transformers

    def qwen2(**window: Any) -> Any:
        return transformers.Qwen2Config(num_hidden_layers=2, **window)

    assert sliding_window(qwen2()) is None
    assert sliding_window(qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)) == 8
    # windowed from layer 2 on, so no layer of 2 is: the configured window must not apply
    assert sliding_window(qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=2)) is None
    assert sliding_window(transformers.MistralConfig(sliding_window=8)) == 8
    with pytest.raises(ValueError, match="full_attention, sliding_attention: run it on hf_transformers"):
        sliding_window(qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1))


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
    found = batch.prefilling[0].computed  # the prompt tokens the prefix cache already holds
    engine.release([request.id])
    return found


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


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_request_that_left_offers_its_generated_blocks_to_the_prefix_cache(
    engine, oracle, run_ahead
) -> None:
    """Where a request leaves, the full blocks of what it generated are cached too, under the
    keys of its prompt and answer: a prompt that goes on from them (a chat's next turn, a
    preempted request resumed) finds them, and gives the same tokens."""
    start = prompt(30 + run_ahead, 21)
    answer = Runner(engine, run_ahead=run_ahead).run({0: [GenerationRequest(1, start, 20)]})[1]
    # written: the prompt and the answer less its last token (40 tokens: 10 full blocks of 4);
    # a prompt of those 40 tokens and one more keys the 40 before its last
    follow = GenerationRequest(2, (*start, *answer[:19], 5), 6)
    assert hits(engine, follow) == 40
    assert alone(engine, follow) == oracle(follow.input_ids, 6)
    resumed = GenerationRequest(3, start, 20, generated_ids=tuple(answer[:12]))
    assert alone(engine, resumed) == answer[12:]  # its prompt and 12 generated ids: 8 blocks cached
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
