"""Building our C++ CPU kernels (kernels/csrc/) into one shared library per CPU family.

TARGETS are families of CPUs by the instruction sets the sources test for (ISA_FLAGS): a CPU
is served by the target whose compiler options define exactly the macros `-march=native` would
define there (`target_for`), so what the engines decide from the CPU's flags (`utils/cpu.py`)
holds for the library too, and a library built for a target runs on every CPU of it. The shard
loads the target's library from `prebuilt_dir()` where `text-generation-server
build-cpu-kernels` put it (the container image does, and its release stage has no compiler),
else builds the same library at first use (about 40 s on 2 cores), cached under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); a CPU no target serves builds with
`-march=native`. Each library's name carries a digest of the sources, the flags and torch's
version, so a changed source or another torch builds anew. On a 2-core AMD EPYC (Zen 4) the
target's library stepped the reference model as fast as a `-march=native` one (bf16, median of
8 alternated pairs: 0.95x at batch 1, 1.02x at 32, 0.99x for a prefill of 16 x 128 tokens).

A build needs a C++ compiler (CXX, else c++). Concurrent builds of one library (several shards
starting at once) wait for each other on a lock file; the library appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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
CFLAGS = ("-O3", "-fopenmp", "-ffast-math", "-std=c++17", "-fPIC")
NATIVE = ("-march=native",)

# The instruction sets the sources test for (`#if defined(__AVX2__)`, ...): each macro and the
# /proc/cpuinfo flag of the CPUs that have it. tests/engines/test_cpu_build.py keeps this complete.
ISA_FLAGS = {
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VBMI__": "avx512vbmi",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}

# x86-64 micro-architecture levels as /proc/cpuinfo flags (lzcnt is listed as abm)
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AMX = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")


@dataclass(frozen=True, slots=True)
class Target:
    """Compiler options for a family of CPUs, and the CPU flags the code they make may use."""

    name: str
    march: tuple[str, ...]
    flags: frozenset[str]


# One target for each combination of ISA_FLAGS that server CPUs have.
TARGETS = (
    Target("x86-64-v3", ("-march=x86-64-v3",), _V3),  # AVX2 + FMA: Haswell and later, AMD Zen 1-3
    Target("x86-64-v4", ("-march=x86-64-v4",), _V4),  # Skylake-SP
    Target("v4-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),  # Cascade Lake
    Target(  # Ice Lake-SP
        "v4-vnni-vbmi",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi"),
        _V4 | {"avx512_vnni", "avx512vbmi"},
    ),
    Target(  # Cooper Lake
        "v4-bf16",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        _V4 | {"avx512_vnni", "avx512_bf16"},
    ),
    Target(  # AMD Zen 4 and later
        "v4-bf16-vbmi",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi"),
        _V4 | {"avx512_vnni", "avx512_bf16", "avx512vbmi"},
    ),
    Target(  # Sapphire Rapids and later
        "v4-amx",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi", *_AMX),
        _V4 | {"avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16", "amx_int8"},
    ),
)


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here."""


def target_for(flags: frozenset[str]) -> Target | None:
    """The target whose library serves a CPU with these flags: the CPU has all of its
    instructions, and it has the same ISA_FLAGS as the CPU (None where no target has)."""
    tested = set(ISA_FLAGS.values())
    for target in TARGETS:
        if target.flags <= flags and target.flags & tested == flags & tested:
            return target
    return None


def library_name(march: tuple[str, ...], cpu: frozenset[str] = frozenset()) -> str:
    """A name unique to the sources, the compiler flags, torch's version and (`-march=native`)
    this CPU's feature flags."""
    import torch

    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(" ".join((*CFLAGS, *march)).encode())
    digest.update(" ".join(sorted(cpu)).encode())
    digest.update(torch.__version__.encode())
    return f"tgis_cpu_{digest.hexdigest()[:16]}"


def native_dir() -> Path:
    """Where libraries built for this CPU are kept (read when called: TORCH_EXTENSIONS_DIR)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "tgis_cpu"


def prebuilt_dir() -> Path:
    """Where `build-cpu-kernels` puts the targets' libraries by default: in this Python
    environment (the image's virtualenv), beside its packages."""
    return Path(sys.prefix) / "lib" / "tgis-cpu-kernels"


def prebuilt_path(target: Target, directory: Path) -> Path:
    return directory / f"{target.name}-{library_name(target.march)}.so"


def compiler() -> str:
    """The C++ compiler's path; KernelBuildError where there is none."""
    name = os.environ.get("CXX", "c++")
    found = shutil.which(name)
    if found is None:
        raise KernelBuildError(f"no C++ compiler ({name!r} not found; set CXX or install g++)")
    return found


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = next((line for line in lines if "error" in line), lines[-1] if lines else "")
        raise KernelBuildError(f"building the CPU kernels failed: {reason.strip()}")


def build(march: tuple[str, ...], library: Path) -> Path:
    """Compile the sources with `march` into the shared library `library` (kept if it exists)."""
    cxx = compiler()
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with _locked(library.with_suffix(".lock")):
            if not library.exists():
                _compile(cxx, march, library)
    except OSError as exc:  # a directory that cannot be written (a read-only home, ...)
        raise KernelBuildError(f"building the CPU kernels in {library.parent} failed: {exc}") from exc
    return library


def _compile(cxx: str, march: tuple[str, ...], library: Path) -> None:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    flags = [*CFLAGS, *march, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in SOURCES]
        with ThreadPoolExecutor(max_workers=min(len(SOURCES), os.cpu_count() or 1)) as pool:
            compiled = [
                pool.submit(_run, [cxx, *flags, "-c", str(source), "-o", obj])
                for source, obj in zip(SOURCES, objects, strict=True)
            ]
            for job in compiled:
                job.result()
        libs = [f"-L{path}" for path in cpp_extension.library_paths()]
        linked = str(Path(scratch) / library.name)
        _run([cxx, "-shared", "-fopenmp", *objects, *libs, "-lc10", "-ltorch_cpu", "-o", linked])
        os.replace(linked, library)
