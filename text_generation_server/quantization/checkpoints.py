"""Pre-quantized checkpoints: what a model's `quantization_config` says, and its quantized linears
read into our CPU layers.

Served without any flag (QUANTIZE may name the same method, never another):
  gptq                GPTQ (AutoGPTQ / GPTQModel layout: qweight, qzeros, scales, g_idx), 4-bit or
                      8-bit, any group size that tiles the layer (or one group per channel),
                      symmetric or not, act-order (desc_act), checkpoint_format gptq (zeros stored
                      minus one) or gptq_v2
  awq                 AWQ (AutoAWQ's GEMM layout: qweight, qzeros packed along the output channels
                      in AWQ's order, scales), 4-bit with zero points, any group size
  compressed-tensors  llm-compressor / vLLM's format: `int-quantized` W8A8 (int8 weights per output
                      channel, int8 activations per token, dynamic and symmetric),
                      `pack-quantized` W4A16 (4-bit weights in groups, symmetric or not) and,
                      on GPUs with fp8, `float-quantized` FP8_DYNAMIC (float8 e4m3 weights per
                      output channel, fp8 activations per token, dynamic) and FP8 (weights
                      per tensor or channel, activations with one stored scale per tensor)
  fp8                 AutoFP8's layout (config `quant_method: fp8`, `activation_scheme` static or
                      dynamic; weight, weight_scale and input_scale tensors), on GPUs with fp8
4-bit layers run on quantization/int4.py's Int4Linear, GPTQ's 8-bit ones on int8_groups.py's
Int8GroupLinear, W8A8 on int8.py's Int8Linear (the same integer products as the checkpoint's
definition), the fp8 ones on fp8.py's Fp8Linear. Every other variant is refused with one line
naming it. The model is built by transformers from its config without the quantizer (which
would need packages that have no CPU wheel) and without weights (`load_model`); each quantized
Linear is then made from the checkpoint's tensors and every other weight read, straight from
the safetensors files.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from text_generation_common.quantize import CHECKPOINTS_SERVED
from text_generation_server.quantization.fp8 import Fp8Linear
from text_generation_server.quantization.int4 import Int4Linear
from text_generation_server.quantization.int8 import Int8Linear
from text_generation_server.quantization.int8_groups import Int8GroupLinear

logger = logging.getLogger(__name__)

GPTQ, AWQ, COMPRESSED_TENSORS, FP8 = "gptq", "awq", "compressed-tensors", "fp8"
# AWQ's GEMM layout packs eight output channels to an int32 in this order (nibble i holds channel
# AWQ_ORDER[i] of its eight); reading nibbles in sequence, this puts them back in place
AWQ_UNORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True, slots=True)
class Plan:
    """How a checkpoint's quantized linears are read."""

    method: str  # one of CHECKPOINTS_SERVED
    bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    act_order: bool = False  # GPTQ desc_act
    zeros_minus_one: bool = False  # GPTQ's v1 checkpoint format stores each zero point minus one
    activations: bool = False  # 8-bit activations (W8A8, FP8_DYNAMIC per token; FP8 per tensor)
    floating: bool = False  # float8 e4m3 weights and activations (FP8_DYNAMIC, FP8; GPU only)
    static_inputs: bool = False  # one stored activation scale per layer (FP8), not per token
    per_tensor: bool = False  # one weight scale per layer (FP8), not per output channel

    @property
    def fp8_name(self) -> str:
        """An fp8 checkpoint's kind, as its format names it."""
        if self.method == FP8:
            return f"fp8, activation_scheme {'static' if self.static_inputs else 'dynamic'}"
        return f"{self.method} {'FP8' if self.static_inputs else 'FP8_DYNAMIC'}"

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "per output channel"
        if self.per_tensor:
            groups = "per tensor"
        parts = [
            f"{self.method} {'fp8' if self.floating else f'{self.bits}-bit'} weights",
            groups,
            "symmetric" if self.symmetric else "with zero points",
        ]
        if self.act_order:
            parts.append("act-order")
        kind = "fp8" if self.floating else "int8"
        own = "activations in the model's dtype"
        per = "per tensor (static scales)" if self.static_inputs else "per token"
        parts.append(f"{kind} activations {per}" if self.activations else own)
        return ", ".join(parts)


def method_of(hf_config: Any, model_dir: Path) -> str | None:
    """The quantization method a checkpoint declares (its config's `quant_method`, or GPTQ's old
    `quantize_config.json`), or None."""
    declared = _declared(hf_config, model_dir)
    return None if declared is None else _method(declared)


def _method(declared: dict[str, Any]) -> str:
    return str(declared.get("quant_method") or GPTQ).lower().replace("_", "-")


def _declared(hf_config: Any, model_dir: Path) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is not None:
        return config if isinstance(config, dict) else config.to_dict()
    old = model_dir / "quantize_config.json"
    if old.is_file():
        return {"quant_method": GPTQ, **json.loads(old.read_text())}
    return None


def plan(hf_config: Any, model_dir: Path) -> Plan:
    """How this checkpoint's quantized linears are read; ValueError (one line) for a variant that
    is not served."""
    declared = _declared(hf_config, model_dir) or {}
    method = _method(declared)
    if method == GPTQ:
        return _gptq_plan(declared)
    if method == AWQ:
        return _awq_plan(declared)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors_plan(declared)
    if method == FP8:
        return _fp8_plan(declared)
    raise ValueError(
        f"this checkpoint is quantized with {method}, which is not served; "
        f"served: {', '.join(CHECKPOINTS_SERVED)}"
    )


def _gptq_plan(declared: dict[str, Any]) -> Plan:
    bits = int(declared.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ checkpoints with {bits}-bit weights are not served (4-bit and 8-bit are)")
    group = int(declared.get("group_size", 128))
    fmt = str(declared.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not served (gptq or gptq_v2)")
    return Plan(
        method=GPTQ,
        bits=bits,
        group_size=group if group > 0 else None,
        symmetric=bool(declared.get("sym", True)),
        act_order=bool(declared.get("desc_act", False)),
        zeros_minus_one=fmt == "gptq",
    )


def _awq_plan(declared: dict[str, Any]) -> Plan:
    bits = int(declared.get("bits", declared.get("w_bit", 4)))
    version = str(declared.get("version", "gemm")).lower()
    zeros = bool(declared.get("zero_point", True))
    if bits != 4 or version != "gemm" or not zeros:
        this = f"{bits}-bit, {version}{'' if zeros else ', no zero points'}"
        raise ValueError(f"AWQ checkpoints are served in 4-bit GEMM layout with zero points, not {this}")
    group = int(declared.get("group_size", declared.get("q_group_size", 128)))
    return Plan(method=AWQ, bits=4, group_size=group if group > 0 else None, symmetric=False)


def _fp8_plan(declared: dict[str, Any]) -> Plan:
    """AutoFP8's serialized layout (vLLM's `fp8` checkpoints): fp8 weights with a scale per tensor,
    activations at a stored scale per tensor (`static`) or at run time (`dynamic`: here per token,
    at least as fine as the per-tensor scale that scheme computes)."""
    if declared.get("weight_block_size"):
        raise ValueError(
            f"fp8 checkpoints with block-wise scales (weight_block_size {declared['weight_block_size']}) "
            "are not served (one scale per tensor is)"
        )
    if declared.get("kv_cache_quant_targets") or declared.get("kv_cache_scheme"):
        raise ValueError("fp8 checkpoints with a quantized KV cache are not served")
    scheme = str(declared.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("static", "dynamic"):
        raise ValueError(
            f"fp8 checkpoints with activation_scheme {scheme!r} are not served (static, dynamic)"
        )
    return _fp8_layers(FP8, static_inputs=scheme == "static", per_tensor=True)


def _fp8_layers(method: str, *, static_inputs: bool, per_tensor: bool) -> Plan:
    """fp8 weights (symmetric, one scale per channel or tensor) and fp8 activations."""
    return Plan(
        method=method,
        bits=8,
        group_size=None,
        symmetric=True,
        activations=True,
        floating=True,
        static_inputs=static_inputs,
        per_tensor=per_tensor,
    )


def _compressed_tensors_plan(declared: dict[str, Any]) -> Plan:
    fmt = declared.get("format")
    groups = list((declared.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoints with {len(groups)} config groups are not served (one)"
        )
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if declared.get("kv_cache_scheme") or groups[0].get("output_activations"):
        raise ValueError("compressed-tensors checkpoints with quantized KV caches or outputs are not served")
    bits, strategy = int(weights.get("num_bits", 0)), weights.get("strategy")
    if weights.get("type") == "float":
        fp8 = fmt == "float-quantized" and bits == 8 and strategy in ("channel", "tensor")
        static = _static_tensor(inputs)
        if fp8 and weights.get("symmetric", True) and (static or _dynamic_tokens(inputs, "float")):
            return _fp8_layers(COMPRESSED_TENSORS, static_inputs=static, per_tensor=strategy == "tensor")
        raise ValueError(
            f"compressed-tensors {fmt} with {bits}-bit float {strategy} weights is not served "
            "(float-quantized FP8 and FP8_DYNAMIC are: fp8 weights per channel or per tensor, fp8 "
            "activations per token or with a static scale per tensor)"
        )
    if weights.get("type") != "int":
        raise ValueError(f"compressed-tensors {weights.get('type')} weights are not served (int and float)")
    if fmt == "int-quantized" and bits == 8 and strategy == "channel" and weights.get("symmetric"):
        if not _dynamic_tokens(inputs, "int"):
            raise ValueError(
                "compressed-tensors int8 weights are served with dynamic int8 activations per token "
                "(W8A8) only"
            )
        return Plan(method=COMPRESSED_TENSORS, bits=8, group_size=None, symmetric=True, activations=True)
    if fmt == "pack-quantized" and bits == 4 and strategy in ("group", "channel") and inputs is None:
        group = int(weights["group_size"]) if strategy == "group" else None
        return Plan(
            method=COMPRESSED_TENSORS,
            bits=4,
            group_size=group,
            symmetric=bool(weights.get("symmetric", True)),
        )
    raise ValueError(
        f"compressed-tensors {fmt} with {bits}-bit {strategy} weights is not served "
        "(int-quantized W8A8, pack-quantized W4A16 and float-quantized FP8_DYNAMIC are)"
    )


def _static_tensor(inputs: dict[str, Any] | None) -> bool:
    """Whether a config group's input activations are fp8 with one stored scale per tensor."""
    if inputs is None:
        return False
    declared = tuple(inputs.get(k) for k in ("type", "num_bits", "strategy", "dynamic", "symmetric"))
    return declared == ("float", 8, "tensor", False, True)


def _dynamic_tokens(inputs: dict[str, Any] | None, kind: str) -> bool:
    """Whether a config group's input activations are 8-bit `kind`, dynamic, symmetric, per token."""
    if inputs is None:
        return False
    declared = tuple(inputs.get(k) for k in ("type", "num_bits", "strategy", "dynamic", "symmetric"))
    return declared == (kind, 8, "token", True, True)


def load_model(
    auto: Any, model_dir: Path, hf_config: Any, how: Plan, dtype: torch.dtype, **options: Any
) -> Any:
    """The model of a quantized checkpoint: built by transformers from its config (without the
    quantization_config, `options` to from_config) with its weights on the meta device, its
    quantized Linears replaced from the checkpoint, every other weight read from the safetensors
    files. The dense weights the quantized layers stand for are never allocated."""
    import transformers
    from accelerate import init_empty_weights

    if hasattr(hf_config, "quantization_config"):
        delattr(hf_config, "quantization_config")
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed
        model = auto.from_config(hf_config, dtype=dtype, **options)
    tensors = _Tensors(model_dir)
    _replace_linears(model, tensors, how, dtype)
    for name, param in list(model.named_parameters()):
        key = tensors.stored_as(name)
        if param.device.type != "meta" or key is None:
            continue
        value = tensors.get(key)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = nn.Parameter(
            value.to(dtype) if value.is_floating_point() else value, requires_grad=False
        )
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise ValueError(f"the safetensors files of {model_dir} lack {', '.join(missing[:3])}")
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(model_dir)
    return model


def _replace_linears(model: nn.Module, tensors: _Tensors, how: Plan, dtype: torch.dtype) -> None:
    """Replace every Linear the checkpoint holds quantized with our layer."""
    replaced = 0
    for prefix, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        layer = _read_layer(tensors, prefix, module, how, dtype)
        if layer is not None:
            owner, _, attribute = prefix.rpartition(".")
            setattr(model.get_submodule(owner), attribute, layer)
            replaced += 1
    if not replaced:
        raise ValueError(
            f"the checkpoint declares {how.method} quantization but holds no quantized linear layers"
        )
    logger.info("checkpoint quantization: %s: %d linear layers", how.describe(), replaced)


def _read_layer(
    tensors: _Tensors, prefix: str, linear: nn.Linear, how: Plan, dtype: torch.dtype
) -> nn.Module | None:
    key = tensors.key(prefix)
    if key is None:
        return None
    bias = tensors.get(f"{key}.bias") if tensors.has(f"{key}.bias") else linear.bias
    if bias is not None and bias.device.type == "meta":
        raise ValueError(f"the checkpoint lacks {key}.bias")
    if how.method in (GPTQ, AWQ):
        if not tensors.has(f"{key}.qweight"):
            return None
        read = _gptq_layer if how.method == GPTQ else _awq_layer
        return read(tensors, key, linear, how, bias, dtype)
    if tensors.has(f"{key}.weight_packed"):
        return _packed_layer(tensors, key, linear, how, bias, dtype)
    if tensors.has(f"{key}.weight_scale") and how.bits == 8:
        values, scales = tensors.get(f"{key}.weight"), tensors.get(f"{key}.weight_scale")
        _check_shape(prefix, values.shape, linear)
        scales = scales.float().flatten().expand(values.shape[0])  # one per tensor: every row's
        if not how.floating:
            return Int8Linear(values, scales, bias, dtype)
        if not how.static_inputs:
            return Fp8Linear(values, scales, bias, dtype)
        if not tensors.has(f"{key}.input_scale"):
            raise ValueError(
                f"{key}: the checkpoint declares static activation scales but holds no input_scale"
            )
        return Fp8Linear(values, scales, bias, dtype, input_scale=float(tensors.get(f"{key}.input_scale")))
    return None


def _gptq_layer(
    tensors: _Tensors, key: str, linear: nn.Linear, how: Plan, bias: torch.Tensor | None, dtype: torch.dtype
) -> Int4Linear | Int8GroupLinear:
    ints = unpack_ints(tensors.get(f"{key}.qweight"), dim=0, bits=how.bits).t()  # [out, in]
    _check_shape(key, ints.shape, linear)
    scales = tensors.get(f"{key}.scales").float().t()  # [out, groups]
    zeros = unpack_ints(tensors.get(f"{key}.qzeros"), dim=1, bits=how.bits)[:, : ints.shape[0]].t().float()
    if how.zeros_minus_one:
        zeros += 1
    in_features = ints.shape[1]
    group_size = how.group_size or in_features
    order = None
    if tensors.has(f"{key}.g_idx"):
        groups_of = tensors.get(f"{key}.g_idx").long()
        if not torch.equal(groups_of, torch.arange(in_features) // group_size):
            order = torch.argsort(groups_of, stable=True)
            if not torch.equal(groups_of[order], torch.arange(in_features) // group_size):
                raise ValueError(f"{key}: act-order groups of unequal sizes are not served")
            ints = ints[:, order]
    layer = Int8GroupLinear if how.bits == 8 else Int4Linear
    return layer(ints, scales, zeros, group_size, bias, dtype, order=order)


def _awq_layer(
    tensors: _Tensors, key: str, linear: nn.Linear, how: Plan, bias: torch.Tensor | None, dtype: torch.dtype
) -> Int4Linear:
    def channels(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out], in place
        values = unpack_ints(words, dim=1)
        return values.view(values.shape[0], -1, 8)[:, :, list(AWQ_UNORDER)].reshape(values.shape[0], -1)

    ints = channels(tensors.get(f"{key}.qweight")).t()  # [out, in]
    _check_shape(key, ints.shape, linear)
    zeros = channels(tensors.get(f"{key}.qzeros"))[:, : ints.shape[0]].t().float()
    scales = tensors.get(f"{key}.scales").float().t()
    return Int4Linear(ints, scales, zeros, how.group_size or ints.shape[1], bias, dtype)


def _packed_layer(
    tensors: _Tensors, key: str, linear: nn.Linear, how: Plan, bias: torch.Tensor | None, dtype: torch.dtype
) -> Int4Linear:
    out_features, in_features = (int(v) for v in tensors.get(f"{key}.weight_shape").tolist())
    _check_shape(key, (out_features, in_features), linear)
    ints = unpack_ints(tensors.get(f"{key}.weight_packed"), dim=1)[:, :in_features]
    scales = tensors.get(f"{key}.weight_scale").float().reshape(out_features, -1)
    if how.symmetric:
        zeros = torch.full_like(scales, 8.0)  # stored integers are the signed ones plus 8
    else:
        zeros = unpack_ints(tensors.get(f"{key}.weight_zero_point"), dim=0)[:out_features].float()
    group_size = how.group_size or in_features
    return Int4Linear(ints, scales, zeros.reshape(scales.shape), group_size, bias, dtype)


def _check_shape(key: str, shape: Any, linear: nn.Linear) -> None:
    if tuple(shape) != tuple(linear.weight.shape):
        raise ValueError(
            f"{key}: quantized weights {tuple(shape)} do not match the model's {tuple(linear.weight.shape)}"
        )


def unpack_ints(words: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """`bits`-bit values (4 or 8) packed 32 / bits to an int32 along `dim` (value j at bits
    bits * j and up), as unsigned integers, `dim` 32 / bits times longer."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = words.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    values = torch.bitwise_and(torch.bitwise_right_shift(moved, shifts), 2**bits - 1)
    return values.flatten(-2).movedim(-1, dim).to(torch.uint8)


class _Tensors:
    """The checkpoint's safetensors files, each opened once, read one tensor at a time."""

    def __init__(self, model_dir: Path) -> None:
        self.files: dict[str, Any] = {}  # tensor name -> its open file
        paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise ValueError(f"quantized checkpoints are read from safetensors files; {model_dir} has none")
        for path in paths:
            stored = safe_open(str(path), framework="pt", device="cpu")
            for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self.files[name] = stored

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self.files[name].get_tensor(name)
        return tensor

    def stored_as(self, name: str, leaves: tuple[str, ...] = ("",)) -> str | None:
        """The checkpoint's spelling of the model's `name` (transformers may add or drop a leading
        `model.`): the first under which it holds `name` + one of `leaves`, or None."""
        for candidate in (name, f"model.{name}", name.removeprefix("model.")):
            if any(self.has(f"{candidate}{leaf}") for leaf in leaves):
                return candidate
        return None

    def key(self, prefix: str) -> str | None:
        """The checkpoint's name for the module the model calls `prefix`, or None when it holds no
        quantized weights under it."""
        return self.stored_as(prefix, (".qweight", ".weight_packed", ".weight_scale"))
