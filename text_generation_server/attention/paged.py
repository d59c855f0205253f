"""Attention over the paged KV cache, plugged into transformers' model classes.

`register()` adds NAME to transformers' attention interface (and a mask function that builds no
dense mask); a model loaded with `attn_implementation=NAME` then calls `paged_attention` in every
layer with the packed batch's new tokens and the step's `StepLayout` (layout.py, passed through
the model's forward kwargs as `tgis_step`):

    query [1, heads, T, d], key/value [1, kv_heads, T, d]    T = all sequences' new tokens, packed
    1. write the new K/V into the cache at layout.slots
    2. the single-token rows together, by the step's attention backend (backend.py)
    3. every other sequence alone with SDPA (layout.Alone)
    -> [1, T, heads, d]
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from text_generation_server.attention.layout import StepLayout

NAME = "tgis_paged"


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
    groups = heads // key.shape[1]
    rows = tgis_step.decode
    if rows is not None:
        scale = scaling if scaling is not None else dim**-0.5
        q = query[0, :, rows.tokens, :].transpose(0, 1)  # [D, heads, dim]
        result = tgis_step.backend.decode(rows, tgis_step.plan, cache, layer, q, scale)
        if rows.rows == tgis_step.tokens:  # decode only: the rows are the whole packed batch, in order
            return result.unsqueeze(0), None
    out = query.new_empty((1, query.shape[2], heads, dim))
    if rows is not None:
        out[0, rows.tokens] = result
    for alone in tgis_step.others:
        start, end = alone.start, alone.end
        q = query[:, :, start:end, :]
        if alone.blocks is None:
            k, v = key[:, :, start:end, :], value[:, :, start:end, :]
        else:
            k, v = cache.read_blocks(layer, alone.blocks)
            k, v = k[None, :, : alone.keys], v[None, :, : alone.keys]
        causal = alone.mask is None
        attended = sdpa(q, k, v, attn_mask=alone.mask, is_causal=causal, scale=scaling, enable_gqa=groups > 1)
        out[:, start:end] = attended.transpose(1, 2)
    return out, None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of NAME: the attention builds its own per-sequence masks."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, no_mask)
