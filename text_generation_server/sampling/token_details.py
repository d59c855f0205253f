"""Token details (logprob, rank, top-n candidates) with TGIS's exact rules.

Generated tokens use the final scores of the step (after every processor and warper); input
tokens of decoder-only models use the raw prefill logits. Rules (tgis-api §8):
  logprob  = log_softmax(scores)[token]
  rank     = 1 + number of scores strictly greater than the token's
  top-n    = every id whose score is >= the n-th highest (a -inf threshold is clamped to the
             dtype's minimum so filtered tokens never qualify), in ascending id order, at most
             4n of them; with logprobs they are sorted by logprob descending, lower id first on
             ties; without logprobs they stay in id order with no logprob.
Callers: engines (per step, only for rows that asked for details).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from text_generation_common.messages import (
    FIRST_INPUT_TOKEN_LOGPROB,
    RequestedDetails,
    TokenInfo,
    TopToken,
)

TOP_N_CAP_FACTOR = 4


def _top_tokens(scores: torch.Tensor, logprobs: torch.Tensor | None, top_n: int) -> tuple[TopToken, ...]:
    """Top-n candidates of one row. scores/logprobs: [vocab]."""
    n = min(top_n, scores.shape[-1])
    nth = scores.topk(n).values[-1]
    if torch.isneginf(nth):
        nth = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
    ids = (scores >= nth).nonzero().squeeze(-1)[: n * TOP_N_CAP_FACTOR]
    if logprobs is None:
        return tuple(TopToken(int(i)) for i in ids.tolist())
    values = logprobs[ids].tolist()
    pairs = sorted(zip(ids.tolist(), values, strict=True), key=lambda p: (-p[1], p[0]))
    return tuple(TopToken(int(i), float(v)) for i, v in pairs)


def generated_token_infos(
    scores: torch.Tensor, next_ids: Sequence[int], details: Sequence[RequestedDetails]
) -> list[TokenInfo]:
    """One TokenInfo per row. scores: final scores [batch, vocab]; next_ids: chosen ids."""
    detail_rows = [i for i, d in enumerate(details) if d.any_token_detail]
    infos = [TokenInfo(token_id=t) for t in next_ids]
    if not detail_rows:
        return infos
    logprob_rows = [i for i in detail_rows if details[i].logprobs]
    logprobs = torch.log_softmax(scores[logprob_rows], dim=-1) if logprob_rows else None
    lp_index = {row: k for k, row in enumerate(logprob_rows)}
    for row in detail_rows:
        d, token, row_scores = details[row], next_ids[row], scores[row]
        row_logprobs = logprobs[lp_index[row]] if logprobs is not None and row in lp_index else None
        infos[row] = TokenInfo(
            token_id=token,
            logprob=float(row_logprobs[token]) if row_logprobs is not None else 0.0,
            rank=int((row_scores > row_scores[token]).sum()) + 1 if d.ranks else 0,
            top_tokens=_top_tokens(row_scores, row_logprobs, d.top_n_tokens) if d.top_n_tokens else (),
        )
    return infos


def input_token_infos(
    logits: torch.Tensor | None, input_ids: Sequence[int], details: RequestedDetails
) -> tuple[TokenInfo, ...]:
    """Details of a decoder-only prompt. logits: raw logits [len(input_ids), vocab], row i
    predicting token i + 1 (the last row is unused). The first token has logprob NaN (if
    logprobs were requested), no rank and no candidates."""
    first = TokenInfo(input_ids[0], logprob=FIRST_INPUT_TOKEN_LOGPROB if details.logprobs else 0.0)
    if not details.any_token_detail or logits is None or len(input_ids) == 1:
        return (first, *(TokenInfo(t) for t in input_ids[1:]))
    preceding = logits[:-1].float()  # [n - 1, vocab]
    targets = torch.tensor(input_ids[1:], device=preceding.device)
    logprobs = torch.log_softmax(preceding, dim=-1) if details.logprobs else None
    chosen_lp = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist() if logprobs is not None else None
    ranks = None
    if details.ranks:
        # Ranked on logprobs when they exist (as TGIS does), else on the logits: same order.
        basis = logprobs if logprobs is not None else preceding
        chosen = basis.gather(1, targets.unsqueeze(1))
        ranks = ((basis > chosen).sum(dim=1) + 1).tolist()
    infos = [first]
    for k, token in enumerate(input_ids[1:]):
        infos.append(
            TokenInfo(
                token_id=token,
                logprob=chosen_lp[k] if chosen_lp is not None else 0.0,
                rank=ranks[k] if ranks is not None else 0,
                top_tokens=_top_tokens(
                    preceding[k], logprobs[k] if logprobs is not None else None, details.top_n_tokens
                )
                if details.top_n_tokens
                else (),
            )
        )
    return tuple(infos)


def encoder_input_token_infos(input_ids: Sequence[int], details: RequestedDetails) -> tuple[TokenInfo, ...]:
    """Encoder-decoder prompts: ids only, logprob NaN when logprobs were requested."""
    logprob = FIRST_INPUT_TOKEN_LOGPROB if details.logprobs else 0.0
    return tuple(TokenInfo(t, logprob=logprob) for t in input_ids)
