"""Guided decoding: a request's constraint (messages.Guided) as an llguidance grammar over the
model's tokenizer, checked by the router and matched token by token in the shard.

Why llguidance: it needs no other package (one Rust extension), takes every kind the doors
carry (JSON Schema, regex, choice, Lark and GBNF grammars), compiles lazily (a schema costs
microseconds to accept; token masks are computed as the generation goes, with its lexer and
Earley parser), and fills a batch's masks on its own threads without the GIL. Measured against
xgrammar 0.2.8 and outlines-core 0.2.14 on our tiny tokenizers (README, Guided decoding).

`Grammars` is built once per process from the model's tokenizer.json, the model's vocabulary
size (ids past the tokenizer's are never allowed) and its EOS id (allowed only where the
grammar accepts the text so far). `check` is the router's validation (run off the event loop:
a large schema can take milliseconds); `matcher` gives the shard a fresh matcher per request,
copied from a pristine one kept per (kind, spec) in an LRU of CACHE_SIZE entries.
What one constraint may cost is bounded three ways: its text (MAX_SPEC_BYTES), llguidance's
parser limits (grammar size, lexer states, work per token: its defaults), and the router's check
computing the first token mask once (a regex like `(a{1000}){1000}` compiles in a millisecond
and then needs seconds per mask): each refusal says why.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from text_generation_common.messages import Guided, GuidedKind, ThinkingMarks

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # pristine matchers kept, by (kind, spec)
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar (or all choices) longer than this is refused
MAX_FIRST_MASK_S = 0.5  # a constraint whose first token mask takes longer is refused as too complex

# the JSON kind (TGIS ResponseFormat.JSON, OpenAI json_object): a JSON object
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# JSON is written compact, ", " and ": " between items (no free whitespace): a model can no
# longer fill its token budget with spaces and newlines between the values
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


UNAVAILABLE = "guided decoding needs the model's tokenizer.json in a form it reads (see the log at start-up)"


class GuidedError(ValueError):
    """A constraint that cannot be used (the message is the library's reason, one line)."""


def _first_line(text: str) -> str:
    """The library's reason on one line: its first line, and the `error: ...` line of a regex
    parser's report (which follows a picture of the pattern)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()[:500]


def grammar_text(guided: Guided) -> str:
    """The llguidance grammar of a constraint (after a reasoning model's thinking, where it says
    so); GuidedError when it does not parse."""
    answer = _answer_grammar(guided)
    return answer if guided.after_thinking is None else after_thinking(answer, guided.after_thinking)


def after_thinking(answer: str, marks: ThinkingMarks) -> str:
    """The grammar of an output that thinks freely, then answers as `answer` (an llguidance
    grammar, of either form `grammar_from` gives) says: the thinking runs to the first closing
    marker, from the first token where the prompt opens it, else from an opening marker (an
    output without one answers at once), as vLLM applies a constraint after the reasoning."""
    try:
        parts = json.loads(answer)["grammars"]
    except ValueError:  # Lark text
        parts = [{"lark_grammar": answer}]
    ends = "|".join(re.escape(end).replace("/", "\\/") for end in marks.ends)
    thinking = f"think[stop=/{ends}/]: /(.|\\n)*/\n"
    if marks.opened_by_prompt:
        start = "start: think @answer\n"
    else:
        opening = " | ".join(json.dumps(s) for s in marks.starts)
        start = f"start: ({opening}) think @answer | @answer\n"
    grammars = [{"lark_grammar": start + thinking}, {**parts[0], "name": "answer"}, *parts[1:]]
    return json.dumps({"grammars": grammars})


def _answer_grammar(guided: Guided) -> str:
    import llguidance

    kind = guided.kind
    try:
        if kind in (GuidedKind.JSON, GuidedKind.JSON_SCHEMA):
            schema = ANY_JSON_OBJECT if kind is GuidedKind.JSON else _schema(guided.spec)
            return llguidance.grammar_from("json_schema", json.dumps({**schema, "x-guidance": JSON_LAYOUT}))
        if kind is GuidedKind.REGEX:
            return llguidance.grammar_from("regex", guided.spec)
        if kind is GuidedKind.CHOICE:
            if not guided.choices:
                raise GuidedError("choice needs at least one string")
            return llguidance.grammar_from("choice", json.dumps(list(guided.choices)))
        return llguidance.grammar_from("grammar", guided.spec)  # Lark, or GBNF converted
    except GuidedError:
        raise
    except Exception as exc:  # the library's reason, e.g. a GBNF rule that is not defined
        raise GuidedError(_first_line(str(exc))) from None


def schema_text(value: Any) -> str:
    """A JSON Schema given as an object (HTTP doors) or as its text (gRPC), as text."""
    return value if isinstance(value, str) else json.dumps(value)


def _schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GuidedError(f"json_schema is not valid JSON: {exc}") from None
    if isinstance(schema, bool):  # true: anything; false: nothing (refused by the compiler)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GuidedError("json_schema must be a JSON object")
    return schema


@dataclass(slots=True)
class _Compiled:
    """A constraint's pristine matcher, and the outcome of its first-mask check once run."""

    matcher: Any
    verdict: str | None = None  # "" passed, else the refusal; None: not checked yet


class Grammars:
    """Constraints over one model's tokenizer (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.limits = llguidance.LLParserLimits()
        self._pristine: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, guided: Guided) -> None:
        """Raise GuidedError unless `guided` compiles for this tokenizer and its first token
        mask is computed within MAX_FIRST_MASK_S (the router's check, and the shard's for
        clients of the internal protocol). The mask is computed once per cached constraint:
        later requests with it get the same verdict without the work."""
        import llguidance.numpy

        compiled = self._compiled(guided)
        if compiled.verdict is None:
            matcher = compiled.matcher.deep_copy()
            started = time.monotonic()
            mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            took = time.monotonic() - started
            if matcher.is_error():
                compiled.verdict = _first_line(matcher.get_error())
            elif took > MAX_FIRST_MASK_S:
                compiled.verdict = (
                    f"too complex: its first token mask took {took:.1f} s (the limit is {MAX_FIRST_MASK_S} s)"
                )
            else:
                compiled.verdict = ""
        if compiled.verdict:
            raise GuidedError(compiled.verdict)

    def matcher(self, guided: Guided) -> Any:
        """A fresh llguidance.LLMatcher for one request."""
        return self._compiled(guided).matcher.deep_copy()

    def _compiled(self, guided: Guided) -> _Compiled:
        import llguidance

        size = len(guided.spec.encode()) + sum(len(c.encode()) for c in guided.choices)
        if size > MAX_SPEC_BYTES:
            raise GuidedError(f"{size} bytes long, more than the {MAX_SPEC_BYTES} allowed")
        key = (guided.kind.value, guided.spec, guided.choices, guided.after_thinking)
        with self._lock:
            found = self._pristine.get(key)
            if found is not None:
                self._pristine.move_to_end(key)
                return found
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(guided), limits=self.limits, log_level=0)
        if matcher.is_error():
            raise GuidedError(_first_line(matcher.get_error()))
        compiled = _Compiled(matcher)
        with self._lock:
            self._pristine[key] = compiled
            while len(self._pristine) > CACHE_SIZE:
                self._pristine.popitem(last=False)
        return compiled


def grammars_for(model_dir: str | Path, vocab_size: int, eos_token_id: int) -> Grammars | None:
    """The constraints of the model in `model_dir` (its tokenizer.json), or None without one
    (requests that ask for guided decoding then fail with a clear line)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return grammars_of(path.read_text(encoding="utf-8"), vocab_size, eos_token_id)


def grammars_of(tokenizer_json: str, vocab_size: int, eos_token_id: int) -> Grammars | None:
    """Grammars over this tokenizer, or None (with a warning saying why) for a tokenizer
    llguidance cannot read (e.g. WordPiece decoders): the server runs, guided requests are
    refused with UNAVAILABLE's line."""
    try:
        return Grammars(tokenizer_json, vocab_size, eos_token_id)
    except Exception as exc:  # the library's reason, once at start-up
        logger.warning("guided decoding is unavailable for this tokenizer: %s", _first_line(str(exc)))
        return None
