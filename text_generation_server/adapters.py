"""What a request's `prefix_id` / `adapter_id` names, for the engines that take adapters.

`prefix_id` is TGIS's soft prompt (prompts.py). `adapter_id` resolves by the type the stored
adapter's adapter_config.json names, as vllm-tgis-adapter's clients expect: PROMPT_TUNING is a
soft prompt, LORA a LoRA adapter (lora.py). Both live in the one store, PREFIX_STORE_PATH/<id>/.
The router's PrefixLookup loads an adapter before its first request runs (`lookup`, any
thread); a step resolves its new requests again from the caches (`for_requests`, the worker
thread), reloading what was evicted meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from text_generation_common.defaults import ADAPTER_ID_PATTERN
from text_generation_common.messages import AdapterCacheState, GenerationRequest
from text_generation_server import distributed
from text_generation_server.config import ServerConfig
from text_generation_server.errors import PrefixNotFoundError, ShardError
from text_generation_server.kernels import cpu_kernels
from text_generation_server.lora import AdapterError, Adapters, LoraWeights
from text_generation_server.prompts import PromptStore, SoftPrompt, clipped, store_for

logger = logging.getLogger(__name__)

PROMPT_TUNING, LORA = "PROMPT_TUNING", "LORA"


class AdapterExists(ShardError):
    """An adapter added at run time under a name that is taken (ALREADY_EXISTS)."""


MAX_LISTED = 1024  # adapter ids one listing answers (ListAdapters)
MAX_LIST_DEPTH = 4  # levels of nested directories a listing looks into (ids may hold `/`)


@dataclass(slots=True)
class Resolved:
    """The adapters of a batch's requests, by request id (requests whose adapter failed to
    load are in neither: they fail alone, batches/inputs.py)."""

    prompts: dict[int, SoftPrompt] = field(default_factory=dict)
    loras: dict[int, LoraWeights] = field(default_factory=dict)

    def prefix_lengths(self) -> dict[int, int]:
        """Virtual tokens of every request whose adapter was found (0 for LoRA)."""
        return {**{i: 0 for i in self.loras}, **{i: p.length for i, p in self.prompts.items()}}


class AdapterSet:
    def __init__(self, prompts: PromptStore, lora: Adapters | None) -> None:
        self.prompts = prompts
        self.lora = lora  # None: the engine cannot apply LoRA here (see its reason)
        # adapters added at run time by name (the router's /v1/load_lora_adapter): they shadow
        # the store's of the same id
        self.added: dict[str, Path] = {}

    def directory(self, adapter_id: str) -> Path:
        """Where adapter `adapter_id` is: added at run time, else in the store."""
        added = self.added.get(adapter_id)
        return added if added is not None else self.prompts.directory(adapter_id)

    def add(self, adapter_id: str, path: str, replace: bool = False) -> int:
        """Serve the adapter saved in directory `path` as `adapter_id`, loaded now (its virtual
        tokens, 0 for LoRA). AdapterExists where the id was added before and not `replace`;
        PrefixNotFoundError without an adapter_config.json there; the adapter's own error where
        it does not load (then nothing is added)."""
        if not ADAPTER_ID_PATTERN.fullmatch(adapter_id):
            raise AdapterError(
                f"Invalid adapter name {adapter_id}, must contain only alphanumeric, _ and - and /"
            )
        if adapter_id in self.added and not replace:
            raise AdapterExists(f"The lora adapter '{adapter_id}' has already been loaded.")
        directory = Path(path)
        if not (directory / "adapter_config.json").is_file():
            raise PrefixNotFoundError(f"{adapter_id} at {path}", "adapter")
        before = self.added.get(adapter_id)
        self.added[adapter_id] = directory
        self._forget(adapter_id)
        try:
            return self.lookup(adapter_id=adapter_id)
        except Exception:
            if before is None:
                self.added.pop(adapter_id, None)
            else:
                self.added[adapter_id] = before
            raise

    def remove(self, adapter_id: str) -> bool:
        """Stop serving an adapter added at run time (requests running with it finish with it);
        False if none was added by that id."""
        if self.added.pop(adapter_id, None) is None:
            return False
        self._forget(adapter_id)
        return True

    def _forget(self, adapter_id: str) -> None:
        self.prompts.cache.drop(adapter_id)
        if self.lora is not None:
            self.lora.cache.drop(adapter_id)

    def kind(self, adapter_id: str) -> str:
        """PROMPT_TUNING or LORA, from the stored adapter_config.json."""
        path = self.directory(adapter_id)
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            kind = config.get("peft_type") if isinstance(config, dict) else None
        except FileNotFoundError:
            raise PrefixNotFoundError(adapter_id, "adapter") from None
        except (OSError, ValueError) as exc:
            raise AdapterError(f"adapter {adapter_id} has an unreadable adapter_config.json: {exc}") from None
        if kind not in (PROMPT_TUNING, LORA):
            raise AdapterError(f"adapter {adapter_id} is a {kind} adapter: PROMPT_TUNING and LORA are served")
        return str(kind)

    @property
    def max_loras(self) -> int:
        """LoRA adapters resident at most (MAX_LORAS); 0 where this engine applies none."""
        return self.lora.max_loras if self.lora is not None else 0

    def servable(self, adapter_id: str) -> bool:
        """Whether a request naming `adapter_id` would find an adapter this engine applies (its
        adapter_config.json read, nothing loaded)."""
        try:
            kind = self.kind(adapter_id)
        except ShardError:
            return False
        if kind == LORA:
            return self.lora is not None
        return not self.prompts.spec.seq2seq  # PEFT prompt tuning: decoder-only models (TGIS)

    def listed(self, limit: int = MAX_LISTED) -> tuple[list[str], bool]:
        """The ids (sorted) of the adapters added at run time and of the stored ones, those
        `servable` finds, at most `limit`, and whether more were left out."""
        added = list(self.added)  # a copy: added to meanwhile
        stored = (adapter_id for adapter_id in self._stored() if adapter_id not in self.added)
        found = list(itertools.islice(filter(self.servable, itertools.chain(added, stored)), limit + 1))
        return sorted(found)[:limit], len(found) > limit

    def _stored(self) -> Iterator[str]:
        """The ids of the store's adapter directories (an adapter_config.json), level by level,
        `MAX_LIST_DEPTH` levels deep and not below an adapter's own; names that are not valid ids
        (dot files) and links that leave the store are passed over, as requests naming them
        would be refused."""
        root = self.prompts.root
        level = [""] if root is not None else []
        for _ in range(MAX_LIST_DEPTH):
            deeper = []
            for parent in level:
                assert root is not None
                try:
                    names = sorted(entry.name for entry in (root / parent).iterdir() if entry.is_dir())
                except OSError:
                    continue
                for name in names:
                    adapter_id = f"{parent}/{name}" if parent else name
                    try:
                        path = self.prompts.directory(adapter_id)  # a valid id inside the store
                    except ShardError:
                        continue
                    if (path / "adapter_config.json").is_file():
                        yield adapter_id
                    else:
                        deeper.append(adapter_id)
            level = deeper

    def get(self, prefix_id: str = "", adapter_id: str = "") -> SoftPrompt | LoraWeights:
        if not adapter_id:
            return self.prompts.get(prefix_id)
        # loaded before: no disk access (steps resolve every new request's adapter again)
        cached: SoftPrompt | LoraWeights | None = self.prompts.cache.peek(adapter_id)
        if cached is None and self.lora is not None:
            cached = self.lora.cache.peek(adapter_id)
        if cached is not None:
            return cached
        if self.kind(adapter_id) == PROMPT_TUNING:
            return self.prompts.get(adapter_id, self.directory(adapter_id))
        if self.lora is None:
            raise AdapterError(f"adapter {adapter_id} is a LoRA adapter, which this engine does not apply")
        return self.lora.get(adapter_id, self.directory(adapter_id))

    def state(self) -> AdapterCacheState:
        prompts, lora = self.prompts.cache, (self.lora.cache if self.lora is not None else None)
        return AdapterCacheState(
            resident_prompts=len(prompts.keys()),
            resident_loras=len(lora.keys()) if lora else 0,
            prompt_loads=prompts.loads,
            lora_loads=lora.loads if lora else 0,
            prompt_evictions=prompts.evictions,
            lora_evictions=lora.evictions if lora else 0,
        )

    def lookup(self, prefix_id: str = "", adapter_id: str = "") -> int:
        """Load the adapter; its virtual tokens (0 for LoRA)."""
        found = self.get(prefix_id, adapter_id)
        return found.length if isinstance(found, SoftPrompt) else 0

    def applied(
        self,
        loras: Sequence[LoraWeights | None],
        device: torch.device,
        by_rows: bool,
        repeats: Sequence[int] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """The forward pass inside applies `loras` (lora.Adapters.applied), when any is set."""
        if self.lora is None or not any(loras):
            return contextlib.nullcontext()
        return self.lora.applied(loras, device, by_rows, repeats)

    def for_requests(self, requests: Sequence[GenerationRequest]) -> Resolved:
        resolved = Resolved()
        for request in requests:
            if not (request.prefix_id or request.adapter_id):
                continue
            try:
                found = self.get(request.prefix_id, request.adapter_id)
            except ShardError as exc:
                logger.warning("request %d: %s", request.id, clipped(str(exc)))
                continue
            if isinstance(found, SoftPrompt):
                resolved.prompts[request.id] = found
            else:
                resolved.loras[request.id] = found
        if resolved.loras and self.lora is not None:
            self.lora.install(list(resolved.loras.values()))
        return resolved


def adapters_for(
    config: ServerConfig, model: Any, device: torch.device, seq2seq: bool, max_sequence_length: int
) -> AdapterSet:
    """The adapters of an engine's `model`: soft prompts always; LoRA on one shard or sharded by
    transformers' tensor-parallel plans (GPT-BigCode's own sharded layers take no LoRA yet)."""
    prompts = store_for(config, model.get_input_embeddings(), device, seq2seq, max_sequence_length)
    lora = None
    if not distributed.own_sharded_layers(getattr(model, "config", None), config.world_size):
        cache_bytes = config.lora_cache_size_mb * 2**20
        kernel = device.type == "cpu" and bool(config.prefix_store_path) and lora_kernel_builds()
        lora = Adapters(model, config.max_loras, cache_bytes, prompts.spec.dtype, device, kernel)
    return AdapterSet(prompts, lora)


def lora_kernel_builds() -> bool:
    """Whether our CPU LoRA kernel serves the steps with few adapter tokens (lora.py); where it
    cannot be built (no compiler) every step takes the matmul form, which computes the same."""
    return cpu_kernels.loads("LoRA steps use matmuls only (no CPU kernel)")
