"""The router's tokenizer pool: every Tokenize option gives what the tokenizer's full path gives."""

from __future__ import annotations

import pytest

from router.core.tokenizer import TokenizerPool, _byte_offsets, load_tokenizer
from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

TEXTS = ["A very long story:\n", "é€😀 <s>x</s> \x00", "", "   ", "def hello(world):\n    return 1"]


@pytest.fixture(scope="module", params=[("llama", "byte_level"), ("gpt2", "metaspace"), ("t5", "byte_level")])
def pool(request, tmp_path_factory):
    arch, kind = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{kind}")
    write_tokenizer(out, ARCHITECTURES[arch], kind=kind)
    pool = TokenizerPool(load_tokenizer(str(out)), workers=1)
    yield pool
    pool.close()


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_tokenize_options_match_the_full_encoding(pool: TokenizerPool, tokens: bool, offsets: bool) -> None:
    results = pool.tokenize_sync(TEXTS, tokens=tokens, offsets=offsets)
    for text, result in zip(TEXTS, results, strict=True):
        full = pool.tokenizer.encode(text, add_special_tokens=True)
        assert result.ids == full.ids
        assert result.tokens == (full.tokens if tokens else [])
        assert result.offsets == (_byte_offsets(text, full.offsets) if offsets else [])


def test_generation_ids_match_the_full_encoding(pool: TokenizerPool) -> None:
    assert pool.encode_batch_sync(TEXTS) == [pool.tokenizer.encode(t).ids for t in TEXTS]
