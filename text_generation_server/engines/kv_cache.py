"""Row and length surgery on transformers KV caches of left-padded batches.

Every layer holds keys/values [batch, heads, seq, head_dim] (transformers 5 uses this layout for
every architecture we serve, BLOOM and GPT-NeoX included). Sequences are left-padded, so the
newest position of every row is the last column, and shrinking or growing the padding is a cut
or a zero-fill on the left:

    row 0:  . . k k k k        (. = padding, masked out by the attention mask)
    row 1:  k k k k k k
             <-- seq -->

Callers: the padded batch classes (prune, concatenate).
"""

from __future__ import annotations

from collections.abc import Sequence

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


def new_cache(seq2seq: bool) -> Cache:
    """An empty cache of plain dynamic layers for a prefill.

    NOTE: built without the model config on purpose: with a config, transformers gives models
    that declare a sliding window (Mistral, Phi-3, Gemma 2, ...) sliding layers, which keep only
    the last window of positions and cannot be cut and padded row by row. Attention masks still
    apply the window, so the outputs are the same; the cache simply keeps every position.
    """
    return EncoderDecoderCache(DynamicCache(), DynamicCache()) if seq2seq else DynamicCache()


def dynamic_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, which must all be plain DynamicLayers (no sliding windows)."""
    layers = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"padded batches support plain dynamic KV layers only, not {type(layer).__name__}"
            )
        layers.append(layer)
    return layers


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by every key and value tensor of the cache."""
    return sum(
        t.numel() * t.element_size()
        for layer in dynamic_layers(cache)
        for t in (layer.keys, layer.values)
        if t is not None
    )


def select(cache: Cache, rows: torch.Tensor, keep_last: int, cross_keep_last: int | None = None) -> None:
    """Keep `rows` (in that order) and the last `keep_last` positions of every layer, in place.

    For encoder-decoder caches `keep_last` applies to self-attention and `cross_keep_last`
    (None = all) to cross-attention.
    """
    if isinstance(cache, EncoderDecoderCache):
        select(cache.self_attention_cache, rows, keep_last)
        select(cache.cross_attention_cache, rows, cross_keep_last if cross_keep_last is not None else -1)
        return
    assert isinstance(cache, DynamicCache)
    for layer in dynamic_layers(cache):
        if not layer.is_initialized or layer.keys is None or layer.values is None:
            continue
        seq = layer.keys.shape[-2]
        start = 0 if keep_last < 0 else seq - keep_last
        layer.keys = layer.keys.index_select(0, rows)[:, :, start:]
        layer.values = layer.values.index_select(0, rows)[:, :, start:]


def _concat_dynamic(caches: Sequence[DynamicCache], length: int) -> DynamicCache:
    data = []
    for per_batch in zip(*(dynamic_layers(c) for c in caches), strict=True):
        keys = torch.cat([pad_left(layer.keys, length, dim=2) for layer in per_batch])
        values = torch.cat([pad_left(layer.values, length, dim=2) for layer in per_batch])
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data)


def concatenate(caches: Sequence[Cache], length: int, cross_length: int | None = None) -> Cache:
    """Stack caches along the batch dimension, left-padding each to `length` positions
    (`cross_length` for the cross-attention part of encoder-decoder caches)."""
    if isinstance(caches[0], EncoderDecoderCache):
        enc_dec = [c for c in caches if isinstance(c, EncoderDecoderCache)]
        assert cross_length is not None and len(enc_dec) == len(caches)
        return EncoderDecoderCache(
            _concat_dynamic([c.self_attention_cache for c in enc_dec], length),
            _concat_dynamic([c.cross_attention_cache for c in enc_dec], cross_length),
        )
    dynamic = [c for c in caches if isinstance(c, DynamicCache)]
    assert len(dynamic) == len(caches)
    return _concat_dynamic(dynamic, length)
