"""Replays the YAML cases against the real launcher (unary and streamed, concurrently)."""

from __future__ import annotations

import asyncio

import pytest

from integration_tests.cases import CASES_DIR, Outcome, check, load, run_file

# case file -> server model
FILES = {"llama.yaml": "llama", "llama_sp.yaml": "llama-sp", "t5.yaml": "t5"}
_results: dict[str, dict[tuple[str, str], Outcome]] = {}


def _outcomes(file: str, server) -> dict[tuple[str, str], Outcome]:
    if file not in _results:
        s = server(FILES[file])

        async def run() -> dict[tuple[str, str], Outcome]:
            return await run_file(s.aio_stub(), load(CASES_DIR / file), seq2seq=FILES[file] == "t5")

        _results[file] = asyncio.run(run())
    return _results[file]


def _params() -> list:
    params = []
    for file in FILES:
        for case in load(CASES_DIR / file):
            params.append(pytest.param(file, case, "unary", id=f"{file}:{case.name}:unary"))
            if case.single and case.stream:
                params.append(pytest.param(file, case, "stream", id=f"{file}:{case.name}:stream"))
    return params


@pytest.mark.parametrize(("file", "case", "mode"), _params())
def test_case(server, file, case, mode) -> None:
    outcome = _outcomes(file, server)[(case.name, mode)]
    problems = check(case, outcome)
    assert not problems, "\n".join(problems)
