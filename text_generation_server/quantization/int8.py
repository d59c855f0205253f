"""Int8 linears on CPU: int8 weights, one scale per output channel, each token's activations in
int8 (W8A8: what QUANTIZE=int8 makes at load, and what compressed-tensors' int-quantized W8A8
checkpoints hold).

On CPUs with AVX-VNNI but not AVX-512 (not measured against our kernel), and where our kernels
do not build, the weights are packed for oneDNN's int8 matrix kernels through torch's
dynamic-quantization linear (`quantized::linear_dynamic`, oneDNN engine), which quantizes its
input at run time with one scale for the whole tensor. A request's output must not depend on
the requests batched beside it, and each token must be quantized as W8A8 defines it
(compressed-tensors: symmetric, scale max |x| / 127.5, integers clamped to [-128, 127]), so each
call first scales every token to max |x| = 1 and appends one row holding +1 and -1: the
tensor's range is then always [-1, 1], the kernel's scale 2 / 255 and zero point 128, and a
token value x becomes round(127.5 x / max |x|) + 128 (clamped to [0, 255]), W8A8's integer
shifted by the zero point the kernel subtracts again (the kernel rounds halves up: a token whose
largest magnitude is negative sits at exactly -127.5 steps, -127 here and -128 in
compressed-tensors' reference forward; logits stay within cosine 0.995 of it, tests/
test_quantized_checkpoints.py). The int32 products are exact; each output row is scaled back by
its token's max |x| and rounded to the model's dtype once. Weights take half the bytes of bf16
(plus 4 bytes per output channel).

CPUs with AVX512-VNNI (with AMX or without), and those whose oneDNN products saturate (below),
multiply on our C++ kernel (csrc/w8a8_cpu.cpp) over the layer's int8 weights in its own layout,
each token's W8A8 integers computed there (the definition's rounding, halves to even), the sums
exact in 32 bits. With AVX512-VNNI (no AMX) it reads the weights faster than
oneDNN's int8 kernels: on a 2-core AMD EPYC (Zen 4), eight distinct 8192 x 2048 layers in turn,
0.74-0.82x oneDNN's time at 1 row, 0.69-0.82x at 8, 0.95x at 32, 0.71x at 512 (2048 x 8192:
0.67x at 1 row, 0.99x at 512; oneDNN's calls also quantize and append the range row); the 1.0 B
model's decode step 0.82-0.83x at batch 1, 0.86-0.89x at 8. With AMX-INT8, calls of 4 rows or
more over inputs in multiples of 64 sum the same integers on AMX's tiles (the kernel's panels are
its B tiles as they lie): on a 2-core Xeon with AMX, eight distinct layers in turn, 0.44-0.51x
oneDNN's time at 1 row, 0.43-0.54x at 32, 0.51-0.82x at 128, 0.61-0.82x at 512 (2048 x 2048,
8192 x 2048, 2048 x 8192); the 1.0 B model's decode step 50.1 -> 35.0 ms at batch 1 and 72.5 ->
44.4 ms at batch 8, its prompts of 64 tokens 122 -> 87 ms alone and 951 -> 566 ms eight at once.

CPUs without VNNI or AMX-INT8 (AVX2 only, or AVX-512 before Cascade Lake) have no int8 dot
product: oneDNN sums each pair of u8 x s8 products in 16 bits (vpmaddubsw), which saturates once
activations near the top of their 8-bit range meet large weights (a token's output off by 13 %
on a 2-core AMD EPYC with AVX2 only; `products_saturate`, probed once per process). There our
kernel's weights are interleaved by 4 output channels and 16 inputs (a cache line a step), each
token's integers are 16-bit and pairs of products are summed into 32 bits by vpmaddwd, exactly.
On that EPYC, float32 activations, eight distinct layers in turn: 8192 x 2048 0.84 / 1.19
/ 3.16 / 10.8 / 107 ms at 1 / 4 / 16 / 64 / 512 rows against 2.97 / 4.65 / 6.88 / 19.9 / 138 ms
for float32 weights in oneDNN's layout (at 1 row, 0.78-1.07 ms before the weights were
interleaved, 0.51-0.61 ms after); 2048 x 2048 0.27x float32's time at 1 row, 0.82x at 64, 1.04x at 512.
Where our kernels do not build, oneDNN's 8-bit product serves where it does not saturate;
elsewhere each token's W8A8 integers a are computed here and split into
a = 2 h + l, h in [-64, 63], l in {0, 1}; the h rows and the l rows go through oneDNN in one
call at 7-bit activation range (torch's `reduce_range`, whose pairs cannot overflow), with a
range row of +63 and -64 so that the kernel's scale is 1 and its integers are h and l as given,
and y = 2 y_h + y_l: the same integer products, exactly, for twice the rows (10x the kernel's
time at 1 row on that EPYC).
`product_way` says which of the three ways serves.

oneDNN's int8 product, measured on a 2-core Xeon with AMX (bf16 oneDNN linears = 1): distinct
4096-wide weights in turn 0.41x at 1 token, 0.49x at 32, 0.56x at 512 without the range row;
2048-wide about 0.8x at 1 token; 512-wide slower than bf16 (per-call overhead). The C++ decoder
stack (CPU_FORWARD) runs these layers the same way (kernels/csrc/decoder_cpu.cpp's int8_linear
and w8a8_linear).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
from torch import nn

from text_generation_server.kernels import cpu_kernels
from text_generation_server.utils.cpu import cpu_flags

logger = logging.getLogger(__name__)

TINY = torch.finfo(torch.float32).tiny
STEPS = 127.5  # W8A8's integer steps in a token's max |x|
HIGH = 64.0  # the split's high part is in [-HIGH, HIGH - 1]: 7-bit activations

# How Int8Linear multiplies (module doc): oneDNN's 8-bit product, our exact kernel over the int8
# weights, or oneDNN's product of each token's integers split into two 7-bit halves.
EIGHT_BIT, EXACT, SPLIT = "8-bit", "exact", "split"


def _pack(ints: torch.Tensor, scales: torch.Tensor) -> Any:
    """oneDNN's packed int8 weights: `ints` [out, in] times `scales` [out] per output channel."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 layers need torch's oneDNN quantized engine, which this torch lacks")
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "onednn"  # the packed weights keep their engine's kernels
    try:
        with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will go
            warnings.simplefilter("ignore", UserWarning)
            zero_points = torch.zeros(ints.shape[0], dtype=torch.long)
            quantized = torch._make_per_channel_quantized_tensor(
                ints.to(torch.int8).contiguous(), scales.double().flatten(), zero_points, 0
            )
            return torch.ops.quantized.linear_prepack(quantized, None)
    finally:
        torch.backends.quantized.engine = engine


def _bounds(in_features: int, split: bool) -> torch.Tensor:
    """The range row appended to every call's input (module doc): +1 and -1 for the 8-bit product,
    +63 and -64 for the split one."""
    bounds = torch.zeros(1, in_features)
    bounds[0, 0], bounds[0, -1] = (HIGH - 1, -HIGH) if split else (1.0, -1.0)
    return bounds


def product(tokens: torch.Tensor, packed: Any, bounds: torch.Tensor, split: bool) -> torch.Tensor:
    """[tokens, out] float32: each row of `tokens` (float32) rounded to W8A8's integers, times the
    packed weights, scaled back (module doc); `bounds` from _bounds(in, split)."""
    top = tokens.abs().amax(dim=1, keepdim=True).clamp_(min=TINY)
    if not split:
        y = torch.ops.quantized.linear_dynamic(torch.cat((tokens / top, bounds)), packed, False)
        return y[:-1].mul_(top)
    steps = torch.round(tokens / (top / STEPS)).clamp_(-128, 127)
    high = torch.floor(steps * 0.5)
    rows = tokens.shape[0]
    y = torch.ops.quantized.linear_dynamic(torch.cat((high, steps - 2 * high, bounds)), packed, True)
    return y[:rows].mul_(2).add_(y[rows : 2 * rows]).mul_(top / STEPS)


@functools.cache
def products_saturate() -> bool:
    """Whether oneDNN's 8-bit product overflows on this CPU (module doc): weights of 127 times
    activations at the top of their range, 64 channels, against the exact 63.75."""
    packed = _pack(torch.full((16, 64), 127), torch.full((16,), 1 / 127))
    y = product(torch.ones(1, 64), packed, _bounds(64, False), False)
    return bool((y - 63.75).abs().max() > 0.01)


@functools.cache
def product_way() -> str:
    """How Int8Linear multiplies on this CPU (module doc), logged once: EXACT where oneDNN's int8
    products saturate, or where the CPU has AVX512-VNNI (with AMX-INT8 or without: measured faster
    on both), when our C++ kernels are here; else EIGHT_BIT where oneDNN's products do not saturate
    (AVX-VNNI alone); else SPLIT."""
    saturate = products_saturate()
    flags = cpu_flags()
    ours_faster = {"avx512_vnni", "avx512bw"} <= flags
    if not saturate and not ours_faster:
        logger.info("int8 layers: W8A8 layers multiply on oneDNN's int8 kernels")
        return EIGHT_BIT
    fallback = (
        "oneDNN's int8 kernels" if not saturate else "two 7-bit halves of each token's integers in oneDNN"
    )
    if cpu_kernels.loads(f"W8A8 layers multiply on {fallback}"):
        how = exact_instructions()
        logger.info("int8 layers: W8A8 layers multiply on our C++ kernel (%s), exact in 32 bits", how)
        return EXACT
    if not saturate:
        return EIGHT_BIT
    logger.info("int8 layers: this CPU's int8 products saturate at 8 bits in oneDNN (no VNNI or AMX-INT8)")
    return SPLIT


def exact_instructions() -> str:
    """The instructions our exact kernel sums with on this CPU (it is compiled for it)."""
    flags = cpu_flags()
    if {"avx512_vnni", "avx512bw", "amx_int8"} <= flags:
        return "AVX512-VNNI; AMX-INT8 tiles for 4 rows or more over inputs in multiples of 64"
    if {"avx512_vnni", "avx512bw"} <= flags:
        return "AVX512-VNNI"
    return "AVX2" if "avx2" in flags else "plain loops"


class Int8Linear(nn.Module):
    """A Linear with int8 weights per output channel and each token's activations in int8."""

    def __init__(
        self, ints: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ):
        """`ints` [out, in] int8 in [-128, 127], `scales` [out] (weight = ints * scales), `bias`
        [out] or None; `dtype` is the model's (the dtype of inputs and outputs)."""
        super().__init__()
        self.out_features, self.in_features = ints.shape
        self.way = product_way()
        self.packed: Any = None  # oneDNN's packed weights (EIGHT_BIT, SPLIT)
        if self.way == EXACT:  # the weights in our kernel's layout (csrc/w8a8_cpu.cpp's w8a8_pack)
            packed = torch.ops.tgis_cpu.w8a8_pack(ints.to(torch.int8))
            self.register_buffer("ints", packed, persistent=False)
            self.register_buffer("scales", scales.detach().float().contiguous(), persistent=False)
        else:
            self.packed = _pack(ints, scales)
            self.register_buffer("bounds", _bounds(self.in_features, self.way == SPLIT), persistent=False)
        self.register_buffer("bias_float", None if bias is None else bias.detach().float(), persistent=False)
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
        rows = x.reshape(-1, self.in_features)
        if self.way == EXACT:
            y = torch.ops.tgis_cpu.w8a8_linear(rows, self.ints, self.scales, self.bias_float)
            return y.view(*x.shape[:-1], self.out_features)
        bounds = self.bounds
        assert isinstance(bounds, torch.Tensor)
        y = product(rows.float(), self.packed, bounds, self.way == SPLIT)
        bias = self.bias_float
        if bias is not None:
            assert isinstance(bias, torch.Tensor)
            y += bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight takes: int8 values (in our kernel's layout, padded to its
        whole panels or tasks) and a float32 scale per output channel."""
        ints = self.ints if self.way == EXACT else None
        values = ints.numel() if isinstance(ints, torch.Tensor) else self.in_features * self.out_features
        return values + 4 * self.out_features

    def packed_bytes(self) -> int:
        """Bytes of its weights held outside its buffers (oneDNN's packed object), else 0."""
        return 0 if self.packed is None else self.weight_bytes()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self.way})"
