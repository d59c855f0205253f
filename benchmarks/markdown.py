"""Markdown pieces shared by the report's tables (report.py, comparisons.py)."""

from __future__ import annotations

from typing import Any


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: floats with thousands separators and `digits` decimals, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
