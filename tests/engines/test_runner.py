"""The model runner of tgis_native: persistent step buffers, token-count buckets, and steps
(decode, prompt chunks, both) replayed from closures captured once per bucket (the discipline of
CUDA graphs, checked on the CPU with a capture that keeps the closure: every per-step input must
come from the buffers)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.conformance import Runner, transformers_oracle
from tests.engines.test_tgis_native import config_for, prompt
from text_generation_common.messages import GenerationRequest, SamplingParams
from text_generation_server.attention.layout import StepLayout
from text_generation_server.engines.tgis_native import TgisNativeEngine
from text_generation_server.engines.tgis_native.graphs import Step, StepGraphs, buckets_up_to
from text_generation_server.engines.tgis_native.runner import DecodeBuffers, StepPiece
from text_generation_server.kernels import cpu_kernels
from text_generation_server.kv.paged_kv import BlockPool, SequenceKV

MAX_ROWS, MAX_TOKENS = 6, 24  # the graphs of the module's engine: 1, 2, 4, 6 and 24 tokens


def test_buckets_grow_by_powers_of_two_then_by_32_then_coarser_and_end_at_the_maximum() -> None:
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(5) == [1, 2, 4, 5]
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert buckets_up_to(200)[-4:] == [128, 160, 192, 200]
    assert buckets_up_to(MAX_ROWS, MAX_TOKENS) == [1, 2, 4, 6, 24]
    assert buckets_up_to(128, 128 + 2048)[8:] == [
        *(64, 96, 128),
        *(192, 256, 320, 384, 448, 512),  # prompt tokens: every 64,
        *(640, 768, 896, 1024),  # every 128,
        *(1280, 1536, 1792, 2048, 2176),  # every 256, to the maximum
    ]
    graphs = StepGraphs(buckets_up_to(40, 100), max_kept=40)
    assert [graphs.bucket_for(n) for n in (1, 3, 17, 32, 33, 40, 41, 100, 101)] == [
        *(1, 4, 24, 32, 40, 40, 100, 100, None)
    ]
    assert [graphs.kept(b) for b in (4, 40, 100)] == [4, 40, 40]
    assert graphs.bucket_for(90, kept=40) == 100 and graphs.bucket_for(90, kept=41) is None
    assert graphs.bucket_for(90, 1, prompt_keys=graphs.max_prompt_keys) == 100
    assert graphs.bucket_for(90, 1, prompt_keys=graphs.max_prompt_keys + 1) is None


def test_the_buffers_hold_each_row_and_pad_the_rest() -> None:
    pool = BlockPool(8, 4)
    first, second = SequenceKV(pool), SequenceKV(pool)
    first.reserve(6)
    first.length = 6  # blocks [0, 1]; its new token goes to position 6, slot 1 * 4 + 2
    second.reserve(4)
    second.length = 4  # blocks [2]; position 4 needs a new block (3)
    buffers = DecodeBuffers(max_rows=4, width=3, device=torch.device("cpu"), scratch_slot=8 * 4)
    assert buffers.fill([first, second], [11, 12], rows=3) == (7, 5)
    assert (first.length, second.length, second.blocks) == (7, 5, [2, 3])
    assert buffers.ids(3).tolist() == [11, 12, 0]
    assert buffers.positions(3).tolist() == [6, 4, 0]
    assert buffers.slots(3).tolist() == [6, 12, 32]  # the padding row writes to the scratch slot
    assert buffers.lengths(3).tolist() == [7, 5, 0]
    assert buffers.tables(2).tolist() == [[0, 1, 0], [2, 3, 0]]
    assert buffers.kept(3).tolist() == [0, 1, 0]


def test_a_prompt_chunk_fills_one_row_per_token_on_its_sequence_s_table() -> None:
    """A token at position p is a row with p + 1 keys (causal), on its sequence's block table."""
    pool = BlockPool(8, 4)
    decoding, prompt = SequenceKV(pool), SequenceKV(pool)
    decoding.reserve(6)
    decoding.length = 6  # blocks [0, 1]
    prompt.reserve(3)
    prompt.length = 3  # blocks [2]: 3 cached tokens, then a chunk of 3 (positions 3, 4, 5)
    buffers = DecodeBuffers(max_rows=8, width=3, device=torch.device("cpu"), scratch_slot=8 * 4)
    buffers.kept(8)[:] = 7  # what a larger step left there
    pieces = [StepPiece(decoding, [11]), StepPiece(prompt, [21, 22, 23])]
    buffers.fill_pieces(pieces, kept=[0, 3], rows=6)
    assert (decoding.length, prompt.length, prompt.blocks) == (7, 6, [2, 3])
    assert buffers.ids(6).tolist() == [11, 21, 22, 23, 0, 0]
    assert buffers.positions(6).tolist() == [6, 3, 4, 5, 0, 0]
    assert buffers.slots(6).tolist() == [6, 11, 12, 13, 32, 32]
    assert buffers.lengths(6).tolist() == [7, 4, 5, 6, 0, 0]
    assert buffers.tables(4).tolist() == [[0, 1, 0], [2, 3, 0], [2, 3, 0], [2, 3, 0]]
    assert buffers.kept(6).tolist() == [0, 3, 0, 0, 0, 0]  # the rest read row 0, inside the bucket


class Replays:
    """A capture stand-in: keeps each captured closure and counts its replays."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, step: Step) -> Step:
        def replay() -> torch.Tensor:
            self.count += 1
            return step()

        return replay


@pytest.fixture(scope="module")
def graphed(tiny_model) -> tuple[TgisNativeEngine, Replays]:
    try:
        cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        pytest.skip(f"the CPU kernel (a graphable backend) cannot be built here: {exc}")
    engine = TgisNativeEngine(config_for(tiny_model("llama"), cpu_attention="kernel", cuda_graphs=False))
    assert engine.runner.graphs is None
    replays = Replays()
    engine.capture_graphs(MAX_ROWS, replays, MAX_TOKENS)
    assert not engine.info.eager_joins  # steps with prompt chunks replay too: joins need not wait
    return engine, replays


@pytest.fixture
def eager_layouts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps that ran eagerly (the eager forward builds its layout from Python lists)."""
    built: list[int] = []
    build = StepLayout.build

    def counted(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(StepLayout, "build", counted)
    return built


def test_prompt_steps_replay_the_graph_of_their_token_count(graphed, tiny_model, eager_layouts) -> None:
    """A whole prompt, then prompt chunks riding with another request's decode rows: every step
    replays a graph (no eager layout) and the tokens are generate's."""
    engine, replays = graphed
    oracle = transformers_oracle(tiny_model("llama"))
    first, second = GenerationRequest(1, prompt(1, 9), 6), GenerationRequest(2, prompt(2, 11), 5)
    before = replays.count
    got = Runner(engine, token_budget=4).run({0: [first], 2: [second]})
    assert eager_layouts == []
    assert replays.count >= before + 9
    for request in (first, second):
        assert got[request.id] == oracle(request.input_ids, request.max_new_tokens), request.id


def test_prompt_rows_that_read_too_many_keys_run_eagerly(
    graphed, tiny_model, eager_layouts, monkeypatch
) -> None:
    """A prompt token's row reads its keys on its own: a chunk of n tokens after c cached ones
    reads n * c + n (n + 1) / 2; past the graphs' bound the step runs eagerly (8 tokens read 36,
    9 read 45; the bound here 40)."""
    engine, _ = graphed
    assert engine.runner.graphs is not None
    monkeypatch.setattr(engine.runner.graphs, "max_prompt_keys", 40)
    oracle = transformers_oracle(tiny_model("llama"))
    for length, eager in ((8, 0), (9, 1)):
        request = GenerationRequest(length, prompt(length, length), 2)  # no prefix shared
        eager_layouts.clear()
        got = Runner(engine).run({0: [request]})
        assert len(eager_layouts) == eager, length
        assert got[request.id] == oracle(request.input_ids, request.max_new_tokens), length


def test_steps_a_graph_cannot_take_run_eagerly(graphed, tiny_model, eager_layouts) -> None:
    """A prompt step larger than the largest graph, and one whose prompt tokens' logits are
    asked for, run eagerly; the tokens are generate's."""
    from text_generation_common.messages import RequestedDetails

    engine, _ = graphed
    oracle = transformers_oracle(tiny_model("llama"))
    long = GenerationRequest(1, prompt(3, MAX_TOKENS + 1), 2)
    detailed = GenerationRequest(2, prompt(4, 7), 2, details=RequestedDetails(input_tokens=True))
    for request in (long, detailed):
        eager_layouts.clear()
        got = Runner(engine).run({0: [request]})
        assert len(eager_layouts) == 1, request.id  # its prompt step; its decode step replayed
        assert got[request.id] == oracle(request.input_ids, request.max_new_tokens), request.id


def test_replayed_decode_steps_give_the_tokens_of_generate(graphed, tiny_model) -> None:
    """Batches of 1 to 7 rows (7: more rows than a graph returns, eager over the buffers) with
    joins, prunes, chunked prompts and seeded sampling: greedy rows equal generate alone, and
    padding rows (3 rows replay the graph of 4) change nothing."""
    engine, replays = graphed
    oracle = transformers_oracle(tiny_model("llama"))
    greedy = [GenerationRequest(i, prompt(i, 5 + 3 * i), 4 + i % 5) for i in range(1, 8)]
    sampled = GenerationRequest(50, prompt(50, 9), 8, params=SamplingParams(temperature=0.8, seed=5))
    schedule = {0: greedy[:1], 2: greedy[1:3], 3: [sampled], 4: greedy[3:7]}
    before = replays.count
    got = Runner(engine, token_budget=16).run(schedule)
    assert replays.count > before + 5  # most decode steps replayed a captured closure
    for request in greedy:
        assert got[request.id] == oracle(request.input_ids, request.max_new_tokens), request.id
    alone = Runner(engine).run({0: [sampled]})
    assert got[sampled.id] == alone[sampled.id]  # batch invariant, padding rows or not


def test_steps_beyond_the_largest_bucket_run_eagerly(graphed) -> None:
    """7 prompts of 6 tokens (42 > 24 tokens), then 7 decode rows (more than a graph returns)."""
    engine, replays = graphed
    assert engine.runner.graphs is not None and engine.runner.graphs.bucket_for(7, 7) is None
    before = replays.count
    requests = [GenerationRequest(i, prompt(100 + i, 6), 3) for i in range(7)]
    Runner(engine).run({0: requests})
    assert replays.count == before


@pytest.mark.gpu
def test_a_cuda_decode_step_never_waits_for_the_device(tiny_model) -> None:
    """The forward (a replayed graph or eager over the buffers; a prompt step's graph) and the
    choice of the next ids (greedy, seeded sampling, penalties) run with torch's sync debug mode
    set to raise: the only wait of a step is the copy of the chosen ids that follows."""
    from text_generation_common.messages import CachedBatchRef
    from text_generation_server.batch_manager import BatchManager

    engine = TgisNativeEngine(config_for(tiny_model("llama")))
    manager = BatchManager(engine, 8)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
        SamplingParams(repetition_penalty=1.2, min_new_tokens=4),
    ]
    requests = [GenerationRequest(i, prompt(i, 6 + i), 8, params=p) for i, p in enumerate(params)]
    manager.prefill(1, requests, [])
    manager.next_token([CachedBatchRef(1)])
    (batch,) = manager._cache.values()
    states = [batch.states[r.id] for r in batch.requests]
    ids = [h[-1] for h in batch.histories]
    joining = engine.allocations.open(99, [], 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            for loras in ([None] * 3, [None] * 3):  # replayed, then again with the buffers refilled
                logits = engine.runner.decode([s.kv for s in states], ids, loras)
                next_ids, _ = batch.chooser.choose(logits.float())
                batch.chooser.advance(ids, next_ids)
            prompt_logits = engine.runner.forward([StepPiece(joining, list(prompt(9, 7)))], [6])
    finally:
        torch.cuda.set_sync_debug_mode("default")
        engine.allocations.release([99])
    assert engine.runner.graphs is not None and next_ids.device.type == "cuda"
    assert prompt_logits.shape[0] == 1


def test_a_capture_that_fails_stops_the_engine_with_the_way_out(graphed) -> None:
    engine, _ = graphed

    def broken(step: Step) -> Step:
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")

    with pytest.raises(
        RuntimeError, match=r"^capturing the decode steps as CUDA graphs failed \(operation not "
    ):
        engine.capture_graphs(2, broken)
    with pytest.raises(RuntimeError, match=r"; CUDA_GRAPHS=false runs them eagerly$"):
        engine.capture_graphs(2, broken)
    engine.capture_graphs(MAX_ROWS, Replays(), MAX_TOKENS)  # as the module's other tests expect
