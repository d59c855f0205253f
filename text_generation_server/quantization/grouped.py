"""What the CPU linears with integer weights in groups of input channels share (int4.py's
Int4Linear, int8_groups.py's Int8GroupLinear): the checks of their shapes, the buffers beside the
weights (per group and output channel a scale and an offset, the act-order input order, the
bias), the gathering of each input in the layer's channel order, and whether our C++ kernels
(csrc/grouped_cpu.cpp) are here."""

from __future__ import annotations

import functools

import torch
from torch import nn

from text_generation_server.kernels import cpu_kernels


class GroupedLinear(nn.Module):
    """A Linear whose weights are `bits`-bit integers with a scale and an offset per group of
    `group_size` input channels; subclasses hold the integers and compute the product."""

    bits: int
    scale_offset: torch.Tensor  # [groups, out (padded), 2]
    order: torch.Tensor | None
    bias_value: torch.Tensor | None

    def __init__(
        self,
        ints: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        order: torch.Tensor | None,
    ) -> None:
        """`ints` [out, in]; `scales`, `zeros` [out, in / group_size]; `order` [in]: input channel
        k of the layer is channel order[k] of the input (None: in order); `dtype`: the model's."""
        super().__init__()
        self.out_features, self.in_features = ints.shape
        if self.in_features % group_size:
            raise ValueError(
                f"{self.bits}-bit groups of {group_size} do not tile {self.in_features} input channels"
            )
        if tuple(scales.shape) != (self.out_features, self.in_features // group_size) != tuple(zeros.shape):
            raise ValueError(
                f"{self.bits}-bit scales {tuple(scales.shape)} do not match weights {tuple(ints.shape)}"
            )
        self.group_size = group_size
        self.register_buffer("order", None if order is None else order.to(torch.long))
        self.register_buffer("bias_value", None if bias is None else bias.detach().to(dtype))
        self.bias = None  # model code may read it; `bias_value` is what is added
        # model code reads `weight.dtype` (and LoRA its shape): shape and dtype, no data
        self.weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device="meta")

    def gathered(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s tokens as rows [tokens, in], input channels in the layer's order."""
        rows = x.reshape(-1, self.in_features)
        return rows if self.order is None else rows.index_select(1, self.order)

    @property
    def integers(self) -> torch.Tensor:
        """The weights' integers in the subclass's layout, a byte each or two to a byte (what the C++
        decoder stack takes beside `scale_offset`; its dtype says which)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of this layer's weights: the integers, and a scale and an offset per group."""
        integers, so = self.integers, self.scale_offset
        return integers.numel() * integers.element_size() + so.numel() * so.element_size()

    def extra_repr(self) -> str:
        order = ", act-order" if self.order is not None else ""
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, int{self.bits} g{self.group_size}{order}"


@functools.cache
def kernels_here() -> bool:
    """Whether our C++ kernels are here (built once per process; the reason logged if not)."""
    return cpu_kernels.loads("layers with weights in groups unpack them with tensor operations")
