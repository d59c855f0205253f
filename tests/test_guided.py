"""Guided decoding in the shard against what each constraint means: with the tiny random models
(whose free output is gibberish) every output parses / matches / is one of the choices, greedy
and sampled, alone and in batches mixed with free requests and joins (a constrained request
gives the same tokens either way), on hf_transformers and tgis_native (with chunked prefill);
100 seeded samples of a nested schema all validate; bad constraints fail alone with one line."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from tests.engines.conformance import Runner, alone
from text_generation_common import guided as guided_module
from text_generation_common.guided import Grammars, GuidedError
from text_generation_common.messages import (
    GenerationRequest,
    Guided,
    GuidedKind,
    SamplingParams,
    ThinkingMarks,
)
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ("yes", "no", "maybe")
GRAMMAR = 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/'
GUIDED = {
    "json_schema": Guided(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    "regex": Guided(GuidedKind.REGEX, REGEX),
    "choice": Guided(GuidedKind.CHOICE, choices=CHOICES),
    "grammar": Guided(GuidedKind.GRAMMAR, GRAMMAR),
    "json": Guided(GuidedKind.JSON),
}
MAX_NEW = 64


def engine(name: str, model_dir: Path):
    config = ServerConfig(
        model_name=str(model_dir),
        deployment_framework=name,
        max_batch_size=16,
        max_sequence_length=256,
        max_new_tokens=96,
        dtype="float32",
    )
    return get_engine_class(name)(config)


def text_of(tokenizer: Tokenizer, ids: list[int], eos: int) -> tuple[str, bool]:
    """(decoded text without EOS, whether the generation ended with EOS)."""
    ended = bool(ids) and ids[-1] == eos
    return tokenizer.decode(ids[:-1] if ended else ids), ended


def satisfies(kind: str, text: str, ended: bool, grammars: Grammars, ids: list[int]) -> bool:
    """What the constraint means, checked by other code than the one that enforced it."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return ended
    if kind == "regex":
        return ended and re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return ended and text in CHOICES
    if kind == "grammar":
        return ended and re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text) is not None
    if ended:  # any JSON object; a generation cut by max_new_tokens is a valid prefix of one
        return isinstance(json.loads(text), dict)
    matcher = grammars.matcher(GUIDED["json"])
    return text.startswith("{") and matcher.consume_tokens(ids) and not matcher.is_error()


@pytest.mark.parametrize("name", ["hf_transformers", "tgis_native"])
def test_every_kind_holds_alone_and_mixed_greedy_and_sampled(name: str, tiny_model) -> None:
    model_dir = tiny_model("llama")
    e = engine(name, model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = e.info.eos_token_id
    prompt = tuple(tokenizer.encode("Hello world, here is the answer:").ids)
    requests, kinds = [], {}
    for kind, guided in GUIDED.items():
        for sampled in (False, True):
            params = SamplingParams(
                guided=guided, temperature=1.0 if sampled else 0.0, seed=7 if sampled else None
            )
            requests.append(GenerationRequest(len(requests), prompt, MAX_NEW, params=params))
            kinds[requests[-1].id] = kind
    free = [GenerationRequest(100 + i, prompt[i:], 12) for i in range(3)]
    out = {r.id: alone(e, r) for r in [*requests, *free]}
    grammars = e.context.grammars if hasattr(e, "context") else e.limits.grammars
    for request in requests:
        text, ended = text_of(tokenizer, out[request.id], eos)
        assert satisfies(kinds[request.id], text, ended, grammars, out[request.id]), (kinds[request.id], text)
    free_text = [text_of(tokenizer, out[r.id], eos)[0] for r in free]
    assert not any(re.fullmatch(REGEX, t) for t in free_text)  # the constraint is what made it hold
    mixed = [*requests[:4], *free, *requests[4:]]
    assert Runner(e).run({0: mixed[:6], 2: mixed[6:]}) == out
    # resumed after 3 tokens (preempted): each grammar has read them, the rest is the same
    resumed = [replace(r, generated_ids=tuple(out[r.id][:3])) for r in requests if len(out[r.id]) > 3]
    assert resumed and Runner(e).run({0: resumed}) == {r.id: out[r.id][3:] for r in resumed}
    if name == "tgis_native":  # prompts computed over several steps
        assert Runner(e, token_budget=5).run({0: mixed}) == out
        # pipelined steps (a GPU's default): free rows run launched ahead until constrained rows
        # join beside a step in flight; from then on the batch steps without (launch refuses it)
        e.pipelined = True
        assert Runner(e, token_budget=5).run({0: free, 2: requests}) == out
        e.pipelined = False


def test_a_hundred_seeded_samples_of_a_nested_schema_validate(tiny_model) -> None:
    model_dir = tiny_model("llama")
    e = engine("hf_transformers", model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tuple(tokenizer.encode("JSON:").ids)
    guided = GUIDED["json_schema"]
    requests = [
        GenerationRequest(i, prompt, 90, params=SamplingParams(guided=guided, temperature=1.0, seed=1000 + i))
        for i in range(100)
    ]
    out: dict[int, list[int]] = {}
    for start in range(0, len(requests), 16):  # batches of 16, the second row of each joining late
        wave = requests[start : start + 16]
        out |= Runner(e).run({0: wave[:1], 1: wave[1:]})
    for ids in out.values():
        text, ended = text_of(tokenizer, ids, e.info.eos_token_id)
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({tuple(ids) for ids in out.values()}) > 50  # sampled: not one answer repeated


OPENED = ThinkingMarks(True, ("<think>",), ("</think>",))  # deepseek_r1's: the prompt opens the thinking
ANSWER_OPENS = ThinkingMarks(False, ("<think>",), ("</think>",))  # qwen3's: the answer may open it


@pytest.mark.parametrize("kind", sorted(GUIDED))
def test_a_constraint_after_thinking_leaves_the_thinking_free_and_holds_the_answer(
    kind: str, tiny_model
) -> None:
    """A reasoning model's answer is constrained after its thinking (as vLLM applies structured
    outputs with a reasoning parser): the thinking is free text up to its closing marker, the
    answer after it satisfies the constraint. Generated on a request resumed after it thought and
    closed (the tiny model never closes on its own); matched for an answer that may open its
    thinking or answer at once."""
    model_dir = tiny_model("llama")
    e = engine("tgis_native", model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = e.info.eos_token_id
    thought = tuple(tokenizer.encode("free words, no rules</think>", add_special_tokens=False).ids)
    prompt = tuple(tokenizer.encode("Hello world, here is the answer:").ids)
    after = replace(GUIDED[kind], after_thinking=OPENED)
    resumed = GenerationRequest(1, prompt, 90, params=SamplingParams(guided=after), generated_ids=thought)
    answer = alone(e, resumed)
    assert satisfies(kind, *text_of(tokenizer, answer, eos), e.context.grammars, answer), kind
    grammars = e.context.grammars
    assert grammars is not None
    valid = VALID_ANSWERS[kind]
    opens = replace(after, after_thinking=ANSWER_OPENS)

    def accepted(guided: Guided, text: str) -> bool:
        matcher = grammars.matcher(guided)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()

    assert not accepted(after, f"any words{valid}")  # thinking until it closes
    assert accepted(after, f"any words</think>{valid}") and not accepted(after, "any words</think>x")
    assert accepted(opens, valid) and accepted(opens, f"<think>free</think>{valid}")  # opened or not
    assert not accepted(opens, "x") and not accepted(opens, "<think>free</think>x")


VALID_ANSWERS = {  # one answer of each constraint, as the compact JSON layout writes it
    "json_schema": '{"name": "a", "age": 1, "role": "user", "address": {"zip": "12345"}}',
    "regex": "123-4567",
    "choice": "maybe",
    "grammar": "1+22",
    "json": '{"a": [1]}',
}


def test_min_new_tokens_gives_way_to_a_completed_grammar(tiny_model) -> None:
    e = engine("hf_transformers", tiny_model("llama"))
    params = SamplingParams(guided=GUIDED["choice"], min_new_tokens=10)
    ids = alone(e, GenerationRequest(1, (5, 6, 7), 20, params=params))
    assert ids[-1] == e.info.eos_token_id and len(ids) < 10


@pytest.mark.parametrize(
    ("guided", "reason"),
    [
        (Guided(GuidedKind.REGEX, "(abc"), "invalid regex"),
        (Guided(GuidedKind.JSON_SCHEMA, "{not json"), "json_schema is not valid JSON"),
        (Guided(GuidedKind.JSON_SCHEMA, '{"type": "strin"}'), "Invalid type: strin"),
        (Guided(GuidedKind.GRAMMAR, "root ::= foo"), "Rule 'foo' not found"),
        (Guided(GuidedKind.CHOICE), "choice needs at least one string"),
        (Guided(GuidedKind.REGEX, "|".join(f"w{i}" for i in range(20000))), "more than the 65536 allowed"),
        (Guided(GuidedKind.REGEX, "(a{1000}){1000}"), "too complex: its first token mask took"),
    ],
    ids=["regex", "not-json", "schema", "grammar", "no-choices", "huge", "too-complex"],
)
def test_bad_constraints_are_refused_with_the_reason(
    guided: Guided, reason: str, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    if reason.startswith("too complex"):
        # its first mask takes ~0.5 s on a 2-core Zen 4 EPYC, at the real limit: a tenth of that
        # keeps the case about the refusal on machines up to 10x faster
        monkeypatch.setattr(guided_module, "MAX_FIRST_MASK_S", 0.05)
    model_dir = tiny_model("llama")
    config = json.loads((model_dir / "config.json").read_text())
    grammars = Grammars(
        (model_dir / "tokenizer.json").read_text(), config["vocab_size"], config["eos_token_id"]
    )
    with pytest.raises(GuidedError, match=re.escape(reason)) as error:
        grammars.check(guided)
    assert "\n" not in str(error.value)


def test_a_bad_constraint_fails_its_request_alone_in_the_shard(tiny_model) -> None:
    e = engine("tgis_native", tiny_model("llama"))
    good = GenerationRequest(1, (5, 6, 7), 8, params=SamplingParams(guided=GUIDED["regex"]))
    bad = GenerationRequest(2, (5, 6, 7), 8, params=SamplingParams(guided=Guided(GuidedKind.REGEX, "(abc")))
    batch, errors = e.new_batch(1, [good, bad])
    assert batch is not None  # holding the good request
    assert [(x.request_id, x.message.split(":")[0]) for x in errors] == [
        (2, "invalid regex for guided decoding")
    ]
    e.release([good.id])  # the batch is dropped here, not by a BatchManager (which releases)
    tokenizer = Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))
    text, ended = text_of(tokenizer, alone(e, good), e.info.eos_token_id)
    assert ended and re.fullmatch(REGEX, text)


def test_a_tokenizer_llguidance_cannot_read_leaves_guided_decoding_off(tmp_path: Path, caplog) -> None:
    from text_generation_common.guided import grammars_of
    from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

    write_tokenizer(tmp_path, ARCHITECTURES["llama"], kind="wordpiece")
    assert grammars_of((tmp_path / "tokenizer.json").read_text(), 2000, 2) is None  # the server still starts
    assert "guided decoding is unavailable for this tokenizer: " in caplog.text
