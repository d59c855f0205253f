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
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from integration_tests.servers import free_port

SHARDED = {
    "tgis_native": ("llama", "gpt_neox", "granite", "qwen2", "mistral", "gpt_bigcode"),
    "hf_transformers": ("llama",),  # the archs of its conformance cases that shard
}
TIMEOUT_S = 600


@pytest.mark.parametrize("engine", sorted(SHARDED))
def test_the_conformance_suite_passes_on_two_ranks(
    engine: str, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    archs = SHARDED[engine]
    models = tmp_path / "models"
    for arch in archs:  # built here: a rank > 0 cannot save a model
        shutil.copytree(tiny_model(arch), models / arch)
    selection = " or ".join(f"{engine}-{arch}" for arch in archs)
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
        }
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--basetemp", str(tmp_path / f"rank{rank}"),
            "-o", "log_cli=true", "--log-cli-level=INFO",  # shows what each rank holds
            "tests/engines/test_conformance.py",
            "-k", f"({selection}) and not stream_equals",
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
        outputs.append(out.decode(errors="replace"))
    for rank, (process, out) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{out[-6000:]}"
        summary = out.strip().splitlines()[-1]
        passed = int(summary.split(" passed")[0].split()[-1])
        assert passed >= 9 * len(archs), summary  # every selected case ran
        assert "failed" not in summary and "error" not in summary, summary
        assert out.count(f"shard {rank}/2 holds") >= len(archs), "the engines were not sharded"
