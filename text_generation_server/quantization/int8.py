"""Int8 linears on CPU: int8 weights, one scale per output channel, each token's activations in
int8 (W8A8: what QUANTIZE=int8 makes at load, and what compressed-tensors' int-quantized W8A8
checkpoints hold).

The weights are packed for oneDNN's int8 matrix kernels (AMX-INT8 where the CPU has it, else
AVX512-VNNI / AVX2) through torch's dynamic-quantization linear (`quantized::linear_dynamic`,
oneDNN engine), which quantizes its input at run time with one scale for the whole tensor. A
request's output must not depend on the requests batched beside it, and each token must be
quantized as W8A8 defines it (compressed-tensors: symmetric, scale max |x| / 127.5, integers
clamped to [-128, 127]), so each call first scales every token to max |x| = 1 and appends one
row holding +1 and -1: the tensor's range is then always [-1, 1], the kernel's scale 2 / 255 and
zero point 128, and a token value x becomes round(127.5 x / max |x|) + 128 (clamped to [0, 255]),
W8A8's integer shifted by the zero point the kernel subtracts again (the kernel rounds halves
up: a token whose largest magnitude is negative sits at exactly -127.5 steps, -127 here and -128
in compressed-tensors' reference forward; logits stay within cosine 0.995 of it, tests/
test_quantized_checkpoints.py). The int32 products are
exact; each output row is scaled back by its token's max |x| and rounded to the model's dtype
once. Weights take half the bytes of bf16 (plus 4 bytes per output channel).

Measured on a 2-core Xeon with AMX (bf16 oneDNN linears = 1): distinct 4096-wide weights in turn
0.41x at 1 token, 0.49x at 32, 0.56x at 512 without the range row; 2048-wide about 0.8x at 1
token; 512-wide slower than bf16 (per-call overhead). The C++ decoder stack (CPU_FORWARD) runs
these layers the same way (kernels/csrc/decoder_cpu.cpp's int8_linear).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

TINY = torch.finfo(torch.float32).tiny


class Int8Linear(nn.Module):
    """A Linear with int8 weights per output channel and each token's activations in int8."""

    def __init__(
        self, ints: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ):
        """`ints` [out, in] int8 in [-127, 127], `scales` [out] (weight = ints * scales), `bias`
        [out] or None; `dtype` is the model's (the dtype of inputs and outputs)."""
        super().__init__()
        self.out_features, self.in_features = ints.shape
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        if "onednn" not in torch.backends.quantized.supported_engines:
            raise ValueError("int8 layers need torch's oneDNN quantized engine, which this torch lacks")
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "onednn"  # the packed weights keep their engine's kernels
        try:
            with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will go
                warnings.simplefilter("ignore", UserWarning)
                quantized = torch._make_per_channel_quantized_tensor(
                    ints.to(torch.int8).contiguous(), scales.double().flatten(), zero_points, 0
                )
                self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        finally:
            torch.backends.quantized.engine = engine
        self.register_buffer("bias_float", None if bias is None else bias.detach().float(), persistent=False)
        # one row of +1 and -1: every call's input range is exactly [-1, 1] (see the module doc)
        bounds = torch.zeros(1, self.in_features)
        bounds[0, 0], bounds[0, -1] = 1.0, -1.0
        self.register_buffer("bounds", bounds, persistent=False)
        self.bias = None  # model code may read it; the float copy above is what is added
        # model code reads `weight.dtype` (and LoRA its shape): shape and dtype, no data
        self.weight = torch.empty(ints.shape, dtype=dtype, device="meta")

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int8Linear:
        """`linear`'s weights rounded to int8, symmetric per output channel (max |w| / 127)."""
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=TINY) / 127.0
        ints = torch.round(weight / scales[:, None]).clamp_(-127, 127)
        return cls(ints, scales, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.in_features).float()
        top = tokens.abs().amax(dim=1, keepdim=True).clamp_(min=TINY)
        bounds = self.bounds
        assert isinstance(bounds, torch.Tensor)
        y = torch.ops.quantized.linear_dynamic(torch.cat((tokens / top, bounds)), self.packed, False)
        y = y[:-1].mul_(top)
        if self.bias_float is not None:
            y += self.bias_float
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight takes: int8 values and a float32 scale per output channel."""
        return self.in_features * self.out_features + 4 * self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
