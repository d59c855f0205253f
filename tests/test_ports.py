"""The ports tests and benchmarks give the servers they start."""

from __future__ import annotations

import itertools
import socket

from text_generation_server.testing import ports


def test_a_call_passes_over_a_port_it_picked_already(monkeypatch) -> None:
    span = ports.port_range()
    pair = (span.start + 17, span.start + 18)
    picks = itertools.chain([pair[0], pair[0], pair[0]], itertools.repeat(pair[1]))
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
    assert ports.free_ports(2) == list(pair)
    for port in pair:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # released once picked


def test_many_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    picked = ports.free_ports(64)
    assert len(set(picked)) == 64 and all(port in ports.port_range() for port in picked)
