"""The `hf_transformers` engine: any transformers causal or seq2seq LM, on CPU or CUDA.

Loads the model with AutoModelForCausalLM / AutoModelForSeq2SeqLM from a local directory or the
local Hugging Face cache (loading.py), and runs steps over left-padded batches (padded_engine.py
over padded_causal.py, padded_seq2seq.py). Called only from the shard's worker thread (server.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from text_generation_server.adapters import adapters_for
from text_generation_server.batches.kv_cache import cache_bytes, new_cache
from text_generation_server.batches.padded import PaddedBatch
from text_generation_server.batches.padded_causal import CausalLMBatch
from text_generation_server.batches.padded_seq2seq import Seq2SeqLMBatch
from text_generation_server.config import ServerConfig
from text_generation_server.engines.cpu_attention import use_decode_packed_sdpa
from text_generation_server.engines.loading import load_pretrained, model_context, prefill_bytes_per_token
from text_generation_server.engines.padded_engine import PaddedEngine
from text_generation_server.engines.step import ForwardTimer
from text_generation_server.kernels.weight_layout import LinearLayout, choose_linear_layouts
from text_generation_server.memory import MemoryFacts, cuda_available_bytes, host_available_bytes

logger = logging.getLogger(__name__)


class HFTransformersEngine(PaddedEngine):
    device_map: str | None = None  # how accelerate places the layers (None: all on one device)

    def __init__(self, config: ServerConfig) -> None:
        loaded = load_pretrained(config, device_map=self.device_map)
        self.model = loaded.model
        self.device, self.dtype, self.dtype_reason = loaded.device, loaded.dtype, loaded.dtype_reason
        self.timer = ForwardTimer(self.device)
        self.seq2seq = loaded.seq2seq
        dtype_name = loaded.dtype_name
        hf_config = loaded.hf_config
        if self.device.type == "cpu" and use_decode_packed_sdpa(self.model):
            logger.info("attention: SDPA, with GQA decode steps on the packed-query kernel")
        self.batch_type: type[PaddedBatch] = Seq2SeqLMBatch if self.seq2seq else CausalLMBatch
        self.context = model_context(loaded, config)
        max_length = self.context.max_sequence_length
        self.adapters = adapters_for(config, self.model, self.device, self.seq2seq, max_length)
        self.info = self.padded_info(
            config, self._memory_facts(hf_config, config.cuda_process_memory_fraction), dtype_name
        )
        whole = config.world_size == 1 and self.device_map is None  # one module per linear
        if self.device.type == "cpu" and whole:  # after the steps above, which read the weights
            choose_linear_layouts(self.model, config.max_batch_size, LinearLayout(config.linear_layout))

    def _memory_facts(self, hf_config: Any, cuda_fraction: float) -> MemoryFacts:
        """Measure KV bytes per token with a one-token forward pass; estimate the rest."""
        ctx = self.context
        with torch.inference_mode():
            if self.seq2seq:
                out = self.model(
                    input_ids=torch.full((1, 2), ctx.pad_token_id, device=self.device),
                    decoder_input_ids=torch.full((1, 1), ctx.decoder_start_token_id or 0, device=self.device),
                    past_key_values=new_cache(seq2seq=True, capacity=1),
                    use_cache=True,
                )
                hidden = out.encoder_last_hidden_state
                kv_in = cache_bytes(out.past_key_values.cross_attention_cache) // 2
                kv_in += hidden.shape[-1] * hidden.element_size()  # the kept encoder output
                kv_out = cache_bytes(out.past_key_values.self_attention_cache)
            else:
                out = self.model(
                    input_ids=torch.full((1, 1), ctx.pad_token_id, device=self.device),
                    past_key_values=new_cache(seq2seq=False, capacity=1),
                    use_cache=True,
                )
                kv_in = kv_out = cache_bytes(out.past_key_values)
        if self.device.type == "cuda":
            free = cuda_available_bytes(self.device, cuda_fraction)
        else:
            free = host_available_bytes()
        return MemoryFacts(
            kv_bytes_per_input_token=kv_in,
            kv_bytes_per_output_token=kv_out,
            prefill_bytes_per_token=prefill_bytes_per_token(hf_config, torch.finfo(self.dtype).bits // 8),
            free_bytes=free,
        )


class HFAccelerateEngine(HFTransformersEngine):
    """TGIS's `hf_accelerate`: one process, the model's layers spread over every visible GPU by
    accelerate (`device_map="auto"`; a single device on CPU), for models too large for one GPU
    that have no tensor-parallel plan. Steps and batches are hf_transformers'."""

    device_map = "auto"
