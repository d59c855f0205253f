"""Rows to fp8 in Triton: each row of a [rows, width] tensor scaled by its largest magnitude and
rounded to float8 e4m3, in one launch (a program per row reads the whole row once, keeps it in
registers, takes max |x|, then writes the fp8 values and the row's float32 scale). It serves
quantization/fp8.py's activations, once per fp8 linear and call; the grid depends only on the
number of rows, and the host reads no value, so CUDA graphs capture it.

    x      [rows, width]  bf16 / fp16 / fp32, rows contiguous (any row stride)
    -> q   [rows, width]  float8 e4m3, q = clamp(x / scale, -fp8_max, fp8_max)
    -> s   [rows, 1]      float32, s = max(max |x|, tiny) / fp8_max

Checked against quantization/fp8.py's torch operations on a GPU (tests/test_fp8.py, marked gpu).
"""

from __future__ import annotations  # also keeps `tl.constexpr` unevaluated where Triton is missing

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: ImportError | None = None
except ImportError as error:  # the CPU build works without Triton
    triton = None
    tl = None
    _IMPORT_ERROR = error

MAX_WIDTH = 1 << 16  # a row lives in one program's registers


def available() -> bool:
    """Whether Triton imports here."""
    return _IMPORT_ERROR is None


def quantize_rows(x: torch.Tensor, fp8_max: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values [rows, width], float32 scales [rows, 1]) of the rows of CUDA tensor `x`."""
    rows, width = x.shape
    if width > MAX_WIDTH or x.stride(1) != 1:
        raise ValueError(
            f"rows to fp8 take contiguous rows of at most {MAX_WIDTH} values, got {tuple(x.shape)}"
        )
    values = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        warps = 4 if block <= 4096 else 8 if block <= 16384 else 16
        _kernel()[(rows,)](x, values, scales, width, x.stride(0), fp8_max, tiny, BLOCK=block, num_warps=warps)
    return values, scales


@functools.cache
def _kernel() -> Any:
    @triton.jit
    def rows_to_fp8(x_ptr, q_ptr, s_ptr, width, stride, fp8_max, tiny, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(x_ptr + row * stride + cols, mask=inside, other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), tiny), fp8_max)  # IEEE division, as torch's
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(s_ptr + row, scale)

    return rows_to_fp8
