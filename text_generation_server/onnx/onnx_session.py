"""An ONNX decoder with past key/values, run by ONNX Runtime on torch tensors.

The graph is the one optimum exports for `text-generation-with-past` (and `convert-to-onnx`
writes, onnx_export.py):

    inputs   input_ids [B, S] int64, attention_mask [B, P + S] int64, position_ids [B, S] int64
             (models with absolute or rotary positions), past_key_values.{i}.key / .value
             [B, kv_heads, P, head_dim] per layer (P = 0 for a prefill)
    outputs  logits [B, S, vocab], present.{i}.key / .value [B, kv_heads, P + S, head_dim]

Our exports (convert-to-onnx) add an optional input, `logits_to_keep` [K] int64: the positions
whose logits to compute (a prefill needs only the last one, unless token details of the prompt
are asked for), which spares a [B, S, vocab] projection and its memory.

The names transformers' own exporter writes (`input.past_key_values.layers.{i}.keys`,
`output.past_key_values.layers.{i}.values`, `input.`/`output.` in front of the others) are read
too, and optimum's older merged decoder (`decoder_model_merged.onnx`, with a `use_cache_branch`
flag) is fed the flag. Anything else is refused at load with one line saying what is missing.

Every tensor is bound in place (ONNX Runtime's I/O binding on the torch tensors' memory): the
inputs as they are, the outputs into tensors allocated here with their known shapes, so a step
copies nothing through numpy and the presents become the next step's past as they are.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from text_generation_common.logs import first_line

logger = logging.getLogger(__name__)

# the ONNX files a model directory may hold, in the order they are looked for
DECODER_FILES = ("model.onnx", "decoder_model_merged.onnx")
PAST = re.compile(r"^(?:input\.)?past_key_values\.(?:layers\.)?(\d+)\.(key|value)s?$")
PRESENT = re.compile(
    r"^(?:present\.(\d+)\.(key|value)|(?:output\.)?past_key_values\.(?:layers\.)?(\d+)\.(key|value)s?)$"
)

ELEMENT_TYPES = {  # ONNX tensor type strings -> torch dtypes
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


class OnnxModelError(ValueError):
    """An ONNX file this engine cannot serve (the message is the one line to show)."""


@dataclass(frozen=True, slots=True)
class DecoderIO:
    """Where each tensor of the decoder goes, by the graph's own names."""

    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits_to_keep: str | None
    use_cache_branch: str | None
    past: tuple[tuple[str, str], ...]  # per layer: (key, value) inputs
    logits: str
    present: tuple[tuple[str, str], ...]  # per layer: (key, value) outputs
    kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    logits_dtype: torch.dtype
    input_types: tuple[tuple[str, torch.dtype], ...]  # every input's element type

    @property
    def layers(self) -> int:
        return len(self.past)


def _plain(name: str) -> str:
    return name.removeprefix("input.").removeprefix("output.")


def _layers(names: dict[int, dict[str, str]], what: str, file: str) -> tuple[tuple[str, str], ...]:
    if not names:
        return ()
    count = max(names) + 1
    missing = [
        f"{i}.{part}" for i in range(count) for part in ("key", "value") if part not in names.get(i, {})
    ]
    if missing:
        raise OnnxModelError(f"{file}: the {what} of layer(s) {', '.join(missing[:4])} are missing")
    return tuple((names[i]["key"], names[i]["value"]) for i in range(count))


def describe(inputs: list[Any], outputs: list[Any], file: str) -> DecoderIO:
    """The decoder's I/O from ONNX Runtime's input/output descriptions (name, shape, type)."""
    by_name = {_plain(i.name): i for i in inputs}
    past: dict[int, dict[str, str]] = {}
    for i in inputs:
        match = PAST.match(i.name)
        if match:
            past.setdefault(int(match.group(1)), {})[match.group(2)] = i.name
    present: dict[int, dict[str, str]] = {}
    logits = None
    for o in outputs:
        match = PRESENT.match(o.name)
        if match:
            layer, part = (
                (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
            )
            present.setdefault(int(layer), {})[part] = o.name
        elif _plain(o.name) == "logits":
            logits = o
    for needed in ("input_ids", "attention_mask"):
        if needed not in by_name:
            raise OnnxModelError(f"{file} has no {needed} input: not a decoder in optimum's layout")
    if logits is None:
        raise OnnxModelError(f"{file} has no logits output: not a causal LM decoder in optimum's layout")
    if not past or not present:
        raise OnnxModelError(
            f"{file} has no past_key_values inputs / present outputs: export the decoder with its KV "
            "cache (optimum's text-generation-with-past, or text-generation-server convert-to-onnx)"
        )
    past_names, present_names = _layers(past, "past inputs", file), _layers(present, "present outputs", file)
    if len(past_names) != len(present_names):
        raise OnnxModelError(
            f"{file} takes the past of {len(past_names)} layers and returns {len(present_names)}"
        )
    key_in = next(i for i in inputs if i.name == past_names[0][0])
    shape = list(key_in.shape)
    if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
        raise OnnxModelError(
            f"{file}: past keys must be [batch, kv_heads, past, head_dim] with fixed heads and head "
            f"size, got {shape}"
        )
    kv_dtype = ELEMENT_TYPES.get(key_in.type)
    logits_dtype = ELEMENT_TYPES.get(logits.type)
    if kv_dtype is None or logits_dtype is None or not kv_dtype.is_floating_point:
        raise OnnxModelError(f"{file}: unsupported tensor types (past {key_in.type}, logits {logits.type})")
    types = []
    for i in inputs:
        dtype = ELEMENT_TYPES.get(i.type)
        if dtype is None:
            raise OnnxModelError(f"{file}: input {i.name} has an unsupported type {i.type}")
        types.append((i.name, dtype))
    known = {by_name["input_ids"].name, by_name["attention_mask"].name} | {
        n for pair in past_names for n in pair
    }
    position = by_name.get("position_ids")
    keep = by_name.get("logits_to_keep")
    branch = by_name.get("use_cache_branch")
    known |= {x.name for x in (position, keep, branch) if x is not None}
    unknown = [i.name for i in inputs if i.name not in known]
    if unknown:
        raise OnnxModelError(f"{file} has inputs this engine does not feed: {', '.join(unknown)}")
    return DecoderIO(
        input_ids=by_name["input_ids"].name,
        attention_mask=by_name["attention_mask"].name,
        position_ids=position.name if position is not None else None,
        logits_to_keep=keep.name if keep is not None else None,
        use_cache_branch=branch.name if branch is not None else None,
        past=past_names,
        logits=logits.name,
        present=present_names,
        kv_heads=int(shape[1]),
        head_dim=int(shape[3]),
        kv_dtype=kv_dtype,
        logits_dtype=logits_dtype,
        input_types=tuple(types),
    )


def find_decoder(model_dir: Path) -> Path | None:
    """The ONNX decoder file of a model directory (DECODER_FILES), or None when it has none."""
    for name in DECODER_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    return None


def has_cuda_provider() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def session_device(device: torch.device) -> torch.device:
    """Where sessions run: `device` (the shard's, picked by what is visible), or the CPU when it
    is a GPU this onnxruntime cannot use (the CPU-only package), with one warning."""
    if device.type == "cuda" and not has_cuda_provider():
        logger.warning(
            "a GPU is visible but this onnxruntime has no CUDA provider (install onnxruntime-gpu): "
            "hf_optimum_ort runs on the CPU"
        )
        return torch.device("cpu")
    return device


def providers(device: torch.device) -> list[str]:
    """ONNX Runtime's execution providers for `device` (session_device's choice)."""
    if device.type == "cuda":
        if not has_cuda_provider():
            raise OnnxModelError("this onnxruntime has no CUDA provider (install onnxruntime-gpu)")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class DecoderSession:
    """One ONNX Runtime session over a decoder file; `run` is one forward pass."""

    def __init__(self, file: Path, device: torch.device) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: ORT's warnings about its own fusions are noise here
        try:
            self.session = onnxruntime.InferenceSession(str(file), options, providers=providers(device))
        except OnnxModelError:
            raise
        except Exception as exc:  # a corrupt file, an unsupported opset: ORT's first line says which
            raise OnnxModelError(f"ONNX Runtime cannot load {file.name}: {first_line(exc)}") from None
        self.io = describe(self.session.get_inputs(), self.session.get_outputs(), file.name)
        self.device = device
        self.file = file
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = (device.index or 0) if device.type == "cuda" else 0
        self._types = dict(self.io.input_types)
        vocab = next(o.shape for o in self.session.get_outputs() if o.name == self.io.logits)[-1]
        if not isinstance(vocab, int):
            raise OnnxModelError(f"{file.name}: the vocabulary size of the logits is not fixed in the graph")
        self.vocab_size = vocab

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        """The past of a prefill: every layer's keys and values with 0 positions."""
        shape = (batch, self.io.kv_heads, 0, self.io.head_dim)
        return [
            torch.empty(shape, dtype=self.io.kv_dtype, device=self.device) for _ in range(2 * self.io.layers)
        ]

    def run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
        all_logits: bool = True,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [B, S, vocab] (or [B, 1, vocab], the last position's, without `all_logits`
        where the graph takes logits_to_keep) and the presents (keys and values of layer 0, 1,
        ...: the past of the next step) of the pending tokens `input_ids` [B, S] over `past`."""
        io = self.io
        batch, seq = input_ids.shape
        length = past[0].shape[2] + seq
        binding = self.session.io_binding()
        held: list[torch.Tensor] = []  # the bound tensors stay alive until the run returns

        def bind_input(name: str, tensor: torch.Tensor) -> None:
            tensor = tensor.to(self._types[name]).contiguous()
            held.append(tensor)
            binding.bind_input(
                name,
                self._device_type,
                self._device_id,
                _numpy_type(tensor.dtype),
                tuple(tensor.shape),
                _address(tensor),
            )

        def bind_output(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            binding.bind_output(
                name, self._device_type, self._device_id, _numpy_type(dtype), shape, _address(tensor)
            )
            return tensor

        bind_input(io.input_ids, input_ids)
        bind_input(io.attention_mask, attention_mask)
        if io.position_ids is not None:
            bind_input(io.position_ids, position_ids)
        kept = seq
        if io.logits_to_keep is not None:
            keep = torch.arange(seq) if all_logits else torch.tensor([seq - 1])
            kept = keep.shape[0]
            bind_input(io.logits_to_keep, keep.to(self.device))
        if io.use_cache_branch is not None:
            bind_input(io.use_cache_branch, torch.tensor([past[0].shape[2] > 0], device=self.device))
        for layer, (key, value) in enumerate(io.past):
            bind_input(key, past[2 * layer])
            bind_input(value, past[2 * layer + 1])
        logits = bind_output(io.logits, (batch, kept, self.vocab_size), io.logits_dtype)
        present_shape = (batch, io.kv_heads, length, io.head_dim)
        present = [bind_output(name, present_shape, io.kv_dtype) for pair in io.present for name in pair]
        self.session.run_with_iobinding(binding)
        return logits, present


def _address(tensor: torch.Tensor) -> int:
    """The tensor's data address; a 1-byte stand-in for empty tensors (ORT refuses null)."""
    return tensor.data_ptr() or _EMPTY.data_ptr()


_EMPTY = torch.zeros(16, dtype=torch.uint8)


def _numpy_type(dtype: torch.dtype) -> Any:
    import numpy

    if dtype == torch.bfloat16:
        raise OnnxModelError("bfloat16 tensors cannot be bound from Python (export in float32 or float16)")
    return {
        torch.float32: numpy.float32,
        torch.float16: numpy.float16,
        torch.int64: numpy.int64,
        torch.int32: numpy.int32,
        torch.bool: numpy.bool_,
    }[dtype]
