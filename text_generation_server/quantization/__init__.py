"""QUANTIZE on the shard: which schemes serve where, what a checkpoint declares, and the model's
linears replaced by quantized ones.

  int8                   (CPU) every Linear (not the LM head, not the embeddings) rounded to int8
                         weights per output channel at load, activations in int8 per token
                         (int8.py: oneDNN's int8 kernels, AMX-INT8 where the CPU has it; on
                         CPUs whose int8 products saturate, no VNNI or AMX-INT8, our C++ kernel
                         with exact sums)
  fp8                    (GPU, Hopper or newer) the same Linears in float8 e4m3 per output
                         channel, activations in fp8 per token (fp8.py: torch's scaled product);
                         a checkpoint in AutoFP8's layout (quant_method fp8) is read as it is
  gptq, awq, compressed-tensors  pre-quantized checkpoints, read as their quantization_config
                         says (checkpoints.py; int4.py, int8_groups.py and int8.py run them),
                         with or without the flag
  bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4  HF TGI's names: transformers' bitsandbytes
                         integration quantizes at load (LLM.int8(), NF4, FP4; compute in the
                         model's dtype), on the modules' forward

The names TGIS and HF TGI give QUANTIZE and the engines each serves on are in
text_generation_common/quantize.py (the launcher checks them too). The loader
(engines/loading.py) calls `check` before loading, `checkpoint_plan` on the model's
config (then checkpoints.load_model builds the model), `load_kwargs` into transformers'
from_pretrained otherwise, then `quantize_model` and `check_loaded` on the loaded model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from text_generation_common.quantize import (
    BITSANDBYTES,
    CHECKPOINT_METHODS,
    CHECKPOINTS_SERVED,
    GPU_ONLY,
    refusal,
)
from text_generation_server.kernels.weight_layout import plain_linears
from text_generation_server.quantization import checkpoints, fp8, int8
from text_generation_server.quantization.checkpoints import Plan
from text_generation_server.quantization.fp8 import Fp8Linear
from text_generation_server.quantization.int4 import Int4Linear
from text_generation_server.quantization.int8 import Int8Linear
from text_generation_server.quantization.int8_groups import Int8GroupLinear

logger = logging.getLogger(__name__)

__all__ = [
    "Fp8Linear",
    "Int4Linear",
    "Int8GroupLinear",
    "Int8Linear",
    "Plan",
    "check",
    "check_loaded",
    "checkpoint_plan",
    "load_kwargs",
    "packed_bytes",
    "quantize_model",
    "resident_bytes",
]


FP8_GPUS = "GPUs with fp8 tensor cores (Hopper or newer: compute capability {}.{})".format(
    *fp8.MIN_CAPABILITY
)


def check(scheme: str | None, engine: str, device: torch.device, world_size: int = 1) -> None:
    """Raise ValueError with one line unless `scheme` (QUANTIZE) can serve here."""
    reason = refusal(scheme, engine, world_size)
    if reason is not None:
        raise ValueError(reason)
    if scheme in GPU_ONLY:
        where = _without_fp8(device)
        if where:
            raise ValueError(f"QUANTIZE={scheme} runs on {FP8_GPUS}, not on {where}; on CPU use int8")
    elif scheme and device.type != "cpu":
        raise ValueError(
            f"QUANTIZE={scheme} runs on CPU (our int8 / int4 layers, bitsandbytes' CPU backend), "
            f"not on {device.type}"
        )


def _without_fp8(device: torch.device) -> str | None:
    """What `device` is when it cannot run fp8 layers (None: it can)."""
    if device.type != "cuda":
        return device.type
    capability = torch.cuda.get_device_capability(device)
    return None if capability >= fp8.MIN_CAPABILITY else "compute capability {}.{}".format(*capability)


def checkpoint_plan(
    scheme: str | None, hf_config: Any, model_dir: Path, engine: str, device: torch.device, world_size: int
) -> Plan | None:
    """How the checkpoint's own quantization is read (None: it declares none); ValueError (one
    line) where it is not served here or QUANTIZE (`scheme`) contradicts it."""
    method = checkpoints.method_of(hf_config, model_dir)
    if method is None:
        if scheme in CHECKPOINT_METHODS:
            raise ValueError(
                f"QUANTIZE={scheme}: {model_dir} declares no quantization (its config.json has no "
                f"quantization_config); {scheme} serves checkpoints quantized with {scheme}"
            )
        return None
    if scheme and scheme != method:
        raise ValueError(
            f"QUANTIZE={scheme} contradicts the checkpoint, which is quantized with {method} "
            f"(config.json quantization_config); leave QUANTIZE unset or set it to {method}"
        )
    if method not in CHECKPOINTS_SERVED:
        raise ValueError(
            f"this checkpoint is quantized with {method}, which is not served; "
            f"served checkpoints: {', '.join(CHECKPOINTS_SERVED)}"
        )
    plan = checkpoints.plan(hf_config, model_dir)
    if not plan.floating:
        check(method, engine, device, world_size)
        return plan
    reason = refusal(method, engine, world_size)
    where = _without_fp8(device)
    if reason is None and where:
        reason = f"this checkpoint's fp8 weights ({plan.fp8_name}) run on {FP8_GPUS}, not on {where}"
    if reason is not None:
        raise ValueError(reason)
    return plan


def load_kwargs(scheme: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """What transformers' from_pretrained takes for `scheme` (bitsandbytes' quantizer), or {}."""
    if scheme not in BITSANDBYTES:
        return {}
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(
            f"QUANTIZE={scheme} needs the bitsandbytes package: "
            "pip install 'text-generation-server[quantize]'"
        ) from None
    import transformers

    if scheme == "bitsandbytes":
        config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=scheme.rsplit("-", 1)[1], bnb_4bit_compute_dtype=dtype
        )
    return {"quantization_config": config, "device_map": "cpu"}


BNB_4BIT_BLOCK = 64  # bitsandbytes' CPU 4-bit kernels take inputs in blocks of this many


def check_loaded(model: nn.Module, scheme: str | None) -> None:
    """ValueError (one line) where the loaded, quantized model cannot run: bitsandbytes' CPU
    4-bit layers fail at their first call unless every input size is a multiple of 64."""
    if scheme not in BITSANDBYTES[1:]:
        return
    for name, module in model.named_modules():
        if type(module).__name__ == "Linear4bit" and module.in_features % BNB_4BIT_BLOCK:
            raise ValueError(
                f"QUANTIZE={scheme}: bitsandbytes' CPU 4-bit kernels need input sizes that are multiples "
                f"of {BNB_4BIT_BLOCK}; {name} takes {module.in_features}"
            )


def packed_bytes(model: nn.Module) -> int:
    """Bytes of int8 weights packed outside the model's parameters and buffers (oneDNN's packed
    objects); fp8 and grouped 4-bit and 8-bit weights are buffers, counted with the model's."""
    return sum(m.packed_bytes() for m in model.modules() if isinstance(m, Int8Linear))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the weights this rank holds: parameters, buffers and packed int8 weights."""
    from text_generation_server import distributed

    return distributed.local_bytes(model) + packed_bytes(model)


# QUANTIZE=int8's log: which product serves (int8.py's product_way)
INT8_WAYS = {
    int8.EIGHT_BIT: "oneDNN's int8 kernels",
    int8.EXACT: "our C++ kernel over the int8 weights, exact in 32 bits",
    int8.SPLIT: "oneDNN, each token's integers in two 7-bit halves: no VNNI or AMX-INT8 here, no C++ kernels",
}


def _at_load(
    scheme: str | None,
) -> tuple[Callable[[nn.Linear], Int8Linear | Fp8Linear], str] | None:
    """How QUANTIZE=`scheme` makes each Linear at load, and how the log says it (None: it makes
    none at load)."""
    if scheme == "fp8":
        return Fp8Linear.quantize, "in fp8 e4m3 (scaled per output channel, each token's activations in fp8)"
    if scheme != "int8":
        return None
    return Int8Linear.quantize, f"in int8, each token's activations in int8 ({INT8_WAYS[int8.product_way()]})"


def quantize_model(model: Any, scheme: str | None) -> None:
    """Replace the model's Linear layers (not the LM head) with int8 ones for QUANTIZE=int8 (W8A8),
    fp8 ones for QUANTIZE=fp8 (else nothing); logs it."""
    at_load = _at_load(scheme)
    if at_load is None:
        return
    make, how = at_load
    head = model.get_output_embeddings()
    device = head.weight.device if head is not None else next(model.parameters()).device
    targets = [
        (p, name, linear) for p, name, linear in plain_linears(model, device.type) if linear is not head
    ]
    if not targets:
        raise ValueError(f"QUANTIZE={scheme}: this model has no Linear layers to quantize")
    before = after = 0
    for parent, name, linear in targets:
        replacement = make(linear)
        before += linear.weight.numel() * linear.weight.element_size()
        after += replacement.weight_bytes()
        setattr(parent, name, replacement)
    logger.info(
        "QUANTIZE=%s: %d linear layers %s: their weights %.1f MiB -> %.1f MiB",
        scheme,
        len(targets),
        how,
        before / 2**20,
        after / 2**20,
    )
