"""Ports for the servers tests and benchmarks start side by side."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST_PORT = 10000


def port_range() -> range:
    """The ports picked from: LOWEST_PORT up to the kernel's first ephemeral port."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    return range(LOWEST_PORT, max(first_ephemeral, LOWEST_PORT + 1000))


def free_ports(count: int) -> list[int]:
    """`count` distinct ports, free now and below the kernel's ephemeral range.

    Ports the kernel hands out (bind to 0) come from that range, where the processes a test
    starts take theirs too: the ranks of a sharded server open many connections, and one took
    the HTTP port picked for the router before the router bound it. Each port stays bound until
    all are picked, so no two of one call are the same (a server refuses --port equal to
    --grpc-port)."""
    span = port_range()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(1000 + count):
            port = random.randrange(span.start, span.stop)
            s = held.enter_context(socket.socket())
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports below the ephemeral range")


def free_port() -> int:
    return free_ports(1)[0]
