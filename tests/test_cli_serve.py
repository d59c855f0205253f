"""`text-generation-server serve` as a real process: readiness, env config, shutdown, bad config."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.shard_harness import make_request
from text_generation_common.pb import generate_pb2 as pb
from text_generation_common.pb import generate_pb2_grpc


def shard_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "text_generation_server.cli", "serve", *args]


def wait_for_socket(proc: subprocess.Popen, path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"shard exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("shard socket did not appear")
        time.sleep(0.1)


def test_serve_until_sigterm(tiny_model, tmp_path) -> None:
    uds = tmp_path / "tgs"
    cpu = min(os.sched_getaffinity(0))
    env = {**os.environ, "MAX_BATCH_SIZE": "2", "MAX_SEQUENCE_LENGTH": "100", "CPU_AFFINITY": str(cpu)}
    proc = subprocess.Popen(
        shard_command(str(tiny_model("gpt2")), "hf_transformers", "--uds-path", str(uds)),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    socket = Path(f"{uds}-0")
    try:
        wait_for_socket(proc, socket)
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
            info = stub.ModelInfo(pb.ModelInfoRequest())
            assert info.max_sequence_length == 100 and info.model_type == pb.ModelInfoResponse.CAUSAL_LM
            requests = [make_request(i, [5, 6, 7], 3) for i in range(3)]
            with pytest.raises(grpc.RpcError) as error:  # MAX_BATCH_SIZE=2 came from the environment
                stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=requests)))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            result = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=requests[:2]))).result
            assert len(result.tokens) == 2
        for task in Path(f"/proc/{proc.pid}/task").iterdir():  # every thread inherited the pinning
            assert os.sched_getaffinity(int(task.name)) == {cpu}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not socket.exists(), "the socket is removed on shutdown"
        assert proc.stderr is not None
        log = proc.stderr.read()
        frozen = re.search(r"shard 0 loaded: (\d+) objects kept out of garbage collection", log)
        assert frozen and int(frozen.group(1)) > 10_000, "the loaded heap is frozen"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("model", "engine", "extra", "message"),
    [
        ("gpt2", "nope", [], "unknown deployment framework 'nope'; choose one of: hf_accelerate, "),
        ("no-such/model", "hf_transformers", [], "model 'no-such/model' not found"),
        ("gpt2", "hf_transformers", ["--dtype", "int3"], "Invalid value for '--dtype'"),
        ("gpt2", "hf_transformers", ["--cpu-affinity", "0-x"], "CPU_AFFINITY: '0-x' is not a CPU number"),
        (
            "gpt2",
            "hf_transformers",
            ["--cpu-affinity", "99999"],
            "CPU_AFFINITY names CPUs this process may not",
        ),
    ],
)
def test_bad_configuration_fails_fast(tiny_model, tmp_path, model, engine, extra, message) -> None:
    model_arg = str(tiny_model(model)) if model == "gpt2" else model
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    proc = subprocess.run(
        shard_command(model_arg, engine, "--uds-path", str(tmp_path / "s"), *extra),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
