"""Vectorised logits processors vs the transformers processors applied to each row alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers.generation import logits_process as hf

from tests.engines.conformance import LogitBias, OpenAIPenalties, TGIFrequencyPenalty
from text_generation_common.messages import LengthPenalty, SamplingParams
from text_generation_server.sampling import logits_process as lp
from text_generation_server.sampling.chooser import TokenChooser, inverse_transform, sample

VOCAB = 300
EOS = 2


def random_scores(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn((rows, VOCAB), generator=gen) * 3
    scores[0, 10:20] = scores[0, 10]  # ties
    return scores


def per_row(processor_for_row, scores: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Apply transformers processors row by row; processor_for_row(i) -> processor or None."""
    out = []
    for i in range(scores.shape[0]):
        row = scores[i : i + 1].clone()
        ids = input_ids[i : i + 1] if input_ids is not None else torch.zeros((1, 1), dtype=torch.long)
        proc = processor_for_row(i)
        out.append(proc(ids, row) if proc is not None else row)
    return torch.cat(out)


def test_temperature() -> None:
    temps = [1.0, 0.5, 1.7, 0.05]
    scores = random_scores(len(temps))
    got = lp.apply_temperature(scores.clone(), torch.tensor(temps))
    want = per_row(lambda i: hf.TemperatureLogitsWarper(temps[i]), scores)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("top_k", [[0, 1, 5, 50], [3, 3, 3, 3], [0, 0, 0, 0], [VOCAB + 10, 2, 0, 17]])
def test_top_k(top_k: list[int]) -> None:
    scores = random_scores(len(top_k))
    got = lp.apply_top_k(scores.clone(), top_k)
    want = per_row(lambda i: hf.TopKLogitsWarper(top_k[i]) if top_k[i] else None, scores)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("top_p", [[1.0, 0.9, 0.5, 0.01], [0.3, 0.3, 0.95, 1.0]])
def test_top_p(top_p: list[float]) -> None:
    scores = random_scores(len(top_p), seed=1)
    got = lp.apply_top_p(scores.clone(), top_p)
    want = per_row(lambda i: hf.TopPLogitsWarper(top_p[i]) if top_p[i] < 1 else None, scores)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("min_p", [[0.0, 0.05, 0.3, 1.0], [0.5, 0.5, 0.0, 0.01]])
def test_min_p(min_p: list[float]) -> None:
    scores = random_scores(len(min_p), seed=9)
    plan = lp.RowsPlan.of(min_p, scores.device, off=0.0)
    assert plan is not None and plan.rows.tolist() == [i for i, m in enumerate(min_p) if m > 0]
    got = lp.min_p_with(scores.clone(), plan)
    want = per_row(lambda i: hf.MinPLogitsWarper(min_p[i]) if min_p[i] else None, scores)
    torch.testing.assert_close(got, want)
    kept = (got > float("-inf")).sum(dim=-1).tolist()
    assert all(n >= 1 for n in kept) and kept[min_p.index(max(min_p))] < VOCAB  # the likeliest stays


@pytest.mark.parametrize("typical_p", [[1.0, 0.9, 0.5, 0.2], [0.95, 0.1, 1.0, 0.7]])
def test_typical_p(typical_p: list[float]) -> None:
    scores = random_scores(len(typical_p), seed=2)
    got = lp.apply_typical_p(scores.clone(), typical_p)
    want = per_row(lambda i: hf.TypicalLogitsWarper(typical_p[i]) if typical_p[i] < 1 else None, scores)
    torch.testing.assert_close(got, want)


def test_repetition_penalty() -> None:
    penalties = [1.0, 1.2, 0.8, 3.0]
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
    scores = random_scores(4, seed=4)
    seen = torch.zeros((4, VOCAB), dtype=torch.bool)
    seen.scatter_(1, input_ids, True)
    got = lp.apply_repetition_penalty(scores.clone(), seen, torch.tensor(penalties))
    want = per_row(lambda i: hf.RepetitionPenaltyLogitsProcessor(penalties[i]), scores, input_ids)
    torch.testing.assert_close(got, want)


def test_additive_penalties() -> None:
    """Counts of 0-3 per token, both signs, a row with neither penalty: against the slow rule."""
    penalties = [(0.0, 0.0), (0.5, 0.0), (0.0, 1.5), (-0.7, 0.3), (2.0, -2.0)]  # (presence, frequency)
    gen = torch.Generator().manual_seed(5)
    prompt = 4
    ids = torch.cat(
        [torch.zeros(len(penalties), prompt, dtype=torch.long), torch.randint(0, 9, (5, 12), generator=gen)],
        1,
    )
    counts = torch.zeros((len(penalties), VOCAB))
    counts.scatter_add_(1, ids[:, prompt:], torch.ones(len(penalties), 12))
    assert counts.max() >= 3  # repeats: presence counts once, frequency per time
    scores = random_scores(len(penalties), seed=7)
    presence, frequency = (torch.tensor(column) for column in zip(*penalties, strict=True))
    got = lp.apply_additive_penalties(scores.clone(), counts, presence, frequency)
    want = per_row(lambda i: OpenAIPenalties(prompt, *penalties[i]), scores, ids)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[0], scores[0])


def test_min_new_tokens() -> None:
    scores = random_scores(3)
    masked = torch.tensor([True, False, True])
    got = lp.apply_min_new_tokens(scores.clone(), EOS, masked)
    # transformers counts new tokens from the input length: 2 of 5 generated -> masked.
    ids = torch.zeros((1, 5), dtype=torch.long)
    want = torch.cat(
        [
            hf.MinNewTokensLengthLogitsProcessor(3, 5, EOS)(ids, scores[0:1].clone()),
            scores[1:2],
            hf.MinNewTokensLengthLogitsProcessor(3, 5, EOS)(ids, scores[2:3].clone()),
        ]
    )
    torch.testing.assert_close(got, want)


def test_length_penalty() -> None:
    """k = generated - start_index; transformers: cur_len - (start_index + input_len)."""
    cases = [(0, 1.5, 4), (3, 2.0, 10), (2, 1.01, 1), (5, 9.0, 5)]  # start, decay, generated
    scores = random_scores(len(cases), seed=5)
    scores[1, EOS] = -abs(scores[1, EOS])  # a negative EOS score is boosted too
    input_len = 7
    factors = [decay ** (g - start) if g > start else 1.0 for start, decay, g in cases]
    got = lp.apply_length_penalty(scores.clone(), EOS, torch.tensor(factors, dtype=torch.float64))
    rows = []
    for i, (start, decay, g) in enumerate(cases):
        proc = hf.ExponentialDecayLengthPenalty((start, decay), EOS, input_len)
        rows.append(proc(torch.zeros((1, input_len + g), dtype=torch.long), scores[i : i + 1].clone()))
    torch.testing.assert_close(got, torch.cat(rows))


PIPELINE_PARAMS = [
    SamplingParams(),  # greedy: untouched by warpers
    SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        typical_p=0.8,
        min_p=0.02,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        seed=1,
    ),
    SamplingParams(temperature=1.3, top_p=0.5, min_new_tokens=5, seed=2, logit_bias=((EOS, 3.0), (7, -2.5))),
    SamplingParams(
        repetition_penalty=2.0,
        length_penalty=LengthPenalty(1, 1.7),
        presence_penalty=-0.7,
        logit_bias=((13, 4.0), (31, -1.0), (299, 0.5)),
    ),
    SamplingParams(temperature=0.9, min_p=0.2, length_penalty=LengthPenalty(0, 1.2), seed=3),
    SamplingParams(
        min_new_tokens=3,
        length_penalty=LengthPenalty(1, 1.5),
        frequency_penalty=-1.5,
        frequency_by_length=True,
    ),
]
PIPELINE_PROMPTS = [[5, 6, 7], [8, 9, 9, 10], [11], [12, 13, 14, 15, 16], [EOS, 17], [18, 19]]


def transformers_process(chooser: TokenChooser, scores: torch.Tensor) -> torch.Tensor:
    """Each row of `scores` through its own transformers processor list, for the chooser's
    current histories (prompt: PIPELINE_PROMPTS)."""
    return transformers_process_for(chooser, scores, PIPELINE_PROMPTS)


def transformers_process_for(
    chooser: TokenChooser, scores: torch.Tensor, prompts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """transformers_process with the rows' own prompts (and OpenAI's penalties after the
    repetition penalty, as vLLM orders them; TGI's frequency penalty there too, as TGI does)."""
    rows = []
    for i, p in enumerate(chooser.params):
        ids = torch.tensor([chooser.histories[i]])
        n_in = len(prompts[i])
        procs: list = [LogitBias(p.logit_bias)] if p.logit_bias else []
        if p.min_new_tokens and chooser.generated[i] < p.min_new_tokens:
            procs.append(hf.MinNewTokensLengthLogitsProcessor(n_in, p.min_new_tokens, EOS))
        elif p.length_penalty is not None:
            procs.append(
                hf.ExponentialDecayLengthPenalty(
                    (p.length_penalty.start_index, p.length_penalty.decay_factor), EOS, n_in
                )
            )
        if p.repetition_penalty != 1.0:
            procs.append(hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if p.frequency_by_length:
            procs.append(TGIFrequencyPenalty(p.frequency_penalty))
        elif p.presence_penalty or p.frequency_penalty:
            procs.append(OpenAIPenalties(n_in, p.presence_penalty, p.frequency_penalty))
        if not p.greedy:
            if p.temperature != 1.0:
                procs.append(hf.TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                procs.append(hf.TopKLogitsWarper(p.top_k))
            if p.top_p < 1.0:
                procs.append(hf.TopPLogitsWarper(p.top_p))
            if p.min_p:
                procs.append(hf.MinPLogitsWarper(p.min_p))
            if p.typical_p < 1.0:
                procs.append(hf.TypicalLogitsWarper(p.typical_p))
        row = scores[i : i + 1].clone()
        for proc in procs:
            row = proc(ids, row)
        rows.append(row)
    return torch.cat(rows)


def test_chooser_pipeline_matches_transformers_in_tgis_order() -> None:
    """The whole chain of a heterogeneous batch vs each row's transformers processor list."""
    generated = [3, 0, 2, 4, 1, 0]
    # As if each row had generated `count` tokens (ids 30, 31, ...).
    histories = [p + list(range(30, 30 + n)) for p, n in zip(PIPELINE_PROMPTS, generated, strict=True)]
    generators = [None if p.greedy else torch.Generator().manual_seed(0) for p in PIPELINE_PARAMS]
    chooser = TokenChooser(PIPELINE_PARAMS, histories, generated, generators, EOS, VOCAB, torch.device("cpu"))
    scores = random_scores(len(PIPELINE_PARAMS), seed=6)
    torch.testing.assert_close(chooser.process(scores.clone()), transformers_process(chooser, scores))


@pytest.mark.parametrize(
    "generated", [[0, 1], [4, 2], [5, 3], [6, 9]], ids=["all held", "all held, last", "none", "past"]
)
def test_min_new_tokens_holds_every_row_or_none_as_transformers(generated: list[int]) -> None:
    """Where every row (or none) is held by min_new_tokens, the host counts decide it without a
    mask (one fill of the EOS column, or nothing); the same scores as transformers'."""
    rows = [2, 5]  # min_new_tokens 5 and 3, the second with a length penalty from 1
    params = [PIPELINE_PARAMS[i] for i in rows]
    histories = [PIPELINE_PROMPTS[i] + list(range(30, 30 + n)) for i, n in zip(rows, generated, strict=True)]
    generators = [None if p.greedy else torch.Generator().manual_seed(0) for p in params]
    chooser = TokenChooser(params, histories, generated, generators, EOS, VOCAB, torch.device("cpu"))
    scores = random_scores(len(rows), seed=8)
    got = chooser.process(scores.clone())
    expected = transformers_process_for(chooser, scores, [PIPELINE_PROMPTS[i] for i in rows])
    torch.testing.assert_close(got, expected)
    held = [g < p.min_new_tokens for g, p in zip(generated, params, strict=True)]
    assert (got[:, EOS] == float("-inf")).tolist() == held


def test_the_chooser_keeps_matching_over_steps_and_copies_nothing_to_the_device(monkeypatch) -> None:
    """Step after step (min_new_tokens running out, length penalties starting, tokens seen), the
    chain still equals transformers', and a step makes no tensor from host data (on a GPU that
    would be a copy to wait for): counters and parameters live on the device."""
    chooser = TokenChooser.create(PIPELINE_PARAMS, PIPELINE_PROMPTS, EOS, VOCAB, torch.device("cpu"))
    made: list[object] = []
    real_tensor = torch.tensor

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        made.append(args[0] if args else kwargs)
        return real_tensor(*args, **kwargs)

    for step in range(7):
        scores = random_scores(len(PIPELINE_PARAMS), seed=20 + step)
        expected = transformers_process(chooser, scores)
        monkeypatch.setattr(torch, "tensor", counting)
        got = chooser.process(scores.clone())
        ids, _ = chooser.choose(scores.clone())
        chooser.advance(ids.tolist(), ids)
        monkeypatch.setattr(torch, "tensor", real_tensor)
        torch.testing.assert_close(got, expected)
        assert made == [], f"step {step} made tensors from host data: {made}"
    assert chooser.generated == [7] * len(PIPELINE_PARAMS)
    assert chooser.generated_t is not None and chooser.generated_t.tolist() == chooser.generated


def test_choosers_reach_the_device_without_waiting(monkeypatch) -> None:
    """Building, selecting, concatenating, expanding and advancing choosers copies their host
    values through to_device (pinned memory, a non-blocking copy on a GPU), never with
    torch.tensor(..., device=...): a chooser built while a forward runs (a prompt that completes
    in the step) would wait for the forward there."""
    direct: list[object] = []
    real_tensor = torch.tensor

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        if "device" in kwargs:
            direct.append(args[0] if args else kwargs)
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    chooser = TokenChooser.create(PIPELINE_PARAMS, PIPELINE_PROMPTS, EOS, VOCAB, torch.device("cpu"))
    both = TokenChooser.concatenate([chooser, chooser.select([3, 1, 0])])
    rows = len(both)
    both.advance([7] * rows)
    both.advance_many([[8, 9]] * rows)
    expanded = both.expand([[10]] * rows)
    monkeypatch.setattr(torch, "tensor", real_tensor)
    assert direct == []
    assert len(expanded) == 2 * rows and both.generated == [3] * rows
    assert both.seen is not None and both.seen[:, [7, 8, 9]].all()


def test_generated_token_counts_follow_the_rows_through_every_chooser_operation() -> None:
    """The counts the additive penalties read, kept on the device through advance, select,
    concatenate, advance_many and expand, equal the counts of each row's generated ids (of its
    whole history in TGI's rows, whose length so far is the frequency's divisor)."""
    device = torch.device("cpu")
    penalised = SamplingParams(frequency_penalty=1.0)
    chooser = TokenChooser.create(PIPELINE_PARAMS, PIPELINE_PROMPTS, EOS, VOCAB, device)
    plain = TokenChooser.create([SamplingParams()] * 2, [[5], [6, 6]], EOS, VOCAB, device)
    assert plain.counts is None and chooser.counts is not None and not chooser.plain
    chooser.advance([40, 41, 40, 42, 43, 44])
    check_counts(chooser)  # (histories are shared with the choosers made from it: check now)
    both = TokenChooser.concatenate([chooser.select([3, 1, 0]), plain, chooser.select([5])])
    both.advance([40, 40, 41, 9, 40, 41])
    both.advance_many([[41, 41], [], [40], [5, 5, 5], [6], [40, 40, 40]])
    check_counts(both)
    check_counts(both.expand([[40, 41], [], [9], [5], [], []]))
    only_plain = both.select([3, 4])
    assert only_plain.counts is None and only_plain.plain
    check_counts(
        TokenChooser.concatenate([only_plain, TokenChooser.create([penalised], [[8]], EOS, VOCAB, device)])
    )


def check_counts(chooser: TokenChooser) -> None:
    assert chooser.counts is not None
    want = torch.zeros_like(chooser.counts)
    lengths = []
    rows = zip(chooser.histories, chooser.generated, chooser.params, strict=True)
    for row, (history, generated, params) in enumerate(rows):
        counted = history if params.frequency_by_length else history[len(history) - generated :]
        for token in counted:
            want[row, token] += 1
        lengths.append(float(len(history)) if params.frequency_by_length else 1.0)
    assert torch.equal(chooser.counts, want)
    if any(p.frequency_by_length for p in chooser.params):
        assert chooser.length_t is not None and chooser.length_t.tolist() == lengths
    else:
        assert chooser.length_t is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_copies_without_a_sync_on_a_gpu() -> None:
    from text_generation_server.utils.transfer import to_device

    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        values = to_device([[1, 2], [3, 4]], device, torch.float64)
        flags = to_device([True, False], device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert values.device.type == "cuda" and values.dtype == torch.float64
    assert values.tolist() == [[1.0, 2.0], [3.0, 4.0]] and flags.tolist() == [True, False]


def test_a_chooser_is_finished_once_every_row_had_max_new_tokens_or_an_eos_that_ends_it() -> None:
    params = [SamplingParams(), SamplingParams(min_new_tokens=3)]
    chooser = TokenChooser.create(params, [[1, EOS], [1]], EOS, VOCAB, torch.device("cpu"))
    assert not chooser.finished([4, 4])  # a prompt ending with EOS is not an end
    chooser.advance([EOS, 7])
    assert not chooser.finished([4, 4])  # row 1 goes on
    assert chooser.finished([4, 1])  # ... unless it had its max_new_tokens
    chooser.advance([5, EOS])
    assert not chooser.finished([4, 4])  # row 1's EOS came before its min_new_tokens
    chooser.advance([6, EOS])
    assert not chooser.finished([4, 4])  # row 0 went on after its EOS: its last token counts
    assert chooser.finished([3, 4])


def test_every_eos_id_of_the_model_is_held_back_boosted_and_ends_a_row_as_transformers() -> None:
    """A model with several EOS ids: min_new_tokens holds every one back and a length penalty
    boosts every one (transformers' processors given the list), each ends a row, and the
    choosers made from a chooser keep them."""
    extra = (7, 9)
    eos_ids = [EOS, *extra]
    params = [
        SamplingParams(min_new_tokens=3),
        SamplingParams(length_penalty=LengthPenalty(1, 1.6)),
        SamplingParams(),
    ]
    prompts = [[5, 6], [8], [4, 4, 4]]
    chooser = TokenChooser.create(params, prompts, EOS, VOCAB, torch.device("cpu"), extra_eos_ids=extra)
    chooser.advance([11, 12, 13])
    chooser.advance([11, 12, 13])
    scores = random_scores(3, seed=12)
    got = chooser.process(scores.clone())
    held = hf.MinNewTokensLengthLogitsProcessor(2, 5, eos_ids)(
        torch.tensor([prompts[0] + [11, 11]]), scores[:1].clone()
    )
    boosted = hf.ExponentialDecayLengthPenalty((1, 1.6), eos_ids, 1)(
        torch.tensor([[8, 12, 12]]), scores[1:2].clone()
    )
    torch.testing.assert_close(got, torch.cat([held, boosted, scores[2:]]))
    assert (got[0, eos_ids] == float("-inf")).all()
    assert not chooser.finished([9, 9, 9])
    chooser.advance([1, 1, 9])  # row 2 ends on an extra EOS id: not finished while the others go on
    assert not chooser.finished([9, 9, 9]) and chooser.finished([3, 3, 9])
    for made in (
        chooser.select([2, 0]),
        TokenChooser.concatenate([chooser, chooser]),
        chooser.expand([[1]] * 3),
    ):
        assert made.eos_ids == eos_ids
    assert chooser.trim_drafts([[4, 9, 5], [7, 7], [2, 7]]) == [[4, 9], [7], [2]]


def test_a_rows_own_stop_token_ids_are_held_back_and_end_it_as_eos_in_that_row_only() -> None:
    params = [SamplingParams(min_new_tokens=3, stop_token_ids=(7, 9)), SamplingParams(), SamplingParams()]
    chooser = TokenChooser.create(params, [[5], [6], [4]], EOS, VOCAB, torch.device("cpu"))
    scores = random_scores(3, seed=13)
    got = chooser.process(scores.clone())  # row 0 held: its EOS and its own stop ids masked
    assert (got[0, [EOS, 7, 9]] == float("-inf")).all()
    assert torch.equal(got[1:], scores[1:])  # the other rows' 7 and 9 are tokens like any other
    alone = TokenChooser.create(params[:1], [[5]], EOS, VOCAB, torch.device("cpu"))  # every row held
    assert (alone.process(scores[:1].clone())[0, [EOS, 7, 9]] == float("-inf")).all()
    for _ in range(3):
        chooser.advance([1, 1, 1])
    assert torch.equal(chooser.process(scores.clone()), scores)  # not held any more
    chooser.advance([9, 9, 1])
    assert chooser.finished([9, 4, 4]) and not chooser.finished([9, 9, 4])  # 9 ends row 0 only
    assert chooser.trim_drafts([[3, 7, 5], [3, 7, 5], [EOS, 1]]) == [[3, 7], [3, 7, 5], [EOS]]
    assert chooser.select([0]).stop_index is not None and chooser.select([1, 2]).stop_index is None


def test_allowed_token_ids_mask_everything_else_in_their_rows_but_never_leave_a_row_without_a_token() -> None:
    params = [
        SamplingParams(allowed_token_ids=(3, 8, 11)),
        SamplingParams(),
        SamplingParams(allowed_token_ids=(EOS,), min_new_tokens=2),  # held: EOS is all it may take
    ]
    chooser = TokenChooser.create(params, [[5], [6], [4]], EOS, VOCAB, torch.device("cpu"))
    assert not chooser.plain
    scores = random_scores(3, seed=14)
    got = chooser.process(scores.clone())
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [3, 8, 11]
    assert torch.equal(got[0, [3, 8, 11]], scores[0, [3, 8, 11]]) and torch.equal(got[1], scores[1])
    assert torch.isfinite(got[2]).sum() == VOCAB - 1  # stuck: its scores kept, EOS held back
    ids, _ = chooser.choose(scores.clone())
    assert ids[0].item() in (3, 8, 11)
    for _ in range(2):
        chooser.advance([3, 1, 1])
    assert torch.isfinite(chooser.process(scores.clone())[2]).nonzero().flatten().tolist() == [EOS]
    assert chooser.select([1]).allowed is None
    both = TokenChooser.concatenate([chooser.select([1]), chooser.select([0])])
    assert both.allowed is not None and both.allowed[0].all() and both.allowed[1].sum() == 3


def test_sampling_uses_each_rows_generator() -> None:
    """A row's draws depend only on its own seed and scores, not on its neighbours."""
    row_scores = random_scores(1, seed=7)[0]
    sampled = SamplingParams(temperature=1.0, seed=42)

    def draws(params: list[SamplingParams], row: int) -> list[int]:
        chooser = TokenChooser.create(params, [[1]] * len(params), EOS, VOCAB, torch.device("cpu"))
        scores = random_scores(len(params), seed=8)
        scores[row] = row_scores
        out = []
        for _ in range(5):
            ids, _ = chooser.choose(scores.clone())
            out.append(int(ids[row]))
            chooser.advance(ids.tolist())
        return out

    alone = draws([sampled], 0)
    assert alone == draws([SamplingParams(), sampled, SamplingParams(temperature=0.5, seed=1)], 1)
    assert alone == draws([SamplingParams(temperature=2.0, seed=3), SamplingParams(top_k=4), sampled], 2)
    assert len(set(alone)) > 1, "five draws at temperature 1 over 300 tokens should differ"


def test_inverse_transform_never_picks_a_token_of_probability_zero() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0, 0.8]])
    lowest, highest = 0.0, 1.0 - 2.0**-53  # the ends of torch.rand's float64 range
    for u in (lowest, 0.25, 0.5 - 2.0**-53, 0.5, 0.75, highest):
        picked = inverse_transform(probs, torch.full((3,), u, dtype=torch.float64))
        assert probs.gather(1, picked.unsqueeze(1)).min() > 0, (u, picked)
    ends = inverse_transform(probs, torch.tensor([lowest, highest, highest], dtype=torch.float64))
    assert ends.tolist() == [1, 2, 4]


def test_sampled_tokens_follow_the_distribution() -> None:
    """Chi-square over 20,000 seeded draws of an 8-token distribution, each draw through the
    chooser's sampler with a row generator of its own seed: below the 0.1 % critical value."""
    weights = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0])
    draws = 20_000
    rows = 500
    counts = torch.zeros(8)
    for start in range(0, draws, rows):
        generators = [torch.Generator().manual_seed(start + i) for i in range(rows)]
        picked = sample(weights.expand(rows, 8), generators)
        counts += torch.bincount(picked, minlength=8).float()
    assert counts[7] == 0  # probability 0: never drawn
    expected = weights[:7] * draws
    chi2 = float(((counts[:7] - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (chi2, counts.tolist())  # 6 degrees of freedom, p = 0.001


def test_top_p_after_top_k_sorts_only_what_top_k_kept_and_equals_transformers() -> None:
    """Every top-p row has a top-k: only the scores top-k kept are sorted (ties at the k-th
    value included); the result is transformers' TopK then TopP, row by row."""
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.99, seed=2),
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.2, top_k=300, top_p=0.6, seed=3),  # k above the vocabulary
    ]
    prompts = [[5, 6, 7], [8, 9], [11], [12]]
    for seed in range(5):
        scores = random_scores(len(params), seed=40 + seed)
        scores[1, :4] = torch.tensor([13.0, 12.9, 12.8, 12.7])
        scores[1, 4:14] = 12.6  # ten ties at the 5th value: top-k keeps 14, top-p all of them
        chooser = TokenChooser.create(params, prompts, EOS, VOCAB, torch.device("cpu"))
        got = chooser.process(scores.clone())
        for row, p in enumerate(params):
            expected = scores[row : row + 1].clone()
            if not p.greedy:
                ids = torch.tensor([prompts[row]])
                for proc in (
                    hf.TemperatureLogitsWarper(p.temperature),
                    hf.TopKLogitsWarper(min(p.top_k, VOCAB)),
                    hf.TopPLogitsWarper(p.top_p),
                ):
                    expected = proc(ids, expected)
            kept = torch.isfinite(got[row])
            if row == 1:
                assert int(kept.sum()) == 14
            assert torch.equal(kept, torch.isfinite(expected[0])), (seed, row)
            torch.testing.assert_close(got[row][kept], expected[0][kept])


def banned_reference(chooser: TokenChooser, scores: torch.Tensor) -> torch.Tensor:
    """Slow bad words: a sequence's last id -inf where the row's generated ids (only: vLLM's
    rule) end with the ids before it."""
    want = scores.clone()
    rows = zip(chooser.histories, chooser.generated, chooser.params, strict=True)
    for row, (history, generated, params) in enumerate(rows):
        made = history[len(history) - generated :]
        for *before, last in params.bad_words:
            if not before or (made[len(made) - len(before) :] == before and len(made) >= len(before)):
                want[row, last] = float("-inf")
    return want


def test_bad_words_ban_a_sequences_last_id_after_its_others_through_every_chooser_operation() -> None:
    """The last generated ids that bad words are matched against follow the rows through
    advance, select, concatenate (with rows of no or shorter bad words), advance_many and expand;
    a prompt that ends with a sequence's start bans nothing (only generated ids count)."""
    device = torch.device("cpu")
    params = [
        SamplingParams(bad_words=((7,), (20, 21), (30, 31, 32))),
        SamplingParams(),
        SamplingParams(bad_words=((5, 6, 7, 8),)),
        SamplingParams(bad_words=((20, 21), (21, 22))),
    ]
    chooser = TokenChooser.create(params, [[30, 31], [1], [5, 6, 7], [20]], EOS, VOCAB, device)
    assert not chooser.plain and chooser.recent is not None and chooser.recent.shape == (4, 3)
    checked = 0

    def check(c: TokenChooser) -> None:
        nonlocal checked
        scores = random_scores(len(c), seed=checked)
        torch.testing.assert_close(c.process(scores.clone()), banned_reference(c, scores))
        checked += 1

    check(chooser)  # the prompts' ends ban nothing: only the one-id word
    for ids in ([30, 9, 5, 20], [31, 9, 6, 21], [20, 9, 7, 5]):
        chooser.advance(ids)
        check(chooser)
    # resumed requests (preempted): the ids they generated end their prompts, counted as generated
    histories = [list(h) for h in chooser.histories]
    resumed = TokenChooser.create(params, histories, EOS, VOCAB, device, generated=chooser.generated)
    assert resumed.recent is not None and chooser.recent is not None
    assert torch.equal(resumed.recent, chooser.recent)
    check(resumed)
    wider = TokenChooser.create([SamplingParams(bad_words=((1, 2, 3, 4, 5),))], [[1]], EOS, VOCAB, device)
    plain = TokenChooser.create([SamplingParams()], [[9]], EOS, VOCAB, device)
    both = TokenChooser.concatenate([chooser.select([3, 0]), plain, wider, chooser.select([2])])
    assert both.recent is not None and both.recent.shape == (5, 4)
    check(both)
    for ids in ([21, 4, 1, 8, 6], [22, 20, 2, 3, 7], [3, 21, 3, 4, 5]):
        both.advance(ids)
        check(both)
    both.advance_many([[20], [30, 31], [], [4], [5, 6]])
    check(both)
    expanded = both.expand([[21, 22], [32, 7], [1], [], [7, 8]])
    check(expanded)
    narrow = both.select([0])
    assert narrow.recent is not None and narrow.recent.shape == (1, 1)
    check(narrow)
    assert both.select([2]).recent is None and both.select([2]).plain
