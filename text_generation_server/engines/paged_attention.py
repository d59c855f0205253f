"""Attention over the paged KV cache, plugged into transformers' model classes.

`register()` adds NAME to transformers' attention interface (and a mask function that builds no
dense mask); a model loaded with `attn_implementation=NAME` then calls `paged_attention` in every
layer with the packed batch's new tokens and our per-step `StepLayout` (passed through the
model's forward kwargs as `tgis_step`):

    query [1, heads, T, d], key/value [1, kv_heads, T, d]    T = all sequences' new tokens, packed
    1. write the new K/V into the cache at layout.slots
    2. the sequences with one new token (decode), together: their contexts gathered into one
       padded [D, kv_heads, L, d] with a key-padding mask, one SDPA call
    3. every other sequence alone: read its whole context back (layout.context[i]) and run SDPA
       for its queries (layout.queries[i]): a whole prompt with SDPA's causal flag; a chunk after
       cached tokens with a causal mask aligned to the END of its keys (SDPA's flag is aligned
       to the start), and a sliding window where the model has one
    -> [1, T, heads, d]

A single-token query with grouped KV heads runs as SDPA over the query heads packed per KV
head (one query per head group), an order of magnitude faster on CPU in bfloat16 than SDPA's
enable_gqa path (engines/cpu_attention.py has the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from text_generation_server.engines.cpu_attention import one_query_gqa_sdpa
from text_generation_server.engines.paged_kv import PagedKVCache

NAME = "tgis_paged"


@dataclass(slots=True)
class DecodeGroup:
    """The sequences with one new token, attended in one padded SDPA call per layer."""

    tokens: torch.Tensor  # [D] their query positions in the packed batch
    slots: torch.Tensor  # [D * L] their context slots, each row padded to L (padding: slot 0)
    mask: torch.Tensor  # [D, 1, 1, L] True = a real key

    @classmethod
    def of(cls, tokens: list[int], contexts: list[torch.Tensor]) -> DecodeGroup:
        longest = max(len(c) for c in contexts)
        device = contexts[0].device
        slots = torch.zeros((len(contexts), longest), dtype=torch.long, device=device)
        mask = torch.zeros((len(contexts), longest), dtype=torch.bool, device=device)
        for row, context in enumerate(contexts):
            slots[row, : len(context)] = context
            mask[row, : len(context)] = True
        return cls(torch.tensor(tokens, device=device), slots.reshape(-1), mask[:, None, None, :])


@dataclass(slots=True)
class StepLayout:
    cache: PagedKVCache
    slots: torch.Tensor  # [T] where each new token's K/V go
    queries: list[tuple[int, int]]  # per sequence: its new tokens [start, end) in the packed batch
    context: list[torch.Tensor]  # per sequence: the slots of its whole context, new tokens included
    window: int | None = None  # the model's sliding window (the same in every layer)
    decode: DecodeGroup | None = None  # single-token sequences that need no mask of their own
    others: list[int] | None = None  # the sequences attended one by one

    def __post_init__(self) -> None:
        single = [i for i, (s, e) in enumerate(self.queries) if self.mask(i, self.window) is None]
        if len(single) > 1:
            self.decode = DecodeGroup.of(
                [self.queries[i][0] for i in single], [self.context[i] for i in single]
            )
            self.others = [i for i in range(len(self.queries)) if i not in set(single)]
        else:
            self.others = list(range(len(self.queries)))

    def mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """Sequence i's boolean mask [q, kv] (True = attend), None when every key is allowed."""
        start, end = self.queries[i]
        q, kv = end - start, len(self.context[i])
        if q == 1 and (window is None or kv <= window):
            return None
        rows = torch.arange(kv - q, kv, device=self.slots.device).unsqueeze(1)  # absolute positions
        cols = torch.arange(kv, device=self.slots.device).unsqueeze(0)
        allowed = cols <= rows
        if window is not None:
            allowed &= cols > rows - window
        return allowed


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
    cache.write(layer, tgis_step.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    heads, dim = query.shape[1], value.shape[-1]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty((1, query.shape[2], heads, dim))
    group = tgis_step.decode
    if group is not None:
        rows = group.mask.shape[0]
        q = query[0, :, group.tokens, :].transpose(0, 1).reshape(rows, kv_heads, groups, query.shape[-1])
        k, v = cache.read_padded(layer, group.slots, rows)
        result = sdpa(q, k, v, attn_mask=group.mask, scale=scaling)  # [D, kv_heads, groups, dim]
        out[0, group.tokens] = result.reshape(rows, heads, dim)
    for i in tgis_step.others or ():
        start, end = tgis_step.queries[i]
        k, v = cache.read(layer, tgis_step.context[i])
        q = query[:, :, start:end, :]
        whole = end - start == k.shape[2] and (tgis_step.window is None or k.shape[2] <= tgis_step.window)
        if whole and end - start > 1:  # a whole prompt: SDPA's own causal mask is the right one
            result = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
        elif (mask := tgis_step.mask(i, tgis_step.window)) is None and end - start == 1 and groups > 1:
            result = one_query_gqa_sdpa(q, k, v, groups, scaling)
        else:
            result = sdpa(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
        out[:, start:end] = result.transpose(1, 2)
    return out, None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of NAME: the attention builds its own per-sequence masks."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, no_mask)
