"""One model loader for every engine: the model directory, device, dtype, transformers config,
tokenizer and generation config, the weights (whole, this rank's slices under tensor
parallelism, spread by accelerate, or a quantized checkpoint), and the special tokens and limits
the batches check requests against (ModelContext). hf_transformers and tgis_native load their
model here (`load_pretrained`); hf_optimum_ort reads the same config, tokenizer and generation
config beside its ONNX graph (`load_hf_config`, `load_tokenizer`, `load_generation_config`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from text_generation_common.defaults import DEFAULT_MAX_SEQUENCE_LENGTH
from text_generation_common.guided import grammars_for
from text_generation_common.model_config import context_length
from text_generation_server import distributed, quantization
from text_generation_server.batches.padded import ModelContext
from text_generation_server.config import ServerConfig
from text_generation_server.engines import sharded_bigcode
from text_generation_server.utils.cpu import cpu_flags, default_cpu_dtype, emulated_dtype
from text_generation_server.utils.hub import resolve_model_dir

logger = logging.getLogger(__name__)


def select_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def select_dtype(
    name: str | None, device: torch.device, flags: frozenset[str] | None = None
) -> tuple[torch.dtype, str]:
    """The dtype to load in, and why: the one asked for (a warning where the CPU can only emulate
    it), else float16 on CUDA, else by the CPU's instructions (utils/cpu.py; `flags` defaults to
    this machine's)."""
    if name is not None:
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype)
        if device.type == "cpu":
            slow = emulated_dtype(dtype, cpu_flags() if flags is None else flags)
            if slow is not None:
                logger.warning("%s asked for, but %s", name, slow)
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


def load_hf_config(model_dir: Path | str, config: ServerConfig) -> Any:
    """The model's transformers config (config.json), local files only."""
    import transformers

    return transformers.AutoConfig.from_pretrained(
        model_dir, trust_remote_code=config.trust_remote_code, local_files_only=True
    )


def load_tokenizer(model_dir: Path | str, config: ServerConfig) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        model_dir, trust_remote_code=config.trust_remote_code, local_files_only=True
    )


def load_generation_config(model_dir: Path | str) -> Any:
    """generation_config.json, or None where the model has none (config.json and the tokenizer
    then say enough)."""
    import transformers

    try:
        return transformers.GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        return None


def prefill_bytes_per_token(hf_config: Any, element_bytes: int) -> int:
    """Transient activation bytes of one prompt token in a forward pass, from the config's widths."""
    width = config_int(hf_config, ("hidden_size", "n_embd", "d_model"), 1024)
    inner = config_int(hf_config, ("intermediate_size", "n_inner", "d_ff"), 4 * width)
    return (4 * width + 2 * inner) * element_bytes


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value) if value is not None else None


SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # vLLM's


def sampling_defaults(generation_config: Any) -> tuple[tuple[str, float], ...]:
    """The sampling parameters generation_config.json sets to other than transformers'
    defaults, by name (none without one)."""
    if generation_config is None:
        return ()
    values = generation_config.to_diff_dict()
    return tuple(
        (name, float(values[name]))
        for name in SAMPLING_DEFAULTS
        if isinstance(values.get(name), (int, float)) and not isinstance(values.get(name), bool)
    )


def _ids(value: Any) -> list[int]:
    """An id or a list of ids (None: none) as a list."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)] if value is not None else []


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
    hf_config = load_hf_config(model_dir, config)
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
    if quantized is None:  # a quantized checkpoint is served as it is (QUANTIZE may name its method)
        quantization.quantize_model(model, config.quantize)
    quantization.check_loaded(model, config.quantize)
    logger.info(
        "shard %d/%d holds %.1f MiB of the model's weights",
        config.rank,
        config.world_size,
        quantization.resident_bytes(model) / 2**20,
    )
    tokenizer = load_tokenizer(model_dir, config)
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
    # every EOS id the model names (instruct models end a turn with one, a text with another),
    # as transformers' generate and vLLM stop on each
    named = [
        *_ids(hf_config.eos_token_id),
        *_ids(getattr(generation_config, "eos_token_id", None)),
        *_ids(tokenizer.eos_token_id),
    ]
    extra_eos = tuple(dict.fromkeys(i for i in named if i != eos and 0 <= i < vocab_size))
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
        extra_eos_token_ids=extra_eos,
        sampling_defaults=sampling_defaults(generation_config),
        pad_token_id=pad,
        bos_token_id=bos,
        max_sequence_length=max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        accepts_position_ids=accepts_position_ids,
        accepts_logits_to_keep=accepts_logits_to_keep,
        decoder_start_token_id=decoder_start,
    )
