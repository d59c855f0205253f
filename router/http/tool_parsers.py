"""Tool calls in a model's own format, read from its free text: what `tool_choice: "auto"` needs.

Each model family writes calls its own way; TOOL_CALL_PARSER names the served model's (vLLM's
names for the same formats):
  - `hermes` (Hermes 2/3, Qwen 2/2.5/3 and others): `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` blocks anywhere in the answer, one per call; the text around them is the
    message's content;
  - `llama3_json` (Llama 3.1/3.2/3.3): the whole answer is one or more `{"name": ...,
    "parameters": {...}}` objects (separated by `;`), after an optional `<|python_tag|>`;
  - `pythonic` (Llama 3.2 and 4 with their pythonic templates, and others): the whole answer is a
    Python list of calls with keyword arguments, `[get_weather(city="Oslo"), now()]`, read with
    `ast` (parsed, never run; only literal values);
  - `granite` (IBM Granite 3.0 to 3.3): the whole answer is a JSON list of `{"name": ...,
    "arguments": {...}}` objects, after an optional `<|tool_call|>` (3.0) or `<tool_call>` (3.1+);
  - `granite-20b-fc` (Granite 20B function calling): `<function_call> {"name": ..., "arguments":
    {...}}` per call, the text before the first one the message's content;
  - `mistral` (Mistral, Mixtral, Ministral, Magistral, Devstral): `[TOOL_CALLS]` (a special token,
    so answers of a request that may call keep their special tokens) then a JSON list of calls
    (tokenizers before v11), or `name{...}` / `name[ARGS]{...}` per `[TOOL_CALLS]` (v11 and
    later); the text before the first is the message's content;
  - `qwen3_coder` (Qwen3-Coder and later Qwen models): XML, `<tool_call><function=name>
    <parameter=key>value</parameter>...</function></tool_call>` per call after the text; each
    value is text, read as the type the function's JSON Schema gives the parameter (integer,
    number, boolean, null, object, array; a string or an unknown parameter stays text), so this
    parser is bound to the request's functions (`for_tools`);
  - `glm45` (GLM-4.5 to 4.7; also `glm47`): `<tool_call>name<arg_key>key</arg_key><arg_value>value
    </arg_value>...</tool_call>` per call after the text, values read as `qwen3_coder`'s; a
    special token, so answers that may call keep their special tokens.
`llama4_json` and `llama4_pythonic` are vLLM's other names for `llama3_json` and `pythonic`.
An answer whose calls do not parse is the message's text, as if it had none. While streaming,
`streamable` says how much of the answer so far is text for sure: the rest is held back until
the answer ends (then its calls come in one chunk, or the held text).
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def function_call(name: str, arguments: str) -> dict[str, Any]:
    """One of OpenAI's message.tool_calls: a call of `name` with `arguments` (JSON text)."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Parsed:
    """An answer with calls: the text outside them (as written), and OpenAI's tool_calls."""

    content: str
    calls: list[dict[str, Any]]


class ToolCallParser(ABC):
    name: str
    # the format's markers are special tokens: the answer keeps its special tokens when the
    # request may call (unless it sets skip_special_tokens itself)
    needs_special_tokens = False

    @abstractmethod
    def parse(self, text: str) -> Parsed | None:
        """The calls in a whole answer; None when it has none (or they do not parse)."""

    @abstractmethod
    def streamable(self, text: str) -> int:
        """How many characters of the answer so far are text whatever comes next."""

    def for_tools(self, schemas: Mapping[str, Any]) -> ToolCallParser:
        """The parser for a request whose functions take `schemas` (name -> JSON Schema of the
        parameters): itself, unless its format needs them to read values."""
        return self


def _call_of(value: Any, arguments_key: str) -> dict[str, Any] | None:
    """OpenAI's tool call for one decoded call object; None where it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return function_call(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _text_before(text: str, marker: str) -> int:
    """`streamable` of a format whose calls follow text, each after `marker`: the text before the
    first marker, or before an end that may become one."""
    at = text.find(marker)
    return at if at >= 0 else len(text) - held_prefix(text, marker)


def _object_calls(blocks: list[str], *, whole: bool) -> list[dict[str, Any]] | None:
    """One call object ({"name", "arguments"}) per block: all of it (`whole`), or the JSON value
    it begins with; None where a block holds none."""
    decoder = json.JSONDecoder()
    calls = []
    for block in blocks:
        try:
            value = json.loads(block) if whole else decoder.raw_decode(block.lstrip())[0]
        except ValueError:
            return None
        call = _call_of(value, "arguments")
        if call is None:
            return None
        calls.append(call)
    return calls


def _json_calls(text: str) -> list[dict[str, Any]] | None:
    """A JSON list of call objects ({"name", "arguments"}); None where `text` is not one."""
    try:
        values = json.loads(text)
    except ValueError:
        return None
    if not isinstance(values, list) or not values:
        return None
    calls = [_call_of(value, "arguments") for value in values]
    return None if any(call is None for call in calls) else [c for c in calls if c is not None]


def _held_whole(text: str, starts: tuple[str, ...]) -> int:
    """`streamable` of a format whose calls are the whole answer, beginning with one of `starts`
    (markers, or a bracket): all of it waits while it begins so, or may still."""
    start = text.lstrip()
    if not start or any(s.startswith(start[: len(s)]) for s in starts):
        return 0
    return len(text)


class Hermes(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed | None:
        blocks = list(self.BLOCK.finditer(text))
        calls = _object_calls([block.group(1) for block in blocks], whole=True)
        return Parsed(self.BLOCK.sub("", text), calls) if calls else None

    def streamable(self, text: str) -> int:
        return _text_before(text, self.OPEN)


class Llama3Json(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed | None:
        rest = text.strip()
        rest = rest.removeprefix(self.TAG).lstrip()
        if not rest.startswith("{"):
            return None
        decoder = json.JSONDecoder()
        calls = []
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            call = _call_of(value, "parameters" if "parameters" in value else "arguments")
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        return Parsed("", calls)

    def streamable(self, text: str) -> int:
        return _held_whole(text, (self.TAG, "{"))


class Pythonic(ToolCallParser):
    name = "pythonic"

    def parse(self, text: str) -> Parsed | None:
        source = text.strip()
        if not (source.startswith("[") and source.endswith("]")):
            return None
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
                return None
            try:
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
                calls.append(function_call(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):  # not literals, or not JSON
                return None
        return Parsed("", calls)

    def streamable(self, text: str) -> int:
        return _held_whole(text, ("[",))


class Granite(ToolCallParser):
    name = "granite"
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def parse(self, text: str) -> Parsed | None:
        rest = text.strip()
        for marker in self.MARKERS:
            rest = rest.removeprefix(marker).lstrip()
        if not rest.startswith("["):
            return None
        calls = _json_calls(rest)
        return Parsed("", calls) if calls is not None else None

    def streamable(self, text: str) -> int:
        return _held_whole(text, (*self.MARKERS, "["))


class Granite20bFc(ToolCallParser):
    name = "granite-20b-fc"
    OPEN = "<function_call>"

    def parse(self, text: str) -> Parsed | None:
        content, *blocks = text.split(self.OPEN)
        calls = _object_calls(blocks, whole=False)
        return Parsed(content, calls) if calls else None

    def streamable(self, text: str) -> int:
        return _text_before(text, self.OPEN)


class Mistral(ToolCallParser):
    name = "mistral"
    needs_special_tokens = True
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> Parsed | None:
        content, *blocks = text.split(self.OPEN)
        if not blocks:
            return None
        decoder = json.JSONDecoder()
        calls: list[dict[str, Any]] = []
        for block in blocks:
            block = block.strip()
            if block.startswith("["):  # tokenizers before v11: one JSON list of calls
                listed = _json_calls(block)
                if listed is None:
                    return None
                calls += listed
                continue
            name, args, rest = block.partition(self.ARGS)
            if not args:  # `name{...}`
                brace = block.find("{")
                name, rest = (block[:brace], block[brace:]) if brace >= 0 else (block, "")
            try:
                arguments, _ = decoder.raw_decode(rest.lstrip())
            except ValueError:
                return None
            call = _call_of({"name": name.strip(), "arguments": arguments}, "arguments")
            if call is None or not name.strip():
                return None
            calls.append(call)
        return Parsed(content, calls)

    def streamable(self, text: str) -> int:
        return _text_before(text, self.OPEN)


class _TextValues(ToolCallParser):
    """A format whose argument values are text: each is read as the type the request's function
    schema gives its parameter (so the parser is bound to the request's functions)."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self.schemas = schemas or {}

    def for_tools(self, schemas: Mapping[str, Any]) -> ToolCallParser:
        return type(self)(schemas)

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """OpenAI's call of `name` with the (parameter, text) pairs as typed arguments."""
        schema = self.schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        arguments = {
            key.strip(): _typed(_trimmed(value), properties.get(key.strip())) for key, value in pairs
        }
        return function_call(name, json.dumps(arguments, ensure_ascii=False))


class Qwen3Coder(_TextValues):
    name = "qwen3_coder"
    OPEN, BARE = "<tool_call>", "<function="
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed | None:
        at = text.find(self.OPEN)
        if at < 0:
            at = text.find(self.BARE)  # the opening left out, as the model sometimes does
        if at < 0:
            return None
        calls = [
            self._call(function.group(1).strip(), self.PARAMETER.findall(function.group(2)))
            for function in self.FUNCTION.finditer(text, at)
        ]
        return Parsed(text[:at], calls) if calls else None

    def streamable(self, text: str) -> int:
        return min(_text_before(text, self.OPEN), _text_before(text, self.BARE))


class Glm45(_TextValues):
    """GLM-4.5 to 4.7: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`
    (line breaks between the parts or not); `<tool_call>` is a special token."""

    name = "glm45"
    needs_special_tokens = True
    OPEN = "<tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
    ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed | None:
        at = text.find(self.OPEN)
        if at < 0:
            return None
        calls = []
        for call in self.CALL.finditer(text, at):
            body = call.group(1)
            name = body.split("<arg_key>", 1)[0].strip()
            if not name or "\n" in name:
                return None
            calls.append(self._call(name, self.ARGUMENT.findall(body)))
        return Parsed(text[:at], calls) if calls else None

    def streamable(self, text: str) -> int:
        return _text_before(text, self.OPEN)


def _trimmed(value: str) -> str:
    """A parameter's value as written between its tags, less one line break on each side."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type makes it: text where the schema is
    missing or says string, or the text is not of its type."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    kinds = declared if isinstance(declared, list) else [declared]
    word = value.strip()
    if word.lower() == "null" and "string" not in kinds:
        return None
    for kind in kinds:
        if kind in ("string", None):
            return value
        try:
            if kind == "integer":
                return int(word)
            if kind == "number":
                number = int(word) if word.lstrip("-").isdigit() else float(word)
                if math.isfinite(number):  # JSON has no NaN or infinities
                    return number
            if kind == "boolean" and word.lower() in ("true", "false"):
                return word.lower() == "true"
            if kind in ("object", "array"):
                return json.loads(word)
        except ValueError:
            continue
    return value


PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (Hermes, Llama3Json, Pythonic, Granite, Granite20bFc, Mistral, Qwen3Coder, Glm45)
}
# vLLM's other names for the same formats
PARSERS |= {"llama4_json": Llama3Json, "llama4_pythonic": Pythonic, "glm47": Glm45}


def parser_named(name: str | None) -> ToolCallParser | None:
    """The parser TOOL_CALL_PARSER names (None: none); ValueError for an unknown name."""
    if not name:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
