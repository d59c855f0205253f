"""Speculative decoding: the n-gram proposer, the per-request lookahead, cutting a block table
back, the chooser's verification of candidates against a step-by-step reference (every logits
processor, seeded sampling, token details), the distribution it samples from (chi-square), and
the tgis_native engine with speculation against the same engine without it: the same tokens,
greedy and seeded, alone and in batches with joins and chunked prefill, on two model families
and both dtypes, with every KV block back in the pool at the end."""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from router.core.capacity import capacity_for
from router.core.metrics import Metrics
from router.core.stopping import StopReason
from router.core.tokenizer import load_tokenizer
from tests.engines.conformance import LocalShard, Runner, through_batcher, validated_request
from tests.engines.test_tgis_native import config_for
from text_generation_common.messages import (
    GenerationRequest,
    Guided,
    GuidedKind,
    LengthPenalty,
    RequestedDetails,
    SamplingParams,
    Speculation,
    StepOutput,
    TokenInfo,
)
from text_generation_common.speculate import refusal
from text_generation_server.config import ServerConfig
from text_generation_server.engines.step import choose_speculated, choose_tokens
from text_generation_server.engines.tgis_native import TgisNativeEngine
from text_generation_server.kernels.weight_layout import PanelLinear, panels_offered
from text_generation_server.kv.paged_kv import BlockPool, PagedKVCache, SequenceKV, prefix_keys
from text_generation_server.sampling.chooser import TokenChooser
from text_generation_server.speculation import Lookahead, Speculator, Target, best_lookahead, mlp
from text_generation_server.speculation.draft import DraftSpeculator
from text_generation_server.speculation.mlp import (
    MlpSpeculatorConfig,
    MlpSpeculatorModel,
    load_speculator,
    save_speculator,
    tree_shape,
)
from text_generation_server.speculation.ngram import NgramSpeculator
from text_generation_server.speculation.train import main as train_main
from text_generation_server.speculation.train import prompt_lengths
from text_generation_server.testing.tiny_models import build_tiny_model

CPU = torch.device("cpu")
VOCAB = 40
EOS = 2


def skip_bf16_on_cuda(dtype: str) -> None:
    """Greedy equality with and without speculation needs the product over k + 1 rows of a
    sequence to round as k + 1 one-row products do: it does on the CPU; on CUDA cuBLAS picks its
    kernels by shape, so bf16 near-ties can flip there (float32 checks equality on CUDA)."""
    if dtype == "bfloat16" and torch.cuda.is_available():
        pytest.skip("on CUDA bf16 products round by shape, so near-ties can flip; float32 checks equality")


# ---- the n-gram proposer and the lookahead ------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    ngram = NgramSpeculator(max_match=3, min_match=2)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    history = [5, 6, 7, 8, 9, 6, 7, 1, 2, 3, 6, 7]
    # suffix (6, 7) occurs at 1 and 5; (x, 6, 7) never: the latest 2-gram wins -> 1, 2, 3
    assert ngram.lookup(history, 3) == [1, 2, 3]
    # past the end of the history the copy goes on from itself: the loop it is in
    assert ngram.lookup(history, 8) == [1, 2, 3, 6, 7, 1, 2, 3]
    assert ngram.lookup([5, 6, 7, 8, 9, 5, 6, 7], 2) == [8, 9]  # the 3-gram (5, 6, 7)
    assert ngram.lookup([1, 2, 3, 4], 4) == []  # no earlier occurrence
    assert ngram.lookup([3, 3], 4) == []  # shorter than the shortest match after the last token
    assert ngram.lookup([3, 3, 3], 4) == [3, 3, 3, 3]  # (3, 3) at 0, followed by 3 and so on
    assert ngram.propose([1, 2], [history, history], [0, 1]) == [[], [1]]


def test_the_lookahead_follows_what_was_taken() -> None:
    look = Lookahead(4)
    assert look.limit == 4
    look.taken(4, 1)
    assert look.limit == 2  # one more than taken
    look.taken(2, 2)
    assert look.limit == 3  # all taken: one more than offered
    look.taken(3, 0)
    assert look.limit == 1  # never below one
    look.taken(1, 1)
    look.taken(2, 2)
    look.taken(3, 3)
    look.taken(4, 4)
    assert look.limit == 4  # never above the most
    assert look.ask() == 4


def test_a_request_whose_candidates_keep_missing_pauses_longer_each_time() -> None:
    look = Lookahead(3)
    pauses = []
    for _ in range(8):
        look.taken(look.limit, 0)
        pauses.append(look.pause)
        asked = [look.ask() for _ in range(look.pause + 1)]
        assert asked == [0] * pauses[-1] + [1]  # paused, then one candidate again
    assert pauses == [0, 2, 4, 8, 8, 8, 8, 8]
    look.taken(1, 1)  # a hit ends the misses
    assert (look.misses, look.pause, look.limit) == (0, 0, 2)


def test_the_best_lookahead_pays_most_tokens_per_step_time() -> None:
    flat = (1.3, 1.3, 1.3)  # verifying more rows is free: every candidate that may be taken pays
    assert [best_lookahead(p, flat) for p in (0.2, 0.5, 0.9)] == [0, 3, 3]
    steep = (1.2, 1.5, 1.8)  # each verified row costs 0.3 of a plain step
    # slow reference: tokens 1 + p + ... + p^k per cost, the first of the best
    for p in [i / 20 for i in range(21)]:
        rates = [1.0] + [sum(p**j for j in range(k + 1)) / c for k, c in enumerate(steep, start=1)]
        assert best_lookahead(p, steep) == rates.index(max(rates)), p
    assert [best_lookahead(p, steep) for p in (0.1, 0.5, 0.7, 1.0)] == [0, 1, 2, 3]
    assert best_lookahead(1.0, (2.0, 3.0)) == 0  # ties go to fewer candidates: 2 tokens for 2.0


def test_with_measured_costs_a_request_asks_what_its_acceptance_pays_for() -> None:
    steep = (1.2, 1.5, 1.8)
    look = Lookahead(3, steep)
    assert look.acceptance == 0.75 and look.limit == 2  # the prior
    for _ in range(4):
        look.taken(look.ask(), look.limit)  # all taken
    assert look.acceptance > 0.9 and look.limit == 3
    limits, pauses = [], []
    for _ in range(10):  # misses: the estimate falls, fewer are asked, then none pays
        look.taken(look.limit, 0)
        limits.append(look.limit)
        pauses.append(look.pause)
        asked = [look.ask() for _ in range(look.pause + 1)]
        assert asked == [0] * pauses[-1] + [look.limit]  # paused, then one candidate again
    assert limits == sorted(limits, reverse=True) and limits[0] == 3 and limits[-1] == 1, limits
    first = pauses.index(2)  # where 1 + p no longer pays for 1.2: then 2, 4, 8, 8 ... steps
    assert look.acceptance < 0.2 and pauses[first:] == [min(2 ** (i + 1), 8) for i in range(10 - first)]
    assert not any(pauses[:first])
    for _ in range(3):
        look.taken(look.limit, look.limit)  # taken again: the pause ends, the lookahead grows
    assert (look.misses, look.pause) == (0, 0) and look.limit >= 2
    # where every verified row is free, a request keeps asking its most while it takes some
    flat = Lookahead(3, (1.1, 1.1, 1.1))
    for accepted in (0, 1, 0, 2, 0, 1):
        flat.taken(3, accepted)
        assert flat.limit == 3 and flat.pause == 0
    with pytest.raises(ValueError, match="a lookahead of 3 needs 3 costs"):
        Lookahead(3, (1.0, 1.0))


def test_speculation_is_refused_with_one_line_where_it_cannot_run() -> None:
    assert refusal(0, 16, "hf_transformers") is None
    assert refusal(3, 16, "tgis_native") is None
    assert refusal(3, 16, "hf_transformers") == (
        "SPECULATE=3: speculative decoding is served by tgis_native, not hf_transformers"
    )
    assert refusal(-1, 16, "tgis_native") == "SPECULATE must be >= 0, got -1"
    assert refusal(2, 0, "tgis_native") == "SPECULATOR_MAX_BATCH_SIZE must be >= 1, got 0"
    assert refusal(2, 16, "tgis_native", world_size=2) is None  # n-gram: every rank proposes the same
    assert refusal(0, 16, "tgis_native", "ibm/accelerator", 2) == (
        "SPECULATOR_NAME=ibm/accelerator: a speculator model is not served on 2 shards yet (NUM_SHARD=1; "
        "SPECULATE alone is)"
    )
    with pytest.raises(ValueError, match="served by tgis_native, not hf_optimum_ort"):
        ServerConfig(model_name="m", deployment_framework="hf_optimum_ort", speculate=2)


def test_a_sequence_cut_back_gives_its_later_blocks_to_the_pool() -> None:
    pool = BlockPool(8, 4)
    prompt = list(range(10, 19))  # 9 tokens: two full blocks registered
    sequence = SequenceKV(pool, prefix_keys(prompt, 4), max_tokens=30)
    sequence.append(len(prompt))
    sequence.register_written()
    sequence.append(6)  # 15 tokens: 4 blocks
    assert len(sequence.blocks) == 4 and pool.free == 4
    sequence.truncate(11)
    assert sequence.length == 11 and len(sequence.blocks) == 3 and pool.free == 5
    sequence.truncate(2)  # never below the registered prompt blocks
    assert len(sequence.blocks) == 2
    with pytest.raises(ValueError, match="cannot truncate"):
        sequence.truncate(3)


def test_a_fork_shares_the_full_blocks_copies_the_partial_one_and_gives_everything_back() -> None:
    pool = BlockPool(8, 4)
    sequence = SequenceKV(pool, max_tokens=40)
    sequence.append(6)  # blocks: one full, one partial
    fork, copy = sequence.fork()
    assert copy == (sequence.blocks[1], fork.blocks[1]) and fork.blocks[0] == sequence.blocks[0]
    assert fork.length == 6 and pool.free == 5 and sequence.fork_blocks(3) == 2
    fork.append(3)  # 9 tokens: a block more
    sequence.append(3)
    assert pool.free == 3 and fork.slot(5) != sequence.slot(5) and fork.slot(1) == sequence.slot(1)
    sequence.adopt(fork)  # the fork's chain won: its blocks become the sequence's
    assert sequence.length == 9 and fork.blocks == [] and pool.free == 5
    sequence.truncate(8)
    aligned, copy = sequence.fork()
    assert copy is None and pool.free == 6 and aligned.blocks == sequence.blocks  # 2 full blocks, shared
    aligned.free()
    sequence.free()
    assert pool.free == pool.num_blocks


def test_copied_blocks_carry_every_layer_head_key_and_value() -> None:
    pool = BlockPool(4, 2)
    cache = PagedKVCache(pool, CPU)
    cache.layers = {layer: torch.randn(2, 3, pool.num_blocks + 1, 2 * 5) for layer in range(2)}
    before = {layer: kv.clone() for layer, kv in cache.layers.items()}
    cache.copy_blocks([(1, 3), (0, 2)])
    for layer, kv in cache.layers.items():
        assert torch.equal(kv[:, :, 3], before[layer][:, :, 1]) and torch.equal(
            kv[:, :, 2], before[layer][:, :, 0]
        )
        assert torch.equal(kv[:, :, :2], before[layer][:, :, :2])


# ---- the chooser's verification against stepping one token at a time --------------------------

PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(min_new_tokens=3),
    SamplingParams(length_penalty=LengthPenalty(1, 1.5)),
    SamplingParams(temperature=0.9, top_k=8, seed=11),
    SamplingParams(temperature=1.3, top_p=0.8, seed=12, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, typical_p=0.9, seed=13, min_new_tokens=2),
    SamplingParams(presence_penalty=0.6, frequency_penalty=0.9),
    SamplingParams(temperature=0.8, seed=14, frequency_penalty=-0.5),
    SamplingParams(frequency_penalty=-30.0, frequency_by_length=True),
    SamplingParams(temperature=0.9, seed=15, frequency_penalty=1.2, frequency_by_length=True),
    SamplingParams(logit_bias=((EOS, -100.0), (7, 2.0)), repetition_penalty=1.3),
    SamplingParams(temperature=1.1, min_p=0.2, seed=16),
]
DETAILS = RequestedDetails(logprobs=True, ranks=True, top_n_tokens=3)


def fresh_chooser() -> TokenChooser:
    prompts = [[EOS + 3 + i, 7, 8, 9][: 2 + i % 3] for i in range(len(PARAMS))]
    return TokenChooser.create(PARAMS, prompts, EOS, VOCAB, CPU)


def position_logits(rows: int, positions: int, seed: int) -> torch.Tensor:
    """[rows, positions, vocab]: few large logits, so that candidates are often right."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((rows, positions, VOCAB), generator=gen)
    logits[..., EOS] += 2.0
    return logits * 2.5


def stepwise(chooser: TokenChooser, logits: torch.Tensor, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The reference: one choose per position, every row at its own pace (rows stop at their
    first disagreement with their candidates), as steps without speculation would."""
    requests = [GenerationRequest(i, (1,), 64, details=DETAILS) for i in range(len(drafts))]
    taken: list[list[int]] = [[] for _ in drafts]
    live = list(range(len(drafts)))
    position = 0
    while live:
        sub = chooser.select(live)
        rows = torch.stack([logits[row, position] for row in live])
        _, output = choose_tokens(rows.clone(), [requests[row] for row in live], sub)
        # put the rows' state back into the full chooser, the way the engine keeps one chooser
        for k, row in enumerate(live):
            chooser.histories[row] = sub.histories[k]
            chooser.generated[row] = sub.generated[k]
        if sub.seen is not None:
            chooser.seen[torch.tensor(live)] = sub.seen
        if sub.counts is not None:
            chooser.counts[torch.tensor(live)] = sub.counts
        if chooser.generated_t is not None:
            chooser.generated_t = torch.tensor(chooser.generated)
        still = []
        for row, generation in zip(live, output.generations, strict=True):
            taken[row].append(generation.token)
            draft = drafts[row]
            if position < len(draft) and generation.token.token_id == draft[position]:
                still.append(row)
        live = still
        position += 1
    return taken


@pytest.mark.parametrize("seed", range(6))
def test_verified_tokens_are_those_steps_one_at_a_time_would_choose(seed: int) -> None:
    rng = random.Random(seed)
    rows, positions = len(PARAMS), 5
    logits = position_logits(rows, positions, seed)
    expected_chooser, chooser = fresh_chooser(), fresh_chooser()
    for _ in range(3):  # the state carried from one step to the next stays the same too
        # candidates: the raw logits' argmax (often right), half of them spoilt at one position
        drafts = []
        for row in range(rows):
            k = rng.randint(0, positions - 1)
            guess = [int(logits[row, j].argmax()) for j in range(k)]
            if guess and rng.random() < 0.5:
                guess[rng.randrange(len(guess))] = rng.randrange(VOCAB)
            drafts.append(guess)
        drafts = chooser.trim_drafts(drafts)
        expected = stepwise(expected_chooser, logits, drafts)
        flat = torch.cat([logits[row, : len(d) + 1] for row, d in enumerate(drafts)])
        requests = [GenerationRequest(i, (1,), 64, details=DETAILS) for i in range(rows)]
        verified = choose_speculated(flat.clone(), requests, chooser, [[d] for d in drafts])
        taken, accepted, output = verified.taken, verified.accepted, verified.output
        got = {i: [g.token for g in output.generations if g.request_id == i] for i in range(rows)}
        for row in range(rows):
            assert [t.token_id for t in got[row]] == taken[row] == [t.token_id for t in expected[row]]
            for mine, theirs in zip(got[row], expected[row], strict=True):
                assert mine.rank == theirs.rank and mine.top_tokens == theirs.top_tokens
                assert math.isclose(mine.logprob, theirs.logprob, rel_tol=1e-6)
            assert accepted[row] == len(taken[row]) - 1
        assert output.speculation == [Speculation(len(d), accepted[row]) for row, d in enumerate(drafts) if d]
        assert chooser.histories == expected_chooser.histories
        assert chooser.generated == expected_chooser.generated
        for mine, theirs in zip(chooser.generators, expected_chooser.generators, strict=True):
            assert (mine is None) == (theirs is None)
            if mine is not None:  # one draw per token taken: the same stream as without speculation
                assert torch.equal(mine.get_state(), theirs.get_state())


def context_logits(row: int, prefix: Sequence[int]) -> torch.Tensor:
    """Logits that depend on the row and the tokens it took in the step only, as a model's do:
    chains that share a prefix see the same logits there."""
    gen = torch.Generator().manual_seed(hash((row, *prefix)) % 2**31)
    logits = torch.randn(VOCAB, generator=gen) * 2.5
    logits[EOS] -= 3.0
    return logits


def greedy_walk(chooser: TokenChooser, row: int, chains: Sequence[Sequence[int]]) -> list[TokenInfo]:
    """The reference for a greedy row with several chains: one token at a time (the row's own
    state, every processor), going on while some chain continues with the token chosen."""
    request = GenerationRequest(row, (1,), 64, details=DETAILS)
    sub = chooser.select([row])
    taken: list[TokenInfo] = []
    while True:
        ids = [t.token_id for t in taken]
        _, output = choose_tokens(context_logits(row, ids)[None].clone(), [request], sub)
        taken.append(output.generations[0].token)
        ids.append(taken[-1].token_id)
        if not any(len(c) >= len(ids) and list(c[: len(ids)]) == ids for c in chains):
            return taken


@pytest.mark.parametrize("seed", range(4))
def test_a_greedy_row_follows_the_chain_that_takes_the_most(seed: int) -> None:
    """Several candidate chains per greedy row (shared prefixes, the right one anywhere or
    missing): the tokens and details are those steps one at a time would choose, the chain
    named is one they follow, and the row's state carries on as after those steps."""
    rng = random.Random(seed)
    params = PARAMS[:4]  # the greedy ones: every processor that is not a warper
    prompts = [[EOS + 3 + i, 7, 8, 9][: 2 + i % 3] for i in range(len(params))]
    chooser = TokenChooser.create(params, prompts, EOS, VOCAB, CPU)
    reference = TokenChooser.create(params, prompts, EOS, VOCAB, CPU)
    chains: list[list[list[int]]] = []
    for row in range(len(params)):
        right: list[int] = []  # what the row would take, from its own reference walk
        for _ in range(4):
            right.append(int(context_logits(row, right).argmax()))
        row_chains = []
        for _ in range(rng.randint(1, 4)):
            chain = list(right[: rng.randint(1, 4)])
            if rng.random() < 0.6:
                chain[rng.randrange(len(chain))] = rng.randrange(3, VOCAB)
            if chain not in row_chains:
                row_chains.append(chain)
        chains.append(chooser.trim_drafts(row_chains, [row] * len(row_chains)))
    expected = [greedy_walk(reference, row, c) for row, c in enumerate(chains)]
    logits = torch.stack(
        [context_logits(row, c[:j]) for row, cs in enumerate(chains) for c in cs for j in range(len(c) + 1)]
    )
    requests = [GenerationRequest(i, (1,), 64, details=DETAILS) for i in range(len(params))]
    verified = choose_speculated(logits, requests, chooser, chains)
    for row, infos in enumerate(expected):
        mine = [g.token for g in verified.output.generations if g.request_id == row]
        assert [t.token_id for t in mine] == verified.taken[row] == [t.token_id for t in infos]
        for a, b in zip(mine, infos, strict=True):
            assert a.rank == b.rank and a.top_tokens == b.top_tokens and math.isclose(a.logprob, b.logprob)
        followed = chains[row][verified.chain[row]]
        assert verified.taken[row][:-1] == followed[: len(verified.taken[row]) - 1]
        assert verified.accepted[row] == len(verified.taken[row]) - 1
    for row, tokens in enumerate(verified.taken):
        assert chooser.histories[row] == prompts[row] + tokens and chooser.generated[row] == len(tokens)
    if chooser.seen is not None:
        for row, tokens in enumerate(verified.taken):
            assert all(bool(chooser.seen[row, t]) for t in tokens)


def test_candidates_past_eos_are_cut() -> None:
    chooser = TokenChooser.create([SamplingParams()] * 2, [[5], [6]], EOS, VOCAB, CPU)
    assert chooser.trim_drafts([[4, EOS, 9, 9], [7, 8]]) == [[4, EOS], [7, 8]]


def test_speculative_sampling_keeps_the_models_distribution() -> None:
    """Two positions of a small vocabulary; the candidate for the first is the likeliest token.
    Over 20,000 seeded rows the first token follows softmax(first logits), and the second,
    where the first was the candidate, softmax(second logits): chi-square, p > 0.01."""
    vocab, rows = 6, 20_000
    first = torch.tensor([1.0, 0.2, -0.5, 1.5, 0.0, -1.0])
    second = torch.tensor([-0.3, 0.8, 0.1, -1.2, 0.5, 0.0])
    candidate = int(first.argmax())
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(rows)]
    chooser = TokenChooser.create(params, [[1]] * rows, 5, vocab, CPU)
    logits = torch.stack([first, second]).repeat(rows, 1)
    requests = [GenerationRequest(i, (1,), 4) for i in range(rows)]
    taken = choose_speculated(logits, requests, chooser, [[[candidate]]] * rows).taken
    counts = torch.bincount(torch.tensor([t[0] for t in taken]), minlength=vocab)
    assert p_value(counts, first.softmax(-1)) > 0.01
    seconds = [t[1] for t in taken if t[0] == candidate]
    counts = torch.bincount(torch.tensor(seconds), minlength=vocab)
    assert len(seconds) > 5_000 and p_value(counts, second.softmax(-1)) > 0.01


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    statistic = float(((counts.double() - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


# ---- the engine: with and without speculation -----------------------------------------------------


class Replay(Speculator):
    """Proposes each request's known continuation (from a run without speculation), wrong at
    every `wrong_every`-th position of the sequence: acceptance of every length happens."""

    name = "replay"

    def __init__(self, sequences: Sequence[Sequence[int]], wrong_every: int) -> None:
        self.sequences = [list(s) for s in sequences]
        self.wrong_every = wrong_every
        self.asked = 0

    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        out = []
        for history, limit in zip(histories, limits, strict=True):
            self.asked += 1
            n = len(history)
            known = next((s for s in self.sequences if s[:n] == list(history) and len(s) > n), None)
            guess = list(known[n : n + limit]) if known else []
            for j in range(len(guess)):
                if (n + j) % self.wrong_every == 0:
                    guess[j] = (guess[j] + 1) % 100 + 5
            out.append(guess)
        return out


def recorded(engine: TgisNativeEngine) -> list[Speculation]:
    """What `engine`'s steps verify from now on (filled as they run)."""
    verified: list[Speculation] = []
    real_step = engine.generate_token

    def recording(batch, token_budget=0):  # type: ignore[no-untyped-def]
        output, kept = real_step(batch, token_budget)
        verified.extend(output.speculation)
        return output, kept

    engine.generate_token = recording  # type: ignore[method-assign]
    return verified


def workload(seed: int) -> dict[int, list[GenerationRequest]]:
    rng = random.Random(seed)
    kinds = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(frequency_penalty=-30.0, frequency_by_length=True),
        SamplingParams(min_new_tokens=6, length_penalty=LengthPenalty(3, 1.2)),
        SamplingParams(temperature=0.8, top_k=30, seed=5),
        SamplingParams(temperature=1.1, top_p=0.9, seed=6),
        SamplingParams(guided=Guided(GuidedKind.JSON)),
    ]
    schedule: dict[int, list[GenerationRequest]] = {}
    next_id = 1
    for step in (0, 0, 3, 7, 7, 9):
        prompt = tuple(rng.randrange(5, 300) for _ in range(rng.randint(3, 20)))
        params = kinds[next_id % len(kinds)]
        details = DETAILS if next_id % 2 else RequestedDetails()
        request = GenerationRequest(next_id, prompt, rng.randint(8, 24), params=params, details=details)
        schedule.setdefault(step, []).append(request)
        next_id += 1
    return schedule


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("gpt2", "float32"), ("llama", "bfloat16")]
)
def test_the_engine_takes_the_same_tokens_with_and_without_speculation(
    tiny_model, arch: str, dtype: str
) -> None:
    model_dir = tiny_model(arch)
    skip_bf16_on_cuda(dtype)
    base = TgisNativeEngine(config_for(model_dir, dtype=dtype))
    spec = TgisNativeEngine(
        config_for(model_dir, dtype=dtype, speculate=4, deployment_framework="tgis_native")
    )
    verified = recorded(spec)
    for seed, budget in ((0, 0), (1, 6), (2, 0)):
        schedule = workload(seed)
        requests = {r.id: r for group in schedule.values() for r in group}
        runner = Runner(base, token_budget=budget)
        expected = runner.run(schedule)
        sequences = [list(requests[i].input_ids) + ids for i, ids in expected.items()]
        spec.speculator = Replay(sequences, wrong_every=3 + seed)
        speculating = Runner(spec, token_budget=budget, run_ahead=seed == 2)
        assert speculating.run(schedule) == expected
        for rid, infos in runner.tokens.items():  # details too, to the batch's rounding
            for mine, theirs in zip(speculating.tokens[rid], infos, strict=True):
                assert mine.rank == theirs.rank and len(mine.top_tokens) == len(theirs.top_tokens)
                assert math.isclose(mine.logprob, theirs.logprob, rel_tol=1e-4, abs_tol=1e-6)
        assert spec.kv.pool.free == spec.kv.pool.num_blocks
        if dtype != "float32":  # recomputed in bf16 the KV rounds otherwise: near ties may part
            continue
        # resumed after 3 tokens (preempted), speculating: the rest of each answer, as before
        resumed = [
            replace(requests[rid], id=rid + 1000, generated_ids=tuple(ids[:3]))
            for rid, ids in expected.items()
            if len(ids) > 3
        ]
        again = Runner(spec, token_budget=budget).run({0: resumed})
        assert {r.id - 1000: again[r.id] for r in resumed} == {
            r.id - 1000: expected[r.id - 1000][3:] for r in resumed
        }
    proposed = sum(v.proposed for v in verified)
    accepted = sum(v.accepted for v in verified)
    assert 0 < accepted < proposed, (accepted, proposed)
    assert any(v.accepted == v.proposed for v in verified) and any(v.accepted == 0 for v in verified)


class ReplayTree(Replay):
    """Several chains per greedy row: wrong ones around the replayed one (itself wrong at every
    `wrong_every`-th position), which comes at a varying place, so that forks win too."""

    name = "replay tree"

    def __init__(self, sequences: Sequence[Sequence[int]], wrong_every: int) -> None:
        super().__init__(sequences, wrong_every)
        self.several_asked: list[bool] = []

    def propose_chains(self, requests, histories, limits, hidden, several):  # type: ignore[no-untyped-def]
        self.several_asked += several
        out = []
        for row, guess in enumerate(self.propose(requests, histories, limits, hidden)):
            if not guess or not several[row]:
                out.append([guess] if guess else [])
                continue
            wrong = [(t + 7) % 100 + 5 for t in guess]
            half = guess[: len(guess) // 2] + wrong[len(guess) // 2 :]
            chains = [wrong, half, guess]
            turn = len(histories[row]) % 3
            out.append([c for c in chains[turn:] + chains[:turn] if c])
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_candidate_chains_in_forks_take_the_same_tokens_and_give_their_blocks_back(
    tiny_model, dtype: str, monkeypatch
) -> None:
    """Greedy rows verify three chains (two of them in forks of their sequence, the partial
    block copied): the same tokens as without speculation, busy batches with joins, chunked
    prefill, sampling rows (one chain each) beside them, every block back in the pool."""
    skip_bf16_on_cuda(dtype)
    model_dir = tiny_model("llama")
    base = TgisNativeEngine(config_for(model_dir, dtype=dtype))
    spec = TgisNativeEngine(
        config_for(model_dir, dtype=dtype, speculate=4, deployment_framework="tgis_native")
    )
    adopted = []
    real_adopt = SequenceKV.adopt
    monkeypatch.setattr(SequenceKV, "adopt", lambda self, fork: (adopted.append(1), real_adopt(self, fork)))
    verified = recorded(spec)
    for seed, budget in ((0, 0), (1, 6)):
        schedule = workload(seed)
        requests = {r.id: r for group in schedule.values() for r in group}
        expected = Runner(base, token_budget=budget).run(schedule)
        sequences = [list(requests[i].input_ids) + ids for i, ids in expected.items()]
        tree = ReplayTree(sequences, wrong_every=4 + seed)
        spec.speculator = tree
        assert Runner(spec, token_budget=budget).run(schedule) == expected
        assert spec.kv.pool.free == spec.kv.pool.num_blocks
        assert True in tree.several_asked and False in tree.several_asked  # sampling rows: one chain
    assert adopted and sum(v.accepted for v in verified) > 0


def test_forks_that_the_free_blocks_cannot_hold_are_not_tried(tiny_model) -> None:
    """With the pool all but spent by the requests' reserves, rows verify their first chain
    only (no fork takes a reserved block), and the output is unchanged."""
    model_dir = tiny_model("llama")
    request = GenerationRequest(1, tuple(range(20, 33)), 12)
    base = TgisNativeEngine(config_for(model_dir))
    expected = Runner(base).run({0: [request]})
    sequence = [*request.input_ids, *expected[1]]
    spec = TgisNativeEngine(
        config_for(model_dir, speculate=3, deployment_framework="tgis_native", kv_cache_blocks=7)
    )
    spec.speculator = ReplayTree([sequence], wrong_every=1000)
    verified = recorded(spec)
    forked = []
    real_fork = SequenceKV.fork
    SequenceKV.fork = lambda self: (forked.append(1), real_fork(self))[1]  # type: ignore[method-assign]
    try:
        assert Runner(spec).run({0: [request]}) == expected
    finally:
        SequenceKV.fork = real_fork  # type: ignore[method-assign]
    assert not forked and spec.kv.pool.free == spec.kv.pool.num_blocks
    assert sum(v.accepted for v in verified) > 0  # the first chains were verified


def test_a_step_that_fails_with_forks_gives_their_blocks_back(tiny_model) -> None:
    model_dir = tiny_model("llama")
    requests = [GenerationRequest(i, tuple(range(20 + i, 33 + i)), 12) for i in (1, 2)]
    expected = Runner(TgisNativeEngine(config_for(model_dir))).run({0: requests})
    spec = TgisNativeEngine(config_for(model_dir, speculate=3, deployment_framework="tgis_native"))
    spec.speculator = ReplayTree([[*r.input_ids, *expected[r.id]] for r in requests], wrong_every=1000)
    batch, _ = spec.new_batch(1, requests)
    assert batch is not None
    _, batch = spec.generate_token(batch)  # the prompts: no candidates yet
    forked = spec.kv.pool.used
    real_decode = spec.runner.decode

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal forked
        forked = spec.kv.pool.used - forked  # blocks the forks took before the forward
        raise RuntimeError("the forward failed")

    spec.runner.decode = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the forward failed"):
        spec.generate_token(batch)
    spec.runner.decode = real_decode  # type: ignore[method-assign]
    assert forked > 0
    spec.release([r.id for r in requests])
    assert spec.kv.pool.free == spec.kv.pool.num_blocks


def test_no_speculation_above_the_batch_limit(tiny_model) -> None:
    model_dir = tiny_model("llama")
    config = config_for(
        model_dir, speculate=3, speculator_max_batch_size=2, deployment_framework="tgis_native"
    )
    engine = TgisNativeEngine(config)
    replay = Replay([], wrong_every=1000)
    engine.speculator = replay
    outputs: list[StepOutput] = []
    real_step = engine.generate_token

    def recording(batch, token_budget=0):  # type: ignore[no-untyped-def]
        output, kept = real_step(batch, token_budget)
        outputs.append(output)
        return output, kept

    engine.generate_token = recording  # type: ignore[method-assign]
    requests = [GenerationRequest(i, (5 + i, 6, 7), 6) for i in range(3)]
    Runner(engine).run({0: requests[:2], 3: requests[2:]})
    # two rows decode: asked; three: not asked (the steps where all three decode)
    assert replay.asked > 0
    asked_before = replay.asked
    Runner(engine).run({0: requests})
    assert replay.asked == asked_before


# ---- through the router: several tokens per step ------------------------------------------------


async def test_the_router_hands_out_several_tokens_a_step_and_cuts_at_stop_sequences(tiny_model) -> None:
    model_dir = tiny_model("llama")
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [tuple(range(40 + i, 52 + 2 * i)) for i in range(3)]

    async def serve(engine: TgisNativeEngine, stops: Sequence[tuple[str, ...]]) -> tuple[list, Metrics]:
        shard = LocalShard(engine)
        metrics = Metrics(max_batch_size=8)
        requests = [
            (validated_request(p, 14, stop=stop), stream)
            for p, stop in zip(prompts, stops, strict=True)
            for stream in (False, True)
        ]
        capacity = capacity_for(await shard.model_info(), 1.0)
        return await through_batcher(shard, tokenizer, requests, capacity, metrics), metrics

    base = TgisNativeEngine(config_for(model_dir))
    plain, _ = await serve(base, [()] * 3)
    answers = [plain[2 * i][0] for i in range(3)]
    stops = [(), (answers[1].text[5:8],), (answers[2].text[9:11],)]
    expected, _ = await serve(base, stops)
    assert [o[-1].stop_reason for o in expected[::2]] == [
        StopReason.MAX_TOKENS,
        StopReason.STOP_SEQUENCE,
        StopReason.STOP_SEQUENCE,
    ]
    spec = TgisNativeEngine(config_for(model_dir, speculate=5, deployment_framework="tgis_native"))
    spec.speculator = Replay(
        [[*p, *(t.token_id for t in a.tokens)] for p, a in zip(prompts, answers, strict=True)], wrong_every=6
    )
    got, metrics = await serve(spec, stops)
    for mine, theirs in zip(got, expected, strict=True):
        assert [(o.text, o.stop_reason, o.generated_tokens) for o in mine] == [
            (o.text, o.stop_reason, o.generated_tokens) for o in theirs
        ]
    proposed = metrics.counters["tgi_spec_proposed_tokens"].get()
    accepted = metrics.counters["tgi_spec_accepted_tokens"].get()
    assert 0 < accepted < proposed
    assert spec.kv.pool.free == spec.kv.pool.num_blocks


# ---- IBM's MLP speculator -------------------------------------------------------------------------


def target(vocab: int, hidden: int) -> Target:
    return Target(vocab, hidden, torch.float32, "float32", CPU, 128, None)


def random_speculator(tie: bool = False, scale_input: bool = False, seed: int = 0) -> MlpSpeculatorModel:
    torch.manual_seed(seed)
    config = MlpSpeculatorConfig(
        vocab_size=50, emb_dim=24, inner_dim=16, n_predict=3, tie_weights=tie, scale_input=scale_input
    )
    model = MlpSpeculatorModel(config)
    for param in model.parameters():
        param.data.normal_(0.0, 0.5)
    return model.eval()


def reference_heads(model: MlpSpeculatorModel, state: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """fms-extras' formulas, one row and one head at a time: head i gets the state and token i."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    w_state = 0.5 ** (0.5 / config.n_predict)
    w_emb = math.sqrt(1 - w_state**2)
    if config.scale_input:
        state = state / torch.sqrt(state.pow(2).mean() + 1e-6) / math.sqrt(2)
    out = []
    for i, token in enumerate(tokens):
        z = params[f"emb.{i}.weight"][token] * w_emb * math.sqrt(config.inner / 2)
        mixed = params[f"proj.{i}.weight"] @ state * w_state + z
        normed = (
            mixed / torch.sqrt(mixed.pow(2).mean() + 1e-6) * params[f"ln.{i}.weight"] + params[f"ln.{i}.bias"]
        )
        state = torch.nn.functional.gelu(normed)
        out.append(params[f"head.{i}.weight"] @ state)
    return out


@pytest.mark.parametrize(("tie", "scale_input"), [(False, False), (True, True)])
def test_the_speculator_heads_follow_the_fms_extras_formulas(tie: bool, scale_input: bool) -> None:
    model = random_speculator(tie, scale_input)
    state = torch.randn(2, 5, 24)
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        logits = model(state, tokens)  # [heads, B, T, vocab]
    for b in range(2):
        for t in range(5):
            expected = reference_heads(model, state[b, t], [int(tokens[b, t + i]) for i in range(3)])
            for i in range(3):
                torch.testing.assert_close(logits[i, b, t], expected[i], rtol=1e-4, atol=1e-4)
    # inference: each head's top token is the next head's input
    chained = model.chain(state[:, 0], tokens[:, 0], 3)
    for b in range(2):
        guesses: list[int] = [int(tokens[b, 0])]
        for i in range(3):
            guesses.append(int(reference_heads(model, state[b, 0], guesses)[i].argmax()))
        assert chained[b].tolist() == guesses[1:]


def kernel_speculator(emb: int, inner: int, vocab: int, tie: bool, scale_input: bool) -> MlpSpeculatorModel:
    torch.manual_seed(7)
    config = MlpSpeculatorConfig(
        vocab_size=vocab, emb_dim=emb, inner_dim=inner, n_predict=4, tie_weights=tie, scale_input=scale_input
    )
    model = MlpSpeculatorModel(config)
    for param in model.parameters():
        param.data.normal_(0.0, 0.5)
    if not model.use_cpu_kernel():
        pytest.skip("the CPU kernels cannot be built here")
    return model.eval()


def assert_top_guesses(
    reference: MlpSpeculatorModel,
    state: torch.Tensor,
    last: torch.Tensor,
    chains: torch.Tensor,
    tolerance: float,
) -> None:
    """Along each row's chain, each guess is within `tolerance` of the logits' spread from the
    top of `reference`'s head (fms-extras' formulas in float64)."""
    rows, steps = chains.shape
    for r in range(rows):
        guesses = [int(last[r]), *chains[r].tolist()]
        with torch.no_grad():
            heads = reference_heads(reference, state[r].double(), guesses[:steps])
        for i, logits in enumerate(heads):
            spread = float(logits.max() - logits.min())
            assert float(logits[guesses[i + 1]]) >= float(logits.max()) - tolerance * spread, (rows, r, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("emb", "inner", "vocab", "tie", "scale_input"),
    [(64, 32, 203, False, False), (48, 48, 64, True, True), (32, 64, 130, True, False)],
)
def test_the_cpu_kernels_chains_take_each_heads_top_token(
    dtype: torch.dtype, emb: int, inner: int, vocab: int, tie: bool, scale_input: bool
) -> None:
    """The C++ chain (csrc/speculator_cpu.cpp) against the fms-extras formulas in float64, head by
    head along the kernel's own chain: each guess is the head's top token, up to the rounding of
    the state between heads (bfloat16: to bfloat16, as the tensor form rounds it). Rows 1 to 6
    (blocks of four states and the rest) and 9 / 13 (one matrix product per head on AMX CPUs),
    vocabularies that do not split into fours, bfloat16 with the 32-wide dot products (inner
    32 / 64) and the float ones (48), fewer steps than heads."""
    model = kernel_speculator(emb, inner, vocab, tie, scale_input).to(dtype)
    model.use_cpu_kernel()
    reference = copy.deepcopy(model).double()
    tolerance = 1e-4 if dtype == torch.float32 else 0.03
    for rows, steps in ((1, 4), (3, 2), (6, 4), (9, 3), (13, 4)):
        state = torch.randn(rows, emb).to(dtype)
        last = torch.randint(0, vocab, (rows,))
        chains = model.chain(state, last, steps)
        assert chains.shape == (rows, steps) and chains.dtype == torch.long
        assert_top_guesses(reference, state, last, chains, tolerance)
        if dtype == torch.float32:  # no rounding between heads: the tensor form's chain, token for token
            model.kernel = False
            assert torch.equal(model.chain(state, last, steps), chains)
            model.kernel = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [True, False])
def test_the_cpu_kernels_chains_read_heads_of_the_targets_lm_head_in_panels(
    dtype: torch.dtype, tie: bool, monkeypatch
) -> None:
    """A head whose weights are the values of the target's LM head (packed in panels) reads the
    panels instead: tied heads all of them, untied ones the head that matches; panels of other
    values or of another shape, none. Its guesses are the top tokens of the LM head's own
    product (rounded to the weights' dtype, as the target rounds its logits), token for token the
    tensor form's chain in float32."""
    model = kernel_speculator(32, 64, 160, tie, False).to(dtype)
    model.use_cpu_kernel()
    if not panels_offered(dtype, 160):
        pytest.skip("no panels layout for these weights here")
    reference = copy.deepcopy(model).double()
    pack = torch.ops.tgis_cpu.panel_pack
    monkeypatch.setattr(mlp, "PACKED_ROWS_COMPARED", 32)  # compared in 5 parts
    assert model.read_lm_head(pack(torch.randn(160, 64).to(dtype))) == 0
    assert model.read_lm_head(pack(model.head[1].weight.detach()[:128].clone())) == 0
    last_row_differs = model.head[1].weight.detach().clone()
    last_row_differs[-1, 0] += 1.0
    assert model.read_lm_head(pack(last_row_differs)) == 0
    panels = pack(model.head[1].weight.detach().clone())
    assert model.read_lm_head(panels) == (4 if tie else 1)
    assert model._weights[4][1] is panels
    tolerance = 1e-4 if dtype == torch.float32 else 0.03
    for rows, steps in ((1, 4), (3, 3)):
        state = torch.randn(rows, 32).to(dtype)
        last = torch.randint(0, 160, (rows,))
        chains = model.chain(state, last, steps)
        assert_top_guesses(reference, state, last, chains, tolerance)
        if dtype == torch.float32:
            model.kernel = False
            assert torch.equal(model.chain(state, last, steps), chains)
            model.kernel = True


def test_the_cpu_kernel_refuses_a_token_outside_the_vocabulary() -> None:
    model = kernel_speculator(32, 32, 40, False, False)
    with pytest.raises(RuntimeError, match="token 40 is not in the vocabulary"):
        model.chain(torch.randn(1, 32), torch.tensor([40]), 2)


def test_the_candidate_tree_keeps_the_chains_of_highest_summed_log_probability() -> None:
    """Every chain of the tree (top 3, 2, 2 tokens per head) scored one by one with the
    formulas' heads: the speculator's n best, in order; top-1 everywhere is the chain of each
    head's top token."""
    model = random_speculator(seed=4)
    state, last = torch.randn(3, 24), torch.randint(0, 50, (3,))
    top_k = (3, 2, 2)
    with torch.no_grad():
        found = model.candidates(state, last, top_k, 5)
    assert found.shape == (3, 5, 3)
    for r in range(3):
        frontier: list[tuple[float, list[int]]] = [(0.0, [])]
        for head, k in enumerate(top_k):  # every chain of the tree, scored head by head
            grown = []
            for score, chain in frontier:
                with torch.no_grad():
                    logits = reference_heads(model, state[r], [int(last[r]), *chain])[head]
                logprobs = logits.log_softmax(-1)
                for token in logprobs.topk(k).indices.tolist():
                    grown.append((score + float(logprobs[token]), [*chain, token]))
            frontier = grown
        scored = frontier
        assert len(scored) == 12
        best = [chain for _, chain in sorted(scored, key=lambda x: -x[0])[:5]]
        assert found[r].tolist() == best
    assert torch.equal(model.candidates(state, last, (1, 1, 1), 4)[:, 0], model.chain(state, last, 3))


def test_the_tree_settings_are_checked_against_the_speculators_heads() -> None:
    config = MlpSpeculatorConfig(
        vocab_size=50, emb_dim=24, n_predict=3, top_k_tokens_per_head=(4, 3, 2), n_candidates=5
    )
    assert tree_shape(config, None, None) == ((4, 3, 2), 5)
    assert tree_shape(config, 2, (2, 2, 1)) == ((2, 2, 1), 2)
    assert tree_shape(MlpSpeculatorConfig(vocab_size=50, emb_dim=24, n_predict=2), None, None) == ((1, 1), 1)
    with pytest.raises(
        ValueError, match=r"^SPECULATOR_TOP_K_TOKENS_PER_HEAD 3,2 names 2 heads, the speculator has 3$"
    ):
        tree_shape(config, None, (3, 2))
    message = refusal(0, 16, "tgis_native", None, tree=True)
    assert message is not None and message.endswith(
        "shape an MLP speculator's candidates: set SPECULATOR_NAME"
    )
    with pytest.raises(ValueError, match="set SPECULATOR_NAME"):
        ServerConfig(
            model_name="m", deployment_framework="tgis_native", speculate=2, speculator_n_candidates=3
        )


@pytest.mark.parametrize("tie", [False, True])
def test_a_saved_speculator_loads_back_in_ibm_layout(tmp_path, tie: bool) -> None:
    model = random_speculator(tie)
    save_speculator(model, tmp_path / "spec")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["model_type"] == "mlp_speculator" and raw["n_predict"] == 3 and raw["tie_weights"] is tie
    from safetensors import safe_open

    with safe_open(str(tmp_path / "spec" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"emb.0.weight", "proj.0.weight", "head.0.weight", "ln.0.weight", "ln.0.bias"} <= names
    assert ("emb.2.weight" in names) is not tie  # tied tensors are stored once
    loaded = load_speculator(tmp_path / "spec", target(50, 24))
    state, last = torch.randn(4, 24), torch.randint(0, 50, (4,))
    assert torch.equal(loaded.chain(state, last, 3), model.chain(state, last, 3))


def test_a_transformers_style_checkpoint_with_prefixed_names_loads(tmp_path) -> None:
    model = random_speculator()
    path = tmp_path / "spec"
    path.mkdir()
    model.config.write(path)
    tensors = {f"speculator.{k}": v for k, v in model.state_dict().items()}
    torch.save(tensors, path / "pytorch_model.bin")
    loaded = load_speculator(path, target(50, 24))
    state, last = torch.randn(3, 24), torch.randint(0, 50, (3,))
    assert torch.equal(loaded.chain(state, last, 2), model.chain(state, last, 2))


def test_a_speculator_that_does_not_fit_is_refused_with_one_line(tmp_path) -> None:
    save_speculator(random_speculator(), tmp_path / "spec")
    with pytest.raises(ValueError, match=r"predicts a vocabulary of 50, the model's has 60$"):
        load_speculator(tmp_path / "spec", target(60, 24))
    with pytest.raises(ValueError, match=r"reads hidden states of 24, the model's are 32$"):
        load_speculator(tmp_path / "spec", target(50, 32))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type 'llama' is not 'mlp_speculator'"):
        load_speculator(tmp_path / "other", target(50, 24))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "spec" / "model.safetensors"))
    del weights["head.1.weight"]
    save_file(weights, str(tmp_path / "spec" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the weights have no head\.1\.weight"):
        load_speculator(tmp_path / "spec", target(50, 24))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> Path:
    """A speculator for the tiny Llama, made by the training command (seconds)."""
    out = tmp_path_factory.mktemp("speculator") / "llama-accelerator"
    args = ["--model", str(tiny_model("llama")), "--out", str(out), "--prompts", "12", "--length", "24"]
    assert train_main([*args, "--prompt-len", "6-12", "--epochs", "1"]) == 0
    return out


def test_training_prompts_spread_over_the_asked_lengths(capsys) -> None:
    assert prompt_lengths(32, 256) == [32, 64, 96, 128, 160, 192, 224, 256]
    assert prompt_lengths(6, 12) == [6, 7, 8, 9, 10, 11, 12]  # fewer where the range holds fewer
    assert prompt_lengths(8, 8) == [8]
    for bad in ("0", "9-8", "a-b", "4-"):
        with pytest.raises(SystemExit):
            train_main(["--model", "m", "--out", "o", "--prompt-len", bad])
        assert "--prompt-len" in capsys.readouterr().err


def test_the_training_command_writes_a_speculator_and_its_report(
    trained: Path, tiny_model, tmp_path: Path
) -> None:
    report = json.loads((trained / "train.json").read_text())
    assert report["sequences"] == 12 and len(report["held_out_top1"]) == 3
    assert report["options"]["prompt_len"] == [6, 12]
    assert report["positions"] == 12 * (24 - 3)  # every sequence from its own prompt's end
    config = MlpSpeculatorConfig.read(trained)
    assert (config.emb_dim, config.n_predict, config.tie_weights) == (64, 3, True)
    wider = tmp_path / "wider"  # a speculator made for another model: refused at load, one line
    shutil.copytree(trained, wider)
    raw = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**raw, "emb_dim": 96}))
    config = config_for(tiny_model("llama"), speculator_name=str(wider), deployment_framework="tgis_native")
    with pytest.raises(ValueError, match=r"speculator .* reads hidden states of 96, the model's are 64$"):
        TgisNativeEngine(config)


@pytest.mark.parametrize(
    ("dtype", "tree"),
    [("float32", None), ("bfloat16", None), ("float32", (3, (2, 2, 2))), ("bfloat16", (4, (3, 2, 1)))],
)
def test_the_mlp_speculator_leaves_the_output_unchanged(
    tiny_model, trained: Path, dtype: str, tree: tuple[int, tuple[int, ...]] | None
) -> None:
    skip_bf16_on_cuda(dtype)
    model_dir = tiny_model("llama")
    base = TgisNativeEngine(config_for(model_dir, dtype=dtype))
    config = config_for(
        model_dir,
        dtype=dtype,
        speculator_name=str(trained),
        deployment_framework="tgis_native",
        speculator_n_candidates=tree[0] if tree else None,
        speculator_top_k_tokens_per_head=tree[1] if tree else None,
    )
    spec = TgisNativeEngine(config)
    assert spec.speculate == 3 and spec.runner.capturing
    assert spec.speculator.n_candidates == (tree[0] if tree else 1)
    # the trained heads are the LM head's frozen copy: chains on the kernel read the model's panels
    shares = not tree and isinstance(spec.model.get_output_embeddings(), PanelLinear)
    assert ("3 of its heads read the model's LM head" in spec.speculator.name) == shares
    verified = recorded(spec)
    for seed, budget in ((0, 0), (1, 6)):
        schedule = workload(seed)
        assert Runner(spec, token_budget=budget).run(schedule) == Runner(base, token_budget=budget).run(
            schedule
        )
        assert spec.kv.pool.free == spec.kv.pool.num_blocks
    assert sum(v.proposed for v in verified) > 0


# ---- a draft model -------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_arch", ["llama", "mistral"])
def test_a_draft_model_leaves_the_output_unchanged(tiny_model, draft_arch: str) -> None:
    """The model as its own draft (every candidate right) and another model of the same
    vocabulary (mostly wrong): the same tokens as without speculation, the draft's blocks back."""
    model_dir = tiny_model("llama")
    base = TgisNativeEngine(config_for(model_dir))
    config = config_for(
        model_dir,
        speculate=3,
        speculator_name=str(tiny_model(draft_arch)),
        deployment_framework="tgis_native",
    )
    spec = TgisNativeEngine(config)
    assert isinstance(spec.speculator, DraftSpeculator) and spec.speculate == 3
    verified = recorded(spec)
    for seed, budget in ((0, 0), (1, 6), (2, 0)):
        schedule = workload(seed)
        assert Runner(spec, token_budget=budget).run(schedule) == Runner(base, token_budget=budget).run(
            schedule
        )
        draft = spec.speculator.engine.kv.pool
        assert spec.kv.pool.free == spec.kv.pool.num_blocks and draft.free == draft.num_blocks
    proposed = sum(v.proposed for v in verified)
    accepted = sum(v.accepted for v in verified)
    assert 0 < accepted < proposed  # penalties, sampling and grammars make the target differ
    if draft_arch == "llama":  # plain greedy requests: what it guesses is what it then says
        verified.clear()
        greedy = [GenerationRequest(100 + i, tuple(range(10 + i, 30 + 2 * i)), 20) for i in range(3)]
        assert Runner(spec).run({0: greedy[:2], 2: greedy[2:]}) == Runner(base).run(
            {0: greedy[:2], 2: greedy[2:]}
        )
        assert sum(v.accepted for v in verified) == sum(v.proposed for v in verified) > 0


def test_a_draft_models_start_up_line_counts_its_checkpoints_parameters_in_any_layout(tiny_model) -> None:
    """The parameter count the start-up line names is the checkpoint's, whether the draft's linears
    were packed for oneDNN at load (their weights then buffers beside a shape-only `weight`) or
    not: the layout is measured at load, so the line changed with the machine's load."""
    from safetensors.torch import load_file

    model_dir = tiny_model("llama")
    total = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    names = set()
    for layout in ("plain", "onednn"):
        config = config_for(
            model_dir,
            speculator_name=str(model_dir),
            deployment_framework="tgis_native",
            linear_layout=layout,
        )
        draft = TgisNativeEngine(config).speculator
        assert isinstance(draft, DraftSpeculator)
        names.add(draft.name)
    assert names == {f"draft model {model_dir} (llama, {total / 1e6:.1f} M parameters)"}


def test_a_draft_model_that_does_not_fit_is_refused_with_one_line(tiny_model, tmp_path: Path) -> None:
    model_dir = tiny_model("llama")
    other = build_tiny_model("llama", tmp_path / "metaspace", tokenizer="metaspace")
    config = config_for(model_dir, speculator_name=str(other), deployment_framework="tgis_native")
    with pytest.raises(ValueError, match=r"draft model .* has another tokenizer than the model"):
        TgisNativeEngine(config)
    seq2seq = tmp_path / "t5"  # with the model's tokenizer: refused for what it is
    shutil.copytree(tiny_model("t5"), seq2seq)
    shutil.copy(model_dir / "tokenizer.json", seq2seq / "tokenizer.json")
    config = config_for(model_dir, speculator_name=str(seq2seq), deployment_framework="tgis_native")
    with pytest.raises(
        ValueError, match=r"draft model .*: the tgis_native engine serves .*; t5 models run on"
    ):
        TgisNativeEngine(config)


def test_a_draft_model_reserves_the_blocks_of_its_catch_up_and_candidates(tiny_model) -> None:
    model_dir = tiny_model("llama")
    config = config_for(model_dir, speculator_name=str(model_dir), deployment_framework="tgis_native")
    draft = TgisNativeEngine(config).speculator
    assert isinstance(draft, DraftSpeculator)
    history = list(range(10, 25))  # 15 tokens: the catch-up, then 5 candidates fed back
    sequence = draft._caught_up(7, history, 6)
    assert sequence.length == 0 and len(sequence.blocks) == -(-(15 + 5) // 4)  # blocks of 4 tokens
    draft.written[7] = history[:12]
    sequence.append(12)
    sequence = draft._caught_up(7, [*history[:10], 99, 98], 3)  # 10 shared, then 2 to catch up
    assert sequence.length == 10 and len(sequence.blocks) == -(-(12 + 2) // 4)
    draft.release([7])


def test_a_draft_model_without_room_proposes_nothing_and_changes_nothing(tiny_model) -> None:
    model_dir = tiny_model("llama")
    config = config_for(model_dir, speculator_name=str(model_dir), deployment_framework="tgis_native")
    spec = TgisNativeEngine(config)
    assert isinstance(spec.speculator, DraftSpeculator)
    pool = spec.speculator.engine.kv.pool
    taken = pool.allocate(pool.free)  # the draft's cache is full
    verified = recorded(spec)
    requests = [GenerationRequest(i, tuple(range(10 + i, 30)), 12) for i in range(3)]
    assert Runner(spec).run({0: requests}) == Runner(TgisNativeEngine(config_for(model_dir))).run(
        {0: requests}
    )
    assert verified == [] and len(spec.speculator.allocations) == 0
    pool.release(taken)
    assert pool.free == pool.num_blocks


@pytest.mark.parametrize("tree", [None, (3, (2, 2))])
def test_the_mlp_speculator_reads_the_hidden_states_of_replayed_decode_graphs(
    tiny_model, tmp_path: Path, tree: tuple[int, tuple[int, ...]] | None
) -> None:
    """Decode steps replayed from captured graphs (the CPU stand-in of CUDA graphs) give the MLP
    speculator the hidden states eager steps give: the same candidates, the same tokens; steps
    verifying candidate trees are replayed too (the graphs keep the logits of every chain)."""
    from tests.engines.test_runner import Replays
    from text_generation_server.kernels import cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        pytest.skip(f"the CPU kernel (a graphable backend) cannot be built here: {exc}")
    model_dir = tiny_model("llama")
    vocab = TgisNativeEngine(config_for(model_dir)).context.vocab_size
    torch.manual_seed(3)
    heads = MlpSpeculatorModel(MlpSpeculatorConfig(vocab_size=vocab, emb_dim=64, n_predict=2))
    save_speculator(heads, tmp_path / "heads")
    proposals: dict[str, list[list[list[list[int]]]]] = {}
    outputs = {}
    for mode in ("eager", "graphed"):
        config = config_for(
            model_dir,
            cpu_attention="kernel",
            speculator_name=str(tmp_path / "heads"),
            deployment_framework="tgis_native",
            speculator_n_candidates=tree[0] if tree else None,
            speculator_top_k_tokens_per_head=tree[1] if tree else None,
        )
        engine = TgisNativeEngine(config)
        replays = Replays()
        if mode == "graphed":
            engine.capture_graphs(3, replays, 64)
        real = engine.speculator.propose_chains
        seen = proposals[mode] = []

        def propose(*args, real=real, seen=seen):  # type: ignore[no-untyped-def]
            out = real(*args)
            seen.append(out)
            return out

        engine.speculator.propose_chains = propose  # type: ignore[method-assign]
        tree_steps = []  # graphed: whether each step with several chains of a row replayed
        real_step = engine._speculative_step

        def step(batch, budget, chains, real_step=real_step, tree_steps=tree_steps, replays=replays):  # type: ignore[no-untyped-def]
            before = replays.count
            several = any(len(c) > 1 for c in chains)
            out = real_step(batch, budget, chains)
            if several:
                tree_steps.append(replays.count > before)
            return out

        engine._speculative_step = step  # type: ignore[method-assign]
        requests = [GenerationRequest(i, tuple(range(20 + i, 32 + 2 * i)), 10) for i in range(3)]
        outputs[mode] = Runner(engine).run({0: requests[:2], 2: requests[2:]})
        if mode == "graphed":
            assert replays.count > 0
            assert all(tree_steps) and bool(tree_steps) == (tree is not None)
    assert outputs["graphed"] == outputs["eager"]
    assert proposals["graphed"] == proposals["eager"] and any(any(p) for p in proposals["eager"])
