"""Attention over the paged KV cache, plugged into transformers' model classes.

`register()` adds NAME to transformers' attention interface (and a mask function that builds no
dense mask); a model loaded with `attn_implementation=NAME` then calls `paged_attention` in every
layer with the packed batch's new tokens and our per-step `StepLayout` (passed through the
model's forward kwargs as `tgis_step`):

    query [1, heads, T, d], key/value [1, kv_heads, T, d]    T = all sequences' new tokens, packed
    1. write the new K/V into the cache at layout.slots
    2. the sequences with one new token (decode), together: on CPU our kernel attends them
       straight from their blocks (cpu_kernels.py, CPU_ATTENTION); otherwise their block tables
       are gathered into one padded [D, kv_heads, L, d] (whole blocks: cache.read_blocks) for
       one SDPA call, with an additive key-padding mask only when their lengths differ (or a
       sliding window cuts)
    3. every other sequence alone: a whole prompt (nothing cached before it) attends to its own
       new K/V with SDPA's causal flag, without reading the cache back; a chunk after cached
       tokens reads its blocks back and uses a causal mask aligned to the END of its keys
       (SDPA's flag is aligned to the start), and a sliding window where the model has one
    -> [1, T, heads, d]

Everything that is the same in every layer (slots, block tables, masks) is built once per step
in `StepLayout.build`, with one tensor per kind rather than per sequence.

The decode query heads are packed per KV head (one query per head group): on CPU an order of
magnitude faster in bfloat16 than SDPA's enable_gqa path (engines/cpu_attention.py has the
measurement).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from text_generation_server.engines import cpu_kernels
from text_generation_server.engines.paged_kv import PagedKVCache

NAME = "tgis_paged"


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


def decode_mask(
    lengths: Sequence[int], window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Additive mask [D, 1, 1, max(lengths)] of single-token queries over padded contexts (0 =
    attend, -inf = padding or outside the window), None when every key of every row counts."""
    longest = max(lengths)
    if min(lengths) == longest and (window is None or longest <= window):
        return None
    ends = torch.tensor(lengths, device=device).unsqueeze(1)
    cols = torch.arange(longest, device=device).unsqueeze(0)
    blocked = cols >= ends
    if window is not None:
        blocked |= cols < ends - window
    mask = torch.zeros((len(lengths), longest), dtype=dtype, device=device).masked_fill_(
        blocked, float("-inf")
    )
    return mask[:, None, None, :]


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
class DecodeGroup:
    """The sequences with one new token, attended in one SDPA call per layer."""

    tokens: slice | torch.Tensor  # their query positions in the packed batch
    blocks: torch.Tensor  # [D * B] their block tables, each padded to B blocks (padding: block 0)
    rows: int  # D
    keys: int  # L = the longest context: each row attends over keys [0, L) of its blocks
    mask: torch.Tensor | None  # SDPA: additive [D, 1, 1, L]; None: every row has all L keys
    lengths: torch.Tensor | None = None  # the kernel's: [D] keys of each row (None: SDPA)
    window: int | None = None  # the kernel's sliding window


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
    slots: torch.Tensor  # [T] where each new token's K/V go
    decode: DecodeGroup | None  # the single-token sequences
    others: list[Alone]  # the sequences attended one by one
    tokens: int  # T

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        pieces: Sequence[Piece],
        window: int | None,
        dtype: torch.dtype,
        device: torch.device,
        kernel: bool = False,
    ) -> StepLayout:
        """The layout of `pieces`; with `kernel`, the decode group is laid out for our CPU
        kernel (lengths instead of a mask)."""
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
        group = None
        if single:
            width = -(-max(lengths) // size)
            padded: list[int] = []
            for table, length in zip(tables, lengths, strict=True):
                used = -(-length // size)
                padded += table[:used]
                padded += [0] * (width - used)
            first = single[0]
            contiguous = single[-1] - first == len(single) - 1
            group = DecodeGroup(
                slice(first, first + len(single)) if contiguous else torch.tensor(single, device=device),
                torch.tensor(padded, device=device),
                len(single),
                max(lengths),
                None if kernel else decode_mask(lengths, window, dtype, device),
                torch.tensor(lengths, device=device) if kernel else None,
                window,
            )
        return cls(cache, torch.tensor(slots, device=device), group, others, len(slots))


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    tgis_step: StepLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if tgis_step is None:
        raise RuntimeError(f"{NAME} attention needs the step layout (tgis_step)")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    cache = tgis_step.cache
    cache.write(layer, tgis_step.slots, key[0], value[0])
    heads, dim = query.shape[1], value.shape[-1]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    group = tgis_step.decode
    if group is not None:
        result = _decode(group, cache, layer, query, kv_heads, scaling)
        if group.rows == tgis_step.tokens:  # decode only: the rows are the whole packed batch, in order
            return result, None
    out = query.new_empty((1, query.shape[2], heads, dim))
    if group is not None:
        out[0, group.tokens] = result[0]
    for alone in tgis_step.others:
        start, end = alone.start, alone.end
        q = query[:, :, start:end, :]
        if alone.blocks is None:
            k, v = key[:, :, start:end, :], value[:, :, start:end, :]
        else:
            k, v = cache.read_blocks(layer, alone.blocks)
            k, v = k[None, :, : alone.keys], v[None, :, : alone.keys]
        causal = alone.mask is None
        result = sdpa(q, k, v, attn_mask=alone.mask, is_causal=causal, scale=scaling, enable_gqa=groups > 1)
        out[:, start:end] = result.transpose(1, 2)
    return out, None


def _decode(
    group: DecodeGroup,
    cache: PagedKVCache,
    layer: int,
    query: torch.Tensor,
    kv_heads: int,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of the single-token sequences: [1, D, heads, dim]."""
    rows, heads, dim = group.rows, query.shape[1], query.shape[-1]
    q = query[0, :, group.tokens, :].transpose(0, 1)  # [D, heads, dim]
    if group.lengths is not None:
        scale = scaling if scaling is not None else dim**-0.5
        tables = group.blocks.view(rows, -1)
        size = cache.pool.block_size
        out = cpu_kernels.paged_decode(
            q, cache.layers[layer], tables, group.lengths, size, scale, group.window
        )
        return out.unsqueeze(0)
    packed = q.reshape(rows, kv_heads, heads // kv_heads, dim)  # query heads packed per KV head
    k, v = (
        t.view(kv_heads, rows, -1, dim)[:, :, : group.keys].transpose(0, 1)
        for t in cache.read_blocks(layer, group.blocks)
    )
    out = sdpa(packed, k, v, attn_mask=group.mask, scale=scaling)
    return out.reshape(1, rows, heads, dim)  # [D, kv_heads, groups, dim] -> [1, D, heads, dim]


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of NAME: the attention builds its own per-sequence masks."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, no_mask)
