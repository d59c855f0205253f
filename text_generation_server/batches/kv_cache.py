"""KV caches of left-padded batches: preallocated layers, and row/length surgery on them.

Every layer holds keys/values [batch, heads, seq, head_dim] (transformers 5 uses this layout for
every architecture we serve, BLOOM and GPT-NeoX included). Sequences are left-padded, so the
newest position of every row is the last column, and shrinking or growing the padding is a cut
or a zero-fill on the left:

    row 0:  . . k k k k _ _ _      (. = padding, masked out by the attention mask)
    row 1:  k k k k k k _ _ _      (_ = room preallocated for the tokens still to come)
             <-- seq -->

PaddedKVLayer keeps each tensor in a buffer with room for the batch's remaining tokens, so a
decode step writes one column in place (transformers' DynamicLayer copies the whole cache on
every step). The batch classes give the capacity: the longest row plus the most tokens any row
may still generate — the same rectangle the router's batch weights budget for.
Callers: the padded batch classes (prefill cache, prune, concatenate) and the memory probe.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import Cache, DynamicLayer


def pad_left(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """Zero-fill `t` on the left of dimension `dim` up to `width` (KV tensors, masks, hidden states)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return torch.nn.functional.pad(t, pad)


class PaddedKVLayer(DynamicLayer):
    """A dynamic layer whose keys and values are views of buffers with room to grow."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity  # positions to allocate at the first update
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> PaddedKVLayer:
        """A layer that holds `keys`/`values` (copied) with room for `capacity` positions."""
        layer = cls(capacity)
        layer.update(keys, values)
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self._key_buffer is not None and self.keys is not None else 0
        needed = length + key_states.shape[-2]
        if self._key_buffer is None or needed > self._key_buffer.shape[-2]:
            # Out of room (a caller's estimate was short): double, as a list would.
            grown = max(needed, self.capacity, 2 * length)
            self._key_buffer = self._grow(self._key_buffer, key_states, length, grown)
            self._value_buffer = self._grow(self._value_buffer, value_states, length, grown)
        assert self._value_buffer is not None
        self._key_buffer[:, :, length:needed] = key_states
        self._value_buffer[:, :, length:needed] = value_states
        self.keys = self._key_buffer[:, :, :needed]
        self.values = self._value_buffer[:, :, :needed]
        return self.keys, self.values

    @staticmethod
    def _grow(old: torch.Tensor | None, like: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        buffer = like.new_empty((batch, heads, capacity, dim))
        if old is not None and length:
            buffer[:, :, :length] = old[:, :, :length]
        return buffer


def new_cache(seq2seq: bool, capacity: int) -> Cache:
    """An empty cache of preallocating layers for a prefill (`capacity` self-attention positions).

    NOTE: built without the model config on purpose: with a config, transformers gives models
    that declare a sliding window (Mistral, Phi-3, Gemma 2, ...) sliding layers, which keep only
    the last window of positions and cannot be cut and padded row by row. Attention masks still
    apply the window, so the outputs are the same; the cache simply keeps every position.
    """
    layers = DynamicCache()
    # A factory where transformers expects a class: it only ever calls it.
    layers.layer_class_to_replicate = functools.partial(PaddedKVLayer, capacity)  # type: ignore[assignment]
    if not seq2seq:
        return layers
    return EncoderDecoderCache(layers, DynamicCache())  # cross-attention is written once


def dynamic_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, which must all be plain dynamic layers (no sliding windows)."""
    layers: list[DynamicLayer] = []
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, PaddedKVLayer):
            raise NotImplementedError(
                f"padded batches support plain dynamic KV layers only, not {type(layer).__name__}"
            )
        assert isinstance(layer, DynamicLayer)
        layers.append(layer)
    return layers


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of the positions the cache holds (preallocated room not counted)."""
    return sum(
        t.numel() * t.element_size()
        for layer in dynamic_layers(cache)
        for t in (layer.keys, layer.values)
        if t is not None
    )


def _rebuilt(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], capacity: int | None) -> DynamicCache:
    """A cache holding these (keys, values); preallocating layers when `capacity` is given."""
    if capacity is None:
        return DynamicCache(ddp_cache_data=list(layers))
    cache = DynamicCache()
    cache.layers = [PaddedKVLayer.holding(k, v, capacity) for k, v in layers]
    return cache


def select(
    cache: Cache,
    rows: torch.Tensor,
    keep_last: int,
    capacity: int,
    cross_keep_last: int | None = None,
) -> Cache:
    """A cache of `rows` (in that order) keeping the last `keep_last` positions of every layer,
    with room for `capacity` positions.

    For encoder-decoder caches `keep_last` and `capacity` apply to self-attention and
    `cross_keep_last` (None = all) to cross-attention, which does not grow.
    """
    if isinstance(cache, EncoderDecoderCache):
        self_part = select(cache.self_attention_cache, rows, keep_last, capacity)
        cross = _selected(
            cache.cross_attention_cache, rows, cross_keep_last if cross_keep_last is not None else -1
        )
        return EncoderDecoderCache(self_part, _rebuilt(cross, None))
    assert isinstance(cache, DynamicCache)
    return _rebuilt(_selected(cache, rows, keep_last), capacity)


def _selected(
    cache: DynamicCache, rows: torch.Tensor, keep_last: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kept = []
    for layer in dynamic_layers(cache):
        assert layer.keys is not None and layer.values is not None
        seq = layer.keys.shape[-2]
        start = 0 if keep_last < 0 else seq - keep_last
        kept.append(
            (layer.keys[:, :, start:].index_select(0, rows), layer.values[:, :, start:].index_select(0, rows))
        )
    return kept


def _stacked(caches: Sequence[DynamicCache], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    stacked = []
    for per_batch in zip(*(dynamic_layers(c) for c in caches), strict=True):
        keys = torch.cat([pad_left(layer.keys, length, dim=2) for layer in per_batch])
        values = torch.cat([pad_left(layer.values, length, dim=2) for layer in per_batch])
        stacked.append((keys, values))
    return stacked


def concatenate(
    caches: Sequence[Cache], length: int, capacity: int, cross_length: int | None = None
) -> Cache:
    """Stack caches along the batch dimension, left-padding each to `length` positions, with room
    for `capacity` (`cross_length` for the cross-attention part of encoder-decoder caches)."""
    if isinstance(caches[0], EncoderDecoderCache):
        enc_dec = [c for c in caches if isinstance(c, EncoderDecoderCache)]
        assert cross_length is not None and len(enc_dec) == len(caches)
        return EncoderDecoderCache(
            _rebuilt(_stacked([c.self_attention_cache for c in enc_dec], length), capacity),
            _rebuilt(_stacked([c.cross_attention_cache for c in enc_dec], cross_length), None),
        )
    dynamic = [c for c in caches if isinstance(c, DynamicCache)]
    assert len(dynamic) == len(caches)
    return _rebuilt(_stacked(dynamic, length), capacity)
