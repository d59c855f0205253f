"""The conformance suite on two tensor-parallel ranks (gloo on CPU).

One pytest process per rank runs the same conformance cases with the engine built over a
2-rank process group (tests/engines/conformance.py `sharding`): both ranks make the same engine
calls in the same order, as the router makes them, and every assertion (greedy parity with
single-process `transformers` generate, batch invariance with joins/prunes/run-ahead, chunked
prefill, seeds, penalties, token details, truncation) must hold on each rank. The cases that go
through the router's batcher are left out: its batches depend on timing, which two processes
do not share (the launcher tests in integration_tests/test_sharded.py cover the router).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from text_generation_server.testing.ports import free_port

SHARDED = {
    "tgis_native": ("llama", "gpt_neox", "granite", "qwen2", "mistral", "gpt_bigcode"),
    "hf_transformers": ("llama",),  # the archs of its conformance cases that shard
}
TIMEOUT_S = 600


def on_two_ranks(tmp_path: Path, models: Path, test_file: str, selection: str) -> list[tuple[int, str]]:
    """Run the selected tests in one pytest per rank of a 2-rank group; (returncode, output)."""
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "CONFORMANCE_RANK": str(rank),
            "CONFORMANCE_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TINY_MODELS_DIR": str(models),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, also where GPUs are visible
        }
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--basetemp", str(tmp_path / f"rank{rank}"),
            "-o", "log_cli=true", "--log-cli-level=INFO",  # shows what each rank holds
            test_file, "-k", selection,
        ]  # fmt: skip
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    for process in ranks:
        try:
            out, _ = process.communicate(timeout=TIMEOUT_S)
        finally:
            for other in ranks:
                if other.poll() is None and process.returncode is None:
                    other.kill()
        outputs.append((process.returncode, out.decode(errors="replace")))
    return outputs


def copied(tiny_model: Callable[..., Path], archs: Sequence[str], models: Path) -> Path:
    for arch in archs:  # built here: a rank > 0 cannot save a model
        shutil.copytree(tiny_model(arch), models / arch)
    return models


def assert_passed(outputs: list[tuple[int, str]], at_least: int, archs: Sequence[str]) -> None:
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank}:\n{out[-6000:]}"
        summary = out.strip().splitlines()[-1]
        passed = int(summary.split(" passed")[0].split()[-1])
        assert passed >= at_least, summary  # every selected case ran
        assert "failed" not in summary and "error" not in summary, summary
        assert out.count(f"shard {rank}/2 holds") >= len(archs), "the engines were not sharded"


@pytest.mark.parametrize("engine", sorted(SHARDED))
def test_the_conformance_suite_passes_on_two_ranks(
    engine: str, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    archs = SHARDED[engine]
    models = copied(tiny_model, archs, tmp_path / "models")
    selection = " or ".join(f"{engine}-{arch}" for arch in archs)
    outputs = on_two_ranks(
        tmp_path, models, "tests/engines/test_conformance.py", f"({selection}) and not stream_equals"
    )
    assert_passed(outputs, 9 * len(archs), archs)


def test_lora_equals_peft_on_two_ranks(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """tests/test_lora.py's parity cases for Llama on both engines, each engine sharded."""
    models = copied(tiny_model, ("llama", "t5", "gpt_neox"), tmp_path / "models")
    outputs = on_two_ranks(tmp_path, models, "tests/test_lora.py", "equals_peft and llama")
    assert_passed(outputs, 2, ("llama",))


def test_the_measured_speculation_gate_agrees_on_two_ranks(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """n-gram speculation on two ranks with SPECULATOR_BATCH_GATE=measured: each rank times its
    own steps, both end with the same costs and the same tokens (no rank waits on a collective
    the other skipped)."""
    models = copied(tiny_model, ("llama",), tmp_path / "models")
    outputs = on_two_ranks(tmp_path, models, "tests/test_speculation_gate.py", "every_rank")
    assert_passed(outputs, 1, ("llama",))
    for pattern in (r"speculating step / plain step, measured: (at [^;]*);", r"rank outputs: (.*)"):
        found = [re.search(pattern, out) for _, out in outputs]
        assert found[0] is not None and found[1] is not None, pattern
        assert found[0].group(1) == found[1].group(1)
