"""A real Prometheus server for the integration tests.

`ensure_prometheus()` finds the `prometheus` binary ($PROMETHEUS_BINARY, else PATH; `make
test-tools` installs the Debian package where missing) and raises `PrometheusUnavailable(reason)`
when there is none, so that tests skip with the reason; nothing is installed from here.
`PrometheusServer` runs a throw-away Prometheus (its own config, data directory and free port)
that scrapes the given `host:port` targets every second, and asks its HTTP API: `query`,
`wait_for`, `targets`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from text_generation_server.testing.ports import free_port

PACKAGE = "prometheus"
BINARY_ENV = "PROMETHEUS_BINARY"  # an explicit binary (e.g. a downloaded release) wins over PATH
INSTALL_HINT = "run `make test-tools` (as root, with apt) to install the Debian package"
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


def ensure_prometheus() -> str:
    """The path of a usable `prometheus` binary (cached); PrometheusUnavailable when there is none."""
    global _cached
    if _cached is None:
        try:
            _cached = _find()
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


def _find() -> str:
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if _usable(explicit):
            return explicit
        raise PrometheusUnavailable(f"${BINARY_ENV}={explicit} is not a working prometheus binary")
    found = _usable(_on_path())
    if not found:
        raise PrometheusUnavailable(f"prometheus is not installed: {INSTALL_HINT}")
    return found


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
