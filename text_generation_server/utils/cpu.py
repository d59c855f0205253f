"""What this CPU can do, for choices the engine makes by hardware (the default CPU dtype).

bfloat16 pays on CPU only with bf16 matrix instructions: AMX-BF16 (Intel Sapphire Rapids and
later) or AVX512-BF16 (Intel Cooper Lake, AMD Zen 4 and later). Without them oneDNN emulates
bf16 through fp32 and converts every operand, and a decode step is slower than in float32
(measured on a 2-core Xeon without either). With them it is faster: on a 2-core AMD EPYC with
AVX512-BF16 (no AMX) the reference model's decode step at batch 1 went from 4.4 ms to 3.9 ms and
its prefill from 24 to 17 ms, with oneDNN-packed weights in both dtypes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
BF16_MATRIX_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
NO_BF16 = "the CPU has no bf16 matrix instructions (AMX-BF16, AVX512-BF16)"


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The feature flags of the first CPU listed (empty where /proc/cpuinfo does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def default_cpu_dtype(flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """The dtype a CPU engine uses when none is asked for, and why."""
    for flag, name in BF16_MATRIX_FLAGS:
        if flag in flags:
            return torch.bfloat16, f"the CPU has {name}"
    return torch.float32, NO_BF16


def emulated_dtype(dtype: torch.dtype, flags: frozenset[str]) -> str | None:
    """Why `dtype`, asked for explicitly, will run slowly on this CPU, or None where it will not:
    bfloat16 without bf16 matrix instructions is widened to float32 for every product. On a
    2-core AMD EPYC with AVX2 only, tgis_native on the reference model with oneDNN's emulation
    (`python -m benchmarks.engine_step --dtype bfloat16`, then float32): prefill of 16 x 128
    tokens 5,821 against 950 ms, a decode step of 32 rows 117 against 42 ms (of one row 6.9
    against 9.6 ms: half the bytes to read); with the linears on our `panels` layout
    (weight_layout.py; `--compare dtypes`): 1,134 against 840 ms, 28.8 against 25.9 ms, and
    4.7 against 6.5 ms; since its tiles group panels, round as they store and prompts widen
    each panel slice once: 0.9-1.05x float32's prefill, 24.7 against 26.0 ms and 3.75 against
    5.8 ms."""
    if dtype == torch.bfloat16 and not any(flag in flags for flag, _ in BF16_MATRIX_FLAGS):
        return (
            f"{NO_BF16}: every bfloat16 product is widened to float32, so prompts can run "
            "slower than in float32 (decode steps read half the bytes and can be faster)"
        )
    return None


def compute_cpus(device: torch.device) -> tuple[int, ...]:
    """The CPUs a forward on `device` computes on: this process's affinity for the CPU (its
    OpenMP team runs there), none for an accelerator. The router reads them (ModelInfo) to know
    whether its own CPU time slows the forward."""
    return tuple(sorted(os.sched_getaffinity(0))) if device.type == "cpu" else ()
