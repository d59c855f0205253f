"""The `hf_optimum_ort` engine: a decoder-only model's ONNX export run by ONNX Runtime.

Serves a model directory holding an ONNX decoder with past key/values in optimum's layout
(onnx_session.py), beside its config.json and tokenizer. A directory without one is exported on
first load into the directory itself (onnx/onnx_export.py, as `convert-to-onnx` does), which
takes a while and is said in the log; where the directory is read-only the error names the
command to run instead. Batches are hf_transformers' left-padded ones with joins and prunes
(padded_causal.py) whose KV cache is a list of exact-size tensors per layer: ONNX Runtime reads
the past and writes the present (past + the new positions) in place through I/O binding, and
the present is the next step's past. Steps share the post-processing of every engine (TGIS
sampling, token details). No soft prompts or LoRA (the graph takes token ids only).

The dtype is the export's: float32 on CPU (ONNX Runtime has no fast bfloat16 CPU kernels),
float16 for the CUDA execution provider (onnxruntime-gpu and a GPU).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from text_generation_server.batches.kv_cache import pad_left
from text_generation_server.batches.padded_causal import CausalLMBatch
from text_generation_server.config import ServerConfig
from text_generation_server.engines.loading import (
    build_context,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
    prefill_bytes_per_token,
    select_device,
)
from text_generation_server.engines.padded_engine import PaddedEngine
from text_generation_server.engines.step import ForwardTimer
from text_generation_server.memory import MemoryFacts, host_available_bytes
from text_generation_server.onnx.onnx_session import (
    DecoderSession,
    OnnxModelError,
    find_decoder,
    session_device,
)
from text_generation_server.utils.hub import resolve_model_dir

logger = logging.getLogger(__name__)

Past = list[torch.Tensor]  # keys and values of layer 0, 1, ...: [batch, kv_heads, positions, head_dim]


class OrtCausalBatch(CausalLMBatch):
    """Left-padded causal batches whose KV cache is the ONNX decoder's past (exact sizes)."""

    def forward(self, model: Any, all_logits: bool) -> torch.Tensor:
        assert isinstance(model, DecoderSession)
        past = self.past if self.past is not None else model.empty_past(len(self.requests))
        logits, self.past = model.run(
            self.input_ids, self.attention_mask, self.position_ids, past, all_logits
        )
        return logits if all_logits else logits[:, -1:]

    @staticmethod
    def _select_past(past: Past, rows: torch.Tensor, keep_last: int, capacity: int) -> Past:
        return [t.index_select(0, rows)[:, :, t.shape[2] - keep_last :].contiguous() for t in past]

    @staticmethod
    def _concatenate_past(pasts: Sequence[Past], length: int, capacity: int) -> Past:
        return [torch.cat([pad_left(p[i], length, dim=2) for p in pasts]) for i in range(len(pasts[0]))]


def export_dtype(asked: str | None, device: torch.device) -> str:
    """The dtype to export in when the engine converts: the one asked for, else the device's."""
    if asked is None:
        return "float16" if device.type == "cuda" else "float32"
    if asked not in ("float32", "float16"):
        raise ValueError(
            f"hf_optimum_ort runs float32 or float16 ONNX exports, not {asked} (set DTYPE_STR to float32 on "
            "CPU, float16 on a GPU)"
        )
    return asked


def decoder_file(model_dir: Path, config: ServerConfig, device: torch.device) -> Path:
    """The model's ONNX decoder, exported into `model_dir` first if it has none."""
    found = find_decoder(model_dir)
    if found is not None:
        return found
    from text_generation_server.onnx import onnx_export

    if not os.access(model_dir, os.W_OK):
        raise ValueError(
            f"{model_dir} holds no ONNX model and is not writable: run `text-generation-server "
            f"convert-to-onnx {config.model_name} TARGET` and serve TARGET"
        )
    logger.info("%s holds no ONNX model: exporting it now (first load only)", model_dir)
    return onnx_export.export(model_dir, model_dir, export_dtype(config.dtype, device))


class OnnxRuntimeEngine(PaddedEngine):
    def __init__(self, config: ServerConfig) -> None:
        if config.world_size > 1:
            raise ValueError("hf_optimum_ort runs on one shard (NUM_SHARD=1)")
        model_dir = Path(resolve_model_dir(config.model_name, config.revision))
        device = session_device(select_device(config.rank))
        hf_config = load_hf_config(model_dir, config)
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ValueError(
                "hf_optimum_ort serves decoder-only models: use hf_transformers for encoder-decoders"
            )
        file = decoder_file(model_dir, config, device)
        try:
            session = DecoderSession(file, device)
        except OnnxModelError as exc:
            raise ValueError(str(exc)) from None
        dtype = session.io.kv_dtype
        if config.dtype is not None and getattr(torch, config.dtype) != dtype:
            raise ValueError(
                f"{file.name} computes in {str(dtype).removeprefix('torch.')}, DTYPE_STR asks for "
                f"{config.dtype}: export again (convert-to-onnx --dtype {config.dtype}) or unset DTYPE_STR"
            )
        logger.info(
            "ONNX Runtime %s on %s: %s (%d layers, %s)",
            _ort_version(),
            ", ".join(session.session.get_providers()),
            file,
            session.io.layers,
            str(dtype).removeprefix("torch."),
        )
        tokenizer = load_tokenizer(model_dir, config)
        generation_config = load_generation_config(model_dir)
        self.model = session
        self.device, self.dtype, self.seq2seq = device, dtype, False
        self.timer = ForwardTimer(device)
        self.dtype_reason = "the ONNX export's"
        self.batch_type = OrtCausalBatch
        self.context = build_context(
            hf_config,
            tokenizer,
            generation_config,
            session.vocab_size,
            config,
            device,
            seq2seq=False,
            accepts_position_ids=True,  # the session feeds them where the graph takes them
            accepts_logits_to_keep=False,
        )
        self.adapters = None
        self.info = self.padded_info(
            config, self._memory_facts(hf_config, session), str(dtype).removeprefix("torch.")
        )

    def _memory_facts(self, hf_config: Any, session: DecoderSession) -> MemoryFacts:
        """KV bytes per token from the graph's past shapes; a prefill also holds every prompt
        position's logits (the graph computes them all)."""
        io = session.io
        element = torch.finfo(io.kv_dtype).bits // 8
        kv = 2 * io.layers * io.kv_heads * io.head_dim * element
        logits = session.vocab_size * (torch.finfo(io.logits_dtype).bits // 8)
        return MemoryFacts(
            kv_bytes_per_input_token=kv,
            kv_bytes_per_output_token=kv,
            prefill_bytes_per_token=prefill_bytes_per_token(hf_config, element) + logits,
            free_bytes=host_available_bytes(),
        )


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)
