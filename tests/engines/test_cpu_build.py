"""Building the C++ CPU kernels (kernels/cpu_build.py): which target serves which CPU, the target
table against the compiler's own macros and the sources' tests, a library loaded where no
compiler is (the container image's way), the build's lock and errors over a fake compiler, and
`text-generation-server build-cpu-kernels`."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from text_generation_server.cli import app
from text_generation_server.kernels import cpu_build, cpu_kernels
from text_generation_server.utils.cpu import cpu_flags

REPO = Path(__file__).resolve().parents[2]
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sse4_2", "popcnt"}
SKYLAKE_SP = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ICE_LAKE = CASCADE_LAKE | {"avx512vbmi", "avx512_vbmi2", "avx512ifma", "gfni", "vaes"}
COOPER_LAKE = CASCADE_LAKE | {"avx512_bf16"}
ZEN4 = ICE_LAKE | {"avx512_bf16", "avx512_bitalg", "avx512_vpopcntdq"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx_vnni"}
GRANITE_RAPIDS = SAPPHIRE_RAPIDS | {"amx_fp16"}


@pytest.mark.parametrize(
    ("flags", "target"),
    [
        (V3, "x86-64-v3"),  # Haswell, AMD Zen 1-3
        (SKYLAKE_SP, "x86-64-v4"),
        (CASCADE_LAKE, "v4-vnni"),
        (ICE_LAKE, "v4-vnni-vbmi"),
        (COOPER_LAKE, "v4-bf16"),
        (ZEN4, "v4-bf16-vbmi"),
        (SAPPHIRE_RAPIDS, "v4-amx"),
        (GRANITE_RAPIDS, "v4-amx"),
        (V3 - {"movbe"}, None),  # an instruction the target's code may use is missing
        (V3 - {"avx2"}, None),  # Sandy Bridge: AVX alone
        (V3 | {"avx512f"}, None),  # AVX-512 without the rest of x86-64-v4 (Knights Landing)
        (SKYLAKE_SP | {"avx512_bf16"}, None),  # BF16 without VNNI: no target tests alike
        ({"fp", "asimd", "sve"}, None),  # an Arm CPU
    ],
)
def test_the_target_of_each_cpu(flags: set[str], target: str | None) -> None:
    found = cpu_build.target_for(frozenset(flags))
    assert (found.name if found else None) == target


def test_isa_flags_name_every_instruction_set_the_sources_test() -> None:
    tested = set()
    for path in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("#if", "#elif")):
                tested |= set(re.findall(r"__(?:AVX|AMX|FMA|F16C|BMI|SSE|VNNI|VBMI)[A-Z0-9_]*__", line))
    assert tested, "the sources test no instruction set?"
    assert tested <= set(cpu_build.ISA_FLAGS), sorted(tested - set(cpu_build.ISA_FLAGS))


def test_the_package_ships_every_source_and_header() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["text_generation_server.kernels"]
    for path in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        relative = path.relative_to(path.parents[1]).as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), relative
    assert sorted(cpu_build.CSRC.iterdir()) == sorted((*cpu_build.SOURCES, *cpu_build.HEADERS))


def compiler_or_skip() -> str:
    try:
        return cpu_build.compiler()
    except cpu_build.KernelBuildError as exc:
        pytest.skip(str(exc))


def isa_macros(march: tuple[str, ...]) -> set[str]:
    """The ISA_FLAGS macros the compiler defines with these options."""
    out = subprocess.run(
        [compiler_or_skip(), *march, "-dM", "-E", "-x", "c++", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return defined & set(cpu_build.ISA_FLAGS)


@pytest.mark.parametrize("target", cpu_build.TARGETS, ids=lambda t: t.name)
def test_each_target_compiles_for_the_instruction_sets_it_names(target: cpu_build.Target) -> None:
    expected = {macro for macro, flag in cpu_build.ISA_FLAGS.items() if flag in target.flags}
    assert isa_macros(target.march) == expected


def test_this_cpus_target_sees_what_a_native_build_sees() -> None:
    target = cpu_build.target_for(cpu_flags())
    if target is None:
        pytest.skip("no target serves this CPU: it builds with -march=native")
    assert isa_macros(target.march) == isa_macros(cpu_build.NATIVE)


LOAD_AND_CHECK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from text_generation_server.kernels import cpu_kernels
    try:
        cpu_kernels.load(Path(sys.argv[1]))
    except cpu_kernels.KernelBuildError as exc:
        print("refused:", exc)
        raise SystemExit(0)
    scores = torch.randn(7, 5000)
    ids, nan = cpu_kernels.first_max(scores)
    assert torch.equal(ids, scores.argmax(-1)) and not nan.any()
    x, w = torch.randn(3, 128), torch.randn(48, 128)
    y = torch.ops.tgis_cpu.panel_linear(x, torch.ops.tgis_cpu.panel_pack(w), None)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
    print("loaded:", cpu_kernels._loaded)
    """
)


def run_without_a_compiler(prebuilt: Path, extensions: Path) -> str:
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(extensions)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_CHECK, str(prebuilt)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_prebuilt_library_serves_where_no_compiler_is(tmp_path: Path) -> None:
    """The library this CPU's target builds (here at first use, or by build-cpu-kernels for the
    image: the same file), put where the image keeps it, loads and computes in a process that
    has no compiler; without it that process says why it has no kernels."""
    target = cpu_build.target_for(cpu_flags())
    if target is None:
        pytest.skip("no target serves this CPU")
    try:
        cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        pytest.skip(f"the CPU kernels cannot be had here: {exc}")
    built = cpu_build.native_dir() / cpu_build.prebuilt_path(target, tmp_path).name
    if not built.exists():
        pytest.skip(f"this process loaded its kernels from elsewhere ({cpu_kernels._loaded})")
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    shutil.copy(built, cpu_build.prebuilt_path(target, prebuilt))
    out = run_without_a_compiler(prebuilt, tmp_path / "extensions")
    assert f"loaded: prebuilt for {target.name}: {cpu_build.prebuilt_path(target, prebuilt)}" in out, out
    out = run_without_a_compiler(tmp_path / "empty", tmp_path / "extensions")
    assert out.startswith("refused: no C++ compiler ('/nonexistent/c++' not found"), out
    assert f"holds no library of this version for this CPU's target ({target.name})" in out, out


FAKE_COMPILER = """#!/bin/sh
# a stand-in for c++: records each call, writes the file after -o, fails where told
echo "$@" >> "{log}"
case "$*" in *{fail}*) echo "x.cpp:1:1: error: told to fail" >&2; exit 1;; esac
sleep 0.2
while [ "$#" -gt 1 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done
"""


def fake_compiler(tmp_path: Path, monkeypatch, fail: str = "never-in-a-command") -> Path:
    log = tmp_path / "calls.log"
    script = tmp_path / "fake-c++"
    script.write_text(FAKE_COMPILER.format(log=log, fail=fail))
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    return log


def test_concurrent_builds_of_one_library_build_it_once(tmp_path: Path, monkeypatch) -> None:
    log = fake_compiler(tmp_path, monkeypatch)
    library = tmp_path / "out" / "lib.so"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(cpu_build.build(("-march=x86-64-v3",), library)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [library] * 3 and library.read_text() == "built\n"
    calls = log.read_text().splitlines()
    assert len(calls) == len(cpu_build.SOURCES) + 1  # each source once, one link
    assert all("-march=x86-64-v3" in call for call in calls[:-1]) and "-shared" in calls[-1]
    assert sorted(p.name for p in library.parent.iterdir()) == ["lib.lock", "lib.so"]  # no leftovers


def test_a_failed_build_names_the_compiler_error_and_leaves_no_library(tmp_path: Path, monkeypatch) -> None:
    fake_compiler(tmp_path, monkeypatch, fail="w8a8_cpu.cpp")
    library = tmp_path / "out" / "lib.so"
    with pytest.raises(cpu_build.KernelBuildError, match=r"failed: x\.cpp:1:1: error: told to fail"):
        cpu_build.build(("-march=x86-64-v3",), library)
    assert not library.exists() and [p.name for p in library.parent.iterdir()] == ["lib.lock"]


def test_a_directory_that_cannot_be_written_is_a_build_error(tmp_path: Path, monkeypatch) -> None:
    fake_compiler(tmp_path, monkeypatch)
    (tmp_path / "file").write_text("")
    with pytest.raises(cpu_build.KernelBuildError, match=r"building the CPU kernels in .*/file/sub failed"):
        cpu_build.build(("-march=x86-64-v3",), tmp_path / "file" / "sub" / "lib.so")


def test_build_cpu_kernels_builds_every_target_or_those_named(tmp_path: Path, monkeypatch) -> None:
    built: list[tuple[tuple[str, ...], Path]] = []

    def build(march: tuple[str, ...], library: Path) -> Path:
        built.append((march, library))
        return library

    monkeypatch.setattr(cpu_build, "build", build)
    monkeypatch.setattr(cpu_build, "prebuilt_dir", lambda: tmp_path / "default")
    result = CliRunner().invoke(app, ["build-cpu-kernels"])
    assert result.exit_code == 0, result.output
    assert built == [(t.march, cpu_build.prebuilt_path(t, tmp_path / "default")) for t in cpu_build.TARGETS]
    assert result.output.split() == [str(path) for _, path in built]
    built.clear()
    args = ["build-cpu-kernels", "--target", "v4-amx", "--target", "x86-64-v3", "--output-dir", str(tmp_path)]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert [path.name.split("-tgis_cpu_")[0] for _, path in built] == ["v4-amx", "x86-64-v3"]
    result = CliRunner().invoke(app, ["build-cpu-kernels", "--target", "avx9000"])
    assert result.exit_code == 2 and "'avx9000' is not one of" in result.output


def test_build_cpu_kernels_says_which_target_failed(tmp_path: Path, monkeypatch) -> None:
    def build(march: tuple[str, ...], library: Path) -> Path:
        raise cpu_build.KernelBuildError("building the CPU kernels failed: x.cpp:1:1: error: no")

    monkeypatch.setattr(cpu_build, "build", build)
    result = CliRunner().invoke(
        app, ["build-cpu-kernels", "--target", "v4-vnni", "--output-dir", str(tmp_path)]
    )
    assert result.exit_code == 1 and "v4-vnni: building the CPU kernels failed" in result.output


def test_build_cpu_kernels_on_another_architecture_builds_nothing(tmp_path: Path, monkeypatch) -> None:
    """An arm64 image build goes on without the x86-64 families (its shards build at first start
    where a compiler is, else run without the kernels)."""
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_build, "build", lambda march, library: pytest.fail("built on aarch64"))
    result = CliRunner().invoke(app, ["build-cpu-kernels", "--output-dir", str(tmp_path)])
    assert result.exit_code == 0 and not list(tmp_path.iterdir()), result.output
    result = CliRunner().invoke(app, ["build-cpu-kernels", "--target", "x86-64-v3"])
    assert result.exit_code == 1 and "x86-64 targets cannot be built on aarch64" in result.output
