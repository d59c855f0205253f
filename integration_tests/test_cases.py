"""Replays the YAML cases against the real launcher (unary and streamed, concurrently)."""

from __future__ import annotations

import asyncio

import pytest

from integration_tests.cases import CASES_DIR, Case, Outcome, check, load, run_file
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK
from text_generation_common.engines import ENGINES

# (case file, server: model or model@engine); the other engines replay the decoder-only cases
RUNS = [
    ("llama.yaml", "llama"),
    ("llama_sp.yaml", "llama-sp"),
    ("t5.yaml", "t5"),
    ("llama.yaml", "llama@tgis_native"),
    ("llama.yaml", "llama@hf_optimum_ort"),
]
_results: dict[tuple[str, str], dict[tuple[str, str], Outcome]] = {}


def _outcomes(file: str, name: str, server) -> dict[tuple[str, str], Outcome]:
    if (file, name) not in _results:
        s = server(name)

        async def run() -> dict[tuple[str, str], Outcome]:
            return await run_file(s.aio_stub(), load(CASES_DIR / file), seq2seq=name == "t5")

        _results[(file, name)] = asyncio.run(run())
    return _results[(file, name)]


def _served(case: Case, name: str) -> bool:
    """Cases naming a soft prompt or adapter replay only on engines that take them."""
    engine = name.partition("@")[2] or DEFAULT_DEPLOYMENT_FRAMEWORK
    names_adapter = "prefixId" in case.request or "adapterId" in case.request
    return ENGINES[engine].capabilities.prompt_tuning or not names_adapter


def _params() -> list:
    params = []
    for file, name in RUNS:
        where = file if "@" not in name else f"{file}@{name.partition('@')[2]}"
        for case in load(CASES_DIR / file):
            if not _served(case, name):
                continue
            params.append(pytest.param(file, name, case, "unary", id=f"{where}:{case.name}:unary"))
            if case.single and case.stream:
                params.append(pytest.param(file, name, case, "stream", id=f"{where}:{case.name}:stream"))
    return params


@pytest.mark.parametrize(("file", "name", "case", "mode"), _params())
def test_case(server, file, name, case, mode) -> None:
    outcome = _outcomes(file, name, server)[(case.name, mode)]
    problems = check(case, outcome)
    assert not problems, "\n".join(problems)
