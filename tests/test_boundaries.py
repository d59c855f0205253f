"""Package boundaries: which top-level package may import which (README, "Layout").

text_generation_common   imports none of the others, and never torch
router                   imports text_generation_common only (and so never torch)
text_generation_server   imports text_generation_common only
launcher                 imports router (flags, defaults) and text_generation_common; the
                         shard's torch-free hub helpers; never torch
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


def test_the_launcher_and_the_router_start_without_torch() -> None:
    code = (
        "import sys, launcher.cli, launcher.config, router.cli, router.server\n"
        "loaded = {'torch', 'transformers'} & set(sys.modules)\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
