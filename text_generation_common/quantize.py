"""QUANTIZE's names (TGIS's and HF TGI's), which ones serve, on which engines; torch-free, so the
launcher refuses before any process starts (the shard checks the device and the checkpoint:
text_generation_server/quantization/)."""

from __future__ import annotations

BITSANDBYTES = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")  # transformers' integration
# pre-quantized checkpoints, served without the flag too
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
SERVED = ("int8", "fp8", *CHECKPOINT_METHODS, *BITSANDBYTES)
# the quant_method values of checkpoints served: fp8 is also AutoFP8's serialized layout (with
# QUANTIZE=fp8 or without a flag), while QUANTIZE=fp8 quantizes an unquantized model at load
CHECKPOINTS_SERVED = (*CHECKPOINT_METHODS, "fp8")
ENGINES = ("tgis_native", "hf_transformers")  # the engines that serve SERVED
GPU_ONLY = ("fp8",)  # the others run on CPU only (the shard checks its device)


def refusal(scheme: str | None, engine: str, world_size: int = 1) -> str | None:
    """Why QUANTIZE=`scheme` cannot serve on `engine` with `world_size` shards (None: it can)."""
    if not scheme:
        return None
    if scheme not in SERVED:
        return f"unknown QUANTIZE {scheme!r}; choose one of {', '.join(SERVED)}"
    if engine not in ENGINES:
        return f"QUANTIZE={scheme} is served by {' and '.join(ENGINES)}, not {engine}"
    if world_size > 1:
        return f"QUANTIZE={scheme} is not served on {world_size} shards yet (NUM_SHARD=1)"
    return None
