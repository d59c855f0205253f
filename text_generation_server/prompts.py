"""Tuned soft prompts (TGIS `prefix_id`): the store on disk and the cache of loaded prompts.

PREFIX_STORE_PATH/<id>/ holds one soft prompt, in TGIS's formats:

    decoder.pt                  a 2-D tensor [virtual_tokens, hidden] (torch.save; read with
                                weights_only=True); decoder-only models need it; for
                                encoder-decoder models it goes in front of the decoder start token
    encoder.pt                  the same, in front of the encoder input (encoder-decoder models)
    adapter_model.safetensors   PEFT prompt tuning (`prompt_embeddings`), or adapter_model.bin;
                                decoder-only models only (TGIS's rule)

Ids may contain `/` (nested directories) and must stay inside the store. Each tensor is
checked as TGIS checks it, with TGIS's messages (2-D, 1..MAX_PROMPT_PREFIX_LENGTH rows, the
model's hidden size, finite before and after the cast to the model's dtype), then kept on the
model's device in an LRU cache bounded by PROMPT_CACHE_SIZE_MB (sizes rounded up to 512 bytes,
as TGIS). `get` is thread-safe: the router's PrefixLookup loads on a thread of its own while
the worker thread keeps stepping; a step that finds its prompt evicted loads it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from text_generation_common.defaults import ADAPTER_ID_PATTERN
from text_generation_common.logs import first_line
from text_generation_server.config import ServerConfig
from text_generation_server.errors import PrefixNotFoundError, ShardError
from text_generation_server.lru import LoadedCache

logger = logging.getLogger(__name__)

PEFT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_KEY = "prompt_embeddings"
SIZE_QUANTUM = 512


def clipped(text: str, limit: int = 200) -> str:
    """A client's string as log lines show it: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class PromptError(ShardError):
    """A soft prompt that exists but cannot be used (INVALID_ARGUMENT, TGIS's message)."""


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """What a soft prompt must fit: the model's embeddings and limits."""

    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    seq2seq: bool
    max_length: int  # most virtual tokens (MAX_PROMPT_PREFIX_LENGTH)


@dataclass(frozen=True, slots=True)
class SoftPrompt:
    prefix_id: str
    decoder: torch.Tensor | None  # [virtual_tokens, hidden] on the model's device and dtype
    encoder: torch.Tensor | None = None  # encoder-decoder models

    @property
    def length(self) -> int:
        """Virtual tokens in front of the input (what counts toward max_sequence_length)."""
        return sum(t.shape[0] for t in (self.decoder, self.encoder) if t is not None)

    @property
    def nbytes(self) -> int:
        size = sum(t.numel() * t.element_size() for t in (self.decoder, self.encoder) if t is not None)
        return -(-size // SIZE_QUANTUM) * SIZE_QUANTUM


class PromptStore:
    def __init__(
        self,
        root: str | None,
        spec: PromptSpec,
        cache_bytes: int,
    ) -> None:
        self.root = Path(root).resolve() if root else None
        self.spec = spec
        self.cache: LoadedCache[SoftPrompt] = LoadedCache(
            "soft prompt",
            lambda prompt: prompt.nbytes,
            cache_bytes,
            lambda prefix_id: PromptError(f"Prefix ID object {prefix_id} exceeds the allowed cache size"),
        )

    def get(self, prefix_id: str, directory: Path | None = None) -> SoftPrompt:
        """The soft prompt `prefix_id`, loaded on first use (from `directory`, else the store's
        directory of that id); PrefixNotFoundError or PromptError."""
        return self.cache.get(prefix_id, lambda: self._load(prefix_id, directory))

    # ---- loading ---------------------------------------------------------------------------

    def directory(self, prefix_id: str) -> Path:
        """Where `prefix_id` is stored (TGIS's id rules: PromptError, or PrefixNotFoundError)."""
        if not ADAPTER_ID_PATTERN.fullmatch(prefix_id):
            raise PromptError(f"Invalid prefix id {prefix_id}, must contain only alphanumeric, _ and - and /")
        if self.root is None:
            raise PrefixNotFoundError(prefix_id)
        try:
            path = (self.root / prefix_id).resolve()
        except (OSError, ValueError):  # a name the file system cannot hold cannot be stored
            raise PrefixNotFoundError(prefix_id) from None
        if not path.is_relative_to(self.root) or path == self.root:
            raise PromptError(f"Invalid prefix id {prefix_id}")
        return path

    def _load(self, prefix_id: str, directory: Path | None = None) -> SoftPrompt:
        path = directory if directory is not None else self.directory(prefix_id)
        try:
            return self._load_from(prefix_id, path)
        except OSError as exc:  # too long a name, no permission, ...: as good as missing
            logger.warning("soft prompt %s: %s", clipped(prefix_id), exc.strerror or exc)
            raise PrefixNotFoundError(prefix_id) from None

    def _load_from(self, prefix_id: str, path: Path) -> SoftPrompt:
        peft = next((path / name for name in PEFT_FILES if (path / name).is_file()), None)
        if peft is not None:
            if self.spec.seq2seq:
                raise PromptError("encoder-decoder architectures not supported for peft models")
            return SoftPrompt(prefix_id, self._checked(self._read(peft, prefix_id, PEFT_KEY), prefix_id))
        decoder, encoder = path / "decoder.pt", path / "encoder.pt"
        found = decoder.is_file() or (self.spec.seq2seq and encoder.is_file())
        if not found:
            raise PrefixNotFoundError(prefix_id)
        tensors = {
            part: self._checked(self._read(file, prefix_id), prefix_id)
            for part, file in (("decoder", decoder), ("encoder", encoder))
            if file.is_file() and (part == "decoder" or self.spec.seq2seq)
        }
        prompt = SoftPrompt(prefix_id, tensors.get("decoder"), tensors.get("encoder"))
        logger.info("soft prompt %s loaded: %d virtual tokens", clipped(prefix_id), prompt.length)
        return prompt

    @staticmethod
    def _read(file: Path, prefix_id: str, key: str | None = None) -> object:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(file)).get(key or "")
            loaded = torch.load(file, map_location="cpu", weights_only=True)
            return loaded.get(key) if key is not None and isinstance(loaded, dict) else loaded
        except Exception as exc:  # a corrupt or foreign file: one clear line, not a traceback
            raise PromptError(
                f"Prefix {prefix_id} could not be read from {file.name}: {first_line(exc)}"
            ) from None

    def _checked(self, tensor: object, prefix_id: str) -> torch.Tensor:
        spec = self.spec
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise PromptError("Invalid prefix embedding tensor")
        length, dim = tensor.shape
        if not 0 < length <= spec.max_length:
            raise PromptError(f"Invalid prefix embedding length of {length}")
        if dim != spec.hidden_size:
            raise PromptError(f"Prefix embedding tensor dim {dim} does not match model ({spec.hidden_size})")
        if not torch.isfinite(tensor).all():
            raise PromptError("Prefix contains non-finite elements")
        converted = tensor.to(dtype=spec.dtype, device=spec.device)
        if not torch.isfinite(converted).all():
            raise PromptError(
                f"Prefix contains non-finite elements after conversion from {tensor.dtype} to {spec.dtype}"
            )
        return converted


def store_for(
    config: ServerConfig,
    embeddings: torch.nn.Module,
    device: torch.device,
    seq2seq: bool,
    max_sequence_length: int,
) -> PromptStore:
    """The soft-prompt store of an engine whose input embeddings are `embeddings`."""
    weight = embeddings.weight
    assert isinstance(weight, torch.Tensor)
    spec = PromptSpec(
        hidden_size=int(weight.shape[-1]),
        dtype=weight.dtype,
        device=device,
        seq2seq=seq2seq,
        max_length=config.max_prompt_prefix_length or max_sequence_length // 2,
    )
    if config.prefix_store_path:
        logger.info(
            "soft prompts from %s (at most %d virtual tokens, cache %d MiB)",
            config.prefix_store_path,
            spec.max_length,
            config.prompt_cache_size_mb,
        )
    return PromptStore(config.prefix_store_path, spec, config.prompt_cache_size_mb * 2**20)
