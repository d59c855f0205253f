"""The paged KV cache of the `tgis_native` engine: fixed-size blocks of token slots, a pool
that hands them out, per-request block tables and their one owner.

    slot = block * block_size + position % block_size          (position = token index in its sequence)
    cache.layers[layer]: [2 (K, V), kv_heads, num_blocks + 1, block_size * head_dim]

A SequenceKV grows its block table as tokens are written (`reserve`) and gives back the blocks of
tokens it forgets (`truncate`: rejected speculative candidates). `KVAllocations` owns every
request's SequenceKV by request id: the engine opens one when a request arrives and releases
it when the request leaves every batch (prune, cancel, error, a dropped or failed batch,
ClearCache: the BatchManager says which ids left after every call), which gives its blocks back
to the pool. Nothing depends on garbage collection.

Prefix caching: every full block of a prompt has a key chaining a hash of all tokens up to its
end (prefix_keys). Written prompt blocks are registered under their keys, and when a request
leaves, the full blocks of what it generated too (`offer`); a new request whose prompt starts
with registered keys takes those blocks (reference-counted, shared read-only) and skips their
prefill. A cached block nobody references stays until the pool needs it back (least
recently used first).

The cache tensors are allocated up front (`allocate`, shaped like a probe cache's layers, which
allocate on their first write), with one extra block past the pool's: the scratch block, where
the padding rows of a fixed-size decode step write (never read as anyone's context).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch


class OutOfBlocks(MemoryError):
    """The pool has fewer free blocks than a step needs (reported as RESOURCE_EXHAUSTED)."""


class BlockPool:
    """Blocks of KV slots: free, in use (reference-counted: prefix-cache hits share blocks), or
    cached and unreferenced (full prompt blocks kept for later hits, evicted least recently
    used first when free blocks run out)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs blocks: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # block -> requests holding it
        self._by_key: dict[bytes, int] = {}  # prefix key -> cached block
        self._key_of: dict[int, bytes] = {}  # cached block -> its prefix key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first

    @property
    def free(self) -> int:
        """Blocks that can be allocated now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        return len(self._key_of)

    @property
    def reclaimable(self) -> int:
        """Cached blocks that no request holds (counted as free)."""
        return len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise OutOfBlocks(f"the KV cache needs {n} more blocks and has {self.free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder of each of `blocks` (in use): a fork of a sequence reads them too."""
        for block in blocks:
            self._refs[block] += 1

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, now referenced."""
        hits = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            hits.append(block)
        return hits

    def register(self, block: int, key: bytes) -> None:
        """Keep `block` (full, in use) for later hits on `key`."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key


def prefix_keys(tokens: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """One key per full block of `tokens`, each hashing every token up to the block's end (a
    chain: equal keys mean equal prefixes). `salt` starts the chain: the soft prompt in front
    of the tokens, so that prompts behind different soft prompts never share blocks."""
    keys = []
    digest = hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = array("q", tokens[start : start + block_size]).tobytes()
        digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
        keys.append(digest)
    return keys


class SequenceKV:
    """One request's block table and the number of its tokens whose K/V are written. With
    `keys` (its prompt's prefix keys), the first blocks come from the prefix cache when cached
    (`length` starts after them) and its own full prompt blocks are registered as written.
    `max_tokens` is the longest the sequence may grow (prompt + max_new_tokens): the blocks it
    may still take are `reserved_blocks`. `free` gives its blocks back (KVAllocations calls it)."""

    def __init__(self, pool: BlockPool, keys: Sequence[bytes] = (), max_tokens: int = 0) -> None:
        self.pool = pool
        self.keys = list(keys)
        self.blocks: list[int] = pool.lookup(self.keys)
        self.length = len(self.blocks) * pool.block_size
        self.registered = len(self.blocks)
        self.max_blocks = -(-max_tokens // pool.block_size)
        # what it holds, for `offer` when it leaves: (placeholder tokens in front, the token ids
        # after them as they grow, the prefix keys' salt); None: nothing offered
        self.source: tuple[int, list[int], str] | None = None

    @property
    def reserved_blocks(self) -> int:
        """Blocks this sequence may still take before it reaches max_tokens."""
        return max(0, self.max_blocks - len(self.blocks))

    def register_written(self) -> None:
        """Offer the prompt blocks that are full and written to the prefix cache."""
        full = min(len(self.keys), self.length // self.pool.block_size)
        for index in range(self.registered, full):
            self.pool.register(self.blocks[index], self.keys[index])
        self.registered = max(self.registered, full)

    def offer(self, tokens: Sequence[int], salt: str = "") -> None:
        """Offer the full written blocks past the registered ones to the prefix cache, under the
        keys of `tokens` (what the sequence holds from its first: its prompt, then what it
        generated; those of it whose K/V are written count), so that a later prompt that goes
        on from them (a chat's next turn, a preempted request resumed) finds them."""
        size = self.pool.block_size
        full = min(self.length, len(tokens)) // size
        if full <= self.registered:
            return
        keys = prefix_keys(tokens[: full * size], size, salt)
        for index in range(self.registered, full):
            self.pool.register(self.blocks[index], keys[index])
        self.registered = full

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens after `length`."""
        needed = -(-(self.length + tokens) // self.pool.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))

    def append(self, tokens: int) -> int:
        """Take `tokens` more tokens after `length` (blocks reserved, length advanced); returns
        the position of the first of them."""
        begin = self.length
        self.reserve(tokens)
        self.length = begin + tokens
        return begin

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (speculative candidates the model rejected): the
        blocks past it go back to the pool. Never shorter than the registered prompt blocks."""
        if length > self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        keep = max(-(-length // self.pool.block_size), self.registered)
        self.length = length
        if keep < len(self.blocks):
            self.blocks, dropped = self.blocks[:keep], self.blocks[keep:]
            self.pool.release(dropped)

    def fork(self) -> tuple[SequenceKV, tuple[int, int] | None]:
        """A sequence with the same tokens that grows on its own: a second candidate chain of
        speculative decoding. It shares the full blocks (read-only, one reference more each) and
        takes a fresh block for the partial last one, returned as (source, copy) for the caller
        to copy on the device before anything is written (None: no partial block). Give it back
        with `free`, or make it this sequence's with `adopt`."""
        size = self.pool.block_size
        full = self.length // size
        shared = self.blocks[:full]
        copy: tuple[int, int] | None = None
        blocks = list(shared)
        if self.length % size:
            blocks += self.pool.allocate(1)
            copy = (self.blocks[full], blocks[-1])
        self.pool.share(shared)
        child = SequenceKV(self.pool)
        child.blocks, child.length = blocks, self.length
        child.registered, child.max_blocks = min(self.registered, full), self.max_blocks
        return child, copy

    def fork_blocks(self, tokens: int) -> int:
        """Blocks a fork takes to grow by `tokens` (its partial block's copy included)."""
        size = self.pool.block_size
        return -(-(self.length + tokens) // size) - self.length // size

    def adopt(self, fork: SequenceKV) -> None:
        """Take `fork`'s tokens and blocks as this sequence's (the candidate chain that won);
        this sequence's own blocks past the shared ones go back to the pool."""
        old, self.blocks, self.length = self.blocks, fork.blocks, fork.length
        fork.blocks = []
        self.pool.release(old)

    def slot(self, position: int) -> int:
        size = self.pool.block_size
        return self.blocks[position // size] * size + position % size

    def slots(self, start: int, end: int) -> list[int]:
        return [self.slot(p) for p in range(start, end)]

    def free(self) -> None:
        """Give every block back to the pool (cached prompt blocks stay cached)."""
        blocks, self.blocks = self.blocks, []
        self.pool.release(blocks)


class KVAllocations:
    """The one owner of the pool's blocks: each live request's SequenceKV, by request id."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._sequences: dict[int, SequenceKV] = {}

    def open(self, request_id: int, keys: Sequence[bytes], max_tokens: int) -> SequenceKV:
        """The new request's sequence (its prefix-cache hits already taken)."""
        if request_id in self._sequences:
            raise ValueError(f"request {request_id} already holds KV blocks")
        sequence = self._sequences[request_id] = SequenceKV(self.pool, keys, max_tokens)
        return sequence

    def get(self, request_id: int) -> SequenceKV | None:
        """The request's sequence (None: it holds no blocks)."""
        return self._sequences.get(request_id)

    def release(self, request_ids: Iterable[int]) -> None:
        """Free the blocks of these requests (ids that hold none are ignored), their full
        written blocks offered to the prefix cache first where they have a `source`."""
        for request_id in request_ids:
            sequence = self._sequences.pop(request_id, None)
            if sequence is None:
                continue
            if sequence.source is not None:
                placeholders, ids, salt = sequence.source
                sequence.offer([0] * placeholders + ids, salt)
            sequence.free()

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def reserved_blocks(self) -> int:
        """Blocks the live requests may still take at their longest."""
        return sum(sequence.reserved_blocks for sequence in self._sequences.values())


class PagedKVCache:
    """Per layer one tensor [2 (K, V), kv_heads, num_blocks + 1, block_size * head_dim]: a block
    of one head is one contiguous run. V blocks are [block_size, head_dim] (a row per token); K
    blocks the same, or with `transposed_keys` [head_dim, block_size] (a row per dimension: the
    layout our CPU decode kernel reads, one vector load per dimension of 16 keys). The last
    block is the scratch block (`scratch_slot`). Gathering whole blocks for a batch of sequences
    (`read_blocks`) copies block-sized runs."""

    def __init__(self, pool: BlockPool, device: torch.device, transposed_keys: bool = False) -> None:
        self.pool = pool
        self.device = device
        self.transposed_keys = transposed_keys
        self.num_blocks = pool.num_blocks + 1  # + the scratch block
        self.layers: dict[int, torch.Tensor] = {}

    @property
    def slots(self) -> int:
        """Slots of the pool's blocks (the scratch block not counted)."""
        return self.pool.num_blocks * self.pool.block_size

    @property
    def scratch_slot(self) -> int:
        """A slot that no sequence owns: padding rows write their K/V there."""
        return self.pool.num_blocks * self.pool.block_size

    def allocate(self, like: PagedKVCache) -> None:
        """Allocate every layer now, with the heads, head size and dtype of `like`'s layers."""
        for layer, kv in like.layers.items():
            shape = (
                2,
                kv.shape[1],
                self.num_blocks,
                kv.shape[3] // like.pool.block_size * self.pool.block_size,
            )
            self.layers[layer] = torch.zeros(shape, dtype=kv.dtype, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: [kv_heads, tokens, head_dim] for `slots` [tokens]."""
        kv = self.layers.get(layer)
        kv_heads, dim = key.shape[0], key.shape[-1]
        if kv is None:  # a probe cache: allocated at its first write
            shape = (2, kv_heads, self.num_blocks, self.pool.block_size * dim)
            kv = self.layers[layer] = torch.zeros(shape, dtype=key.dtype, device=self.device)
        all_slots = self.num_blocks * self.pool.block_size
        if not self.transposed_keys:
            kv.view(2, kv_heads, all_slots, dim).index_copy_(2, slots, torch.stack((key, value)))
            return
        kv[1].view(kv_heads, all_slots, dim).index_copy_(1, slots, value)
        size = self.pool.block_size
        keys = kv[0].view(kv_heads, self.num_blocks, dim, size).permute(1, 3, 0, 2)  # [blocks, size, h, d]
        keys.index_put_((slots // size, slots % size), key.transpose(0, 1))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer: K and V of every head."""
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], device=self.device)
        target = torch.tensor([d for _, d in pairs], device=self.device)
        for kv in self.layers.values():
            kv.index_copy_(2, target, kv.index_select(2, source))

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` [n], in order: [kv_heads, n * block_size, head_dim] each."""
        kv = self.layers[layer].index_select(2, blocks)
        kv_heads, size = kv.shape[1], self.pool.block_size
        dim = kv.shape[-1] // size
        values = kv[1].view(kv_heads, -1, dim)
        if not self.transposed_keys:
            return kv[0].view(kv_heads, -1, dim), values
        keys = kv[0].view(kv_heads, -1, dim, size).transpose(-1, -2).reshape(kv_heads, -1, dim)
        return keys, values

    def bytes(self) -> int:
        """Bytes of the pool's blocks in every layer (the scratch block not counted)."""
        return sum(
            t.numel() * t.element_size() * self.pool.num_blocks // self.num_blocks
            for t in self.layers.values()
        )
