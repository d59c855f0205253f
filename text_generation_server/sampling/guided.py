"""The guided-decoding matchers of a chooser's rows: each constrained row's allowed next tokens
masked into its scores, and its matcher advanced by the token chosen.

One mask per step for the constrained rows: a [rows, vocab / 32] int32 bitmask filled by
llguidance on its own threads (no GIL), unpacked and applied to those rows' scores. A row
whose every token ends up masked (its grammar is complete and only EOS remains, while
min_new_tokens masks EOS) gets EOS back: the grammar wins, the output stays valid. Matchers
travel with their rows through prune and concatenate, like the RNG state.
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


SHIFTS = torch.arange(32, dtype=torch.int32)  # bit k of a mask word: token 32 * word + k


def apply_masks(matchers: Sequence[Any | None], scores: torch.Tensor, eos_token_id: int) -> None:
    """Mask `scores` [rows, vocab] in place to what each row's matcher allows (None: free).
    The bits are unpacked with plain torch (llguidance's own apply is a torch.compile kernel:
    seconds at its first call in every process, and a compiler the release image lacks)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = scores.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr(
        [(matchers[row], i) for i, row in enumerate(rows)], bitmask.data_ptr(), words * 4, len(rows)
    )
    allowed = ((bitmask.unsqueeze(-1) >> SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=scores.device)
    masked = scores.index_select(0, index).masked_fill_(~allowed.to(scores.device), float("-inf"))
    stuck = torch.isneginf(masked).all(dim=-1)
    if bool(stuck.any()):
        masked[stuck, eos_token_id] = 0.0
    scores.index_copy_(0, index, masked)


def advance(matchers: Sequence[Any | None], tokens: Sequence[Sequence[int]]) -> None:
    """Feed each constrained row its chosen tokens, in order (a row whose grammar has stopped
    takes none)."""
    for matcher, ids in zip(matchers, tokens, strict=True):
        for token in ids:
            if matcher is None or matcher.is_stopped():
                break
            if not matcher.consume_token(token):  # cannot happen with the mask applied; say so if it does
                logger.error("guided decoding: token %d was not accepted (%s)", token, matcher.get_error())


def allowed_prefix(matcher: Any, tokens: Sequence[int]) -> int:
    """How many of `tokens`, from the first, the matcher's grammar allows in its current state
    (the matcher itself is left as it is)."""
    if matcher.is_stopped():
        return 0
    copy = matcher.deep_copy()
    return int(copy.try_consume_tokens(list(tokens)))


def positions(matcher: Any | None, tokens: Sequence[int]) -> list[Any | None]:
    """The matcher's state before each of `tokens` and after the last (len(tokens) + 1 states;
    the first is `matcher` itself, the others copies): the grammar of each position of a row
    under speculation. The grammar must allow `tokens` (`allowed_prefix`)."""
    states = [matcher]
    for token in tokens:
        if matcher is None:
            states.append(None)
            continue
        matcher = matcher.deep_copy()
        if not matcher.is_stopped():
            matcher.consume_token(token)
        states.append(matcher)
    return states
