"""4-bit linears on CPU: weights in 4-bit integers with a scale and a zero point per group of input
channels (GPTQ's, AWQ's and compressed-tensors' W4A16 checkpoints), activations in the model's dtype.

A weight is w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // group_size. The values
are held once, in the layout torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, which takes
w = (q - 8) * scale + offset, so offset = (8 - zero) * scale) reads on AVX-512 CPUs: blocks of 64
output channels (`pack`), half a byte per weight plus a scale and an offset per group. On CPUs
without AVX-512 torch packs and reads blocks of 32 instead (four of its float vectors); there
the layers never call torch's kernel (`torch_kernel_rows` is 0) and our products read the layout
above. The product is csrc/grouped_cpu.cpp's int4_linear:

- on CPUs with AMX (bf16 activations, groups and input channels in multiples of 32), a tile
  product for any number of rows: the integers become bf16 tiles by bit operations, the tile unit
  sums x times them per group, and each group's sums are scaled once. On a 2-core Xeon with AMX,
  the 1.0 B Llama's GPTQ 4-bit projections took 41 / 49 / 195 ms at 1 / 8 / 64 rows against 45 /
  108 / 361 ms through the products below;
- elsewhere torch's int4 kernel (where it reads our layout), which reads the packed weights
  directly but whose cost grows with the rows ([M, 2048] x [2048, 2048] in bf16: 0.11 / 0.21 /
  0.45 / 2.2 / 3.9 ms at M = 1 / 4 / 8 / 32 / 64 against 0.46-0.75 ms for the bf16 product), up
  to KERNEL_MAX_ROWS rows, and beyond it (and for float32 models, and groups the kernel does not
  take) the dense product over weights unpacked to the model's dtype a slice of output rows at a
  time (int4_linear_unpacked: 2048 x 2048 at 24 rows in 0.76 ms, 1.15 ms through the kernel).

Act-order checkpoints (GPTQ's desc_act) give input channels to groups out of order; the layer
holds its input channels sorted by group (`order`) and gathers each input the same way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from text_generation_server.quantization.grouped import GroupedLinear, kernels_here

# the kernel up to this many rows, the product over unpacked weights beyond (module doc): the two
# cost the same at 14-16 rows for 1376- to 8192-wide layers and at about 20 for 512 x 512 (2-core
# Xeon with AMX, bf16); on the 30 M reference model's GPTQ checkpoint (groups of 32) a batch-32
# decode step of the C++ decoder stack took 9.1 / 9.7 ms beyond the limit against 12.4 / 12.1 with
# 48 (runs alternated)
KERNEL_MAX_ROWS = 16
BLOCK = 64  # output channels per block of the packed layout
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 kernel takes


def pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values `q` [out, in] (out a multiple of BLOCK) packed two to a byte: per block of
    BLOCK output rows, input channel k's BLOCK / 2 bytes hold row i's value in the low nibble of
    byte i and row BLOCK / 2 + i's in the high nibble -> [out, in / 2] uint8."""
    out, in_features = q.shape
    blocks = q.to(torch.uint8).view(out // BLOCK, BLOCK, in_features)
    low, high = blocks[:, : BLOCK // 2], blocks[:, BLOCK // 2 :]
    packed = torch.bitwise_or(low, torch.bitwise_left_shift(high, 4))  # [blocks, BLOCK / 2, in]
    return packed.transpose(1, 2).contiguous().view(out, in_features // 2)


@functools.cache
def torch_kernel_rows() -> int:
    """Up to how many rows a product takes torch's int4 kernel: KERNEL_MAX_ROWS where torch
    packs as `pack` does (its kernel then reads our weights), else 0 (found once per process)."""
    q = torch.arange(2 * BLOCK * 4, dtype=torch.int32).remainder(13).view(2 * BLOCK, 4)
    return KERNEL_MAX_ROWS if torch.equal(torch._convert_weight_to_int4pack_for_cpu(q, 1), pack(q)) else 0


class Int4Linear(GroupedLinear):
    """A Linear with 4-bit weights in groups along the input channels."""

    bits = 4
    packed: torch.Tensor  # [out padded to BLOCK, in / 2] uint8, the kernel's layout
    scale_offset: torch.Tensor  # [groups, out padded, 2] in the model's dtype

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
        """`ints` [out, in] in [0, 15]; `scales`, `zeros` [out, in / group_size] (zeros may be
        fractional); `order` [in]: input channel k of the layer is channel order[k] of the input
        (None: in order); `dtype`: the model's (inputs, outputs and the scales' dtype)."""
        super().__init__(ints, scales, zeros, group_size, bias, dtype, order)
        if group_size % 2:  # the kernels read two values a byte
            raise ValueError(f"4-bit groups of {group_size} are not whole bytes: an even size is needed")
        padded = -(-self.out_features // BLOCK) * BLOCK  # the kernel's layout is whole blocks
        q = torch.zeros(padded, self.in_features, dtype=torch.int32)
        q[: self.out_features] = ints.to(torch.int32)
        self.register_buffer("packed", pack(q))
        scale_offset = torch.zeros(self.in_features // group_size, padded, 2)
        scale_offset[:, : self.out_features, 0] = scales.float().t()
        scale_offset[:, : self.out_features, 1] = ((8.0 - zeros.float()) * scales.float()).t()
        self.register_buffer("scale_offset", scale_offset.to(dtype).contiguous())

    def unpacked(self) -> torch.Tensor:
        """The weights [out, in] in the model's dtype (input channels in the layer's order), in
        tensor operations: (value - 8) * scale + offset in float, rounded once (the C++ product
        unpacks the same way, a slice at a time)."""
        blocks = self.packed.view(-1, self.in_features, BLOCK // 2)  # [blocks, in, 32]: two rows a byte
        q = torch.empty(blocks.shape[0], BLOCK, self.in_features, dtype=torch.uint8)
        torch.bitwise_and(blocks, 15, out=q[:, : BLOCK // 2].transpose(1, 2))
        torch.bitwise_right_shift(blocks, 4, out=q[:, BLOCK // 2 :].transpose(1, 2))
        groups = self.in_features // self.group_size
        scale, offset = (
            self.scale_offset.float().permute(1, 0, 2).unsqueeze(2).unbind(-1)
        )  # [padded, groups, 1]
        values = q.view(-1, groups, self.group_size).float().sub_(8).mul_(scale).add_(offset)
        return values.view(-1, self.in_features)[: self.out_features].to(self.scale_offset.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.gathered(x)
        if kernels_here():
            y = torch.ops.tgis_cpu.int4_linear(
                rows.contiguous(),
                self.packed,
                self.scale_offset,
                self.group_size,
                self.out_features,
                self.bias_value,
                torch_kernel_rows(),
                True,
            )
        elif (
            x.dtype in KERNEL_DTYPES and self.group_size in KERNEL_GROUPS and len(rows) <= torch_kernel_rows()
        ):
            y = torch._weight_int4pack_mm_for_cpu(
                rows.contiguous(), self.packed, self.group_size, self.scale_offset
            )
            y = y[:, : self.out_features]
            if self.bias_value is not None:
                y = y + self.bias_value
        else:
            y = nn.functional.linear(rows, self.unpacked().to(x.dtype), self.bias_value)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def integers(self) -> torch.Tensor:
        return self.packed  # two to a byte
