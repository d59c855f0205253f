"""Defaults that the launcher, the router and the shards must agree on, and the socket naming
of the shards, defined once."""

from __future__ import annotations

import os
import re
import tempfile

DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_MAX_SEQUENCE_LENGTH = 2048  # when neither the flag nor the model's config.json sets one
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_MAX_BATCH_SIZE = 12
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 2048  # prompt tokens per step; the shard sizes its graphs by it
DEFAULT_BATCH_SAFETY_MARGIN = 20
DEFAULT_DEPLOYMENT_FRAMEWORK = "hf_transformers"
SHARD_SOCKET_NAME = "text-generation-server"
# prefix_id / adapter_id (TGIS's rule): a directory of the adapter store, nested by `/`
ADAPTER_ID_PATTERN = re.compile(r"[/\w\-]+")


def storable_adapter_id(name: str) -> bool:
    """Whether `name` is an id a store directory can have: the pattern, and not an absolute path."""
    return bool(ADAPTER_ID_PATTERN.fullmatch(name)) and not name.startswith("/")


def default_uds_path() -> str:
    """Socket base path of the shards (see shard_socket_path)."""
    return os.path.join(tempfile.gettempdir(), SHARD_SOCKET_NAME)


def shard_socket_path(base: str, rank: int) -> str:
    """The Unix socket shard `rank` listens on."""
    return f"{base}-{rank}"
