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
| apply_temperature            | TemperatureLogitsWarper                                |
| apply_top_k / top_p / typical_p | TopK / TopP / Typical LogitsWarper (min_tokens_to_keep=1) |

Callers: sampling/chooser.py (in TGIS order: min-new-tokens or length penalty, repetition
penalty, then, if any row samples, temperature -> top-k -> top-p -> typical-p).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_min_new_tokens(scores: torch.Tensor, eos_token_id: int, masked_rows: torch.Tensor) -> torch.Tensor:
    """EOS gets -inf in the rows of `masked_rows` [batch] bool (fewer than min_new_tokens generated)."""
    eos = scores[:, eos_token_id]
    scores[:, eos_token_id] = eos.masked_fill(masked_rows, NEG_INF)
    return scores


def apply_length_penalty(scores: torch.Tensor, eos_token_id: int, factors: torch.Tensor) -> torch.Tensor:
    """EOS score += |EOS score| * (factor - 1), factors [batch] float64 = decay ** (generated - start).

    A factor of 1.0 is no change. Non-finite EOS scores are left alone.
    """
    eos = scores[:, eos_token_id]
    boost = (eos.abs().double() * (factors - 1.0)).to(scores.dtype)
    boost = boost.masked_fill(~torch.isfinite(eos), 0.0)
    scores[:, eos_token_id] = eos + boost
    return scores


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalise every token seen so far: negative scores * penalty, positive / penalty.

    seen: [batch, vocab] bool; penalty: [batch] (1.0 = off).
    """
    p = penalty.unsqueeze(1)
    penalised = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalised, scores)


def apply_temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """scores / temperature, temperature [batch] (1.0 = off)."""
    return scores.div_(temperature.unsqueeze(1))


def apply_top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep the k highest scores of each row (ties at the k-th value kept); 0 = off."""
    vocab = scores.shape[-1]
    ks = [min(k, vocab) for k in top_k]
    max_k = max(ks)
    if max_k == 0:
        return scores
    kth_index = torch.tensor([max(k, 1) - 1 for k in ks], device=scores.device).unsqueeze(1)
    kth = scores.topk(max_k, dim=-1).values.gather(1, kth_index)
    off = torch.tensor([k == 0 for k in ks], device=scores.device).unsqueeze(1)
    kth = kth.masked_fill(off, NEG_INF)
    return scores.masked_fill_(scores < kth, NEG_INF)


def apply_top_p(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Nucleus filtering per row; rows with top_p >= 1.0 are untouched."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return scores
    sub = scores[rows]
    # The threshold is computed in double, then compared in the scores' dtype, as transformers does.
    threshold = torch.tensor([1.0 - top_p[i] for i in rows], dtype=sub.dtype, device=sub.device)
    sorted_scores, sorted_idx = sub.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= threshold.unsqueeze(1)
    remove_sorted[:, -1] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    scores[rows] = sub.masked_fill(remove, NEG_INF)
    return scores


def apply_typical_p(scores: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """Locally typical filtering per row; rows with typical_p >= 1.0 are untouched."""
    rows = [i for i, p in enumerate(typical_p) if p < 1.0]
    if not rows:
        return scores
    sub = scores[rows]
    mass = torch.tensor([typical_p[i] for i in rows], dtype=sub.dtype, device=sub.device)
    logprobs = torch.log_softmax(sub, dim=-1)
    entropy = -(logprobs * logprobs.exp()).nansum(-1, keepdim=True)
    shifted = (-logprobs - entropy).abs()
    sorted_shifted, sorted_idx = shifted.sort(dim=-1, descending=False)
    cumulative = sub.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass.unsqueeze(1)).sum(dim=1).clamp_(max=sub.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(1, last.unsqueeze(1))
    remove_sorted[:, 0] = False  # always keep the most typical token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    scores[rows] = sub.masked_fill(remove, NEG_INF)
    return scores
