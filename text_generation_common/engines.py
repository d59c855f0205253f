"""The engine registry: every DEPLOYMENT_FRAMEWORK name, where its class lives and what it can do.

Torch-free, so that the launcher checks a configuration against the engines' capabilities
without importing any of them; the shard imports the class named by `target` lazily
(text_generation_server/engines/__init__.py). The shard also reports the capacity kind and
chunked-prefill support of the running engine to the router in ModelInfo (messages.py).

Adding an engine: a class implementing text_generation_server.engines.base.ModelEngine, one
EngineSpec here, and the engine's parameters in tests/engines/conformance.py (README, "Adding
an engine").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CapacityKind(enum.Enum):
    """How the router decides that a request fits beside the running ones (router/core/capacity.py)."""

    PADDED_WEIGHTS = "padded_weights"  # TGIS batch weights of left-padded rectangular batches
    UNPADDED_WEIGHTS = "unpadded_weights"  # TGIS batch weights of packed (ragged) batches
    KV_BLOCKS = "kv_blocks"  # blocks of a paged KV cache, its state reported with every step


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    tensor_parallel: bool = False  # one model split over NUM_SHARD > 1 shard processes
    capacity: CapacityKind = CapacityKind.PADDED_WEIGHTS
    seq2seq: bool = False  # serves encoder-decoder models as well as decoder-only ones
    prompt_tuning: bool = False  # tuned soft prompts (prefix_id, or adapter_id naming one)
    lora: bool = False  # LoRA adapters (adapter_id)
    chunked_prefill: bool = False  # can compute part of a prompt per step (a token budget)
    speculation: bool = False  # speculative decoding (SPECULATE)
    requires: tuple[str, ...] = ()  # modules beyond the core install (an extra), checked by the launcher
    install_hint: str = ""  # how to get them


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    target: str  # "module:Class", imported only by the shard
    capabilities: EngineCapabilities
    summary: str


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "hf_transformers",
            "text_generation_server.engines.hf_transformers:HFTransformersEngine",
            EngineCapabilities(
                tensor_parallel=True,
                capacity=CapacityKind.PADDED_WEIGHTS,
                seq2seq=True,
                prompt_tuning=True,
                lora=True,
            ),
            "any transformers causal or seq2seq LM, left-padded batches (CPU or CUDA)",
        ),
        EngineSpec(
            "hf_accelerate",
            "text_generation_server.engines.hf_transformers:HFAccelerateEngine",
            EngineCapabilities(
                capacity=CapacityKind.PADDED_WEIGHTS, seq2seq=True, prompt_tuning=True, lora=True
            ),
            "hf_transformers with the layers spread over every visible GPU (one process, "
            "accelerate's device_map=auto) for models without a tensor-parallel plan",
        ),
        EngineSpec(
            "tgis_native",
            "text_generation_server.engines.tgis_native:TgisNativeEngine",
            EngineCapabilities(
                tensor_parallel=True,
                capacity=CapacityKind.KV_BLOCKS,
                chunked_prefill=True,
                prompt_tuning=True,
                lora=True,
                speculation=True,
            ),
            "decoder-only Llama, Mistral, GPT-NeoX, GPT-2, GPT-BigCode, Granite, Qwen2: ragged batches "
            "over a paged KV cache",
        ),
        EngineSpec(
            "hf_optimum_ort",
            "text_generation_server.engines.hf_optimum_ort:OnnxRuntimeEngine",
            EngineCapabilities(
                capacity=CapacityKind.PADDED_WEIGHTS,
                requires=("onnxruntime",),
                install_hint="pip install 'text-generation-server[onnx]' (or onnxruntime-gpu for CUDA)",
            ),
            "a decoder-only model's ONNX export (optimum's layout; exported on first load when missing) "
            "on ONNX Runtime, left-padded batches (CPU or CUDA provider)",
        ),
    )
}


def engine_spec(name: str) -> EngineSpec:
    """The registered engine `name`; ValueError naming the choices otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown deployment framework {name!r}; choose one of: {', '.join(sorted(ENGINES))}"
        ) from None
