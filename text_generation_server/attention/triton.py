"""Decode attention on our Triton kernel (kernels/paged_decode_triton.py): split-K flash decoding
straight from the paged cache, query heads of one KV head packed, a fixed grid per batch size
(graphable: CUDA graphs capture it). K blocks are stored [block_size, dim], as SDPA's.

The number of splits depends only on the rows and the KV heads (so every replay of a captured
batch size launches the same grid): enough programs to fill a GPU at small batches, one split
per row and head at large ones."""

from __future__ import annotations

from typing import Any

import torch

from text_generation_server.attention.backend import AttentionBackend, DecodeRows
from text_generation_server.kernels import paged_decode_triton
from text_generation_server.kv.paged_kv import PagedKVCache

TARGET_PROGRAMS = 512  # about 4 per streaming multiprocessor of an H100 (132)
MAX_SPLITS = 16


def num_splits(rows: int, kv_heads: int) -> int:
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, rows * kv_heads)))


class TritonBackend(AttentionBackend):
    name = "triton"
    graphable = True

    def decode(
        self, rows: DecodeRows, plan: Any, cache: PagedKVCache, layer: int, query: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kv = cache.layers[layer]
        return paged_decode_triton.paged_decode(
            query,
            kv,
            rows.tables,
            rows.lengths,
            cache.pool.block_size,
            scale,
            rows.window,
            num_splits(rows.rows, kv.shape[1]),
        )
