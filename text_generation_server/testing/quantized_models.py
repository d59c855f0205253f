"""Quantized checkpoints of the tiny (or any local) models, made offline, for tests and benchmarks.

compressed-tensors  through the compressed-tensors package itself: its preset scheme (W8A8,
                    W4A16, W4A16_ASYM) applied to every Linear but the LM head, weight scales and
                    zero points from its own `calculate_qparams` over each group's range
                    (round-to-nearest; W8A8's activations are quantized at run time, so no
                    calibration data is needed), compressed and saved by its ModelCompressor
                    exactly as llm-compressor saves them.
gptq                the AutoGPTQ / GPTQModel layout (qweight, qzeros, scales, g_idx and the
                    config's quantization_config), written here because no GPTQ package installs
                    from a wheel on this platform: 4-bit round-to-nearest integers in groups,
                    symmetric or with zero points, act-order (input channels ranked by weight
                    norm, as GPTQ ranks them by the Hessian's diagonal), v1 format (zeros stored
                    minus one) or v2. Only the file layout matters to a loader; GPTQ's own error
                    compensation would choose other integers in the same layout.

  python -m text_generation_server.testing.quantized_models --method gptq --src MODEL --out DIR
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

COMPRESSED_SCHEMES = ("W8A8", "W4A16", "W4A16_ASYM")
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
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None or not hasattr(module, "weight_scale"):
                continue
            args = module.quantization_scheme.weights
            weight = module.weight.float()
            if args.group_size:
                weight = weight.unflatten(-1, (-1, args.group_size))
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


def build_gptq(
    src: Path,
    out: Path,
    group_size: int = 128,
    act_order: bool = False,
    symmetric: bool = True,
    checkpoint_format: str = "gptq",
) -> Path:
    """`src` in GPTQ's 4-bit layout in `out` (see the module doc)."""
    quantization_config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": symmetric,
        "checkpoint_format": checkpoint_format,
    }
    return _write_quantized(
        src,
        out,
        lambda name, weight: _gptq_tensors(name, weight, group_size, act_order, symmetric, checkpoint_format),
        quantization_config,
    )


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
            return pack_nibbles(shuffled.to(torch.int32), dim=1)

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
    return _write_quantized(src, out, tensors, quantization_config)


def _write_quantized(src: Path, out: Path, tensors: Any, quantization_config: dict[str, Any]) -> Path:
    """`src`'s model with each Linear but the LM head replaced by `tensors(name, float weight)`."""
    import torch
    from safetensors.torch import save_file

    model = _load(src)
    head = model.get_output_embeddings()
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
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
    name: str, weight: Any, group_size: int, act_order: bool, symmetric: bool, checkpoint_format: str
) -> dict[str, Any]:
    import torch

    out_features, in_features = weight.shape
    group = group_size if group_size > 0 else in_features
    order = torch.argsort(weight.norm(dim=0), descending=True) if act_order else torch.arange(in_features)
    grouped = weight[:, order].view(out_features, in_features // group, group)
    if symmetric:
        scale = (grouped.abs().amax(-1) * 2 / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-8)
        zero = torch.round(-low / scale).clamp(0, 15)
    scale = scale.half().float()  # the file holds float16 scales: the integers are chosen for those
    q = torch.clamp(torch.round(grouped / scale[..., None]) + zero[..., None], 0, 15).view(
        out_features, in_features
    )
    ints = torch.empty_like(q)
    ints[:, order] = q  # back to the input channels' own order
    groups_of = torch.empty(in_features, dtype=torch.int32)
    groups_of[order] = torch.arange(in_features, dtype=torch.int32) // group
    stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
    return {
        f"{name}.qweight": pack_nibbles(ints.t().to(torch.int32), dim=0),  # [in / 8, out]
        f"{name}.qzeros": pack_nibbles(stored_zero.t().to(torch.int32), dim=1),  # [groups, out / 8]
        f"{name}.scales": scale.t().half().contiguous(),  # [groups, out]
        f"{name}.g_idx": groups_of,
    }


def pack_nibbles(values: Any, dim: int) -> Any:
    """Eight 4-bit values to an int32 along `dim` (value j at bits 4j..4j+3), GPTQ's packing."""
    import torch

    moved = values.movedim(dim, -1)
    words = moved.reshape(*moved.shape[:-1], -1, 8).to(torch.int64)
    packed = (words << torch.arange(0, 32, 4)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--method", choices=["gptq", "awq", "compressed-tensors"], required=True)
    parser.add_argument("--src", required=True, help="a local model directory (safetensors or .bin)")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument(
        "--scheme", choices=COMPRESSED_SCHEMES, default="W8A8", help="compressed-tensors preset"
    )
    parser.add_argument(
        "--group-size", type=int, default=128, help="4-bit group size (-1: per channel, GPTQ)"
    )
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act")
    parser.add_argument("--asym", action="store_true", help="GPTQ with zero points")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    src, out = Path(args.src), Path(args.out)
    if args.method == "gptq":
        build_gptq(src, out, args.group_size, args.act_order, not args.asym)
    elif args.method == "awq":
        build_awq(src, out, args.group_size)
    else:
        build_compressed_tensors(src, out, args.scheme, args.group_size)
    logger.info("wrote a %s checkpoint of %s in %s: %s", args.method, src, out, json.dumps(args.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
