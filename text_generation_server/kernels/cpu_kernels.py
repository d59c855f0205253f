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

The library is compiled with `-O3 -march=native` for the CPU it runs on, so its build directory
(under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) is named after the source and
the CPU's feature flags: another CPU, or a changed source, builds anew (about 10 s on 2 cores).
The build needs a C++ compiler (CXX, else c++) and ninja (the `ninja` package provides it).

CPU_ATTENTION picks: `kernel` (must build: a failure stops the shard with the compiler's
reason), `sdpa` (never built) or `auto` (the kernel where it builds, else SDPA, with the reason
logged as a warning).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from text_generation_server.utils.cpu import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_decode_cpu.cpp",
    CSRC / "lora_cpu.cpp",
    CSRC / "decoder_cpu.cpp",
    CSRC / "grouped_cpu.cpp",
    CSRC / "speculator_cpu.cpp",
    CSRC / "w8a8_cpu.cpp",
    CSRC / "panel_cpu.cpp",
    CSRC / "choice_cpu.cpp",
)
HEADERS = (CSRC / "float_vectors.h", CSRC / "loops.h", CSRC / "amx.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-std=c++17")

_loaded: str | None = None  # the library name once loaded in this process


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here."""


def library_name() -> str:
    """A name unique to the source, the compiler flags and this CPU's features."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(torch.__version__.encode())
    return f"tgis_cpu_{digest.hexdigest()[:16]}"


def _find_ninja() -> str | None:
    found = shutil.which("ninja")
    if found:
        return str(Path(found).parent)
    try:
        import ninja  # the PyPI package ships the binary

        return str(ninja.BIN_DIR)
    except ImportError:
        return None


def check_toolchain() -> None:
    """Raise KernelBuildError unless a C++ compiler and ninja are here; put ninja on PATH."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler ({compiler!r} not found; set CXX or install g++)")
    ninja_dir = _find_ninja()
    if ninja_dir is None:
        raise KernelBuildError("ninja not found (pip install ninja)")
    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH
        os.environ["PATH"] = f"{ninja_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def load() -> None:
    """Build (when needed) and load the kernels into this process; raise KernelBuildError."""
    global _loaded
    if _loaded is not None:
        return
    from torch.utils import cpp_extension

    check_toolchain()
    name = library_name()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # the compiler's or loader's own message says why
        reason = str(exc).strip().splitlines()[-1]
        raise KernelBuildError(f"building the CPU kernels failed: {reason}") from exc
    _loaded = name
    logger.info("CPU kernels loaded (%s)", name)


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
