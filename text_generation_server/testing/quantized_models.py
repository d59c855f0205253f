"""Quantized checkpoints of the tiny (or any local) models, made offline, for tests and benchmarks.

compressed-tensors  through the compressed-tensors package itself: its preset scheme (W8A8,
                    W4A16, W4A16_ASYM, FP8_DYNAMIC, FP8) applied to every Linear but the LM head,
                    weight scales and zero points from its own `calculate_qparams` over each
                    group's, channel's or tensor's range (round-to-nearest), compressed and saved
                    by its ModelCompressor exactly as llm-compressor saves them. Dynamic
                    activations need no calibration data; FP8's static per-tensor input scales
                    are the largest |input| each Linear sees over random-token prompts, over 448
                    (llm-compressor's static min-max observer).
gptq                GPTQ itself (written here: no GPTQ package installs from a wheel on this
                    platform), in the AutoGPTQ / GPTQModel layout (qweight, qzeros, scales, g_idx
                    and the config's quantization_config): 4-bit or 8-bit, groups, symmetric or
                    with zero points, act-order, v1 format (zeros stored minus one) or v2. The
                    Hessian of each Linear's inputs comes from random-token prompts run through
                    the model one decoder layer at a time, each layer calibrated on the already
                    quantized layers before it; columns are rounded one by one, each one's error
                    spread over the columns not yet rounded (lazy updates in blocks of 128, 1 %
                    damping, act-order by the Hessian's diagonal). Without calibration:
                    round-to-nearest.
fp8                 AutoFP8's serialized layout (`quant_method: fp8`, vLLM's `fp8` checkpoints):
                    compressed-tensors' FP8 checkpoint under AutoFP8's quantization_config.
awq                 AutoAWQ's GEMM layout (qweight and qzeros packed along the output channels in
                    AWQ's order, scales), written here for the same reason: 4-bit round-to-nearest
                    integers with zero points in groups. AWQ's activation-aware scaling would fold
                    per-channel factors into the weights and norms before rounding; the layout is
                    the same.

  python -m text_generation_server.testing.quantized_models --method gptq|awq|compressed-tensors|fp8 \
      --src MODEL --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPRESSED_SCHEMES = ("W8A8", "W4A16", "W4A16_ASYM", "FP8_DYNAMIC", "FP8")
STATIC_CALIBRATION = (8, 32)  # prompts x tokens of random ids that set static activation scales
GPTQ_BLOCK = 128  # columns GPTQ updates one by one before updating the rest at once
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _load(src: Path) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def build_compressed_tensors(
    src: Path, out: Path, scheme: str = "W8A8", group_size: int | None = None
) -> Path:
    """`src` quantized with compressed-tensors' preset `scheme` into `out` (groups of
    `group_size` input channels for the 4-bit schemes: None keeps the preset's 128)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    if scheme not in COMPRESSED_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(COMPRESSED_SCHEMES)}")
    model = _load(src)
    preset = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None and preset.weights.group_size:
        preset.weights.group_size = group_size
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"])
    )
    with torch.no_grad():
        _calibrate_static_inputs(model)
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None or not hasattr(module, "weight_scale"):
                continue
            args = module.quantization_scheme.weights
            weight = module.weight.float()
            if args.group_size:
                weight = weight.unflatten(-1, (-1, args.group_size))
            if args.strategy == "tensor":
                weight = weight.flatten()
            low, high = weight.amin(-1), weight.amax(-1)
            scales, zeros = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scales.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zeros.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    return out


def build_autofp8(src: Path, out: Path, activation_scheme: str = "static") -> Path:
    """`src` in AutoFP8's serialized fp8 layout (config `quant_method: fp8`): compressed-tensors'
    FP8 preset writes the same tensors (fp8 `weight`, per-tensor `weight_scale`, `input_scale`),
    so this is that checkpoint with AutoFP8's quantization_config."""
    return as_autofp8(build_compressed_tensors(src, out, "FP8"), activation_scheme)


def as_autofp8(checkpoint: Path, activation_scheme: str = "static") -> Path:
    """A compressed-tensors FP8 checkpoint given AutoFP8's quantization_config in place (a
    dynamic scheme keeps the input scales, which its readers ignore)."""
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": activation_scheme,
        "ignored_layers": ["lm_head"],
    }
    config_path.write_text(json.dumps(config, indent=2))
    return checkpoint


def _calibrate_static_inputs(model: Any) -> None:
    """Set the static input scale of every Linear whose scheme has one, from the range of its
    inputs over STATIC_CALIBRATION random-token prompts (before its weights are quantized)."""
    import torch
    from compressed_tensors.quantization import disable_quantization, enable_quantization
    from compressed_tensors.quantization.utils import calculate_qparams

    ranges: dict[Any, float] = {}

    def observe(module: Any, args: tuple[Any, ...]) -> None:
        ranges[module] = max(ranges.get(module, 0.0), float(args[0].abs().max()))

    static = [
        m
        for m in model.modules()
        if getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
        and not m.quantization_scheme.input_activations.dynamic
    ]
    if not static:
        return
    hooks = [m.register_forward_pre_hook(observe) for m in static]
    prompts, tokens = STATIC_CALIBRATION
    ids = torch.randint(
        3, model.config.vocab_size, (prompts, tokens), generator=torch.Generator().manual_seed(0)
    )
    try:
        model.apply(disable_quantization)  # the inputs of the unquantized model
        with torch.inference_mode():
            model(ids)
    finally:
        model.apply(enable_quantization)
        for hook in hooks:
            hook.remove()
    for module in static:
        high = torch.tensor([ranges[module]])
        scale, _ = calculate_qparams(-high, high, module.quantization_scheme.input_activations)
        module.input_scale.copy_(scale.reshape(module.input_scale.shape))


def build_gptq(
    src: Path,
    out: Path,
    group_size: int = 128,
    act_order: bool = False,
    symmetric: bool = True,
    checkpoint_format: str = "gptq",
    calibration: tuple[int, int] | None = (16, 64),
    bits: int = 4,
) -> Path:
    """`src` in GPTQ's `bits`-bit layout (4 or 8) in `out` (see the module doc); `calibration`
    (prompts, tokens) of random tokens drive GPTQ's error compensation, None rounds to nearest."""
    quantization_config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": symmetric,
        "checkpoint_format": checkpoint_format,
    }
    model = _load(src)
    solved: dict[str, dict[str, Any]] = {}

    def solve(name: str, weight: Any, hessian: Any = None) -> dict[str, Any]:
        solved[name] = _gptq_tensors(
            name, weight, group_size, act_order, symmetric, checkpoint_format, hessian, bits
        )
        return solved[name]

    if calibration:
        _calibrate(model, *calibration, solve, zeros_minus_one=checkpoint_format == "gptq")

    def tensors(name: str, weight: Any) -> dict[str, Any]:  # outside the decoder layers: rounded
        return solved[name] if name in solved else solve(name, weight)

    return _write_quantized(model, src, out, tensors, quantization_config)


def _calibrate(model: Any, prompts: int, tokens: int, solve: Any, zeros_minus_one: bool) -> None:
    """Sequential GPTQ over random-token prompts, one decoder layer at a time: `solve(name, weight,
    hessian)` quantizes each of the layer's Linears, whose weights then become the dequantized
    ones, so the next layer is calibrated on the quantized model's activations."""
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("GPTQ calibration walks model.model.layers (Llama-family models)")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, int(model.config.vocab_size), (prompts, tokens), generator=gen)
    for index, layer in enumerate(layers):
        linears = {
            f"model.layers.{index}.{child}": module
            for child, module in layer.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        for key, hessian in _hessians(model, ids, layer, linears).items():
            module = linears[key]
            written = solve(key, module.weight.detach().float(), hessian)
            with torch.no_grad():
                module.weight.copy_(_gptq_dequantized(written, zeros_minus_one))


class _Stop(Exception):
    """Ends a calibration forward once the layer being calibrated has run."""


def _hessians(model: Any, ids: Any, layer: Any, linears: dict[str, Any]) -> dict[str, Any]:
    """2 X^T X / rows of each of `linears`' inputs X, `ids` run through `model` up to `layer`."""
    import torch

    sums = {key: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for key, m in linears.items()}
    rows = dict.fromkeys(linears, 0)

    def summing(key: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].reshape(-1, module.in_features).double()
            sums[key] += x.t() @ x
            rows[key] += x.shape[0]

        return hook

    def stop(*_: Any) -> None:
        raise _Stop

    hooks = [m.register_forward_pre_hook(summing(key)) for key, m in linears.items()]
    hooks.append(layer.register_forward_hook(stop))
    try:
        with torch.no_grad():
            model(ids)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return {key: (2 * sums[key] / max(rows[key], 1)).float() for key in linears}


def _gptq_dequantized(tensors: dict[str, Any], zeros_minus_one: bool) -> Any:
    """The weights [out, in] a GPTQ layer's tensors hold (v1 format: zeros stored minus one; 4 or
    8 bits, as many as fill qweight's words with g_idx's input channels)."""
    import torch

    from text_generation_server.quantization.checkpoints import unpack_ints

    (qweight,) = (v for k, v in tensors.items() if k.endswith(".qweight"))
    (qzeros,) = (v for k, v in tensors.items() if k.endswith(".qzeros"))
    (scales,) = (v for k, v in tensors.items() if k.endswith(".scales"))
    (groups,) = (v for k, v in tensors.items() if k.endswith(".g_idx"))
    bits = 32 * qweight.shape[0] // groups.numel()
    ints = unpack_ints(qweight, 0, bits).float()  # [in, out]
    zeros = unpack_ints(qzeros, 1, bits).float() + float(zeros_minus_one)
    groups = groups.long()
    return ((ints - zeros[groups]) * scales.float()[groups]).t().to(torch.float32)


def build_awq(src: Path, out: Path, group_size: int = 128) -> Path:
    """`src` in AutoAWQ's 4-bit GEMM layout in `out` (see the module doc)."""
    import torch

    from text_generation_server.quantization.checkpoints import AWQ_UNORDER

    order = [AWQ_UNORDER.index(i) for i in range(8)]  # nibble i holds channel AWQ_ORDER[i]

    def tensors(name: str, weight: Any) -> dict[str, Any]:
        columns = weight.t().contiguous()  # [in, out]: AWQ keeps the input channels as rows
        groups = columns.view(columns.shape[0] // group_size, group_size, -1)
        low, high = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-8).half().float()  # [groups, out]
        zero = torch.round(-low / scale).clamp(0, 15)
        ints = torch.clamp(torch.round(groups / scale[:, None]) + zero[:, None], 0, 15).view_as(columns)

        def packed(values: Any) -> Any:  # [rows, out] -> [rows, out / 8] in AWQ's order
            shuffled = values.reshape(values.shape[0], -1, 8)[:, :, order].reshape(values.shape[0], -1)
            return pack_ints(shuffled.to(torch.int32), dim=1)

        return {
            f"{name}.qweight": packed(ints),
            f"{name}.qzeros": packed(zero),
            f"{name}.scales": scale.half(),
        }

    quantization_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    return _write_quantized(_load(src), src, out, tensors, quantization_config)


def _write_quantized(
    model: Any, src: Path, out: Path, tensors: Any, quantization_config: dict[str, Any]
) -> Path:
    """`model` (loaded from `src`) with each Linear but the LM head replaced by `tensors(name,
    float weight)` (in groups of quantization_config's group_size input channels)."""
    import torch
    from safetensors.torch import save_file

    head = model.get_output_embeddings()
    state: dict[str, Any] = {}
    stored: set[int] = set()
    for name, tensor in model.state_dict().items():  # a tied LM head is its embeddings: once
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            group = quantization_config["group_size"]
            if group > 0 and module.in_features % group:
                raise ValueError(
                    f"groups of {group} do not tile the {module.in_features} input channels of {name}"
                )
            del state[f"{name}.weight"]
            state.update(tensors(name, module.weight.detach().float()))
    out.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = quantization_config
    model.config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    _copy_tokenizer(src, out)
    return out


def _gptq_tensors(
    name: str,
    weight: Any,
    group_size: int,
    act_order: bool,
    symmetric: bool,
    checkpoint_format: str,
    hessian: Any = None,
    bits: int = 4,
) -> dict[str, Any]:
    """One Linear's `bits`-bit GPTQ tensors: GPTQ's column-by-column rounding with error
    compensation over `hessian` [in, in] (None: round to nearest). Act-order ranks the input
    channels by the Hessian's diagonal (without one: by weight norm) and groups them in that order."""
    import torch

    out_features, in_features = weight.shape
    group = group_size if group_size > 0 else in_features
    if not act_order:
        order = torch.arange(in_features)
    elif hessian is not None:
        order = torch.argsort(torch.diagonal(hessian), descending=True)
    else:
        order = torch.argsort(weight.norm(dim=0), descending=True)
    permuted = weight[:, order].clone()
    top = 2**bits - 1  # the largest integer
    scale = torch.empty(out_features, in_features // group)
    zero = torch.empty_like(scale)

    def params(columns: Any, g: int) -> None:  # the group's scale and zero point, from its weights
        if symmetric:
            scale[:, g] = (columns.abs().amax(-1) * 2 / top).clamp(min=1e-8).half().float()
            zero[:, g] = (top + 1) / 2
        else:
            low, high = columns.amin(-1).clamp(max=0), columns.amax(-1).clamp(min=0)
            scale[:, g] = ((high - low) / top).clamp(min=1e-8).half().float()  # the file's float16
            zero[:, g] = torch.round(-low / scale[:, g]).clamp(0, top)

    def rounded(column: Any, g: int) -> Any:
        return torch.clamp(torch.round(column / scale[:, g]) + zero[:, g], 0, top)

    q = torch.empty_like(permuted)
    if hessian is None:
        for g in range(in_features // group):
            params(permuted[:, g * group : (g + 1) * group], g)
        for k in range(in_features):
            q[:, k] = rounded(permuted[:, k], k // group)
    else:  # GPTQ's lazy batch updates: within a block column by column, the rest once per block
        inverse = _inverse_hessian(hessian[order][:, order])
        for start in range(0, in_features, GPTQ_BLOCK):
            end = min(start + GPTQ_BLOCK, in_features)
            block = permuted[:, start:end].clone()
            errors = torch.empty_like(block)
            for j in range(end - start):
                k, g = start + j, (start + j) // group
                if k % group == 0:  # from the weights as updated so far
                    params(torch.cat((block[:, j:], permuted[:, end:]), 1)[:, :group], g)
                q[:, k] = rounded(block[:, j], g)
                errors[:, j] = (block[:, j] - (q[:, k] - zero[:, g]) * scale[:, g]) / inverse[k, k]
                block[:, j + 1 :] -= errors[:, j, None] * inverse[k, k + 1 : end][None, :]
            permuted[:, end:] -= errors @ inverse[start:end, end:]
    ints = torch.empty_like(q)
    ints[:, order] = q  # back to the input channels' own order
    groups_of = torch.empty(in_features, dtype=torch.int32)
    groups_of[order] = torch.arange(in_features, dtype=torch.int32) // group
    stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
    return {  # 32 / bits values to an int32: qweight [in * bits / 32, out], qzeros [groups, out * bits / 32]
        f"{name}.qweight": pack_ints(ints.t().to(torch.int32), dim=0, bits=bits),
        f"{name}.qzeros": pack_ints(stored_zero.t().to(torch.int32), dim=1, bits=bits),
        f"{name}.scales": scale.t().half().contiguous(),  # [groups, out]
        f"{name}.g_idx": groups_of,
    }


def _inverse_hessian(hessian: Any, damp: float = 0.01) -> Any:
    """The upper Cholesky factor of the damped Hessian's inverse, as GPTQ updates with it."""
    import torch

    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def pack_ints(values: Any, dim: int, bits: int = 4) -> Any:
    """32 / bits unsigned `bits`-bit values (4 or 8) to an int32 along `dim` (value j at bits
    bits * j and up), GPTQ's packing."""
    import torch

    moved = values.movedim(dim, -1)
    words = moved.reshape(*moved.shape[:-1], -1, 32 // bits).to(torch.int64) & (2**bits - 1)
    packed = (words << torch.arange(0, 32, bits)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--method", choices=["gptq", "awq", "compressed-tensors", "fp8"], required=True)
    parser.add_argument("--src", required=True, help="a local model directory (safetensors or .bin)")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument(
        "--scheme", choices=COMPRESSED_SCHEMES, default="W8A8", help="compressed-tensors preset"
    )
    parser.add_argument("--group-size", type=int, default=128, help="group size (-1: per channel, GPTQ)")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4, help="GPTQ's bits per weight")
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act")
    parser.add_argument("--asym", action="store_true", help="GPTQ with zero points")
    parser.add_argument(
        "--calibration",
        default="16x64",
        help="GPTQ's calibration: PROMPTSxTOKENS of random tokens, or 0 to round to nearest",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    src, out = Path(args.src), Path(args.out)
    if args.method == "gptq":
        prompts, _, tokens = args.calibration.partition("x")
        calibration = (int(prompts), int(tokens)) if int(prompts) else None
        build_gptq(
            src, out, args.group_size, args.act_order, not args.asym, calibration=calibration, bits=args.bits
        )
    elif args.method == "awq":
        build_awq(src, out, args.group_size)
    elif args.method == "fp8":
        build_autofp8(src, out)
    else:
        build_compressed_tensors(src, out, args.scheme, args.group_size)
    logger.info("wrote a %s checkpoint of %s in %s: %s", args.method, src, out, json.dumps(args.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
