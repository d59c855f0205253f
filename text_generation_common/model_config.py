"""Facts read from a model's config.json that both the launcher and the shard need (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# config.json keys that hold a model's context length, most specific first.
SEQUENCE_LENGTH_KEYS = (
    "max_sequence_length",
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_seq_length",
    "seq_len",
)


def context_length(config: Mapping[str, Any]) -> int | None:
    """The context length a config.json records, if any (first key of SEQUENCE_LENGTH_KEYS)."""
    for key in SEQUENCE_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
