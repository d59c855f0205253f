"""Argument types the benchmark commands share."""

from __future__ import annotations

import argparse

from benchmarks.suite import SWEEP


def concurrency_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, or `sweep`."""
    if text.strip() == "sweep":
        return SWEEP
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or 'sweep', got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def env_pair(text: str) -> tuple[str, str]:
    """KEY=VALUE."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value
