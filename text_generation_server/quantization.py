"""QUANTIZE on the shard: which schemes serve where, and int8 linears on CPU.

`int8` (CPU): every Linear of the model (not the LM head, not the embeddings) holds its weight
in int8, one scale per output channel (symmetric, max |w| / 127), packed for oneDNN's int8
matrix kernels (AMX-INT8 where the CPU has it, else AVX512-VNNI / AVX2) through torch's
dynamic-quantization linear (`quantized::linear_dynamic`, oneDNN engine), which quantizes its
input at run time with one scale for the whole tensor. A request's output must not depend on
the requests batched beside it, so each call first scales every token to max |x| = 1 and adds
one row holding +1 and -1: the tensor's range is then always [-1, 1], every token is quantized
as if alone (8 bits over its own range), the int32 products are exact, and each output row is
scaled back by its token's max and rounded to the model's dtype once. Weights take half the
bytes of bf16 (plus 4 bytes per output channel).

Measured on a 2-core Xeon with AMX (bf16 oneDNN linears = 1): distinct 4096-wide weights in turn
0.41x at 1 token, 0.49x at 32, 0.56x at 512 without the range row; 2048-wide about 0.8x at 1
token; 512-wide slower than bf16 (per-call overhead). The C++ decoder stack (CPU_FORWARD)
runs these layers the same way (engines/csrc/decoder_cpu.cpp).

The other names TGIS and HF TGI give QUANTIZE are known and refused with the reason
(text_generation_common/quantize.py, which the launcher checks too); `check` runs before
loading, `quantize_model` after.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from text_generation_common.quantize import refusal
from text_generation_server.engines.weight_layout import cpu_linears

logger = logging.getLogger(__name__)


def check(scheme: str | None, engine: str, device: torch.device, world_size: int = 1) -> None:
    """Raise ValueError with one line unless `scheme` (QUANTIZE) can serve here."""
    reason = refusal(scheme, engine, world_size)
    if reason is not None:
        raise ValueError(reason)
    if scheme and device.type != "cpu":
        raise ValueError(f"QUANTIZE={scheme} runs on CPU (oneDNN's int8 kernels), not on {device.type}")


class Int8Linear(nn.Module):
    """A Linear with int8 weights per output channel and each token's activations in int8."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will go
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias_float", bias, persistent=False)
        # one row of +1 and -1: every call's input range is exactly [-1, 1] (see the module doc)
        bounds = torch.zeros(1, self.in_features)
        bounds[0, 0], bounds[0, -1] = 1.0, -1.0
        self.register_buffer("bounds", bounds, persistent=False)
        self.bias = None  # model code may read it; the float copy above is what is added
        # model code reads `weight.dtype` (and LoRA its shape): shape and dtype, no data
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.in_features).float()
        top = tokens.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
        bounds = self.bounds
        assert isinstance(bounds, torch.Tensor)
        scaled = torch.cat((tokens / top, bounds))
        y = torch.ops.quantized.linear_dynamic(scaled, self.packed, False)[:-1].mul_(top)
        if self.bias_float is not None:
            y += self.bias_float
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight takes: int8 values and a float32 scale per output channel."""
        return self.in_features * self.out_features + 4 * self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the int8 weights packed outside the model's parameters and buffers."""
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, Int8Linear))


def quantize_model(model: Any, scheme: str | None) -> None:
    """Replace the model's Linear layers as `scheme` says (None: nothing); logs what it did."""
    if not scheme:
        return
    if "onednn" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"QUANTIZE={scheme} needs torch's oneDNN quantized engine, which this torch lacks")
    head = model.get_output_embeddings()
    targets = [(parent, name, linear) for parent, name, linear in cpu_linears(model) if linear is not head]
    if not targets:
        raise ValueError(f"QUANTIZE={scheme}: this model has no Linear layers to quantize")
    before = after = 0
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "onednn"  # the packed weights keep their engine's kernels
    try:
        for parent, name, linear in targets:
            replacement = Int8Linear(linear)
            before += linear.weight.numel() * linear.weight.element_size()
            after += replacement.weight_bytes()
            setattr(parent, name, replacement)
    finally:
        torch.backends.quantized.engine = engine
    logger.info(
        "QUANTIZE=%s: %d linear layers in int8 (oneDNN, each token's activations in int8): "
        "their weights %.1f MiB -> %.1f MiB",
        scheme,
        len(targets),
        before / 2**20,
        after / 2**20,
    )
