"""Attention over the paged KV cache, plugged into transformers' model classes.

`register()` adds NAME to transformers' attention interface (and a mask function that builds no
dense mask); a model loaded with `attn_implementation=NAME` then calls `paged_attention` in every
layer with the packed batch's new tokens and our per-step `StepLayout` (passed through the
model's forward kwargs as `tgis_step`):

    query [1, heads, T, d], key/value [1, kv_heads, T, d]    T = all sequences' new tokens, packed
    1. write the new K/V into the cache at layout.slots
    2. per sequence: read its whole context back (layout.context[i]) and run SDPA for its queries
       (layout.queries[i]); a sequence with more than one new token gets a causal mask aligned
       to the END of its keys (chunked prefill: the queries are the last of the keys), and a
       sliding window where the model has one
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
class StepLayout:
    cache: PagedKVCache
    slots: torch.Tensor  # [T] where each new token's K/V go
    queries: list[tuple[int, int]]  # per sequence: its new tokens [start, end) in the packed batch
    context: list[torch.Tensor]  # per sequence: the slots of its whole context, new tokens included

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
    for i, (start, end) in enumerate(tgis_step.queries):
        k, v = cache.read(layer, tgis_step.context[i])
        q = query[:, :, start:end, :]
        mask = tgis_step.mask(i, sliding_window)
        if mask is None and end - start == 1 and groups > 1:
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
