"""Vectorised, per-row logits processors: one call processes a whole heterogeneous batch.

Each function takes `scores` [batch, vocab] (float32) plus one parameter per row and returns the
processed scores; rows whose parameter means "off" come out unchanged. Semantics follow the
transformers processors of the same name applied to each row alone, which
tests/test_logits_process.py checks with `allclose`:

| here                         | transformers                                           |
|------------------------------|--------------------------------------------------------|
| apply_min_new_tokens         | MinNewTokensLengthLogitsProcessor                      |
| apply_length_penalty         | ExponentialDecayLengthPenalty                          |
| apply_repetition_penalty     | RepetitionPenaltyLogitsProcessor (on a seen-token mask) |
| apply_additive_penalties     | none: OpenAI's presence / frequency penalties (vLLM's)  |
| BadWords                     | NoBadWordsLogitsProcessor, over the generated ids only (vLLM's bad_words) |
| apply_temperature            | TemperatureLogitsWarper                                |
| apply_top_k / top_p / typical_p | TopK / TopP / Typical LogitsWarper (min_tokens_to_keep=1) |

Callers: sampling/chooser.py (in TGIS order: min-new-tokens or length penalty, repetition
penalty, the additive penalties, then, if any row samples, temperature -> top-k -> top-p ->
typical-p).

The per-row parameters of top-k / top-p / typical-p become device tensors once (`*Plan.of`,
when a chooser is built): applying a plan every step copies nothing to the device, so a step on
a GPU has no host-to-device copy to wait for. `apply_top_k(scores, [k, ...])` and the others
prepare and apply in one call (tests, one-off uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import torch

from text_generation_server.utils.transfer import to_device

NEG_INF = float("-inf")


def _columns(eos_token_ids: int | Sequence[int]) -> Sequence[int]:
    """The EOS columns, each indexed on its own below: a model has one to three, and a column
    read as a view is cheaper than a gather of a list of them (a chooser step of one held row of
    8,192 logits: 23 against 28 us, 2-core EPYC)."""
    return (eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids


def apply_min_new_tokens(
    scores: torch.Tensor, eos_token_ids: int | Sequence[int], masked_rows: torch.Tensor
) -> torch.Tensor:
    """Every EOS id gets -inf in the rows of `masked_rows` [batch] bool (fewer than
    min_new_tokens generated)."""
    for column in _columns(eos_token_ids):
        scores[:, column] = scores[:, column].masked_fill(masked_rows, NEG_INF)
    return scores


def apply_length_penalty(
    scores: torch.Tensor, eos_token_ids: int | Sequence[int], factors: torch.Tensor
) -> torch.Tensor:
    """Each EOS score += |EOS score| * (factor - 1), factors [batch] float64 = decay ** (generated
    - start), as transformers' ExponentialDecayLengthPenalty does for every EOS id.

    A factor of 1.0 is no change. Non-finite EOS scores are left alone.
    """
    for column in _columns(eos_token_ids):
        eos = scores[:, column]
        boost = (eos.abs().double() * (factors - 1.0)).to(scores.dtype)
        boost = boost.masked_fill(~torch.isfinite(eos), 0.0)
        scores[:, column] = eos + boost
    return scores


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalise every token seen so far: negative scores * penalty, positive / penalty.

    seen: [batch, vocab] bool; penalty: [batch] (1.0 = off).
    """
    p = penalty.unsqueeze(1)
    penalised = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalised, scores)


def apply_additive_penalties(
    scores: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties as vLLM applies them: score -= frequency * count + presence * (count > 0),
    counts [batch, vocab] float32 = how often each row generated each token; presence and
    frequency [batch] (0.0 = off)."""
    scores -= frequency.unsqueeze(1) * counts
    scores -= presence.unsqueeze(1) * (counts > 0)
    return scores


def apply_allowed(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Every token a row may not choose (allowed [batch, vocab] bool) gets -inf, but in a row
    where that would leave none (its allowed ids all held back by min_new_tokens): that row
    keeps its scores, so that no row is left without a token to choose."""
    kept = scores.masked_fill(~allowed, NEG_INF)
    stuck = torch.isneginf(kept).all(dim=-1, keepdim=True)
    return torch.where(stuck, scores, kept)


NO_TOKEN = -1  # a position of `recent` before the first generated token: no id equals it


@dataclass(frozen=True)
class BadWords:
    """Every row's banned sequences (vLLM's bad_words as token ids), made into device tensors
    once: a sequence's last id gets -inf in its row where the row's last generated ids are the
    ones before it (a one-id sequence: always). `width`: the longest sequence less its last id,
    the generated ids each row must keep at hand (`recent` [batch, width]: the last generated
    ids, NO_TOKEN before the first)."""

    rows: torch.Tensor  # [sequences] the row of each sequence
    banned: torch.Tensor  # [sequences] its last id
    before: torch.Tensor  # [sequences, width] the ids before it, right-aligned
    anything: torch.Tensor  # [sequences, width] bool: positions before a shorter sequence's start
    width: int

    @classmethod
    def of(cls, sequences: Sequence[Sequence[Sequence[int]]], device: torch.device) -> BadWords | None:
        """`sequences[row]`: that row's banned sequences; None where no row has any."""
        flat = [(row, ids) for row, listed in enumerate(sequences) for ids in listed if ids]
        if not flat:
            return None
        width = max(len(ids) for _, ids in flat) - 1
        before = [[NO_TOKEN] * (width - len(ids) + 1) + list(ids[:-1]) for _, ids in flat]
        before_t = to_device(before, device, torch.long).view(len(flat), width)
        return cls(
            to_device([row for row, _ in flat], device),
            to_device([ids[-1] for _, ids in flat], device),
            before_t,
            before_t == NO_TOKEN,  # the padding: no id is NO_TOKEN
            width,
        )

    def apply(self, scores: torch.Tensor, recent: torch.Tensor | None) -> torch.Tensor:
        """-inf at each sequence's last id in its row where the row's `recent` ids end with the
        sequence's others; nothing is read back to the host."""
        if recent is None or self.width == 0:
            scores[self.rows, self.banned] = NEG_INF
            return scores
        window = recent.index_select(0, self.rows)
        matched = ((window == self.before) | self.anything).all(dim=1)
        ban = torch.where(matched, NEG_INF, 0.0)
        return scores.index_put_((self.rows, self.banned), ban, accumulate=True)


def shifted(recent: torch.Tensor, taken: Sequence[Sequence[int]]) -> torch.Tensor:
    """`recent` [rows, width] (each row's last generated ids) after each row took `taken[row]`."""
    most = max((len(ids) for ids in taken), default=0)
    if most == 0 or recent.shape[1] == 0:
        return recent
    rows = len(taken)
    more = to_device([[*ids, *([NO_TOKEN] * (most - len(ids)))] for ids in taken], recent.device)
    both = torch.cat([recent, more.view(rows, most)], dim=1)
    starts = to_device([len(ids) for ids in taken], recent.device)
    index = starts.view(rows, 1) + torch.arange(recent.shape[1], device=recent.device)
    return both.gather(1, index)


def apply_temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """scores / temperature, temperature [batch] (1.0 = off)."""
    return scores.div_(temperature.unsqueeze(1))


@dataclass(frozen=True, slots=True)
class TopKPlan:
    max_k: int  # the largest k of any row (<= vocab)
    kth_index: torch.Tensor  # [batch, 1] index of each row's k-th value among the max_k largest
    off: torch.Tensor  # [batch, 1] bool: rows with top_k 0

    @classmethod
    def of(cls, top_k: Sequence[int], vocab: int, device: torch.device) -> Self | None:
        """None when no row filters."""
        ks = [min(k, vocab) for k in top_k]
        if max(ks, default=0) == 0:
            return None
        kth_index = to_device([max(k, 1) - 1 for k in ks], device).unsqueeze(1)
        off = to_device([k == 0 for k in ks], device).unsqueeze(1)
        return cls(max(ks), kth_index, off)


def top_k_with(scores: torch.Tensor, plan: TopKPlan) -> torch.Tensor:
    """Keep the k highest scores of each row (ties at the k-th value kept); k 0 = off."""
    kth = scores.topk(plan.max_k, dim=-1).values.gather(1, plan.kth_index)
    kth = kth.masked_fill(plan.off, NEG_INF)
    return scores.masked_fill_(scores < kth, NEG_INF)


def apply_top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    plan = TopKPlan.of(top_k, scores.shape[-1], scores.device)
    return top_k_with(scores, plan) if plan is not None else scores


@dataclass(frozen=True, slots=True)
class RowsPlan:
    """The rows a filter applies to, and each one's parameter."""

    rows: torch.Tensor  # [n] row indices
    values: torch.Tensor  # [n] float32

    @classmethod
    def of(
        cls, values: Sequence[float], device: torch.device, transform: float = 0.0, off: float = 1.0
    ) -> Self | None:
        """The rows whose filter is on (a value below `off` 1.0, as top-p's; above `off` 0.0, as
        min-p's), each parameter as `transform - value` when transform is set (top-p's threshold
        1 - p), else the value; None when no row."""
        rows = [i for i, v in enumerate(values) if (v < off if off else v > off)]
        if not rows:
            return None
        picked = [transform - values[i] if transform else values[i] for i in rows]
        return cls(to_device(rows, device), to_device(picked, device, torch.float32))


def top_p_with(scores: torch.Tensor, plan: RowsPlan) -> torch.Tensor:
    """Nucleus filtering of the plan's rows (`values`: the threshold 1 - top_p)."""
    sub = scores.index_select(0, plan.rows)
    # The threshold is computed in double, then compared in the scores' dtype, as transformers does.
    threshold = plan.values.to(sub.dtype)
    vocab = sub.shape[-1]
    # After top-k most scores are -inf (probability 0, removed whatever their place): on CPU,
    # where counting them costs no device sync, only the others are sorted (a full sort of 32
    # rows of 8,192 took 1.7 ms of a step)
    finite = int((sub > NEG_INF).sum(dim=-1).max()) if sub.device.type == "cpu" else vocab
    if finite < vocab:
        top, top_idx = sub.topk(finite, dim=-1)  # descending
        sorted_scores, sorted_idx = top.flip(-1), top_idx.flip(-1)
    else:
        sorted_scores, sorted_idx = sub.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= threshold.unsqueeze(1)
    remove_sorted[:, -1] = False  # always keep the most likely token
    remove = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, sorted_idx, remove_sorted)
    scores.index_copy_(0, plan.rows, sub.masked_fill(remove, NEG_INF))
    return scores


def apply_top_p(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Nucleus filtering per row; rows with top_p >= 1.0 are untouched."""
    plan = RowsPlan.of(top_p, scores.device, transform=1.0)
    return top_p_with(scores, plan) if plan is not None else scores


def min_p_with(scores: torch.Tensor, plan: RowsPlan) -> torch.Tensor:
    """Min-p filtering of the plan's rows (`values`: min_p): tokens whose probability is below
    min_p times the likeliest token's are removed (that one never is)."""
    sub = scores.index_select(0, plan.rows)
    probs = sub.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * plan.values.to(probs.dtype).unsqueeze(1)
    scores.index_copy_(0, plan.rows, sub.masked_fill(probs < threshold, NEG_INF))
    return scores


def typical_p_with(scores: torch.Tensor, plan: RowsPlan) -> torch.Tensor:
    """Locally typical filtering of the plan's rows (`values`: the typical mass)."""
    sub = scores.index_select(0, plan.rows)
    mass = plan.values.to(sub.dtype)
    logprobs = torch.log_softmax(sub, dim=-1)
    entropy = -(logprobs * logprobs.exp()).nansum(-1, keepdim=True)
    shifted = (-logprobs - entropy).abs()
    sorted_shifted, sorted_idx = shifted.sort(dim=-1, descending=False)
    cumulative = sub.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass.unsqueeze(1)).sum(dim=1).clamp_(max=sub.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(1, last.unsqueeze(1))
    remove_sorted[:, 0] = False  # always keep the most typical token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    scores.index_copy_(0, plan.rows, sub.masked_fill(remove, NEG_INF))
    return scores


def apply_typical_p(scores: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """Locally typical filtering per row; rows with typical_p >= 1.0 are untouched."""
    plan = RowsPlan.of(typical_p, scores.device)
    return typical_p_with(scores, plan) if plan is not None else scores
