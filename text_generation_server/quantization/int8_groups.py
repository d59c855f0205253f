"""8-bit linears in groups on CPU: weights in 8-bit integers with a scale and a zero point per group
of input channels (GPTQ's 8-bit checkpoints), activations in the model's dtype (W8A16).

A weight is w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // group_size, q in [0, 255].
The layer holds v = q - 128 as int8 (a byte per weight) and, per group and output channel, the
scale and an offset (128 - zero) * scale in float32, so that w = v * scale + offset.
csrc/grouped_cpu.cpp's int8_group_linear sums x times the int8 values on AMX's integer tiles for
bf16 calls of 3 to 64 rows (x in 16-bit fixed point per row), computes each group's products in
float straight from the int8 values for other calls of a few rows (decode, where reading the
weights is the cost) and multiplies slices of unpacked weights for larger ones (prompts). Where
the C++ kernels do not build, the weights are unpacked in tensor operations each call.

Act-order checkpoints (GPTQ's desc_act) give input channels to groups out of order; the layer
holds its input channels sorted by group (`order`) and gathers each input the same way, as
int4.py's Int4Linear does.
"""

from __future__ import annotations

import torch
from torch import nn

from text_generation_server.quantization.grouped import GroupedLinear, kernels_here

ZERO = 128  # the stored values are the unsigned integers minus this


class Int8GroupLinear(GroupedLinear):
    """A Linear with 8-bit weights in groups along the input channels."""

    bits = 8
    values: torch.Tensor  # [out, in] int8: the unsigned integers minus ZERO
    scale_offset: torch.Tensor  # [groups, out, 2] float32

    def __init__(
        self,
        ints: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        order: torch.Tensor | None = None,
    ) -> None:
        """`ints` [out, in] in [0, 255]; `scales`, `zeros` [out, in / group_size]; `order` [in]:
        input channel k of the layer is channel order[k] of the input (None: in order); `dtype`:
        the model's (inputs and outputs)."""
        super().__init__(ints, scales, zeros, group_size, bias, dtype, order)
        self.register_buffer("values", (ints.to(torch.int16) - ZERO).to(torch.int8).contiguous())
        scale_offset = torch.stack((scales.float(), (ZERO - zeros.float()) * scales.float()), dim=-1)
        self.register_buffer("scale_offset", scale_offset.transpose(0, 1).contiguous())

    def unpacked(self) -> torch.Tensor:
        """The weights [out, in] in float32 (input channels in the layer's order)."""
        groups = self.in_features // self.group_size
        scale, offset = self.scale_offset.permute(1, 0, 2).unsqueeze(2).unbind(-1)  # [out, groups, 1]
        values = self.values.view(self.out_features, groups, self.group_size).float()
        return values.mul(scale).add_(offset).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.gathered(x)
        if kernels_here():
            y = torch.ops.tgis_cpu.int8_group_linear(
                rows.contiguous(), self.values, self.scale_offset, self.group_size, self.bias_value, True
            )
        else:
            y = nn.functional.linear(rows, self.unpacked().to(x.dtype), self.bias_value)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def integers(self) -> torch.Tensor:
        return self.values  # a byte each
