"""Integration fixtures: one real server per tiny model, started on first use, for the session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration_tests.servers import Server, launch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Server]]:
    """server(name) -> the running server of that tiny model (see servers.MODELS)."""
    root = Path(tmp_path_factory.mktemp("servers"))
    running: dict[str, Server] = {}

    def get(name: str) -> Server:
        if name not in running:
            running[name] = launch(name, root)
        return running[name]

    yield get
    for s in running.values():
        s.stop()
