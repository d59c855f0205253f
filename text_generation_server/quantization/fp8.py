"""Fp8 linears on GPUs with fp8 tensor cores (Hopper and newer): what QUANTIZE=fp8 makes at load.

Weights are float8 e4m3 with one float32 scale per output channel (max |w| of the channel /
448, e4m3's largest value); each call scales every token of the input the same way (max |x| of
the token / 448) and multiplies the two fp8 matrices on the tensor cores with both scales
applied to the float32 accumulators (`torch._scaled_mm` with row-wise scales): vLLM's dynamic
fp8 scheme. Weights take half the bytes of bf16 (plus 4 bytes per output channel), so a decode
step, which reads every weight once, moves half the bytes.

Off the GPU (the unit tests, and reading fp8 checkpoints) the product is its definition in float32
(values times scales, multiplied, rounded to bf16 as the GPU's product rounds its output): torch's
CPU `_scaled_mm` took row-wise scales wrongly in some releases, and no CPU serves fp8.

The input's quantization is one Triton kernel per call on CUDA (a program per token: its
largest magnitude, its scale and its fp8 values in one pass over the row), where the same in
torch operations is about eight small kernels per linear; elsewhere it is those torch
operations. Each token is quantized alone, so a request's output does not depend on the
requests batched beside it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from text_generation_server.kernels import fp8_rows_triton

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = torch.finfo(torch.float32).tiny
MULTIPLE = 16  # the fp8 product takes input and output widths that are multiples of 16
MIN_CAPABILITY = (9, 0)  # row-wise scaled fp8 products: Hopper and newer


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` [rows, width] as fp8 with its float32 scale [rows, 1]: max |row| / 448
    (max |row| at least the smallest positive float32), values rounded to the nearest fp8."""
    if x.is_cuda and fp8_rows_triton.available():
        return fp8_rows_triton.quantize_rows(x, FP8_MAX, TINY)
    wide = x.float()
    scale = wide.abs().amax(dim=-1, keepdim=True).clamp_(min=TINY) / FP8_MAX
    return (wide / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` [rows, width] as fp8 at one stored `scale` [1, 1] (a checkpoint's static
    activation scale: values beyond 448 * scale saturate), with that scale for every row."""
    values = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale.expand(x.shape[0], 1).contiguous()


class Fp8Linear(nn.Module):
    """A Linear with fp8 weights per output channel and its activations in fp8: each token at its
    own scale, or every token at the layer's stored one (`input_scale`)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_scale: float | None = None,
    ):
        """`weight` [out, in] fp8 e4m3, `scales` [out] float32 (the weight is weight * scales per
        row), `bias` [out] or None; `dtype` is the model's (the dtype of inputs and outputs);
        `input_scale`: a checkpoint's static activation scale (None: each token's max |x| / 448)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if weight.dtype != FP8:
            raise ValueError(f"fp8 weights must be {FP8}, got {weight.dtype}")
        if self.in_features % MULTIPLE or self.out_features % MULTIPLE:
            raise ValueError(
                f"fp8 products need widths that are multiples of {MULTIPLE}, "
                f"got {self.in_features} -> {self.out_features}"
            )
        self.dtype = dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.detach().float().reshape(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        static = None if input_scale is None else torch.tensor([[float(input_scale)]], dtype=torch.float32)
        self.register_buffer("input_scale", static)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """The fp8 layer nearest to `linear` (its weights rounded per output channel)."""
        weight, scales = quantize_rows(linear.weight.detach())
        return cls(weight, scales.flatten(), linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is None:
            values, scale = quantize_rows(rows)
        else:
            values, scale = quantize_static(rows, self.input_scale)
        if x.is_cuda:  # row-wise scales take a bf16 output; other model dtypes are converted
            out = torch._scaled_mm(
                values, self.weight.t(), scale_a=scale, scale_b=self.scales, out_dtype=torch.bfloat16
            )
        else:  # the definition in float32, rounded as the GPU's product rounds its output
            out = ((values.float() * scale) @ (self.weight.float() * self.scales.t()).t()).to(torch.bfloat16)
        out = out.to(self.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4

    def extra_repr(self) -> str:
        inputs = "static input scale" if self.input_scale is not None else "inputs per token"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, fp8 e4m3 per channel, {inputs}"
