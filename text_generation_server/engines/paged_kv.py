"""The paged KV cache of the `tgis_native` engine: fixed-size blocks of token slots, a pool
that hands them out, and per-request block tables.

    slot = block * block_size + position % block_size          (position = token index in its sequence)
    keys[layer], values[layer]: [num_blocks * block_size, kv_heads, head_dim]

A SequenceKV grows its block table as tokens are written (`reserve`); its blocks go back to
the pool when the SequenceKV is garbage-collected (weakref.finalize), so every way a request
leaves a batch (prune, cancel, error, a dropped or failed batch, ClearCache) frees them.
Layers allocate their tensors on first write, in the dtype and device of the keys they get.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch


class OutOfBlocks(MemoryError):
    """The pool has fewer free blocks than a step needs (reported as RESOURCE_EXHAUSTED)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs blocks: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"the KV cache needs {n} more blocks and has {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class SequenceKV:
    """One request's block table and the number of its tokens whose K/V are written."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        weakref.finalize(self, pool.release, self.blocks)

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens after `length`."""
        needed = -(-(self.length + tokens) // self.pool.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))

    def slots(self, start: int, end: int) -> list[int]:
        size = self.pool.block_size
        return [self.blocks[p // size] * size + p % size for p in range(start, end)]

    def context_slots(self, device: torch.device) -> torch.Tensor:
        """The slots of tokens [0, length), as a tensor."""
        size = self.pool.block_size
        blocks = torch.tensor(self.blocks, device=device)
        return (blocks.unsqueeze(1) * size + torch.arange(size, device=device)).reshape(-1)[: self.length]


class PagedKVCache:
    def __init__(self, pool: BlockPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def slots(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: [tokens, kv_heads, head_dim] for `slots` [tokens]."""
        if layer not in self.keys:
            shape = (self.slots, *key.shape[1:])
            self.keys[layer] = torch.zeros(shape, dtype=key.dtype, device=self.device)
            self.values[layer] = torch.zeros(
                (self.slots, *value.shape[1:]), dtype=value.dtype, device=self.device
            )
        self.keys[layer].index_copy_(0, slots, key)
        self.values[layer].index_copy_(0, slots, value)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots`, [1, kv_heads, len(slots), head_dim] each."""
        key = self.keys[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        value = self.values[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        return key, value

    def read_padded(self, layer: int, slots: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` padded contexts (`slots` [rows * L]), [rows, kv_heads, L, head_dim] each."""
        key = self.keys[layer].index_select(0, slots)
        value = self.values[layer].index_select(0, slots)
        key = key.reshape(rows, -1, *key.shape[1:]).transpose(1, 2)
        return key, value.reshape(rows, -1, *value.shape[1:]).transpose(1, 2)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
