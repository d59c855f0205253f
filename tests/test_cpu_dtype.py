"""The CPU dtype is chosen by the hardware's instructions; an explicit dtype always wins."""

from __future__ import annotations

import logging

import pytest
import torch

from text_generation_server.engines.loading import select_dtype
from text_generation_server.utils.cpu import cpu_flags, default_cpu_dtype

XEON_SPR = "fpu vme sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = "fpu sse2 avx2 avx512f avx512_vnni avx512_bf16"
XEON_CLX = "fpu sse2 avx2 avx512f avx512_vnni"
ZEN3 = "fpu sse2 avx avx2 fma f16c vaes"


@pytest.mark.parametrize(
    ("flags", "dtype", "reason"),
    [
        (XEON_SPR, torch.bfloat16, "the CPU has AMX-BF16"),
        (ZEN4, torch.bfloat16, "the CPU has AVX512-BF16"),
        (XEON_CLX, torch.float32, "the CPU has no bf16 matrix instructions (AMX-BF16, AVX512-BF16)"),
        ("", torch.float32, "the CPU has no bf16 matrix instructions (AMX-BF16, AVX512-BF16)"),
    ],
)
def test_default_cpu_dtype_follows_the_instructions(flags: str, dtype: torch.dtype, reason: str) -> None:
    assert default_cpu_dtype(frozenset(flags.split())) == (dtype, reason)
    assert select_dtype(None, torch.device("cpu"), frozenset(flags.split())) == (dtype, reason)


def test_an_explicit_dtype_always_wins() -> None:
    for flags in (XEON_SPR, XEON_CLX):
        for name in ("float32", "bfloat16", "float16"):
            dtype, reason = select_dtype(name, torch.device("cpu"), frozenset(flags.split()))
            assert dtype == getattr(torch, name) and reason.startswith("asked for")


def test_bfloat16_asked_for_without_bf16_instructions_is_warned_about(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="text_generation_server.engines.loading")
    for flags in (XEON_SPR, ZEN4, XEON_CLX, ZEN3):
        for name in ("float32", "bfloat16", "float16"):
            select_dtype(name, torch.device("cpu"), frozenset(flags.split()))
    assert [r.getMessage() for r in caplog.records] == [
        "bfloat16 asked for, but the CPU has no bf16 matrix instructions (AMX-BF16, AVX512-BF16): "
        "every bfloat16 product is widened to float32, so prompts can run slower than in "
        "float32 (decode steps read half the bytes and can be faster)"
    ] * 2
    caplog.clear()
    select_dtype("bfloat16", torch.device("cuda", 0), frozenset())
    assert not caplog.records


def test_cuda_defaults_to_float16() -> None:
    assert select_dtype(None, torch.device("cuda", 0), frozenset())[0] == torch.float16


def test_flags_are_read_from_cpuinfo(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    first = f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {ZEN4}\n"
    cpuinfo.write_text(first + "\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(cpuinfo) == frozenset(ZEN4.split())
    assert cpu_flags(tmp_path / "missing") == frozenset()
