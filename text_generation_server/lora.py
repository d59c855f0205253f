"""LoRA adapters (`adapter_id`): PEFT saves loaded on first use, a bounded resident set, and the
layers that apply several adapters, or none, to the rows of one batch.

A LoRA adapter lives in the adapter store (PREFIX_STORE_PATH/<id>/, beside soft prompts) as PEFT
saves it: adapter_config.json (`peft_type: LORA`, `r`, `lora_alpha`, `use_rslora`) and
adapter_model.safetensors (or .bin) with `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] per target module. Loading checks every pair against the model (the
module exists, is a linear layer, its features match: an adapter of another base model is
refused by name) and refuses what these layers do not compute (DoRA, trained biases, extra saved
modules, per-module rank or alpha patterns).

`Adapters.get` loads on any thread and keeps at most MAX_LORAS adapters (and
LORA_CACHE_SIZE_MB) resident, least recently used evicted first; a batch holds the weights of
its own requests, so an evicted adapter stays valid for the requests already running with it.
`install` (on the worker thread, before a step) wraps each target module once in a LoraLinear,
which adds, for every adapter of the step, B(A(x)) * scale to the rows (padded batches) or
tokens (packed batches) of the requests that use it:

    y = base(x);  y[idx_a] += (x[idx_a] @ A_a^T) @ B_a^T * scale_a   for each adapter a

Requests without an adapter get the base output unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from text_generation_server.errors import PrefixNotFoundError, ShardError
from text_generation_server.lru import LoadedCache

logger = logging.getLogger(__name__)

KEY_PREFIX = "base_model.model."
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ShardError):
    """A stored adapter that cannot be used (INVALID_ARGUMENT)."""


@dataclass(eq=False, slots=True)
class LoraWeights:
    adapter_id: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # path -> (A [r, in], B [out, r], scale)
    nbytes: int = 0


@dataclass(slots=True)
class Group:
    """The rows (padded batches: [rows]) or tokens (packed batches: [tokens]) of one adapter."""

    weights: LoraWeights
    rows: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


@dataclass(slots=True)
class Routing:
    groups: list[Group] = field(default_factory=list)


class LoraLinear(nn.Module):
    """A target module of the model and the adapters of the current step (see the module doc)."""

    def __init__(self, base: nn.Module, path: str, routing: Routing) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.routing = routing

    @property
    def weight(self) -> torch.Tensor:  # model code reads its layers' weights (T5: the dtype of wo)
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.routing.groups:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        for group in self.routing.groups:
            pair = group.weights.modules.get(self.path)
            if pair is None:
                continue
            a, b, scale = pair
            index = group.tokens
            if index is None:
                assert group.rows is not None
                width = x.shape[1] if x.dim() == 3 else 1
                steps = torch.arange(width, device=x.device)
                index = (group.rows[:, None] * width + steps[None, :]).reshape(-1)
            delta = (flat_x.index_select(0, index) @ a.t()) @ b.t()
            flat_y.index_add_(0, index, delta.to(flat_y.dtype), alpha=scale)
        return y


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear-like module (nn.Linear, a laid-out linear, GPT-2's Conv1D)."""
    if isinstance(module, LoraLinear):
        module = module.base
    features = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(features[0], int) and isinstance(features[1], int):
        return features[0], features[1]
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return int(weight.shape[0]), int(weight.shape[1])
    return None


class Adapters:
    """The LoRA adapters of one engine's model."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        cache_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.dtype, self.device = dtype, device
        self._resident: LoadedCache[LoraWeights] = LoadedCache(
            "LoRA adapter",
            lambda weights: weights.nbytes,
            cache_bytes,
            lambda adapter_id: AdapterError(f"adapter {adapter_id} exceeds the allowed cache size"),
            max_loras,
        )
        self.routing = Routing()  # what the LoraLinear layers apply in the current forward

    # ---- the resident set -------------------------------------------------------------------

    def get(self, adapter_id: str, directory: Path) -> LoraWeights:
        """Adapter `adapter_id` (stored in `directory`), loaded on first use."""
        return self._resident.get(adapter_id, lambda: self._load(adapter_id, directory))

    @property
    def resident(self) -> list[str]:
        return self._resident.keys()

    @property
    def evictions(self) -> int:
        return self._resident.evictions

    # ---- loading ------------------------------------------------------------------------------

    def _load(self, adapter_id: str, directory: Path) -> LoraWeights:
        config = json.loads((directory / "adapter_config.json").read_text())
        refused = [
            ("use_dora", "DoRA"),
            ("modules_to_save", "extra saved modules (modules_to_save)"),
            ("rank_pattern", "per-module ranks (rank_pattern)"),
            ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ]
        for key, what in refused:
            if config.get(key):
                raise AdapterError(f"adapter {adapter_id} uses {what}, which this server does not apply")
        if config.get("bias", "none") != "none":
            raise AdapterError(
                f"adapter {adapter_id} trains biases (bias={config['bias']}): this server does not apply them"
            )
        tensors = self._read(adapter_id, directory)
        rank_of: dict[str, int] = {}
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            if not key.startswith(KEY_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise AdapterError(f"adapter {adapter_id} has a weight this server does not apply: {key}")
            path, _, part = key[len(KEY_PREFIX) :].rpartition(".lora_")
            pairs.setdefault(path, {})[part.split(".")[0]] = tensor
        if not pairs:
            raise AdapterError(f"adapter {adapter_id} has no LoRA weights")
        alpha = float(config.get("lora_alpha", 8))
        rslora = bool(config.get("use_rslora"))
        modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        nbytes = 0
        for path, pair in sorted(pairs.items()):
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise AdapterError(f"adapter {adapter_id}: {path} lacks its lora_A or lora_B weight")
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                raise AdapterError(
                    f"adapter {adapter_id} does not fit this model: it has no module {path} "
                    "(an adapter of another base model?)"
                ) from None
            features = _features(module)
            if features is None:
                raise AdapterError(f"adapter {adapter_id} targets {path}, which is not a linear layer")
            rank = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or (a.shape[1], b.shape[0]) != features:
                raise AdapterError(
                    f"adapter {adapter_id} does not fit this model: {path} is {features[0]} -> {features[1]} "
                    f"features, the adapter's A/B are {tuple(a.shape)} / {tuple(b.shape)} (an adapter of "
                    "another base model?)"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"adapter {adapter_id} contains non-finite weights ({path})")
            rank_of[path] = rank
            scale = alpha / (rank**0.5 if rslora else rank)
            a = a.to(device=self.device, dtype=self.dtype).contiguous()
            b = b.to(device=self.device, dtype=self.dtype).contiguous()
            modules[path] = (a, b, scale)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        logger.info(
            "LoRA adapter %s loaded: %d modules, rank %s, %.1f MiB",
            adapter_id,
            len(modules),
            "/".join(str(r) for r in sorted(set(rank_of.values()))),
            nbytes / 2**20,
        )
        return LoraWeights(adapter_id, modules, nbytes)

    @staticmethod
    def _read(adapter_id: str, directory: Path) -> dict[str, torch.Tensor]:
        file = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
        if file is None:
            raise PrefixNotFoundError(adapter_id, "adapter")
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return dict(load_file(str(file)))
            loaded = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise ValueError("not a state dict")
            return dict(loaded)
        except Exception as exc:  # a corrupt or foreign file: one clear line
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise AdapterError(f"adapter {adapter_id} could not be read from {file.name}: {first}") from None

    # ---- steps --------------------------------------------------------------------------------

    def install(self, weights: Sequence[LoraWeights]) -> None:
        """Wrap the target modules of `weights` not wrapped yet (worker thread only)."""
        for lora in weights:
            for path in lora.modules:
                module = self.model.get_submodule(path)
                if isinstance(module, LoraLinear):
                    continue
                parent_path, _, name = path.rpartition(".")
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                setattr(parent, name, LoraLinear(module, path, self.routing))

    @contextlib.contextmanager
    def applied(self, groups: list[Group]) -> Iterator[None]:
        """The forward pass inside applies `groups` (none: the base model)."""
        self.routing.groups = groups
        try:
            yield
        finally:
            self.routing.groups = []


def groups_of(adapters: Sequence[Any], device: torch.device, by: str) -> list[Group]:
    """One group per distinct adapter among `adapters` (one entry per row or token, None = no
    adapter), with the row / token indices that use it (`by`: "rows" or "tokens")."""
    index: dict[int, tuple[LoraWeights, list[int]]] = {}
    for i, weights in enumerate(adapters):
        if weights is not None:
            index.setdefault(id(weights), (weights, []))[1].append(i)
    groups = []
    for weights, positions in index.values():
        tensor = torch.tensor(positions, device=device)
        groups.append(Group(weights, rows=tensor) if by == "rows" else Group(weights, tokens=tensor))
    return groups
