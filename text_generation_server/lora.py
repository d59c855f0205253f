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
which adds B_a(A_a(x)) * scale_a to the rows (padded batches) or packed tokens (ragged batches)
of the requests that use adapter a. A step computes it in one of two ways:

- few tokens with an adapter (decode steps, short prompts; at most KERNEL_MAX_WORK tokens x
  rank): on CPU, one call of our kernel per module (cpu_kernels.lora_apply) that visits only
  those tokens: the base model's tokens cost nothing. Measured on a 2-core AMD EPYC
  (AVX512-BF16, no AMX), bfloat16, 512 -> 1376 features, rank 8, 17 tokens of which 1 uses
  an adapter: 6 us against 48 us for the matmul form below.
- otherwise, the adapters side by side with a mask, three operations per module however many
  there are (matmul, in-place mask, addmm into the base output; sharded row-parallel modules
  add one all-reduce of x @ A^T):

    A = [A_1; ...; A_n]  (R = r_1 + ... + r_n rows),  Bt = [Bt_1; ...; Bt_n] (B transposed)
    y = base(x) + ((x @ A^T) * M) @ Bt,   M[i, j] = scale of column j's adapter if row i uses it, else 0

  Rows without an adapter get the base output unchanged (their mask row is zero). The extra
  work is the rank of all the step's adapters (a small share of a projection) on every token,
  against one gather / two matmuls / scatter per adapter and module for a grouped form, which
  halved the throughput of the 4-adapter benchmark.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from text_generation_common.logs import first_line
from text_generation_server.errors import PrefixNotFoundError, ShardError
from text_generation_server.kernels import cpu_kernels
from text_generation_server.lru import LoadedCache

logger = logging.getLogger(__name__)

KEY_PREFIX = "base_model.model."
# the kernel serves a step whose tokens with an adapter, times their rank, are at most this
# (about where the matmul form overtakes it, measured as in the module doc)
KERNEL_MAX_WORK = 512
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ShardError):
    """A stored adapter that cannot be used (INVALID_ARGUMENT)."""


@dataclass(eq=False, slots=True)
class LoraWeights:
    adapter_id: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # path -> (A [r, in], Bt [r, out], scale)
    rank: int  # the largest of its modules'
    nbytes: int = 0


@dataclass(slots=True)
class Step:
    """The adapters of one forward pass: `slots[i]` is the index in `adapters` of row i (padded
    batches, `by_rows`) or packed token i (ragged batches) of the batch, -1 for the base model."""

    adapters: list[LoraWeights]
    slots: torch.Tensor  # [rows or tokens], long
    by_rows: bool
    work: int  # the sum over rows (by_rows) or tokens using an adapter of its rank
    kernel: bool = False  # cpu_kernels.lora_apply may serve the step (see use_kernel)
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def use_kernel(self, per_row: int) -> bool:
        return self.kernel and self.work * per_row <= KERNEL_MAX_WORK

    def mask(self, columns: tuple[int, ...], scales: torch.Tensor, per_row: int) -> torch.Tensor:
        """[tokens, R]: the scale of column j where the token's adapter owns it, else 0
        (`columns[j]`: the index in `adapters` of the adapter column j belongs to; `per_row`:
        tokens per row of a padded batch, 1 for packed tokens)."""
        key = (*columns, -per_row)
        mask = self.masks.get(key)
        if mask is None:
            owner = torch.tensor(columns, device=self.slots.device)
            mask = (self.slots[:, None] == owner[None, :]).to(scales.dtype) * scales[None, :]
            if per_row > 1:
                mask = mask.repeat_interleave(per_row, dim=0)
            self.masks[key] = mask
        return mask


@dataclass(slots=True)
class Routing:
    step: Step | None = None  # set around a forward pass (Adapters.applied)


@dataclass(frozen=True, slots=True)
class Layout:
    """One module's LoRA weights of some adapters, side by side: A [R, in], B [out, R] with R
    the sum of their ranks (a step computes every adapter's rank on every row and masks what a
    row does not own: three operations per module however many adapters)."""

    key: tuple[LoraWeights, ...]  # the adapters, in column order (held: no id reuse)
    a: torch.Tensor
    bt: torch.Tensor
    ranks: tuple[int, ...]
    scales: torch.Tensor  # [R]


@dataclass(frozen=True, slots=True)
class KernelArgs:
    """One module's weights of a step's adapters as the kernel takes them (None where an
    adapter does not target the module)."""

    key: tuple[LoraWeights, ...]  # the step's adapters
    a: list[torch.Tensor | None]
    bt: list[torch.Tensor | None]
    scales: list[float]
    any: bool


class LoraLinear(nn.Module):
    """A target module of the model and the adapters of the current step (see the module doc)."""

    def __init__(self, base: nn.Module, path: str, routing: Routing) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.routing = routing
        self._layout: Layout | None = None  # of the last step (steps mostly repeat their adapters)
        self._kernel_args: KernelArgs | None = None  # likewise
        self.row_parallel = False  # a sharded module whose input is this rank's slice (see forward)

    @property
    def weight(self) -> torch.Tensor:  # model code reads its layers' weights (T5: the dtype of wo)
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.routing.step
        if step is None:
            return y
        tokens = x.reshape(-1, x.shape[-1])
        per_row = tokens.shape[0] // step.slots.shape[0] if step.by_rows else 1
        if step.use_kernel(per_row) and not self.row_parallel:
            args = self.kernel_args(step.adapters)
            if args.any:
                if tokens.stride(-1) != 1:
                    tokens = tokens.contiguous()
                cpu_kernels.lora_apply(
                    y.view(-1, y.shape[-1]), tokens, step.slots, per_row, args.a, args.bt, args.scales
                )
            return y
        present = [(i, w) for i, w in enumerate(step.adapters) if self.path in w.modules]
        if not present:
            return y
        layout = self._layout_of(tuple(w for _, w in present))
        # the column owners: each column's adapter as an index in the step's adapters
        columns = tuple(i for (i, _), r in zip(present, layout.ranks, strict=True) for _ in range(r))
        h = tokens @ layout.a.t()  # [tokens, R]
        if self.row_parallel:  # each rank saw its slice of the input: sum the partial products
            torch.distributed.all_reduce(h)
        h.mul_(step.mask(columns, layout.scales, per_row))
        y.view(-1, y.shape[-1]).addmm_(h, layout.bt)
        return y

    def _layout_of(self, adapters: tuple[LoraWeights, ...]) -> Layout:
        """This module's weights of `adapters` side by side (kept while steps repeat them)."""
        layout = self._layout
        if layout is None or layout.key != adapters:
            pairs = [w.modules[self.path] for w in adapters]
            ranks = tuple(a.shape[0] for a, _, _ in pairs)
            scales = torch.cat(
                [torch.full((a.shape[0],), scale, dtype=a.dtype, device=a.device) for a, _, scale in pairs]
            )
            layout = Layout(
                adapters,
                torch.cat([a for a, _, _ in pairs]) if len(pairs) > 1 else pairs[0][0],
                torch.cat([bt for _, bt, _ in pairs]) if len(pairs) > 1 else pairs[0][1],
                ranks,
                scales,
            )
            self._layout = layout
        return layout

    def kernel_args(self, adapters: list[LoraWeights]) -> KernelArgs:
        """This module's weights of the step's `adapters` for the kernel (kept likewise)."""
        key = tuple(adapters)  # LoraWeights compare by identity
        args = self._kernel_args
        if args is None or args.key != key:
            entries = [w.modules.get(self.path) for w in adapters]
            args = KernelArgs(
                key,
                [e[0] if e else None for e in entries],
                [e[1] if e else None for e in entries],
                [e[2] if e else 0.0 for e in entries],
                any(e is not None for e in entries),
            )
            self._kernel_args = args
        return args


def _parallel_style(module: nn.Module) -> str | None:
    """ "col" (output features split over the ranks), "row" (input features split, outputs
    summed) or None, from how transformers' tensor-parallel plan placed the module's weight."""
    if isinstance(module, LoraLinear):
        module = module.base
    placements = getattr(getattr(module, "weight", None), "placements", None)
    if not placements:
        return None
    dim = getattr(placements[0], "dim", None)
    return {0: "col", 1: "row", -1: "row"}.get(dim) if dim is not None else None


def _this_ranks_part(
    module: nn.Module, a: torch.Tensor, b: torch.Tensor, adapter_id: str, path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as this rank needs them: B's rows of its output slice (column-parallel module),
    A's columns of its input slice (row-parallel: the step sums the partial A·x over ranks)."""
    style = _parallel_style(module)
    if style is None:
        return a, b
    ranks, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    split = b if style == "col" else a.t()
    if split.shape[0] % ranks:
        raise AdapterError(
            f"adapter {adapter_id}: {path} has {split.shape[0]} features, which do not divide over "
            f"{ranks} shards"
        )
    size = split.shape[0] // ranks
    part = split[rank * size : (rank + 1) * size]
    return (a, part) if style == "col" else (part.t(), b)


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
        kernel: bool = False,
    ) -> None:
        self.model = model
        self.max_loras = max_loras  # resident at most (MAX_LORAS)
        self.dtype, self.device = dtype, device
        self.kernel = kernel  # steps with few adapter tokens use cpu_kernels.lora_apply (CPU only)
        self.cache: LoadedCache[LoraWeights] = LoadedCache(
            "LoRA adapter",
            lambda weights: weights.nbytes,
            cache_bytes,
            lambda adapter_id: AdapterError(f"adapter {adapter_id} exceeds the allowed cache size"),
            max_loras,
        )
        self.routing = Routing()  # what the LoraLinear layers apply in the current forward
        self._wrapped: set[str] = set()  # module paths wrapped in a LoraLinear

    # ---- the resident set -------------------------------------------------------------------

    def get(self, adapter_id: str, directory: Path) -> LoraWeights:
        """Adapter `adapter_id` (stored in `directory`), loaded on first use."""
        return self.cache.get(adapter_id, lambda: self._load(adapter_id, directory))

    @property
    def evictions(self) -> int:
        return self.cache.evictions

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
            a, b = _this_ranks_part(module, a, b, adapter_id, path)
            a = a.to(device=self.device, dtype=self.dtype).contiguous()
            bt = b.t().to(device=self.device, dtype=self.dtype).contiguous()
            modules[path] = (a, bt, scale)
            nbytes += a.numel() * a.element_size() + bt.numel() * bt.element_size()
        logger.info(
            "LoRA adapter %s loaded: %d modules, rank %s, %.1f MiB",
            adapter_id,
            len(modules),
            "/".join(str(r) for r in sorted(set(rank_of.values()))),
            nbytes / 2**20,
        )
        return LoraWeights(adapter_id, modules, max(rank_of.values()), nbytes)

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
            reason = first_line(exc)
            raise AdapterError(f"adapter {adapter_id} could not be read from {file.name}: {reason}") from None

    # ---- steps --------------------------------------------------------------------------------

    def install(self, weights: Sequence[LoraWeights]) -> None:
        """Wrap the target modules of `weights` not wrapped yet (worker thread only)."""
        for lora in weights:
            for path in lora.modules.keys() - self._wrapped:
                module = self.model.get_submodule(path)
                parent_path, _, name = path.rpartition(".")
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                wrapped = LoraLinear(module, path, self.routing)
                wrapped.row_parallel = _parallel_style(module) == "row"
                setattr(parent, name, wrapped)
                self._wrapped.add(path)

    @contextlib.contextmanager
    def applied(
        self,
        adapters: Sequence[LoraWeights | None],
        device: torch.device,
        by_rows: bool,
        repeats: Sequence[int] | None = None,
    ) -> Iterator[None]:
        """The forward pass inside applies `adapters`: one per row of a padded batch
        (`by_rows`), or per piece of a packed batch, piece i being `repeats[i]` tokens (None:
        the base model). Nothing to do when no entry has an adapter."""
        step = step_of(adapters, device, by_rows, repeats)
        if step is not None:
            step.kernel = self.kernel
        self.routing.step = step
        try:
            yield
        finally:
            self.routing.step = None


def step_of(
    adapters: Sequence[LoraWeights | None],
    device: torch.device,
    by_rows: bool,
    repeats: Sequence[int] | None = None,
) -> Step | None:
    """The step of a batch whose rows or pieces use `adapters` (None: the base model; see
    Adapters.applied); None when none uses one."""
    distinct: dict[int, int] = {}
    chosen: list[LoraWeights] = []
    slots = []
    work = 0
    for index, weights in enumerate(adapters):
        if weights is None:
            slots.append(-1)
            continue
        if id(weights) not in distinct:
            distinct[id(weights)] = len(chosen)
            chosen.append(weights)
        slots.append(distinct[id(weights)])
        work += weights.rank * (repeats[index] if repeats is not None else 1)
    if not chosen:
        return None
    per_entry = torch.tensor(slots, device=device)
    if repeats is not None:
        per_entry = per_entry.repeat_interleave(torch.tensor(repeats, device=device))
    return Step(chosen, per_entry, by_rows, work)
