"""Fill a case file's expectations from a live server (for writing new cases; review the diff).

    python -m integration_tests.record llama.yaml

Starts the file's server, sends every case's request once, and rewrites the file with each
case's `response` or `error` as answered. Expectations must then be checked by hand against
TGIS's rules (tgis-api.md) before they are committed: recording makes the data, not the truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import tempfile
from pathlib import Path

from integration_tests.cases import CASES_DIR, dump, load, run_unary
from integration_tests.servers import launch
from integration_tests.test_cases import RUNS

FILES = {file: name for file, name in RUNS if "@" not in name}  # each file's own server

logger = logging.getLogger(__name__)


def record(file: str) -> None:
    cases = load(CASES_DIR / file)
    with tempfile.TemporaryDirectory() as tmp:
        server = launch(FILES[file], Path(tmp))
        try:

            async def run_all() -> list:
                stub = server.aio_stub()
                return [await run_unary(stub, c) for c in cases]

            outcomes = asyncio.run(run_all())
        finally:
            server.stop()
    out = []
    for case, outcome in zip(cases, outcomes, strict=True):
        item = {k: v for k, v in dataclasses.asdict(case).items() if k not in ("response", "error")}
        item = {
            k: v for k, v in item.items() if v != getattr(type(case), k, None) or k in ("name", "request")
        }
        if outcome.error is not None:
            item["error"] = outcome.error
        else:
            item["response"] = outcome.response
        out.append(item)
    (CASES_DIR / file).write_text(dump(out))
    logger.info("recorded %d cases into %s", len(out), file)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in sys.argv[1:]:
        record(name)
