"""Session fixtures shared by the unit tests: tiny models built once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Deterministic, quiet, offline: set before anything imports transformers or the hub client.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARCHS = ("llama", "gpt2", "bloom", "gpt_neox", "t5", "mistral")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(arch, safetensors=True) -> directory of that tiny model (built once). With
    TINY_MODELS_DIR set, the models live there and one built before is reused (the sharded
    conformance runs get theirs from the test that starts them: a process in a torch.distributed
    group of rank > 0 cannot save a model)."""
    from text_generation_server.testing.tiny_models import build_tiny_model

    built: dict[tuple[str, bool], Path] = {}
    shared = os.environ.get("TINY_MODELS_DIR")

    def get(arch: str, safetensors: bool = True) -> Path:
        key = (arch, safetensors)
        name = f"{arch}{'' if safetensors else '-bin'}"
        if key not in built and shared and (Path(shared) / name / "config.json").exists():
            built[key] = Path(shared) / name
        if key not in built:
            out = Path(shared) / name if shared else tmp_path_factory.mktemp(name)
            built[key] = build_tiny_model(arch, out, safetensors=safetensors)
        return built[key]

    return get


ENGINE_GPU_BYTES = 2**30  # the most free GPU memory an engine built by a test sees


@pytest.fixture(scope="session", autouse=True)
def gpu_share() -> Iterator[None]:
    """On a GPU, engines built by tests size their caches from at most ENGINE_GPU_BYTES of free
    memory within a 1/N share of the card (N test processes side by side, `pytest -n N`), not
    from all of its free memory: the first engine would take it and leave later engines and
    the other processes out of memory. Servers the tests start get the share as
    CUDA_PROCESS_MEMORY_FRACTION."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    real = torch.cuda.mem_get_info

    def shared(device: torch.device | int | None = None) -> tuple[int, int]:
        free, total = real(device)
        return min(free, ENGINE_GPU_BYTES), total // workers

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "mem_get_info", shared)
        patch.setenv("CUDA_PROCESS_MEMORY_FRACTION", f"{1 / workers:.4f}")
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip cleanly on machines without CUDA (CI never has one)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
