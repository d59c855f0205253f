"""Supervisor: runs the launcher's child processes (N shards, then the router) and owns their lifecycle.

Called by launcher/cli.py with ChildSpecs (argv + env, built by launcher/config.py):

    start shards -> wait for every shard's socket file -> start router -> wait for the first event
      a child exited on its own -> write the reason to the termination log, stop the others, exit 1
      SIGTERM / SIGINT          -> stop the router (grace: its drain timeout + 10 s, given by the
                                   launcher), then the shards (grace 10 s), exit 0

Each child has a reader thread (its stdout + stderr lines, kept whole, copied to our stderr with
the child's prefix) and a waiter thread (posts ChildExited to the event queue). The main thread
only waits on that queue; the signal handlers post to it too (SimpleQueue.put is reentrant).
Children run in their own process group, so a terminal's Ctrl-C reaches only the launcher, which
then stops them in order; whatever path `run` leaves by, no child is left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO

from launcher.config import LaunchError

logger = logging.getLogger(__name__)

ROUTER_GRACE_S = 30.0
SHARD_GRACE_S = 10.0
KILL_WAIT_S = 5.0
SOCKET_POLL_S = 0.1
WAITING_LOG_INTERVAL_S = 10.0
READER_JOIN_S = 2.0
FATAL_LINE = re.compile(rb' CRITICAL |"level": "CRITICAL"|^Error: ')
FATAL_LINE_CHARS = 1000


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # "Shard 0", "Router": in log lines and exit reasons
    argv: Sequence[str]
    env: Mapping[str, str]
    log_prefix: str = ""  # prepended to every forwarded output line


@dataclass(frozen=True, slots=True)
class ChildExited:
    name: str
    returncode: int


@dataclass(frozen=True, slots=True)
class SignalReceived:
    signum: int


Event = ChildExited | SignalReceived


class LineForwarder:
    """Copies whole lines to one binary stream; a lock keeps lines of different children apart."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._lock = threading.Lock()

    def forward(self, stream: IO[bytes], prefix: bytes, seen: Callable[[bytes], None] | None = None) -> None:
        with stream:
            for line in stream:
                self.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                if seen is not None:
                    seen(line)

    def write(self, data: bytes) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):  # a closed stderr must not stop draining
            self._out.write(data)
            self._out.flush()


class Child:
    """One running child process with its reader and waiter threads."""

    def __init__(self, spec: ChildSpec, forwarder: LineForwarder, events: queue.SimpleQueue[Event]) -> None:
        self.spec = spec
        try:
            self.proc = subprocess.Popen(
                list(spec.argv),
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {spec.name} ({spec.argv[0]}): {exc.strerror or exc}") from None
        assert self.proc.stdout is not None
        self.last_fatal: str | None = None  # the child's last fatal line (see _seen)
        self.reader = threading.Thread(
            target=forwarder.forward,
            args=(self.proc.stdout, spec.log_prefix.encode(), self._seen),
            name=f"{spec.name} output",
            daemon=True,
        )
        self.reader.start()
        threading.Thread(target=self._wait, args=(events,), name=f"{spec.name} waiter", daemon=True).start()

    def _seen(self, line: bytes) -> None:
        """Keep the last line that says why the child stops: a CRITICAL log record (plain or
        JSON) or click's one-line `Error: ...`."""
        if FATAL_LINE.search(line):
            self.last_fatal = line.decode(errors="replace").strip()[:FATAL_LINE_CHARS]

    def _wait(self, events: queue.SimpleQueue[Event]) -> None:
        events.put(ChildExited(self.spec.name, self.proc.wait()))

    def running(self) -> bool:
        return self.proc.poll() is None

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.running():
                self.proc.send_signal(signum)


def stop_children(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM every running child, wait up to `grace_s`, then SIGKILL the ones still running."""
    running = [c for c in children if c.running()]
    for child in running:
        logger.info("stopping %s", child.spec.name)
        child.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            code = child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s: killing it", child.spec.name, grace_s)
            child.send(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(KILL_WAIT_S)
            code = child.proc.returncode
        logger.info("%s stopped with code %s", child.spec.name, code)


def write_termination_log(path: str | None, reason: str) -> None:
    """The Kubernetes termination message; best effort."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(reason + "\n")
    except OSError as exc:
        logger.debug("cannot write the termination log %s: %s", path, exc)


class Supervisor:
    def __init__(
        self,
        out: IO[bytes],
        termination_log: str | None,
        router_grace_s: float = ROUTER_GRACE_S,
        shard_grace_s: float = SHARD_GRACE_S,
    ) -> None:
        self._forwarder = LineForwarder(out)
        self._termination_log = termination_log
        self._router_grace_s = router_grace_s
        self._shard_grace_s = shard_grace_s
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._shards: list[Child] = []
        self._router: Child | None = None

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """While inside, SIGTERM and SIGINT become SignalReceived events (a graceful shutdown)."""

        def post(signum: int, frame: FrameType | None) -> None:
            self._events.put(SignalReceived(signum))

        previous = {sig: signal.signal(sig, post) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def fail(self, reason: str) -> None:
        """Report a fatal error: one log line and the termination log."""
        logger.error("%s", reason)
        write_termination_log(self._termination_log, reason)

    def run(self, shards: Sequence[ChildSpec], sockets: Sequence[str], router: ChildSpec) -> int:
        """Start everything, supervise until a signal or a child's exit; returns the exit code."""
        try:
            event = self._pending_event()
            if event is None:
                self._start_shards(shards, sockets)
                event = self._wait_for_sockets(sockets)
            if event is None:
                logger.info("starting the router")
                self._router = Child(router, self._forwarder, self._events)
                event = self._events.get()
            return self._handle(event)
        finally:
            self._kill_all()

    def _pending_event(self) -> Event | None:
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    def _start_shards(self, shards: Sequence[ChildSpec], sockets: Sequence[str]) -> None:
        for path in sockets:
            if os.path.lexists(path):
                logger.warning("removing the stale socket %s", path)
                try:
                    os.unlink(path)
                except OSError as exc:
                    raise LaunchError(f"cannot remove the stale socket {path}: {exc.strerror}") from None
        for spec in shards:
            logger.info("starting %s", spec.name)
            self._shards.append(Child(spec, self._forwarder, self._events))

    def _wait_for_sockets(self, sockets: Sequence[str]) -> Event | None:
        """Wait until every shard's socket exists; an event (exit, signal) first ends the wait."""
        pending = dict(enumerate(sockets))
        next_log = time.monotonic() + WAITING_LOG_INTERVAL_S
        while True:
            for rank, path in list(pending.items()):
                if os.path.exists(path):
                    logger.info("shard %d ready on %s", rank, path)
                    del pending[rank]
            if not pending:
                return None
            try:
                return self._events.get(timeout=SOCKET_POLL_S)
            except queue.Empty:
                pass
            if time.monotonic() >= next_log:
                for rank in pending:
                    logger.info("waiting for shard %d to be ready", rank)
                next_log += WAITING_LOG_INTERVAL_S

    def _handle(self, event: Event) -> int:
        if isinstance(event, SignalReceived):
            logger.info("received %s: shutting down", signal.Signals(event.signum).name)
            self._stop_all()
            return 0
        reason = f"{event.name} exited with code {event.returncode}"
        child = next((c for c in self._children() if c.spec.name == event.name), None)
        if child is not None:
            child.reader.join(READER_JOIN_S)  # its last lines, written before it exited
            if child.last_fatal:
                reason += f": {child.last_fatal}"
        self.fail(reason)
        self._stop_all()
        return 1

    def _children(self) -> list[Child]:
        return [*self._shards, *([self._router] if self._router else [])]

    def _stop_all(self) -> None:
        """The router first (it drains its requests through the shards), then the shards."""
        if self._router is not None:
            stop_children([self._router], self._router_grace_s)
        stop_children(self._shards, self._shard_grace_s)

    def _kill_all(self) -> None:
        children = self._children()
        for child in children:
            if child.running():
                logger.warning("killing %s", child.spec.name)
                child.send(signal.SIGKILL)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(KILL_WAIT_S)
            child.reader.join(READER_JOIN_S)
