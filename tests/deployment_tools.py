"""Helpers of tests/test_deployment.py: a kustomize renderer, accessors of rendered manifests, a
Dockerfile parser, .dockerignore matching.

Rendering needs `kubectl kustomize` or `kustomize build`. The first that works wins:
  1. DEPLOYMENT_KUBECTL=<path to kubectl or kustomize>;
  2. `kubectl` or `kustomize` on PATH;
  3. the kubectl that `make test-tools` unpacks into .cache/tools/bin (tests/tools.py).
Nothing is installed from here: without a renderer the tests that need one skip and say so.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TOOLS_DIR = REPO / ".cache" / "tools" / "bin"


@dataclass(frozen=True, slots=True)
class Renderer:
    argv: tuple[str, ...]  # e.g. ("kubectl", "kustomize") or ("kustomize", "build")
    origin: str  # where the tool came from, for the test report

    @property
    def tool(self) -> str:
        return self.argv[0]

    def render(self, directory: Path) -> list[dict]:
        """The objects `kustomize build --load-restrictor LoadRestrictionsNone directory` renders."""
        result = subprocess.run(
            [*self.argv, "--load-restrictor", "LoadRestrictionsNone", str(directory)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise AssertionError(f"rendering {directory} failed: {result.stderr.strip()}")
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class ToolUnavailable(Exception):
    """No kustomize renderer could be found or fetched; str() says why."""


def _argv_for(binary: str) -> tuple[str, ...]:
    return (binary, "build") if Path(binary).name.startswith("kustomize") else (binary, "kustomize")


def _works(argv: tuple[str, ...]) -> bool:
    """The tool runs and renders (a kubectl wrapper may exist but not work offline)."""
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "kustomization.yaml").write_text("resources: []\n")
        try:
            result = subprocess.run([*argv, scratch], capture_output=True, timeout=60, check=False)
        except OSError:
            return False
    return result.returncode == 0


def find_renderer() -> Renderer:
    """The first working kustomize renderer (see the module docstring); ToolUnavailable if none."""
    choice = os.environ.get("DEPLOYMENT_KUBECTL", "")
    if choice:
        argv = _argv_for(choice)
        if not _works(argv):
            raise ToolUnavailable(f"DEPLOYMENT_KUBECTL={choice} does not render a kustomization")
        return Renderer(argv, f"DEPLOYMENT_KUBECTL={choice}")
    for name in ("kubectl", "kustomize"):
        found = shutil.which(name)
        if found and _works(_argv_for(found)):
            return Renderer(_argv_for(found), f"{found} (on PATH)")
    cached = TOOLS_DIR / "kubectl"
    if cached.is_file() and _works(_argv_for(str(cached))):
        return Renderer(_argv_for(str(cached)), f"{cached} (installed by make test-tools)")
    raise ToolUnavailable("neither kubectl nor kustomize found: run `make test-tools`")


# --- rendered manifests -------------------------------------------------------------------------


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def only(docs: list[dict], kind: str) -> dict:
    (found,) = objects(docs, kind)
    return found


def server(docs: list[dict]) -> tuple[dict, dict]:
    """(pod spec, container `server`) of the one Deployment."""
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "server"]
    return pod, container


def env_values(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "<from a secret>") for e in container.get("env", [])}


def mounts(pod: dict, container: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def mounted_from(path: str, table: dict[str, dict]) -> dict | None:
    matches = [mp for mp in table if path == mp or path.startswith(mp.rstrip("/") + "/")]
    return table[max(matches, key=len)] if matches else None


def quantity(value: str | int) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    text = str(value)
    for suffix, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


# --- Dockerfile ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the logical line, continuations joined
    line: int

    def words(self) -> list[str]:
        """Exec (JSON) form as its list, else the shell-like words."""
        if self.args.startswith("["):
            return list(json.loads(self.args))
        return shlex.split(self.args, posix=True)


@dataclass(slots=True)
class Stage:
    name: str
    base: str  # the FROM image or stage, ARGs not substituted
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass(slots=True)
class Dockerfile:
    global_args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: dict[str, Stage]  # in order


def parse_dockerfile(text: str) -> Dockerfile:
    """Logical instructions of a Dockerfile (comments dropped, backslash continuations joined)."""
    instructions: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are skipped by Docker too
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        logical = (buffer + stripped).strip()
        buffer = ""
        keyword, _, args = logical.partition(" ")
        instructions.append(Instruction(keyword.upper(), " ".join(args.split()), start))
    if buffer:
        raise ValueError("Dockerfile ends inside a continued line")
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, words[0])
        elif current is None:
            if ins.keyword != "ARG":
                raise ValueError(f"line {ins.line}: {ins.keyword} before the first FROM")
            key, _, default = ins.args.partition("=")
            global_args[key] = default
        else:
            current.instructions.append(ins)
    return Dockerfile(global_args, stages)


def substitute(value: str, variables: dict[str, str]) -> str:
    """${NAME} / $NAME replaced from `variables` (unknown names left as they are)."""
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: variables.get(m.group(1) or m.group(2), m.group(0)),
        value,
    )


def env_of(stage: Stage) -> dict[str, str]:
    """The ENV KEY=VALUE pairs a stage sets (the KEY VALUE form is not used in Dockerfile.ubi)."""
    env: dict[str, str] = {}
    for ins in stage.all("ENV"):
        for word in ins.words():
            key, sep, value = word.partition("=")
            if not sep:
                raise ValueError(f"line {ins.line}: use ENV KEY=VALUE")
            env[key] = value
    return env


# --- .dockerignore ------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"(?:/.*)?")  # a matched directory excludes everything under it


def dockerignore_excludes(rules: str, path: str) -> bool:
    """Whether the build context leaves `path` (relative, `/`-separated) out: the last matching
    rule wins, `!` rules include again (Docker's semantics, directory patterns included)."""
    excluded = False
    for raw in rules.splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = os.path.normpath(rule.lstrip("!").strip()).lstrip("/")
        if _pattern_regex(pattern).fullmatch(path.rstrip("/")):
            excluded = not negate
    return excluded
