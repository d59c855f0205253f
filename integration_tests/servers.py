"""Real servers for the integration tests: text-generation-launcher on tiny models.

`launch(model, ...)` builds the tiny model (once per directory), starts the launcher exactly as
an operator would (flags of TGIS's own integration tests: batch 8, waiting tokens 10, sequence
200, new tokens 169) with a soft-prompt store (PREFIX_STORE_PATH, testing/tiny_prompts.py),
waits until GET /health answers 200 and returns a Server; `stop()` sends
SIGTERM and waits. Used by integration_tests/conftest.py and record.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from router.pb import generation_pb2_grpc
from text_generation_server.testing.ports import free_ports
from text_generation_server.testing.tiny_models import build_tiny_model
from text_generation_server.testing.tiny_prompts import build_prompt_store

# name -> (architecture, tokenizer kind)
MODELS = {
    "llama": ("llama", "byte_level"),
    "llama-sp": ("llama", "metaspace"),
    "gpt2": ("gpt2", "byte_level"),
    "t5": ("t5", "byte_level"),
    "gpt_neox": ("gpt_neox", "byte_level"),
    "mistral": ("mistral", "byte_level"),
    "granite": ("granite", "byte_level"),
    "qwen2": ("qwen2", "byte_level"),
    "gpt_bigcode": ("gpt_bigcode", "byte_level"),
}
TGIS_TEST_FLAGS = (
    "--max-batch-size", "8",
    "--max-waiting-tokens", "10",
    "--max-sequence-length", "200",
    "--max-new-tokens", "169",
    "--max-concurrent-requests", "64",
    "--dtype", "float32",
)  # fmt: skip
STARTUP_TIMEOUT_S = 120.0


def model_dir(name: str, root: Path) -> Path:
    """The model `name` under `root`: built there from MODELS unless a model is there already."""
    path = root / name
    if not (path / "config.json").exists():
        arch, kind = MODELS[name]
        build_tiny_model(arch, path, tokenizer=kind)
    return path


@dataclass
class Server:
    name: str
    model_dir: Path
    grpc_port: int
    http_port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        """A synchronous stub (one channel per call site)."""
        return generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(self.address))

    def aio_stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        """An asyncio stub; create it inside the event loop that uses it."""
        channel = grpc.aio.insecure_channel(self.address)
        self.channels.append(channel)
        return generation_pb2_grpc.GenerationServiceStub(channel)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=70) as r:
                return int(r.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch(name: str, root: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    """`name`: a key of MODELS, or "model@engine" to serve it with that DEPLOYMENT_FRAMEWORK."""
    model, _, engine = name.partition("@")
    path = model_dir(model, root / "models")
    if engine:
        extra = ("--deployment-framework", engine, *extra)
    grpc_port, http_port, master_port = free_ports(3)
    log_path = root / f"{name.replace('@', '-')}-{grpc_port}.log"
    command = [
        sys.executable, "-m", "launcher.cli",
        "--model-name", str(path),
        "--port", str(http_port),
        "--grpc-port", str(grpc_port),
        "--shard-uds-path", str(root / f"{name.replace('@', '-')}-{grpc_port}"),
        "--master-port", str(master_port),  # sharded servers may run side by side
        *TGIS_TEST_FLAGS,
        *extra,
    ]  # fmt: skip
    termination_log = root / f"{name.replace('@', '-')}-termination.log"
    prompts = root / "prompts" / model  # TGIS's integration tests serve a prompt store too
    if not (prompts / "nested").exists():
        build_prompt_store(path, prompts)
    environment = {
        **os.environ,
        "PREFIX_STORE_PATH": str(prompts),
        **(env or {}),
        "TERMINATION_LOG_PATH": str(termination_log),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
    server = Server(name, path, grpc_port, http_port, log_path, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the {name} server exited with {process.returncode}:\n{server.log()[-4000:]}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the {name} server did not become healthy:\n{server.log()[-4000:]}")
        try:
            if server.health() == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
