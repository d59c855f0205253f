"""`convert-to-onnx`: a transformers causal LM exported as one ONNX decoder in optimum's layout.

No optimum release runs next to transformers 5, so the export is torch's own
(`torch.onnx.export(dynamo=True)`, which needs the `onnx` and `onnxscript` packages) over a
wrapper whose inputs are optimum's: input_ids, attention_mask, position_ids (models that take
them) and past_key_values.{i}.key/value; outputs logits and present.{i}.key/value. Batch, query
and past lengths are dynamic, so the one graph serves prefills (past of length 0) and decode
steps (onnx/onnx_session.py reads it; optimum's own exports load the same way).

The target directory gets `model.onnx` (weights over 2 GB in `model.onnx.data`) and every
non-weight file of the model (config, generation config, tokenizer), so it is a model directory
the `hf_optimum_ort` engine serves. `optimize` saves the graph after ONNX Runtime's extended
optimizations (constant folding, fused layer norms, GELU, attention where the patterns match),
which a session would otherwise redo at every start. The export is checked before it is kept:
ONNX Runtime's logits on a sample must match the torch model's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from text_generation_common.logs import first_line

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".data")
OUTPUT_FILE = "model.onnx"
EXPORT_DTYPES = ("float32", "float16")
CHECK_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}  # max |logit difference| on the sample


CHATTY_LOGGERS = ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "torch._dynamo")


class ExportError(ValueError):
    """The model cannot be exported (one line saying why)."""


# The attention the export traces (registered with transformers under this name): the query heads
# of each KV head packed into one matrix, so the graph neither repeats KV heads (GQA, MQA) nor
# copies transposed keys. ONNX Runtime fuses the key transpose into its MatMul. Measured with
# ONNX Runtime on a 2-core AMD EPYC, the benchmarks' Llama (8 query / 2 KV heads, 8 layers), a
# decode step of 32 rows over 200 cached positions: 56 ms with transformers' SDPA decomposed
# (repeat_kv's Expand and the Transposes were half of it) against 26 ms with this one.
EXPORT_ATTENTION = "onnx_grouped"


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [B, heads, S, d], key/value [B, kv_heads, L, d], mask [B, 1, S, L] (True = attend,
    or additive) -> [B, S, heads, d_v], transformers' attention-interface contract."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, seq, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * seq, dim)  # row g * S + s: head g of the group
    scores = torch.matmul(packed, key.transpose(-1, -2)) * (scaling if scaling is not None else dim**-0.5)
    if attention_mask is None:  # causal over the new positions (the mask was skipped as trivial)
        attention_mask = torch.ones(seq, length, dtype=torch.bool, device=query.device).tril(length - seq)
        attention_mask = attention_mask[None, None]
    mask = attention_mask[:, :, :, :length]
    if groups > 1:
        mask = mask.repeat(1, 1, groups, 1)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value).reshape(batch, heads, seq, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXPORT_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(EXPORT_ATTENTION, sdpa_mask)


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{part}" for i in range(layers) for part in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{part}" for i in range(layers) for part in ("key", "value")]


class _Decoder(torch.nn.Module):
    """The model as the ONNX graph sees it: flat past in, logits and flat presents out;
    position_ids and logits_to_keep (positions whose logits to compute) where the model takes
    them."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        position_ids: torch.Tensor | None = None,
        logits_to_keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        optional = {"position_ids": position_ids, "logits_to_keep": logits_to_keep}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=DynamicCache(ddp_cache_data=past),
            use_cache=True,
            **{name: value for name, value in optional.items() if value is not None},
        )
        flat = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *flat)


def _kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's cache, from a one-token forward pass."""
    with torch.inference_mode():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True)
    layers = out.past_key_values.layers
    keys = layers[0].keys
    if keys is None or keys.dim() != 4:
        raise ExportError("the model's KV cache is not [batch, heads, positions, head_dim] per layer")
    return len(layers), int(keys.shape[1]), int(keys.shape[3])


def _copy_model_files(model_dir: Path, target: Path) -> None:
    """Config, generation config and tokenizer files (everything but weights) into `target`."""
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(item, target / item.name)


def export(model_dir: Path, target: Path, dtype: str = "float32", optimize: bool = False) -> Path:
    """Export the causal LM in `model_dir` into `target` (created; may be `model_dir`); returns
    the ONNX file. Raises ExportError when the model cannot be exported or the export does not
    compute what the model does."""
    import transformers

    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(
            f"the ONNX export needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
            "pip install 'text-generation-server[onnx]'"
        ) from None
    started = time.monotonic()
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ExportError(
            f"{config.model_type} is an encoder-decoder model: only decoder-only models export to ONNX here"
        )
    _register_attention()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), local_files_only=True
        ).eval()
    except (ValueError, OSError) as exc:
        raise ExportError(f"cannot load {model_dir} as a causal LM: {first_line(exc)}") from None
    if getattr(model.config, "_attn_implementation", None) == "sdpa":  # models on the attention interface
        model.set_attn_implementation(EXPORT_ATTENTION)
    layers, kv_heads, head_dim = _kv_shape(model)
    accepted = inspect.signature(model.forward).parameters
    wrapper = _Decoder(model).eval()
    sample = _sample(config, layers, kv_heads, head_dim, getattr(torch, dtype), accepted)
    batch, seq, past_len, total, kept = (torch.export.Dim.DYNAMIC,) * 5
    axes = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "past": tuple(({0: batch, 2: past_len}, {0: batch, 2: past_len}) for _ in range(layers)),
        "position_ids": {0: batch, 1: seq},
        "logits_to_keep": {0: kept},
    }
    dynamic = {name: axes[name] for name in sample}
    # graph inputs in the order torch flattens the sample: its keys, the past as one name per tensor
    names = [n for name in sample for n in (past_names(layers) if name == "past" else [name])]
    target.mkdir(parents=True, exist_ok=True)
    logger.info(
        "exporting %s (%s, %d layers) to ONNX in %s; this takes a while",
        model_dir,
        config.model_type,
        layers,
        target,
    )
    with tempfile.TemporaryDirectory(dir=target) as scratch:
        file = Path(scratch) / OUTPUT_FILE
        try:
            with torch.inference_mode(False), torch.no_grad(), _quiet():
                torch.onnx.export(
                    wrapper,
                    (),
                    str(file),
                    kwargs=sample,
                    dynamo=True,
                    input_names=names,
                    output_names=["logits", *present_names(layers)],
                    dynamic_shapes=dynamic,
                    external_data=_large(model),
                    optimize=True,
                    verbose=False,
                )
        except Exception as exc:  # torch.export's reasons run long: the first line names the failing op
            raise ExportError(f"{config.model_type} cannot be exported to ONNX: {first_line(exc)}") from None
        if optimize:
            _optimize(file)
        _check(file, wrapper, sample, dtype)
        for produced in Path(scratch).iterdir():
            produced.replace(target / produced.name)
    if target.resolve() != model_dir.resolve():
        _copy_model_files(model_dir, target)
    logger.info("ONNX export written to %s in %.1f s", target / OUTPUT_FILE, time.monotonic() - started)
    return target / OUTPUT_FILE


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporter's own loggers at ERROR (they log every rewrite, and missing torchvision ops)
    and its deprecation warnings off while it runs."""
    loggers = [logging.getLogger(name) for name in CHATTY_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def _large(model: Any) -> bool:
    return sum(p.numel() * p.element_size() for p in model.parameters()) > 1_500_000_000


def _sample(
    config: Any, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, accepted: Any
) -> dict[str, Any]:
    """The wrapper's keyword inputs for two rows, three new tokens over three cached positions
    (sizes of 2 and more keep the exported dimensions dynamic; the first row left-padded by one),
    the logits of the last two positions kept; position_ids and logits_to_keep only where the
    model's forward takes them."""
    generator = torch.Generator().manual_seed(0)
    batch, seq, past = 2, 3, 3
    vocab = int(getattr(config, "vocab_size", 100))
    mask = torch.ones((batch, past + seq), dtype=torch.long)
    mask[0, 0] = 0
    sample: dict[str, Any] = {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=generator),
        "attention_mask": mask,
    }
    shape = (batch, kv_heads, past, head_dim)
    sample["past"] = tuple(
        (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
        for _ in range(layers)
    )
    if "position_ids" in accepted:
        sample["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    if "logits_to_keep" in accepted:
        sample["logits_to_keep"] = torch.tensor([seq - 2, seq - 1])
    return sample


def _optimize(file: Path) -> None:
    """Rewrite `file` with ONNX Runtime's extended graph optimizations applied (portable across
    CPUs, unlike the `all` level's layout changes)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    optimized = file.with_name("optimized.onnx")
    options.optimized_model_filepath = str(optimized)
    if (file.parent / (file.name + ".data")).exists():
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", OUTPUT_FILE + ".data"
        )
    onnxruntime.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
    optimized.replace(file)


def _check(file: Path, wrapper: _Decoder, sample: dict[str, Any], dtype: str) -> None:
    """ONNX Runtime's logits on the sample against the torch model's."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    feeds: dict[str, Any] = {}
    for name, value in sample.items():
        if name == "past":
            for i, (key, val) in enumerate(value):
                feeds[f"past_key_values.{i}.key"] = key.numpy()
                feeds[f"past_key_values.{i}.value"] = val.numpy()
        else:
            feeds[name] = value.numpy()
    got = torch.from_numpy(session.run(["logits"], feeds)[0])
    with torch.inference_mode():
        want = wrapper(**sample)[0]
    error = (got.float() - want.float()).abs().max().item()
    if not error <= CHECK_TOLERANCE[dtype]:
        raise ExportError(f"the ONNX export does not match the model (max logit difference {error:.3g})")
    logger.info("ONNX export checked against the model: max logit difference %.2g", error)
