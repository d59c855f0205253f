"""Decode attention on our C++ CPU kernel (kernels/cpu_kernels.py, csrc/paged_decode_cpu.cpp):
each row attends straight from its blocks, no gather, no mask; K blocks stored transposed."""

from __future__ import annotations

from typing import Any

import torch

from text_generation_server.attention.backend import AttentionBackend, DecodeRows
from text_generation_server.kernels import cpu_kernels
from text_generation_server.kv.paged_kv import PagedKVCache


class CpuKernelBackend(AttentionBackend):
    name = "cpu_kernel"
    transposed_keys = True
    graphable = True  # reads tables and lengths only (CPU: no capture, but the same discipline)

    def decode(
        self, rows: DecodeRows, plan: Any, cache: PagedKVCache, layer: int, query: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return cpu_kernels.paged_decode(
            query, cache.layers[layer], rows.tables, rows.lengths, cache.pool.block_size, scale, rows.window
        )
