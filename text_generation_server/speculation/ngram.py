"""N-gram speculation (prompt lookup): a row's last `n` tokens (n from MAX_MATCH down to
MIN_MATCH) are looked up earlier in its prompt and output; the tokens that followed the latest
occurrence are the candidates (a match near the end continues as the loop it is part of). Costs
no model: it pays where outputs repeat their context (code edits, extraction, summaries that
quote, repetition loops)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from text_generation_server.speculation import Speculator

MAX_MATCH = 4
MIN_MATCH = 2


class NgramSpeculator(Speculator):
    name = "n-gram (prompt lookup)"

    def __init__(self, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_match}, {max_match}")
        self.max_match = max_match
        self.min_match = min_match

    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        return [self.lookup(h, k) if k > 0 else [] for h, k in zip(histories, limits, strict=True)]

    def lookup(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix
        of `history` (MIN_MATCH..MAX_MATCH tokens) found."""
        tokens = np.asarray(history, dtype=np.int64)
        earlier = tokens[:-1]  # an occurrence that ends before the last token
        for n in range(min(self.max_match, len(earlier)), self.min_match - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(earlier, n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                return continued(history, int(hits[-1]) + n, limit)
        return []


def continued(history: Sequence[int], start: int, limit: int) -> list[int]:
    """`limit` tokens copied from `start` on, past the end of the history into the copy itself:
    a match close to the end (a loop of a few tokens) continues the loop."""
    tokens = list(history[start:])
    for j in range(limit - len(tokens)):
        tokens.append(tokens[j])
    return tokens[:limit]
