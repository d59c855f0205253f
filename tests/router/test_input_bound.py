"""The token-count lower bound: never above the real count, and absent where it cannot hold."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from router.core.input_bound import max_token_bytes, min_tokens
from router.core.tokenizer import load_tokenizer
from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

ALPHABET = ["a", "b", "z", " ", "  ", "\n", "\t", "é", "€", "😀", "<s>", "</s>", "hello", "def ", "0", "9"]


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer_json(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param)
    write_tokenizer(out, ARCHITECTURES["gpt2"], kind=request.param)
    return (Path(out) / "tokenizer.json").read_text()


def test_the_bound_never_exceeds_the_token_count(tokenizer_json: str) -> None:
    tokenizer = Tokenizer.from_str(tokenizer_json)
    per_token = max_token_bytes(tokenizer)
    assert per_token is not None
    rng = random.Random(1234)
    tight = 0
    for _ in range(2000):
        if rng.random() < 0.2:  # long runs of one piece are where tokens are longest
            text = rng.choice(ALPHABET) * rng.randint(1, 400)
        else:
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 200)))
        count = len(tokenizer.encode(text).ids)
        bound = min_tokens(text, per_token)
        assert count >= bound, (text, count, bound)
        tight += count == bound and bound > 0
    assert tight  # and it is not vacuous: some inputs reach it


def _changed(tokenizer_json: str, change) -> Tokenizer:
    spec = json.loads(tokenizer_json)
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _set(path: tuple[str, ...], value):
    def change(spec):
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _strip_added(spec) -> None:
    spec["added_tokens"][0]["lstrip"] = True


SPLIT_REMOVING = {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}
UNBOUNDED = {
    "lowercase": _set(("normalizer",), {"type": "Lowercase"}),  # may shrink text
    "nfkc": _set(("normalizer",), {"type": "NFKC"}),
    "whitespace-split": _set(("pre_tokenizer",), {"type": "WhitespaceSplit"}),  # deletes whitespace
    "split-removed": _set(("pre_tokenizer",), SPLIT_REMOVING),
    "lstrip-added-token": _strip_added,  # swallows the whitespace beside it
}


@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_no_bound_where_tokens_need_not_tile_the_text(tokenizer_json: str, name: str) -> None:
    assert max_token_bytes(_changed(tokenizer_json, UNBOUNDED[name])) is None


def test_no_bound_without_byte_coverage(tokenizer_json: str) -> None:
    """Without byte-level pieces or byte fallback, unknown characters fold into <unk>."""
    if '"ByteLevel"' in tokenizer_json:
        unbounded = _set(
            ("pre_tokenizer",), {"type": "Metaspace", "replacement": "_", "prepend_scheme": "never"}
        )
    else:
        unbounded = _set(("model", "byte_fallback"), False)
    assert max_token_bytes(_changed(tokenizer_json, unbounded)) is None


def test_other_models_have_no_bound(tmp_path) -> None:
    from tokenizers import models

    assert max_token_bytes(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    assert max_token_bytes(Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None


def test_the_router_tokenizers_of_the_tests_are_bounded(tokenizer_dir) -> None:
    """The bound is the longest piece of the vocabulary (added tokens included), in UTF-8 bytes
    of its text, and no token of any text covers more bytes than that."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    bound = max_token_bytes(tokenizer)
    pieces = tokenizer.get_vocab(with_added_tokens=True)
    assert bound == max(len(piece.encode()) for piece in pieces)
    text = "".join(chr(c) for c in range(32, 0x2FF)) * 3 + "naïve 東京 🙂 " * 20
    encoding = tokenizer.encode(text, add_special_tokens=False)
    assert max(len(text[a:b].encode()) for a, b in encoding.offsets) <= bound
