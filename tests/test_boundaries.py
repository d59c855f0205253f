"""Package boundaries: which top-level package may import which (README, "Layout").

text_generation_common   imports none of the others, and never torch
router                   imports text_generation_common only (and so never torch)
text_generation_server   imports text_generation_common only
launcher                 imports router (flags, defaults) and text_generation_common; the
                         shard's torch-free hub helpers; never torch

Inside the router, one way (its top-level modules, cli/config/server/client, wire the folders
together and may import any):
router/core              a request's life (validation, tokenization, detokenization, stopping,
                         capacity, metrics): no other folder of the router
router/scheduling        the batching loop, its queue, the shard client: core
router/api               what every door shares (the call path, auth, tracing, TLS): core, scheduling
router/grpc, router/http the doors: api, core (http also scheduling, for its health checks;
                         grpc also pb); never each other

Inside the shard's package, folders by layer (SERVER_FOLDERS; its top-level modules, config,
server, batch manager, adapters, ..., are not folders and are left out): the kernels, KV blocks,
sampling, ONNX and utilities at the bottom; attention, quantization and batches over them; the
engines and speculation (which serve each other: a draft model is an engine) on top; testing
may use anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("text_generation_common", "router", "text_generation_server", "launcher")
FORBIDDEN = {
    "text_generation_common": {"router", "text_generation_server", "launcher", "torch", "transformers"},
    "router": {"text_generation_server", "launcher", "torch", "transformers"},
    "text_generation_server": {"router", "launcher"},
    "launcher": {"torch", "transformers"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (at any depth of its code)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_what_it_may(package: str) -> None:
    offending = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((REPO / package).rglob("*.py"))
        if "/pb/" not in str(path)
    }
    assert {k: v for k, v in offending.items() if v} == {}


ROUTER_FOLDERS = {  # folder -> the router's folders it may import (besides itself)
    "core": set(),
    "scheduling": {"core"},
    "api": {"core", "scheduling"},
    "grpc": {"api", "core", "pb"},
    "http": {"api", "core", "scheduling"},
}


SERVER_FOLDERS = {  # folder -> the shard package's folders it may import (besides itself)
    "utils": set(),
    "kv": set(),
    "sampling": {"utils"},
    "onnx": set(),
    "kernels": {"utils"},
    "attention": {"kernels", "kv"},
    "quantization": {"kernels", "utils"},
    "batches": {"sampling"},
    "engines": {
        "attention",
        "batches",
        "kernels",
        "kv",
        "onnx",
        "quantization",
        "sampling",
        "speculation",
        "utils",
    },
    "speculation": {"engines", "kernels", "kv", "utils"},
    "testing": {"attention", "batches", "engines", "kernels", "kv", "quantization", "sampling", "utils"},
}


def folders_imported(path: Path, package: str) -> set[str]:
    """The names right below `package` that `path` imports from (package.X.Y -> X)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        names.update(m.split(".")[1] for m in modules if m.startswith(f"{package}."))
    return names


@pytest.mark.parametrize(
    ("package", "rules"), [("router", ROUTER_FOLDERS), ("text_generation_server", SERVER_FOLDERS)]
)
def test_a_packages_folders_import_one_way(package: str, rules: dict[str, set[str]]) -> None:
    folders = {p.name for p in (REPO / package).iterdir() if (p / "__init__.py").exists()} - {"pb"}
    assert folders == set(rules), "a folder without its rule (or a rule without its folder)"
    offending = {
        str(path.relative_to(REPO)): sorted(
            (folders_imported(path, package) & folders) - rules[folder] - {folder}
        )
        for folder in rules
        for path in sorted((REPO / package / folder).rglob("*.py"))
    }
    assert {k: v for k, v in offending.items() if v} == {}


def test_the_launcher_and_the_router_start_without_torch() -> None:
    code = (
        "import sys, launcher.cli, launcher.config, router.cli, router.server\n"
        "loaded = {'torch', 'transformers'} & set(sys.modules)\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
