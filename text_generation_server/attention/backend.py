"""The contract of a paged decode-attention backend, and the decode rows every backend gets.

A backend owns three things (picked once per engine by name, attention/__init__.py):
  - the cache layout it reads (`transposed_keys`: K blocks [dim, block_size] instead of
    [block_size, dim]; paged_kv.PagedKVCache stores what the backend wants),
  - the per-step work shared by every layer (`prepare`: e.g. SDPA's gather index and mask),
  - the attention of the single-token rows of a step (`decode`), straight from the cache.
Prompts and chunks are attended with SDPA by the attention hook itself (paged.py), whatever the
backend. `graphable` backends read nothing but fixed-shape tensors in `decode` (no host value
of the step, no host sync): a CUDA graph captured once per batch size replays them.

    DecodeRows: tables [D, W] int64, lengths [D] int64 (0 = a padding row: output zeros)
    decode(rows, plan, cache, layer, query [D, heads, dim], scale) -> [D, heads, dim]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from text_generation_server.kv.paged_kv import PagedKVCache


@dataclass(slots=True)
class DecodeRows:
    """The rows of a step with one new token each, as every backend receives them."""

    tokens: slice | torch.Tensor  # their query positions in the packed batch
    tables: torch.Tensor  # [D, W] int64 block tables; entries past a row's last block are unused
    lengths: torch.Tensor  # [D] int64 keys of each row, its new token included (0: padding row)
    max_length: int  # the longest row's keys (host; graphable backends never read it)
    min_length: int  # the shortest row's keys (host; likewise)
    window: int | None  # sliding window of the model (every layer), None: full attention

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])


class AttentionBackend(ABC):
    name: ClassVar[str]
    transposed_keys: ClassVar[bool] = False  # the K-block layout this backend reads
    graphable: ClassVar[bool] = False  # decode reads only fixed-shape tensors (CUDA graphs)

    def prepare(self, rows: DecodeRows, cache: PagedKVCache, dtype: torch.dtype) -> Any:
        """Per-step state every layer's `decode` shares (built once per step); None by default."""
        return None

    @abstractmethod
    def decode(
        self,
        rows: DecodeRows,
        plan: Any,
        cache: PagedKVCache,
        layer: int,
        query: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of `query` [D, heads, dim] (one token per row, its K/V already written)
        over each row's keys in layer `layer` of `cache` -> [D, heads, dim]."""
