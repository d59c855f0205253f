"""The settled canonical prefix of a JSON value being written, against json.dumps(json.loads(...))
on every prefix of hand-picked and generated texts."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from router.http.json_prefix import canonical

TEXTS = [
    '{"city":"Oslo","days":3}',
    '{ "a" : [ 1 , 2.50 , -0 , 1E2 , true , false , null ] ,\n\t"b" : { } , "c" : [ ] }',
    '{"esc": "q\\"b\\\\s\\/n\\nt\\tu\\u00e9\\u0001 emoji \\ud83d\\ude00 lone \\ud800x \\udc00"}',
    '{"raw": "é ü 日本 😀", "n": 12345678901234567890, "f": 1.0e-7}',
    '{"nested": {"deep": [[{"x": [{}]}]], "s": "}]{["}}',
    '[{"name": "f", "arguments": {"k": "v"}}, {"name": "g", "arguments": {}}]',
]


def canonical_form(raw: str) -> str:
    return json.dumps(json.loads(raw), ensure_ascii=False)


def check_every_prefix(raw: str, tail: str = "") -> None:
    whole = canonical_form(raw)
    before = ""
    for cut in range(len(raw) + 1):
        got = canonical(raw[:cut])
        assert whole.startswith(got.text), (raw[:cut], got.text, whole)
        assert got.text.startswith(before), "each prefix's text goes on from the last one's"
        before = got.text
        if got.end is not None:  # whole only once the value is
            assert got.text == whole and got.end == cut == len(raw)
    full = canonical(raw + tail)
    assert full.text == whole and full.end == len(raw)


@pytest.mark.parametrize("raw", TEXTS)
def test_each_prefix_settles_a_prefix_of_the_canonical_form(raw: str) -> None:
    check_every_prefix(raw, tail="  </tool_call> more")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        alphabet = 'ab "\\/\n\t\x01é日😀}{[],:'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
    if kind == "int":
        return rng.randrange(-(10**12), 10**12)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-9, 3.0e20, 1.5])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def written(value: Any, rng: random.Random) -> str:
    """`value` as a model might write it: any spacing, some strings with \\u escapes."""
    space = lambda: rng.choice(["", " ", "\n  "])  # noqa: E731
    if isinstance(value, dict):
        items = [f"{space()}{json.dumps(k)}{space()}:{space()}{written(v, rng)}" for k, v in value.items()]
        return "{" + ",".join(items) + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + written(v, rng) for v in value) + space() + "]"
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(40))
def test_generated_values_written_any_way(seed: int) -> None:
    rng = random.Random(seed)
    value = {"arguments": random_value(rng), "more": [random_value(rng)]}
    check_every_prefix(written(value, rng))


def test_what_is_not_json_settles_nothing_more_and_never_ends() -> None:
    assert canonical('{"a": tru }').end is None
    assert canonical('{"a": 1]').text == '{"a": 1' and canonical('{"a": 1]').end is None
    assert canonical("   ").text == "" and canonical("").end is None
    assert canonical('{"a": "\\uZZZZ"}').end is None
