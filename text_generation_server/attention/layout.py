"""The layout of one packed step over the paged KV cache: what every layer's attention reads.

A step packs the new tokens of several sequences into one batch [1, T] (engines/tgis_native):
each sequence is a `Piece` (its block table, the tokens already cached, the new ones). Built
once per step, shared by every layer:

    slots  [T]       where each new token's K/V are written (cache slot = block * size + offset)
    decode           the pieces with one new token, attended together by the backend
                     (DecodeRows + the backend's per-step plan)
    others           every other piece alone with SDPA: a whole prompt attends its own new K/V
                     (causal flag); a chunk after cached tokens reads its blocks back with a
                     causal mask aligned to the END of its keys (SDPA's flag is aligned to the
                     start), and a sliding window where the model has one

`StepLayout.build` makes it from pieces (any step); a decode-only step of the model runner
builds it over persistent buffers instead (`StepLayout.decode_only`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from text_generation_server.attention.backend import AttentionBackend, DecodeRows
from text_generation_server.kv.paged_kv import PagedKVCache


@dataclass(frozen=True, slots=True)
class Piece:
    """One sequence's part of a step: `new` tokens after its first `cached` tokens (whose K/V
    are written); `blocks` is its block table, covering all cached + new tokens."""

    blocks: Sequence[int]
    cached: int
    new: int


def piece_slots(blocks: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of token positions [start, end) of a sequence with block table `blocks`."""
    slots: list[int] = []
    position = start
    while position < end:
        index, offset = divmod(position, block_size)
        count = min(block_size - offset, end - position)
        base = blocks[index] * block_size + offset
        slots.extend(range(base, base + count))
        position += count
    return slots


def chunk_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [queries, keys] (True = attend) of the last `queries` of `keys` tokens:
    causal aligned to the end of the keys, within the window; None when every key is allowed."""
    if queries == 1 and (window is None or keys <= window):
        return None
    rows = torch.arange(keys - queries, keys, device=device).unsqueeze(1)  # absolute positions
    cols = torch.arange(keys, device=device).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed &= cols > rows - window
    return allowed


@dataclass(slots=True)
class Alone:
    """A sequence with several new tokens, attended by itself."""

    start: int  # its new tokens [start, end) in the packed batch
    end: int
    blocks: torch.Tensor | None  # its block table; None: no cached tokens (attends its own new K/V)
    keys: int  # its context length, new tokens included
    mask: torch.Tensor | None  # boolean [q, keys]; None: SDPA's causal flag is right


@dataclass(slots=True)
class StepLayout:
    cache: PagedKVCache
    backend: AttentionBackend
    slots: torch.Tensor  # [T] where each new token's K/V go
    decode: DecodeRows | None  # the single-token sequences
    plan: Any  # the backend's per-step state for `decode`
    others: list[Alone]  # the sequences attended one by one
    tokens: int  # T

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        backend: AttentionBackend,
        pieces: Sequence[Piece],
        window: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StepLayout:
        size = cache.pool.block_size
        slots: list[int] = []
        single: list[int] = []  # packed positions of the single-token pieces
        lengths: list[int] = []
        tables: list[Sequence[int]] = []
        others: list[Alone] = []
        for piece in pieces:
            start, length = len(slots), piece.cached + piece.new
            if piece.new == 1:
                position = piece.cached
                slots.append(piece.blocks[position // size] * size + position % size)
                single.append(start)
                lengths.append(length)
                tables.append(piece.blocks)
                continue
            slots += piece_slots(piece.blocks, piece.cached, length, size)
            if piece.cached == 0:
                mask = (
                    None if window is None or length <= window else chunk_mask(length, length, window, device)
                )
                others.append(Alone(start, len(slots), None, length, mask))
            else:
                blocks = torch.tensor(piece.blocks[: -(-length // size)], device=device)
                mask = chunk_mask(piece.new, length, window, device)
                others.append(Alone(start, len(slots), blocks, length, mask))
        rows = None
        if single:
            width = -(-max(lengths) // size)
            padded: list[int] = []
            for table, length in zip(tables, lengths, strict=True):
                used = -(-length // size)
                padded += table[:used]
                padded += [0] * (width - used)
            first = single[0]
            contiguous = single[-1] - first == len(single) - 1
            rows = DecodeRows(
                slice(first, first + len(single)) if contiguous else torch.tensor(single, device=device),
                torch.tensor(padded, device=device).view(len(single), width),
                torch.tensor(lengths, device=device),
                max(lengths),
                min(lengths),
                window,
            )
        plan = backend.prepare(rows, cache, dtype) if rows is not None else None
        return cls(cache, backend, torch.tensor(slots, device=device), rows, plan, others, len(slots))

    @classmethod
    def decode_only(
        cls,
        cache: PagedKVCache,
        backend: AttentionBackend,
        rows: DecodeRows,
        slots: torch.Tensor,
        dtype: torch.dtype,
    ) -> StepLayout:
        """A step of `rows` alone, one token each, packed in row order (`slots` [D])."""
        plan = backend.prepare(rows, cache, dtype)
        return cls(cache, backend, slots, rows, plan, [], rows.rows)
