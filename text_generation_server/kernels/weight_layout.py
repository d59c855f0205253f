"""Memory layout of linear weights for CPU inference, chosen by measuring this CPU.

`nn.Linear` stores its weight as [out, in] and computes x @ W.T. Which layout is fastest for the
skinny matrices of decoding (M = batch size) depends on the CPU and the dtype, by a factor of up
to 4, and differently on different CPUs, so the engine measures instead of assuming:

  plain         the weight as loaded (row-major [out, in]).
  column-major  the same tensor with column-major strides, so W.T is a plain row-major matrix
                (float32 only): oneMKL's sgemm takes its fast path. Measured on a 2-core Xeon
                without AVX512-BF16: decode step at batch 32 of the reference model 38 -> 25 ms.
  onednn        the weight reordered once into oneDNN's blocked format for this CPU's kernels
                (`torch.ops.mkldnn`), replacing the Linear module. Measured on a 2-core AMD EPYC
                with AVX512-BF16: [1, 512] x [512, 8192] bf16 231 -> 64 us, fp32 at M = 32
                2.7 -> 0.6 ms; on the Xeon above it was slower at M = 1 in fp32.
  panels        (float32 or bfloat16, AVX2 + FMA CPUs, outputs a multiple of 16) the weight
                packed in panels of 16 output channels for our C++ kernel (kernels/csrc/
                panel_cpu.cpp: register tiles of 6 rows x 16 outputs, bfloat16 weights widened in
                registers and summed in float32; with AVX512-BF16, bfloat16 weights of even width
                in pairs of inputs for its dot product; with AMX, those pairs multiplied on the
                tile unit where the input width is a multiple of 32). Measured on a 2-core AMD
                EPYC without AVX-512, against oneDNN's packed weights: [32, 512] x [512, 2752]
                0.78 -> 0.73 ms, [1, 512] x [512, 2752] 0.18 -> 0.08 ms (float32); on a 2-core
                Zen 4 EPYC with AVX512-BF16, bf16 512 x 512 at M = 1 / 32: 19 / 32 us on oneDNN,
                9 / 21 us; on a 2-core Xeon with AMX, the same: 22 / 23 us, 10 / 10 us on tiles.

GPT-2's `Conv1D` (weight [in, out], x @ W + b) is the same product as a Linear whose weight is
its transpose: `choose_linear_layouts` first turns each into that Linear (a plain [out, in] copy),
so that it gets a measured layout too (measured on the AMX Xeon: GPT-2's bf16 decode step
through the C++ decoder stack, oneDNN-packed, below).

`choose_linear_layouts` times each layout on every distinct weight shape of the model, at M = 1
and at M = the largest decode batch (capped at 32), with the model's dtype and thread count (the
candidates in turn, round by round, so that load on a shared machine biases none of them), and
picks the one with the lowest geometric mean, switching away from the loaded layout only for a
clear win (MIN_GAIN). It then applies the choice to every Linear of that shape. Weights shared
with an embedding (tied input/output embeddings) keep their layout: the lookup gathers rows, which
another layout would scatter or hide. `LinearLayout` names a fixed choice instead (tests, and
operators who want a layout pinned).
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from text_generation_server.kernels import cpu_kernels
from text_generation_server.utils.cpu import cpu_flags

logger = logging.getLogger(__name__)

MIN_GAIN = 0.9  # a layout must take at most this share of the loaded layout's time to replace it
TUNE_REPEATS = 15
TUNE_MAX_M = 32


class LinearLayout(enum.Enum):
    AUTO = "auto"  # measure and pick (the default)
    PLAIN = "plain"
    COLUMN_MAJOR = "column-major"
    ONEDNN = "onednn"
    PANELS = "panels"


class PackedLinear(torch.nn.Module):
    """A Linear whose weight was repacked once for a kernel (inference only); subclasses say how
    (`pack`) and multiply (`forward`)."""

    layout: LinearLayout

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        # Model code reads `weight.dtype` (T5 casts activations to it): shape and dtype without
        # data, so that anything computing with it fails loudly instead of reading garbage.
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.layout.value}"


class OneDnnLinear(PackedLinear):
    """A Linear whose weight lives in oneDNN's blocked format."""

    layout = LinearLayout.ONEDNN

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__(linear, torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PanelLinear(PackedLinear):
    """A float32 or bfloat16 Linear whose weight is packed in panels of 16 output channels for
    our C++ kernel."""

    layout = LinearLayout.PANELS

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear, torch.ops.tgis_cpu.panel_pack(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tgis_cpu.panel_linear(x, self.packed_weight, self.bias)


@dataclass(frozen=True, slots=True)
class Choice:
    shape: tuple[int, int]  # (out, in)
    dtype: torch.dtype
    layout: LinearLayout
    times_us: dict[LinearLayout, tuple[float, float]]  # layout -> (M = 1, M = large) medians


@functools.cache
def _panel_kernel_here() -> bool:
    """A CPU with AVX2 and FMA (the kernel's vector path) and our C++ kernels built (once per
    process; where they cannot build, one warning says why)."""
    return {"avx2", "fma"} <= cpu_flags() and cpu_kernels.loads("LINEAR_LAYOUT: no `panels` layout")


def _on_tiles(choice: Choice) -> bool:
    """Whether the chosen layout is bfloat16 panels that multiply on AMX's tiles here."""
    return (
        choice.layout is LinearLayout.PANELS
        and choice.dtype == torch.bfloat16
        and bool(torch.ops.tgis_cpu.panel_tiles(choice.shape[1]))
    )


def panels_offered(dtype: torch.dtype, out_features: int) -> bool:
    """Whether the `panels` layout can hold such a weight here: float32 or bfloat16, outputs in
    whole panels, and the kernel here."""
    return dtype in (torch.float32, torch.bfloat16) and out_features % 16 == 0 and _panel_kernel_here()


def _candidates(dtype: torch.dtype, out_features: int, panels: bool = True) -> list[LinearLayout]:
    """The layouts to time (`panels`: whether to consider ours, which builds our kernels)."""
    layouts = [LinearLayout.PLAIN]
    if dtype == torch.float32:
        layouts.append(LinearLayout.COLUMN_MAJOR)
    if torch.backends.mkldnn.is_available() and (
        dtype == torch.float32
        # oneDNN's bfloat16 linears need AVX512-BW/VL/DQ or AVX-NE-CONVERT (not on AVX2-only CPUs)
        or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        layouts.append(LinearLayout.ONEDNN)
    if panels and panels_offered(dtype, out_features):
        layouts.append(LinearLayout.PANELS)
    return layouts


def _medians_us(calls: list[Callable[[], object]]) -> list[float]:
    """The median time of each call, timed in turn (one of each per round, TUNE_REPEATS rounds),
    so that a burst of load on a shared machine slows every candidate alike instead of the one
    being timed."""
    for call in calls:
        call()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(TUNE_REPEATS):
        for call, taken in zip(calls, samples, strict=True):
            start = time.perf_counter()
            call()
            taken.append(time.perf_counter() - start)
    return [sorted(taken)[len(taken) // 2] * 1e6 for taken in samples]


def laid_out(linear: torch.nn.Linear, layout: LinearLayout, batch_hint: int) -> torch.nn.Module:
    """`linear` in `layout`: the same module (column-major strides set in place) or its oneDNN or
    panels replacement. The one place a layout is made, for timing and for the model alike."""
    if layout is LinearLayout.COLUMN_MAJOR and linear.weight.is_contiguous():
        with torch.no_grad():
            linear.weight.data = linear.weight.data.t().contiguous().t()
    elif layout is LinearLayout.ONEDNN:
        return OneDnnLinear(linear, batch_hint)
    elif layout is LinearLayout.PANELS:
        return PanelLinear(linear)
    return linear


def _tune(shape: tuple[int, int], dtype: torch.dtype, large_m: int) -> Choice:
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, dtype=dtype) / math.sqrt(in_features)
    inputs = [torch.randn(m, in_features, dtype=dtype) for m in (1, large_m)]
    layouts = _candidates(dtype, out_features)
    with torch.inference_mode():
        modules = []
        for layout in layouts:
            probe = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            probe.weight.data = weight.clone()
            modules.append(laid_out(probe, layout, large_m))
        medians = _medians_us([functools.partial(module, x) for module in modules for x in inputs])
    times = {layout: (medians[2 * i], medians[2 * i + 1]) for i, layout in enumerate(layouts)}
    return Choice(shape, dtype, pick(times), times)


def pick(times: dict[LinearLayout, tuple[float, float]]) -> LinearLayout:
    """The layout with the lowest geometric mean of its two timings, if it clearly beats the
    loaded (plain) layout; else plain."""

    def score(layout: LinearLayout) -> float:
        return math.sqrt(times[layout][0] * times[layout][1])

    best = min(times, key=score)
    return best if score(best) <= MIN_GAIN * score(LinearLayout.PLAIN) else LinearLayout.PLAIN


def plain_linears(
    model: torch.nn.Module, device_type: str = "cpu"
) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, Linear) for every plain Linear on `device_type` not tied to an embedding."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (
                type(child) is torch.nn.Linear
                and id(child.weight) not in embedded
                and child.weight.device.type == device_type
                and child.weight.dim() == 2
            ):
                found.append((parent, name, child))
    return found


def _conv1d_as_linear(model: torch.nn.Module) -> None:
    """Replace every CPU Conv1D (transformers' GPT-2 projection) by the Linear it equals."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if type(child).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor):
                continue
            if weight.device.type != "cpu" or weight.dim() != 2:
                continue
            in_features, out_features = weight.shape
            bias = getattr(child, "bias", None)
            linear = torch.nn.Linear(
                in_features, out_features, bias=bias is not None, dtype=weight.dtype, device="meta"
            )
            linear.weight = torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
            if bias is not None:
                linear.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
            setattr(parent, name, linear)
            replaced += 1
    if replaced:
        logger.info("%d Conv1D projections are laid out as the Linears they equal", replaced)


def choose_linear_layouts(
    model: torch.nn.Module, max_batch_size: int, layout: LinearLayout = LinearLayout.AUTO
) -> list[Choice]:
    """Lay out every eligible Linear of `model` (see the module docstring); returns the choice
    made for each distinct (shape, dtype)."""
    large_m = max(1, min(max_batch_size, TUNE_MAX_M))
    _conv1d_as_linear(model)
    linears = plain_linears(model)
    choices: dict[tuple[tuple[int, int], torch.dtype], Choice] = {}
    for parent, name, linear in linears:
        out_features, in_features = linear.weight.shape
        shape, dtype = (int(out_features), int(in_features)), linear.weight.dtype
        key = (shape, dtype)
        if key not in choices:
            if layout is LinearLayout.AUTO:
                choices[key] = _tune(shape, dtype, large_m)
            elif layout in _candidates(dtype, shape[0], panels=layout is LinearLayout.PANELS):
                choices[key] = Choice(shape, dtype, layout, {})
            else:
                raise ValueError(
                    f"linear layout {layout.value} is not available for {dtype} {shape[0]}x{shape[1]}"
                )
        module = laid_out(linear, choices[key].layout, large_m)
        if module is not linear:
            setattr(parent, name, module)
    for c in choices.values():
        measured = ", ".join(f"{k.value} {t[0]:.0f}/{t[1]:.0f} us" for k, t in c.times_us.items())
        logger.info(
            "linear %dx%d %s: %s%s%s",
            *c.shape,
            str(c.dtype).removeprefix("torch."),
            c.layout.value,
            " on AMX tiles" if _on_tiles(c) else "",
            f" (M = 1 / {large_m}: {measured})" if measured else "",
        )
    return list(choices.values())
