"""The guided-decoding matchers of a chooser's rows: each constrained row's allowed next tokens
masked into its scores, and its matcher advanced by the token chosen.

One mask per step for the whole batch: a [rows, vocab / 32] int32 bitmask starting all-allowed,
the constrained rows' words filled by llguidance on its own threads (no GIL), then applied to
the scores in place. A row whose every token ends up masked (its grammar is complete and only
EOS remains, while min_new_tokens masks EOS) gets EOS back: the grammar wins, the output stays
valid. Matchers travel with their rows through prune and concatenate, like the RNG state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))


def apply_masks(matchers: Sequence[Any | None], scores: torch.Tensor, eos_token_id: int) -> None:
    """Mask `scores` [rows, vocab] in place to what each row's matcher allows (None: free)."""
    import llguidance.torch as llt

    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = llt.allocate_token_bitmask(len(matchers), scores.shape[-1])
    llt.fill_next_token_bitmask_par(_executor(), rows, bitmask)
    llt.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True))
    stuck = torch.isneginf(scores).all(dim=-1)
    if bool(stuck.any()):
        scores[stuck, eos_token_id] = 0.0


def advance(matchers: Sequence[Any | None], next_ids: Sequence[int]) -> None:
    """Feed each constrained row its chosen token (a row whose grammar has stopped takes none)."""
    for matcher, token in zip(matchers, next_ids, strict=True):
        if matcher is None or matcher.is_stopped():
            continue
        if not matcher.consume_token(token):  # cannot happen with the mask applied; say so if it does
            logger.error("guided decoding: token %d was not accepted (%s)", token, matcher.get_error())
