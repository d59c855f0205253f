"""Decode attention with torch's SDPA over gathered blocks (any device, any dtype; not graphable).

Per step (`prepare`): the rows' block tables, cut to the longest row's blocks, become one gather
index [D * B]; an additive key-padding mask [D, 1, 1, L] is built only when the rows' lengths
differ or a sliding window cuts. Per layer (`decode`): the blocks are gathered into a padded
[D, kv_heads, L, dim] copy (whole blocks, PagedKVCache.read_blocks) and attended in one SDPA
call with the query heads packed per KV head (one query row per head of the group): on CPU an
order of magnitude faster in bfloat16 than SDPA's enable_gqa path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from text_generation_server.attention.backend import AttentionBackend, DecodeRows
from text_generation_server.kv.paged_kv import PagedKVCache


@dataclass(slots=True)
class GatherPlan:
    blocks: torch.Tensor  # [D * B] the rows' first B blocks, row after row
    keys: int  # L: the longest row's keys
    mask: torch.Tensor | None  # additive [D, 1, 1, L]; None: every row has all L keys


def decode_mask(lengths: torch.Tensor, keys: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [D, 1, 1, keys] of single-token queries over padded contexts of `lengths`
    [D] keys each (0 = attend, -inf = padding or outside the window)."""
    ends = lengths.unsqueeze(1)
    cols = torch.arange(keys, device=lengths.device).unsqueeze(0)
    blocked = cols >= ends
    if window is not None:
        blocked |= cols < ends - window
    mask = torch.zeros(blocked.shape, dtype=dtype, device=lengths.device).masked_fill_(blocked, float("-inf"))
    return mask[:, None, None, :]


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def prepare(self, rows: DecodeRows, cache: PagedKVCache, dtype: torch.dtype) -> GatherPlan:
        keys, window = rows.max_length, rows.window
        width = -(-keys // cache.pool.block_size)
        uniform = rows.min_length == keys and (window is None or keys <= window)
        mask = None if uniform else decode_mask(rows.lengths, keys, window, dtype)
        return GatherPlan(rows.tables[:, :width].reshape(-1), keys, mask)

    def decode(
        self, rows: DecodeRows, plan: Any, cache: PagedKVCache, layer: int, query: torch.Tensor, scale: float
    ) -> torch.Tensor:
        assert isinstance(plan, GatherPlan)
        count, heads, dim = query.shape
        kv_heads = cache.layers[layer].shape[1]
        packed = query.reshape(count, kv_heads, heads // kv_heads, dim)  # query heads packed per KV head
        k, v = (
            t.view(kv_heads, count, -1, dim)[:, :, : plan.keys].transpose(0, 1)
            for t in cache.read_blocks(layer, plan.blocks)
        )
        out = sdpa(packed, k, v, attn_mask=plan.mask, scale=scale)
        return out.reshape(count, heads, dim)  # [D, kv_heads, groups, dim] -> [D, heads, dim]
