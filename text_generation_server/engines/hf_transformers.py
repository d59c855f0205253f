"""The `hf_transformers` engine: any transformers causal or seq2seq LM, on CPU or CUDA.

Loads the model with AutoModelForCausalLM / AutoModelForSeq2SeqLM from a local directory or the
local Hugging Face cache, and runs steps over left-padded batches (padded_causal.py,
padded_seq2seq.py). One step = forward -> fp32 logits -> TokenChooser -> token details.
Called only from the shard's worker thread (server.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from text_generation_common.defaults import DEFAULT_MAX_SEQUENCE_LENGTH
from text_generation_common.engines import CapacityKind
from text_generation_common.guided import grammars_for
from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    ModelInfo,
    RequestError,
    StepOutput,
)
from text_generation_common.model_config import context_length
from text_generation_server import distributed, quantization
from text_generation_server.adapters import adapters_for
from text_generation_server.batches.kv_cache import cache_bytes, new_cache
from text_generation_server.batches.padded import ModelContext, PaddedBatch
from text_generation_server.batches.padded_causal import CausalLMBatch
from text_generation_server.batches.padded_seq2seq import Seq2SeqLMBatch
from text_generation_server.config import ServerConfig
from text_generation_server.engines import sharded_bigcode
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.cpu_attention import use_decode_packed_sdpa
from text_generation_server.engines.step import ForwardTimer, choose_tokens, drop_failed
from text_generation_server.kernels.weight_layout import LinearLayout, choose_linear_layouts
from text_generation_server.memory import MemoryFacts, estimate, host_available_bytes
from text_generation_server.sampling.token_details import encoder_input_token_infos, input_token_infos
from text_generation_server.utils.cpu import cpu_flags, default_cpu_dtype
from text_generation_server.utils.hub import resolve_model_dir

logger = logging.getLogger(__name__)


def select_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def select_dtype(
    name: str | None, device: torch.device, flags: frozenset[str] | None = None
) -> tuple[torch.dtype, str]:
    """The dtype to load in, and why: the one asked for, else float16 on CUDA, else by the CPU's
    instructions (utils/cpu.py; `flags` defaults to this machine's)."""
    if name is not None:
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype)
        return dtype, "asked for (DTYPE_STR / --dtype)"
    if device.type == "cuda":
        return torch.float16, "the default on CUDA"
    return default_cpu_dtype(cpu_flags() if flags is None else flags)


def config_int(hf_config: Any, names: Sequence[str], default: int) -> int:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value) if value is not None else None


@dataclass(slots=True)
class Loaded:
    """A transformers model loaded for serving, with what the engines need beside it."""

    model: Any
    tokenizer: Any
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    seq2seq: bool

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def load_pretrained(
    config: ServerConfig, attn_implementation: str | None = None, device_map: str | None = None
) -> Loaded:
    """Load the model named by `config` (local files only) on its device, in eval mode: this
    rank's slices when the config has more than one shard; with `device_map` ("auto"), spread
    by accelerate over the visible devices (the returned device is the one inputs go to)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = resolve_model_dir(config.model_name, config.revision)
    device = select_device(config.rank)
    quantization.check(config.quantize, config.deployment_framework, device, config.world_size)
    dtype, dtype_reason = select_dtype(config.dtype, device)
    hf_config = transformers.AutoConfig.from_pretrained(
        model_dir, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    seq2seq = bool(getattr(hf_config, "is_encoder_decoder", False))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    quantized = quantization.checkpoint_plan(
        config.quantize, hf_config, Path(model_dir), config.deployment_framework, device, config.world_size
    )
    load_kwargs: dict[str, Any] = quantization.load_kwargs(config.quantize, dtype)
    own_layers = distributed.own_sharded_layers(hf_config, config.world_size)
    if config.world_size > 1:  # this rank reads only its slices of the weights
        distributed.check_shardable(hf_config, config.world_size)
        if not own_layers:
            load_kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto")
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    if attn_implementation or config.attn_implementation:
        load_kwargs["attn_implementation"] = attn_implementation or config.attn_implementation
    logger.info(
        "loading %s (%s: %s; %s) from %s",
        config.model_name,
        str(dtype).removeprefix("torch."),
        dtype_reason,
        device,
        model_dir,
    )
    model: Any
    if own_layers:
        attn = load_kwargs.get("attn_implementation")
        shards = config.world_size
        model = sharded_bigcode.load(Path(model_dir), hf_config, dtype, device, config.rank, shards, attn)
    elif quantized is not None:
        options = {k: v for k, v in load_kwargs.items() if k == "attn_implementation"}
        options["trust_remote_code"] = config.trust_remote_code
        model = quantization.checkpoints.load_model(
            auto, Path(model_dir), hf_config, quantized, dtype, **options
        )
    else:
        model = auto.from_pretrained(
            model_dir,
            dtype=dtype,
            trust_remote_code=config.trust_remote_code,
            local_files_only=True,
            **load_kwargs,
        )
    if device_map is not None:
        device = model.get_input_embeddings().weight.device
        placed = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()})
        logger.info("layers placed by device_map=%s on: %s", device_map, ", ".join(placed) or str(device))
    elif config.world_size == 1 and "device_map" not in load_kwargs:
        model.to(device)
    model.eval()
    quantization.quantize_model(model, config.quantize)
    quantization.check_loaded(model, config.quantize)
    logger.info(
        "shard %d/%d holds %.1f MiB of the model's weights",
        config.rank,
        config.world_size,
        quantization.resident_bytes(model) / 2**20,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_dir, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    return Loaded(model, tokenizer, hf_config, device, dtype, dtype_reason, seq2seq)


def model_context(loaded: Loaded, config: ServerConfig) -> ModelContext:
    """Special tokens, vocabulary and limits of a loaded model."""
    output = loaded.model.get_output_embeddings()
    vocab_size = int(output.weight.shape[0]) if output is not None else int(loaded.hf_config.vocab_size)
    forward_params = inspect.signature(loaded.model.forward).parameters
    return build_context(
        loaded.hf_config,
        loaded.tokenizer,
        getattr(loaded.model, "generation_config", None),
        vocab_size,
        config,
        loaded.device,
        seq2seq=loaded.seq2seq,
        accepts_position_ids="position_ids" in forward_params,
        accepts_logits_to_keep="logits_to_keep" in forward_params,
    )


def build_context(
    hf_config: Any,
    tokenizer: Any,
    generation_config: Any,
    vocab_size: int,
    config: ServerConfig,
    device: torch.device,
    *,
    seq2seq: bool,
    accepts_position_ids: bool,
    accepts_logits_to_keep: bool,
) -> ModelContext:
    """Special tokens (config.json, then the generation config, then the tokenizer) and limits."""
    eos = _first_id(hf_config.eos_token_id)
    if eos is None and generation_config is not None:
        eos = _first_id(generation_config.eos_token_id)
    if eos is None:
        eos = _first_id(tokenizer.eos_token_id)
    if eos is None:
        raise ValueError("the model defines no EOS token (config.json or tokenizer)")
    pad = _first_id(hf_config.pad_token_id)
    if pad is None:
        pad = _first_id(tokenizer.pad_token_id)
    if pad is None:
        pad = eos  # padding is masked out: any valid id will do
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id if probe and probe[0] == tokenizer.bos_token_id else None
    model_max = context_length(hf_config.to_dict())
    max_sequence_length = config.max_sequence_length or model_max or DEFAULT_MAX_SEQUENCE_LENGTH
    if model_max is not None and max_sequence_length > model_max:
        logger.warning(
            "max_sequence_length %d is above the model's own limit of %d", max_sequence_length, model_max
        )
    decoder_start = None
    if seq2seq:
        decoder_start = _first_id(hf_config.decoder_start_token_id)
        if decoder_start is None:
            decoder_start = pad
    return ModelContext(
        device=device,
        vocab_size=vocab_size,
        grammars=grammars_for(resolve_model_dir(config.model_name, config.revision), vocab_size, eos),
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=bos,
        max_sequence_length=max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        accepts_position_ids=accepts_position_ids,
        accepts_logits_to_keep=accepts_logits_to_keep,
        decoder_start_token_id=decoder_start,
    )


class PaddedEngine(ModelEngine):
    """Steps over left-padded batches (padded_causal.py, padded_seq2seq.py) of a model that
    the subclass loads: `model` is what the batches' forward runs."""

    model: Any
    device: torch.device
    seq2seq: bool
    dtype_reason: str
    batch_type: type[PaddedBatch]
    context: ModelContext
    timer: ForwardTimer  # of the model's forward, on `device`

    def padded_info(self, config: ServerConfig, facts: MemoryFacts, dtype_name: str) -> ModelInfo:
        """What the router learns of the engine: limits, special tokens, the batch-weight model."""
        memory_model = estimate(
            config.estimate_memory,
            facts,
            max_sequence_length=self.context.max_sequence_length,
            max_batch_size=config.max_batch_size,
            safety_margin=config.batch_safety_margin,
        )
        return ModelInfo(
            seq2seq=self.seq2seq,
            eos_token_id=self.context.eos_token_id,
            vocab_size=self.context.vocab_size,
            max_sequence_length=self.context.max_sequence_length,
            memory=memory_model,
            capacity=CapacityKind.PADDED_WEIGHTS,
            chunked_prefill=False,
            dtype=dtype_name,
            dtype_reason=self.dtype_reason,
        )

    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[PaddedBatch | None, list[RequestError]]:
        found = self.adapters.for_requests(requests) if self.adapters is not None else None
        return self.batch_type.from_requests(batch_id, requests, self.context, found)

    def generate_token(
        self, batch: Any, first: bool, token_budget: int = 0
    ) -> tuple[StepOutput, PaddedBatch | None]:
        assert isinstance(batch, PaddedBatch)
        with torch.inference_mode():
            return self._step(batch, first)

    def _step(self, batch: PaddedBatch, first: bool) -> tuple[StepOutput, PaddedBatch | None]:
        want_input_logits = first and not self.seq2seq and batch.wants_input_logits
        self.timer.start()
        applied = (
            self.adapters.applied(batch.loras, self.device, by_rows=True)
            if self.adapters is not None
            else contextlib.nullcontext()
        )
        with applied:
            logits = batch.forward(self.model, all_logits=want_input_logits)
        last = logits[:, -1, :].to(torch.float32, copy=True)
        self.timer.stop()
        next_ids, output = choose_tokens(last, batch.requests, batch.chooser)
        output.forward_ns = self.timer.elapsed_ns()  # after the ids' copy: no sync of its own
        if first:
            output.input_tokens = self._input_tokens(batch, logits if want_input_logits else None)
        batch.append_tokens(next_ids)
        return output, drop_failed(batch, output)

    def _input_tokens(self, batch: PaddedBatch, logits: torch.Tensor | None) -> list[InputTokens]:
        prompts = batch.prompts
        assert prompts is not None, "input tokens are known only in the prefill step"
        result = []
        for row, request in enumerate(batch.requests):
            if not request.details.input_tokens:
                continue
            ids = prompts[row]
            if self.seq2seq:
                infos = encoder_input_token_infos(ids, request.details)
            else:
                row_logits = logits[row, -len(ids) :] if logits is not None else None
                infos = input_token_infos(row_logits, ids, request.details)
            result.append(InputTokens(request.id, infos))
        return result


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
        width = config_int(hf_config, ("hidden_size", "n_embd", "d_model"), 1024)
        inner = config_int(hf_config, ("intermediate_size", "n_inner", "d_ff"), 4 * width)
        element = torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allowed = int(total * cuda_fraction) - torch.cuda.memory_allocated(self.device)
            free = max(0, min(free, allowed))
        else:
            free = host_available_bytes()
        return MemoryFacts(
            kv_bytes_per_input_token=kv_in,
            kv_bytes_per_output_token=kv_out,
            prefill_bytes_per_token=(4 * width + 2 * inner) * element,
            free_bytes=free,
        )


class HFAccelerateEngine(HFTransformersEngine):
    """TGIS's `hf_accelerate`: one process, the model's layers spread over every visible GPU by
    accelerate (`device_map="auto"`; a single device on CPU), for models too large for one GPU
    that have no tensor-parallel plan. Steps and batches are hf_transformers'."""

    device_map = "auto"
