"""A real Prometheus server for the integration tests.

`ensure_prometheus()` finds the `prometheus` binary, installing the Debian package when it is
missing and we are root with apt; it raises `PrometheusUnavailable(reason)` when that cannot be
done, so that tests skip with the reason. `PrometheusServer` runs a throw-away Prometheus (its
own config, data directory and free port) that scrapes the given `host:port` targets every
second, and asks its HTTP API: `query`, `wait_for`, `targets`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

PACKAGE = "prometheus"
BINARY_ENV = "PROMETHEUS_BINARY"  # an explicit binary (e.g. a downloaded release) wins over PATH
INSTALL_TIMEOUT_S = 300.0
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
# apt-get output meaning "no or stale package lists": worth one `apt-get update` and a retry.
MISSING_LISTS = re.compile(
    r"Unable to locate package|has no installation candidate|Failed to fetch|404\s+Not Found"
)
DPKG_INTERRUPTED = "dpkg was interrupted"
# Prometheus's own counters of refused samples and failed scrape pools (names of 2.x).
SCRAPE_PROBLEMS = (
    "prometheus_target_scrapes_sample_duplicate_timestamp_total",
    "prometheus_target_scrapes_sample_out_of_order_total",
    "prometheus_target_scrapes_sample_out_of_bounds_total",
    "prometheus_target_scrapes_exceeded_sample_limit_total",
    "prometheus_target_scrapes_exceeded_body_size_limit_total",
    "prometheus_target_scrapes_exemplar_out_of_order_total",
    "prometheus_target_scrape_pool_exceeded_label_limits_total",
    "prometheus_target_scrape_pools_failed_total",
)

# Never go through a proxy for 127.0.0.1.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusUnavailable(RuntimeError):
    """No usable Prometheus binary and none can be installed here; str() is the reason."""


_cached: str | PrometheusUnavailable | None = None
install_seconds: float | None = None  # how long this process spent installing, when it did


def ensure_prometheus() -> str:
    """The path of a usable `prometheus` binary, installed with apt-get when missing (cached)."""
    global _cached
    if _cached is None:
        try:
            _cached = _find_or_install()
        except PrometheusUnavailable as exc:
            _cached = exc
    if isinstance(_cached, PrometheusUnavailable):
        raise _cached
    return _cached


def prometheus_version(binary: str) -> str:
    """`prometheus --version`'s first line, e.g. 'prometheus, version 2.42.0+ds (...)'."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else "unknown version"


def _usable(binary: str | None) -> str | None:
    if not binary:
        return None
    try:
        prometheus_version(binary)
    except (OSError, subprocess.SubprocessError):
        return None
    return binary


def _on_path() -> str | None:
    return shutil.which(PACKAGE) or shutil.which(PACKAGE, path="/usr/bin:/usr/sbin:/usr/local/bin")


def _find_or_install() -> str:
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if _usable(explicit):
            return explicit
        raise PrometheusUnavailable(f"${BINARY_ENV}={explicit} is not a working prometheus binary")
    found = _usable(_on_path())
    if found:
        return found
    if not sys.platform.startswith("linux"):
        raise PrometheusUnavailable(f"prometheus is not installed (and {sys.platform} has no apt-get)")
    if shutil.which("apt-get") is None:
        raise PrometheusUnavailable("prometheus is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        raise PrometheusUnavailable(
            "prometheus is not installed and installing it needs root: apt-get install prometheus"
        )
    global install_seconds
    start = time.monotonic()
    _apt_install(start + INSTALL_TIMEOUT_S)
    install_seconds = time.monotonic() - start
    found = _usable(_on_path())
    if not found:
        raise PrometheusUnavailable(
            "apt-get installed prometheus, but no working prometheus binary is on PATH"
        )
    return found


def _run_apt(args: Sequence[str], deadline: float) -> subprocess.CompletedProcess[str]:
    remaining = deadline - time.monotonic()
    if remaining <= 1:
        raise PrometheusUnavailable(f"installing prometheus took over {INSTALL_TIMEOUT_S:.0f} s")
    env = {
        **os.environ,
        "DEBIAN_FRONTEND": "noninteractive",
        "APT_LISTCHANGES_FRONTEND": "none",
        "NEEDRESTART_MODE": "l",
    }
    try:
        return subprocess.run(
            list(args), capture_output=True, text=True, env=env, timeout=remaining, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise PrometheusUnavailable(
            f"`{' '.join(args)}` did not finish within {INSTALL_TIMEOUT_S:.0f} s"
        ) from exc
    except OSError as exc:
        raise PrometheusUnavailable(f"`{' '.join(args)}` could not run: {exc}") from exc


def _tail(result: subprocess.CompletedProcess[str], lines: int = 6) -> str:
    text = (result.stdout + result.stderr).strip().splitlines()
    return " | ".join(text[-lines:])


def _apt_install(deadline: float) -> None:
    """apt-get install prometheus without letting the package start its own service."""
    install = [
        "apt-get", "install", "-y", "--no-install-recommends", "-q",
        "-o", "DPkg::Lock::Timeout=120",
        "-o", "Dpkg::Options::=--force-confdef",
        "-o", "Dpkg::Options::=--force-confold",
        PACKAGE,
    ]  # fmt: skip
    before = _prometheus_pids(user=PACKAGE)
    service_was_active = _service_active()
    with _services_not_started():
        result = _run_apt(install, deadline)
        if result.returncode != 0 and DPKG_INTERRUPTED in result.stdout + result.stderr:
            _run_apt(["dpkg", "--configure", "-a"], deadline)
            result = _run_apt(install, deadline)
        if result.returncode != 0 and MISSING_LISTS.search(result.stdout + result.stderr):
            # No (or stale) package lists: refresh them once. A failing third-party source
            # makes `update` exit non-zero while Debian's lists are fine, so just retry.
            _run_apt(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=120"], deadline)
            result = _run_apt(install, deadline)
    # Whatever the policy said, no system Prometheus started by this install survives it: the
    # package's service runs as the `prometheus` user (our test servers run as us).
    if not service_was_active and _service_active():
        subprocess.run(["systemctl", "stop", PACKAGE], capture_output=True, timeout=60, check=False)
    for pid in _prometheus_pids(user=PACKAGE) - before:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    if result.returncode != 0:
        raise PrometheusUnavailable(
            f"apt-get install {PACKAGE} failed ({result.returncode}): {_tail(result)}"
        )


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """A policy-rc.d that forbids starting services (invoke-rc.d and deb-systemd-invoke obey
    it) for the duration of the install, unless the machine already has one (Docker images
    ship `exit 101`), which is left alone."""
    if POLICY_RC_D.exists():
        yield
        return
    try:
        POLICY_RC_D.write_text("#!/bin/sh\n# temporary, from integration_tests/prometheus.py\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            POLICY_RC_D.unlink()


def _service_active() -> bool:
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    result = subprocess.run(
        ["systemctl", "is-active", "--quiet", PACKAGE], capture_output=True, timeout=30, check=False
    )
    return result.returncode == 0


def _prometheus_pids(user: str) -> set[int]:
    """Processes of `user` running a binary called `prometheus` (Linux /proc)."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return set()
    pids = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid == uid and Path(os.readlink(entry / "exe")).name == PACKAGE:
                pids.add(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A private Prometheus scraping `targets` (host:port, /metrics) every second.

    with PrometheusServer(["127.0.0.1:3000"]) as prometheus:
        series = prometheus.wait_for("tgi_request_count")
    """

    JOB = "tgis"

    def __init__(
        self,
        targets: Sequence[str],
        *,
        binary: str | None = None,
        metrics_path: str = "/metrics",
        scrape_interval: str = "1s",
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.targets_config = list(targets)
        self.binary = binary
        self.metrics_path = metrics_path
        self.scrape_interval = scrape_interval
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.directory: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- process ---------------------------------------------------------------------------

    def start(self) -> None:
        binary = self.binary or ensure_prometheus()
        self.directory = Path(tempfile.mkdtemp(prefix="prometheus-test-"))
        config = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval},
            "scrape_configs": [
                {
                    "job_name": self.JOB,
                    "metrics_path": self.metrics_path,
                    "scheme": "http",
                    "static_configs": [{"targets": self.targets_config}],
                }
            ],
        }
        config_path = self.directory / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.port = free_port()
        command = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=info",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                log_text = self.log()
                self.stop()
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{log_text[-4000:]}")
            try:
                with _opener.open(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                log_text = self.log()
                self.stop()
                raise RuntimeError(
                    f"prometheus was not ready after {self.startup_timeout_s} s:\n{log_text[-4000:]}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    @property
    def log_path(self) -> Path:
        assert self.directory is not None, "prometheus is not running"
        return self.directory / "prometheus.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return ""

    # ---- HTTP API --------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with _opener.open(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400/422: bad expression, with a JSON error
            body = json.loads(error.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: [{"metric": {labels}, "value": [time, "value"]}, ...]."""
        data = self.api("query", query=expr)
        result = data["result"]
        return result if isinstance(result, list) else [result]

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Polls `expr` until its result is not empty; AssertionError (with targets) on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"prometheus: {expr!r} is still empty after {timeout} s\n{self.describe_targets()}"
                )
            time.sleep(0.25)

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets: scrapeUrl, health ("up"/"down"/"unknown"), lastError, ..."""
        return list(self.api("targets", state="active")["activeTargets"])

    def describe_targets(self) -> str:
        """A readable summary of the targets for failure messages."""
        try:
            targets = self.targets()
        except (OSError, RuntimeError) as exc:
            return f"targets: unavailable ({exc})"
        lines = [
            f"target {t.get('scrapeUrl')}: health={t.get('health')} lastError={t.get('lastError')!r} "
            f"lastScrape={t.get('lastScrape')} lastScrapeDuration={t.get('lastScrapeDuration')}"
            for t in targets
        ]
        return "\n".join(lines) or "targets: none"

    def self_metrics(self) -> dict[str, float]:
        """Prometheus's own unlabelled-or-summed metrics from its /metrics (e.g. the
        prometheus_target_scrapes_* counters of rejected samples)."""
        with _opener.open(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_part, _, value = line.rpartition(" ")
            name = name_part.split("{", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return values

    def scrape_problems(self) -> dict[str, float]:
        """Non-zero counters of samples Prometheus refused while scraping (duplicates, out of
        order, bounds, limits...) and failed scrapes: empty when our exposition is clean."""
        values = self.self_metrics()
        return {name: values[name] for name in SCRAPE_PROBLEMS if values.get(name)}
