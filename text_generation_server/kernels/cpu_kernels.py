"""Our C++ CPU kernels (kernels/csrc/), built on first use with torch's extension builder.

`lora_apply` (csrc/lora_cpu.cpp) adds each token's LoRA adapter to a module's output in one
call that visits only the tokens with an adapter (lora.py uses it for steps with few of them).

`paged_decode` (csrc/paged_decode_cpu.cpp) attends single-token queries straight from the
paged KV cache: per (sequence, KV head) task on torch's thread pool, online softmax over the
sequence's blocks where they lie, float accumulation, keys read from blocks stored transposed so
that one vector instruction scores 16 keys. Measured against what it replaces (block tables
gathered into a padded copy, then SDPA with a key-padding mask) on a 2-core AMD EPYC
(AVX512-BF16, no AMX), 8 query / 2 KV heads, head dim 64, 32 sequences of 130-300 keys: about
100 us vs 430-600 us in bfloat16; one sequence: 6 vs 33-50 us.

`mlp_speculator_chain` (csrc/speculator_cpu.cpp) runs an MLP speculator's top-1 chain in one
call, each head's vocabulary projection reduced to its argmax without writing logits (one pass
over the head's weights; 0.18-0.23 ms against 0.33-0.51 ms for the bf16 product alone, 8,192 x
512, one row, on the 2-core AMX Xeon); from 8 rows on AMX CPUs the head is one bf16 product and
the argmax of its logits.

`first_max` (csrc/choice_cpu.cpp) is the greedy choice's two reductions in one pass: each row's
first maximum and its NaN flag (engines/step.py, where the kernels are loaded already).

`panel_linear` (csrc/panel_cpu.cpp) is the float32 / bfloat16 product of weight_layout.py's
`panels` layout (weights packed in panels of 16 outputs, register tiles of 6 rows x 16 outputs on
AVX2 + FMA, float32 sums; bfloat16 pairs on `vdpbf16ps`, or on AMX's tiles where the CPU has them).

The library of this CPU's family is loaded as `build-cpu-kernels` prebuilt it (the container
image, which has no compiler), else built at first use (cpu_build.py says how and where).

CPU_ATTENTION picks: `kernel` (must load: a failure stops the shard with the reason), `sdpa`
(never loaded) or `auto` (the kernel where it loads, else SDPA, with the reason logged as a
warning).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from text_generation_server.kernels.cpu_build import (
    NATIVE,
    TARGETS,
    KernelBuildError,
    Target,
    build,
    library_name,
    native_dir,
    prebuilt_dir,
    prebuilt_path,
    target_for,
)
from text_generation_server.utils.cpu import cpu_flags

logger = logging.getLogger(__name__)

_loaded: str | None = None  # how the library was found, once loaded in this process


def load(prebuilt: Path | None = None) -> None:
    """Load the kernels into this process: the library prebuilt for this CPU's target in
    `prebuilt` (default: cpu_build.prebuilt_dir()) where there is one, else the same library built
    here (cached; `-march=native` for a CPU that no target serves); raise KernelBuildError where
    neither can be had."""
    global _loaded
    if _loaded is not None:
        return
    flags = cpu_flags()
    target = target_for(flags)
    directory = prebuilt_dir() if prebuilt is None else prebuilt
    march: tuple[str, ...]  # the options to build with here; () = nothing to build
    if target is None:  # no family: a library of this CPU's own
        path = native_dir() / f"{library_name(NATIVE, flags)}.so"
        march, how = NATIVE, "built for this CPU (-march=native)"
    elif (path := prebuilt_path(target, directory)).exists():
        march, how = (), f"prebuilt for {target.name}"
    else:  # the family's library, built here
        path = native_dir() / path.name
        march, how = target.march, f"built for {target.name}, this CPU's instruction sets"
    if march:
        try:
            build(march, path)
        except KernelBuildError as exc:
            raise KernelBuildError(f"{exc}, and {_no_prebuilt(target, directory)}") from exc
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        raise KernelBuildError(f"loading the CPU kernels ({path}) failed: {exc}") from exc
    _loaded = f"{how}: {path}"
    logger.info("CPU kernels loaded (%s)", _loaded)


def _no_prebuilt(target: Target | None, directory: Path) -> str:
    if target is None:
        names = ", ".join(t.name for t in TARGETS)
        return f"no prebuilt target ({names}) has this CPU's instruction sets"
    return f"{directory} holds no library of this version for this CPU's target ({target.name})"


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (nothing is built)."""
    return _loaded is not None


def loads(otherwise: str) -> bool:
    """Whether the kernels are loaded here (built on first use); where they cannot be, the warning
    says what runs `otherwise` and why."""
    try:
        load()
    except KernelBuildError as exc:
        logger.warning("%s, because %s", otherwise, exc)
        return False
    return True


def use_kernel(mode: str, device: torch.device) -> bool:
    """Whether paged decode attention runs on our kernel, by CPU_ATTENTION (`mode`)."""
    if device.type != "cpu" or mode == "sdpa":
        return False
    try:
        load()
    except KernelBuildError as exc:
        if mode == "kernel":
            raise ValueError(f"CPU_ATTENTION=kernel: {exc}") from exc
        logger.warning("CPU_ATTENTION=auto: decode attention runs on SDPA, because %s", exc)
        return False
    return True


def paged_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """query [rows, heads, dim] over one layer's cache [2, kv_heads, blocks, block_size * dim]
    (K blocks transposed: paged_kv.PagedKVCache with transposed_keys) with block tables
    [rows, width] and key counts [rows] -> [rows, heads, dim]."""
    return torch.ops.tgis_cpu.paged_decode(query, cache, tables, lengths, block_size, scale, window or 0)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    per_row: int,
    a: list[torch.Tensor | None],
    bt: list[torch.Tensor | None],
    scales: list[float],
) -> None:
    """y [tokens, out] += scale_s * (x [tokens, in] @ a[s]^T) @ bt[s] for each token whose row
    (token // per_row) has slot s >= 0 in `slots` [rows]; a[s] [r, in] and bt[s] [r, out]
    (None: adapter s does not target this module)."""
    torch.ops.tgis_cpu.lora_apply(y, x, slots, per_row, a, bt, scales)


def first_max(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum [rows] int64 and whether the row holds a NaN [rows] bool, in one
    pass over `scores` [rows, vocab] (float32, bfloat16 or float16) on the CPU (rows contiguous)."""
    ids, nan = torch.ops.tgis_cpu.first_max(scores)
    return ids, nan
