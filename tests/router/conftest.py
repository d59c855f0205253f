"""Router test fixtures: the tiny models' tokenizer, loaded the way the router loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.core.tokenizer import TokenizerPool, load_tokenizer
from tests.router.harness import make_harness  # noqa: F401 (a fixture: the batcher over a fake shard)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out, ARCHITECTURES["llama"])
    return out


@pytest.fixture(scope="session")
def detokenizer(tokenizer_dir: Path):
    from router.core.detokenizer import Detokenizer

    return Detokenizer(load_tokenizer(str(tokenizer_dir)))


@pytest.fixture
def tokenizer_pool(tokenizer_dir: Path):
    pool = TokenizerPool(load_tokenizer(str(tokenizer_dir)), workers=1)
    yield pool
    pool.close()
