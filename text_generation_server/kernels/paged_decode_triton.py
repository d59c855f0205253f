"""Paged decode attention in Triton: one new token per sequence attends to its keys where they lie
in the paged KV cache (split-K flash decoding). Reached only through the attention backend
(text_generation_server/attention/), which passes one layer of the cache and the step's decode rows.

Layout (kv/paged_kv.py, keys not transposed):

    query   [rows, heads, dim]                    the one new token of each row
    cache   [2 (K, V), kv_heads, num_blocks, block_size * dim]
            cache[0, h, b].view(block_size, dim)[t] = key of slot b * block_size + t
    tables  [rows, width]  int64                  physical block of each logical block of a row
                                                  (entries past a row's length are never read)
    lengths [rows]         int64                  keys of a row, the new one included; 0 = padding
    -> out  [rows, heads, dim]                    query's dtype; zeros for padding rows

Algorithm, two launches (one when num_splits == 1):

    1. grid (rows, kv_heads, num_splits): a program takes one KV head and the `group` query heads
       that share it (heads // kv_heads, padded to >= 16 rows for tl.dot), and the keys of its
       split: logical blocks [s * per_split, (s + 1) * per_split), per_split = ceil(width /
       num_splits), clipped to the row's length and window. It walks them TILE tokens at a
       time, each token's block looked up in the table (so tiles may straddle blocks and
       block_size need not be a power of two), with an online softmax in float32 (scores in
       log2 units: exp2):
           scores [G, TILE] = q [G, D] @ K^T [D, TILE] * scale * log2(e)
           m, l, acc [G, D]  running max, sum of exp2, weighted sum of V
       and writes acc / l [G, D] and lse = m + log2(l) per (row, head, split); a split with no
       keys (past the length, before the window, or a padding row) writes 0 and lse = -inf.
    2. grid (rows, heads): lse-weighted combination of the splits (weights exp2(lse - max));
       a row whose splits are all empty gets zeros, never NaN.

The grid depends only on rows, kv_heads, heads and num_splits, never on tensor values, and the
host reads no value of a tensor: a CUDA graph captures the call and replays it with new tables
and lengths.

Tested on the CPU under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported;
the kernels are jitted at first call) against a plain torch reference
(tests/engines/test_triton_decode.py).
"""

from __future__ import annotations  # also keeps `tl.constexpr` unevaluated where Triton is missing

import functools
import math
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: ImportError | None = None
except ImportError as error:  # the CPU build works without Triton; this backend does not
    triton = None
    tl = None
    _IMPORT_ERROR = error

_LOG2_E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


def available() -> bool:
    """Whether Triton imports here (the kernel then runs on CUDA, or on the CPU when interpreted)."""
    return _IMPORT_ERROR is None


def paged_decode(
    query: torch.Tensor,  # [rows, heads, dim] fp16 / bf16 / fp32
    cache: torch.Tensor,  # [2, kv_heads, num_blocks, block_size * dim], query's dtype
    tables: torch.Tensor,  # [rows, width] int64 (int32 also works)
    lengths: torch.Tensor,  # [rows] int64, 0 = padding row
    block_size: int,
    scale: float,
    window: int | None,  # only the last `window` keys count; None = all
    num_splits: int,  # split-K: fixed number of key ranges per row (the launch grid's third axis)
) -> torch.Tensor:  # [rows, heads, dim], query's dtype
    """Attention of each row's one query over its first `lengths[row]` cached keys."""
    split_kernel, combine_kernel, interpret = _kernels()
    rows, heads, dim = query.shape
    kv_heads, width = cache.shape[1], tables.shape[1]
    _check(query, cache, tables, lengths, block_size, window, num_splits)
    if query.device.type == "cpu" and not interpret:
        raise ValueError(
            "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)"
        )
    group = heads // kv_heads
    out = torch.empty((rows, heads, dim), dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    block_d = max(_MIN_DOT, triton.next_power_of_2(dim))
    tile = 64 if block_d <= 128 else 32  # keeps the K/V tiles [tile, block_d] in registers
    direct = num_splits == 1
    # NOTE: Triton's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 bits;
    # interpreted, bf16 tiles are widened to float32 before each dot (compiled, they stay bf16).
    upcast = interpret and query.dtype == torch.bfloat16
    if direct:  # the one split writes the output itself
        partial = lse = out  # unused placeholders
    else:
        partial = torch.empty((rows, heads, num_splits, dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=query.device)
    split_kernel[(rows, kv_heads, num_splits)](
        query, cache, tables, lengths, out, partial, lse,
        scale * _LOG2_E, window or 0,
        query.stride(0), query.stride(1), query.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        tables.stride(0), tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        dim, group, heads, num_splits, math.ceil(width / num_splits),
        BLOCK_SIZE=block_size,
        GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        TILE=tile,
        USE_WINDOW=window is not None,
        DIRECT=direct,
        UPCAST_DOT=upcast,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
    )  # fmt: skip
    if not direct:
        combine_kernel[(rows, heads)](
            partial, lse, out,
            out.stride(0), out.stride(1), out.stride(2),
            dim, heads, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )  # fmt: skip
    return out


def _check(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    window: int | None,
    num_splits: int,
) -> None:
    """Shape and argument checks (shapes only: nothing here reads a tensor's values)."""
    rows, heads, dim = query.shape
    if cache.dim() != 4 or cache.shape[0] != 2 or cache.shape[3] != block_size * dim:
        raise ValueError(f"cache {tuple(cache.shape)} is not [2, kv_heads, blocks, {block_size} * {dim}]")
    if heads % cache.shape[1]:
        raise ValueError(f"{heads} query heads do not share {cache.shape[1]} KV heads evenly")
    if cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {cache.dtype} differs from the query's {query.dtype}")
    if tables.dim() != 2 or tables.shape[0] != rows or tuple(lengths.shape) != (rows,):
        raise ValueError(
            f"tables {tuple(tables.shape)} / lengths {tuple(lengths.shape)} do not fit {rows} rows"
        )
    if num_splits < 1 or (window is not None and window < 1):
        raise ValueError(f"num_splits {num_splits} and window {window} must be positive")


@functools.cache
def _kernels() -> tuple[Any, Any, bool]:
    """(split kernel, combine kernel, whether Triton interprets them on the CPU), jitted at first use.

    NOTE: interpreting is a process-wide choice made by TRITON_INTERPRET=1 before triton is first
    imported (triton.language's own helpers are jitted at import, in that mode); triton.jit reads
    the same flag again here. The flag is Triton's own switch, read the way Triton reads it."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "the Triton paged-decode kernel needs the `triton` package (pip install triton; it ships "
            "with CUDA builds of torch)"
        ) from _IMPORT_ERROR
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; 3.3 reads the variable directly
    interpret = bool(knobs.runtime.interpret) if knobs is not None else _env_interpret()
    return triton.jit(_split_kernel), triton.jit(_combine_kernel), interpret


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _split_kernel(
    q_ptr, cache_ptr, tables_ptr, lengths_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2, window,
    stride_qr, stride_qh, stride_qd,
    stride_ckv, stride_ch, stride_cb, stride_ce,
    stride_tr, stride_tw,
    stride_or, stride_oh, stride_od,
    dim, group, heads, num_splits, blocks_per_split,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (row, KV head, split): online softmax of the KV head's query group over the split's keys."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + row).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)  # [G] query heads of this KV head (padded)
    d = tl.arange(0, BLOCK_D)  # [D]
    n = tl.arange(0, TILE)  # [T]
    head = kv_head * group + g
    g_mask = g < group
    d_mask = d < dim
    gd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row * stride_qr + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=gd_mask, other=0.0
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # keys [lo, hi) of this split:  | split 0 | split 1 | ... |  (blocks_per_split blocks each)
    lo = split * blocks_per_split * BLOCK_SIZE
    hi = tl.minimum(lo + blocks_per_split * BLOCK_SIZE, length)
    if USE_WINDOW:
        lo = tl.maximum(lo, length - window)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)  # running sum of exp2(...) * V
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_ch  # one layer's cache may pass 2**31 elements
    v_base = k_base + stride_ckv
    for start in range(lo, hi, TILE):
        t = start + n  # [T] key positions in the row
        t_mask = t < hi
        block = tl.load(tables_ptr + row * stride_tr + (t // BLOCK_SIZE) * stride_tw, mask=t_mask, other=0)
        offset = (
            block.to(tl.int64)[:, None] * stride_cb
            + ((t % BLOCK_SIZE)[:, None] * dim + d[None, :]) * stride_ce
        )
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offset, mask=kv_mask, other=0.0)  # [T, D]
        v = tl.load(v_base + offset, mask=kv_mask, other=0.0)  # [T, D]
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G, T]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile holds a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [G, T]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [G, D]; 0 where the split is empty
    if DIRECT:
        out = out_ptr + row * stride_or + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        index = (row * heads + head) * num_splits + split  # [G] into lse [rows, heads, splits]
        tl.store(part_ptr + index[:, None] * dim + d[None, :], result, mask=gd_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + index, lse, mask=g_mask)


def _combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_or, stride_oh, stride_od,
    dim, heads, num_splits,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (row, head): the splits' partial outputs [S, D] weighted by exp2(lse - max lse)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)  # [S]
    d = tl.arange(0, BLOCK_D)  # [D]
    s_mask = s < num_splits
    base = (row * heads + head) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: weights 0, output 0
    weight = tl.exp2(lse - top)  # [S]
    total = tl.sum(weight, 0)
    mask = s_mask[:, None] & (d[None, :] < dim)
    partial = tl.load(part_ptr + (base + s)[:, None] * dim + d[None, :], mask=mask, other=0.0)  # [S, D]
    result = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    out = out_ptr + row * stride_or + head * stride_oh + d * stride_od
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=d < dim)
