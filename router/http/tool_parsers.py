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
    special token, so answers that may call keep their special tokens;
  - `deepseek_v3` (DeepSeek-V3, R1), `deepseek_v31` (DeepSeek-V3.1 and later), `kimi_k2` (Kimi
    K2): special-token markers after the text, around each call's name and JSON arguments.
`llama4_json`, `llama4_pythonic` and `qwen3_xml` are vLLM's other names for `llama3_json`,
`pythonic` and `qwen3_coder`.
An answer whose calls do not parse is the message's text, as if it had none. While streaming,
`streamable` says how much of the answer so far is text for sure, and `partial` which calls have
begun: each once its name is whole, with the settled start of its arguments as the whole answer
will have them (json_prefix.py; a value whose type is not surely a string, and a call that
writes its arguments as a JSON string, come whole), so a call's arguments stream as the model
writes them (`pythonic`'s one whole value at a time).
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

from router.http.json_prefix import canonical, skip_space


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def function_call(name: str, arguments: str) -> dict[str, Any]:
    """One of OpenAI's message.tool_calls: a call of `name` with `arguments` (JSON text)."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class PartialCall:
    """A call begun in an answer still being written: its name, and the start of its arguments
    that the whole answer's call will have (json_prefix.py)."""

    name: str
    arguments: str


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

    def partial(self, text: str) -> list[PartialCall]:
        """The calls begun in the answer so far whose names are whole, in order (none: the
        format's calls come whole, at the end)."""
        return []

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


def scan_call(
    text: str, at: int, keys: tuple[str, ...] = ("arguments",)
) -> tuple[PartialCall | None, int | None]:
    """The call object ({"name": ..., `keys[i]`: {...}}) that begins at `text[at:]` (whitespace
    first), as far as it is written: the call once its name is whole (arguments that are not a
    JSON object come whole, at the end), and where the object ends (None: not yet)."""
    at = skip_space(text, at)
    if not text.startswith("{", at):
        return None, None
    at += 1
    name: Any = None
    arguments = ""
    found = False  # an arguments key was read
    while (at := skip_space(text, at)) < len(text):
        if text[at] in ",}":
            if text[at] == "}":
                return (PartialCall(name, arguments) if isinstance(name, str) else None), at + 1
            at += 1
            continue
        key = canonical(text, at)
        if key.end is None or not key.text.startswith('"'):
            break
        at = skip_space(text, key.end)
        if not text.startswith(":", at):
            break
        value = canonical(text, at + 1)
        field = json.loads(key.text)
        if field == "name" and value.end is not None:
            name = json.loads(value.text)
        elif field in keys and not found:
            found = True
            if text.startswith("{", skip_space(text, at + 1)):
                arguments = value.text
        if value.end is None:
            break
        at = value.end
    return (PartialCall(name, arguments) if isinstance(name, str) else None), None


def scan_calls(
    text: str, at: int, keys: tuple[str, ...] = ("arguments",), *, listed: bool
) -> list[PartialCall]:
    """Call objects one after another from `text[at:]`: the items of a JSON list (`listed`), or
    objects separated by `;` or nothing (llama3_json)."""
    at = skip_space(text, at)
    if listed:
        if not text.startswith("[", at):
            return []
        at += 1
    calls: list[PartialCall] = []
    while True:
        call, end = scan_call(text, at, keys)
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        at = skip_space(text, end)
        if text.startswith(",;"[not listed], at):
            at += 1


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

    def partial(self, text: str) -> list[PartialCall]:
        return _after_each(text, self.OPEN)


def _after_each(text: str, marker: str) -> list[PartialCall]:
    """The calls of a format that writes one call object after each `marker`."""
    calls = []
    for found in re.finditer(re.escape(marker), text):
        call, _ = scan_call(text, found.end())
        if call is None:
            break
        calls.append(call)
    return calls


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

    def partial(self, text: str) -> list[PartialCall]:
        at = skip_space(text, 0)
        if text.startswith(self.TAG, at):
            at += len(self.TAG)
        return scan_calls(text, at, ("parameters", "arguments"), listed=False)


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

    CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
    KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")

    def partial(self, text: str) -> list[PartialCall]:
        """Each call once its name and `(` are written, its arguments one whole value at a time
        (a value is read with `ast` once a `,` or `)` ends it)."""
        at = skip_space(text, 0)
        if not text.startswith("[", at):
            return []
        at += 1
        calls: list[PartialCall] = []
        while (call := self.CALL.match(text, at)) is not None:
            written, at = ["{"], call.end()
            while (at := skip_space(text, at)) < len(text) and text[at] != ")":
                keyword = self.KEYWORD.match(text, at)
                end = _python_value_end(text, keyword.end()) if keyword else None
                if keyword is None or end is None:
                    break
                try:
                    value = json.dumps(
                        ast.literal_eval(text[keyword.end() : end].strip()), ensure_ascii=False
                    )
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    break
                written.append(f"{', ' if len(written) > 1 else ''}{json.dumps(keyword.group(1))}: {value}")
                at = end + (text[end] == ",")
            closed = text.startswith(")", at)
            calls.append(PartialCall(call.group(1), "".join(written) + ("}" if closed else "")))
            if not closed:
                return calls
            at = skip_space(text, at + 1)
            if not text.startswith(",", at):
                return calls
            at += 1
        return calls


def _python_value_end(text: str, at: int) -> int | None:
    """Where the Python expression from `text[at:]` ends: the `,` or `)` after it outside any
    bracket or string (None: it goes on)."""
    depth = 0
    while at < len(text):
        char = text[at]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return at if char == ")" else None
            depth -= 1
        elif char == "," and depth == 0:
            return at
        elif char in "'\"":
            quote = char * 3 if text.startswith(char * 3, at) else char
            at += len(quote)
            while at < len(text) and not text.startswith(quote, at):
                at += 2 if text[at] == "\\" else 1
            if at >= len(text):
                return None
            at += len(quote) - 1
        at += 1
    return None


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

    def partial(self, text: str) -> list[PartialCall]:
        at = skip_space(text, 0)
        for marker in self.MARKERS:
            if text.startswith(marker, at):
                at = skip_space(text, at + len(marker))
        return scan_calls(text, at, listed=True)


class Granite20bFc(ToolCallParser):
    name = "granite-20b-fc"
    OPEN = "<function_call>"

    def parse(self, text: str) -> Parsed | None:
        content, *blocks = text.split(self.OPEN)
        calls = _object_calls(blocks, whole=False)
        return Parsed(content, calls) if calls else None

    def streamable(self, text: str) -> int:
        return _text_before(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        return _after_each(text, self.OPEN)


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

    def partial(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for found in re.finditer(re.escape(self.OPEN), text):
            at = skip_space(text, found.end())
            if text.startswith("[", at):  # a JSON list of calls
                calls += scan_calls(text, at, listed=True)
                continue
            next_call = text.find(self.OPEN, at)
            block = text[at : next_call if next_call >= 0 else len(text)]
            args, brace = block.find(self.ARGS), block.find("{")
            if args < 0 and brace < 0:
                break  # the name goes on
            name = block[: args if args >= 0 else brace].strip()
            start = skip_space(block, args + len(self.ARGS)) if args >= 0 else brace
            if not name or not block.startswith("{", start):
                break
            calls.append(PartialCall(name, canonical(block, start).text))
        return calls


class _TextValues(ToolCallParser):
    """A format whose argument values are text: each is read as the type the request's function
    schema gives its parameter (so the parser is bound to the request's functions)."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self.schemas = schemas or {}

    def for_tools(self, schemas: Mapping[str, Any]) -> ToolCallParser:
        return type(self)(schemas)

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """OpenAI's call of `name` with the (parameter, text) pairs as typed arguments."""
        properties = self._properties(name)
        arguments = {
            key.strip(): _typed(_trimmed(value), properties.get(key.strip())) for key, value in pairs
        }
        return function_call(name, json.dumps(arguments, ensure_ascii=False))

    def _properties(self, name: str) -> dict[str, Any]:
        """The JSON Schemas of function `name`'s parameters, by name (none: {})."""
        schema = self.schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return properties if isinstance(properties, dict) else {}

    def _partial_call(
        self, name: str, pairs: list[tuple[str, str, bool]], closed: bool, ends: tuple[str, ...]
    ) -> PartialCall:
        """The call of `name` as far as its (parameter, text so far, whole) pairs settle its
        arguments (`_call`'s JSON): whole values typed; the last one, still being written, as it
        comes where its schema makes it a string (less a line break and any end of the text
        that may become one of `ends`); the closing brace once the call is `closed`."""
        properties = self._properties(name)
        written = ["{"]
        for index, (key, value, whole) in enumerate(pairs):
            written.append(f"{', ' if index else ''}{json.dumps(key.strip(), ensure_ascii=False)}: ")
            schema = properties.get(key.strip())
            if whole:
                written.append(json.dumps(_typed(_trimmed(value), schema), ensure_ascii=False))
                continue
            declared = schema.get("type") if isinstance(schema, dict) else None
            if (declared[0] if isinstance(declared, list) and declared else declared) == "string":
                value = value[: len(value) - max((held_prefix(value, end) for end in ends), default=0)]
                value = value.removeprefix("\n")
                settled = value.removesuffix("\n")
                written.append(json.dumps(settled, ensure_ascii=False)[:-1])
            return PartialCall(name, "".join(written))
        if closed:
            written.append("}")
        return PartialCall(name, "".join(written))


class Qwen3Coder(_TextValues):
    name = "qwen3_coder"
    OPEN, BARE = "<tool_call>", "<function="
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
    VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")  # what may end a value being written

    def _start(self, text: str) -> int:
        """Where the calls begin (-1: none): at the opening, or at the first function where the
        model left the opening out, as it sometimes does."""
        at = text.find(self.OPEN)
        return at if at >= 0 else text.find(self.BARE)

    def parse(self, text: str) -> Parsed | None:
        at = self._start(text)
        if at < 0:
            return None
        calls = [
            self._call(function.group(1).strip(), self.PARAMETER.findall(function.group(2)))
            for function in self.FUNCTION.finditer(text, at)
        ]
        return Parsed(text[:at], calls) if calls else None

    def streamable(self, text: str) -> int:
        return min(_text_before(text, self.OPEN), _text_before(text, self.BARE))

    def partial(self, text: str) -> list[PartialCall]:
        at = self._start(text)
        if at < 0:
            return []
        calls = []
        for function in self.FUNCTION.finditer(text, at):
            body = function.group(2)
            closed = function.group(0).endswith("</function>")
            pairs = [
                (p.group(1), p.group(2), closed or p.end() < len(body) or p.group(0).endswith("</parameter>"))
                for p in self.PARAMETER.finditer(body)
            ]
            calls.append(self._partial_call(function.group(1).strip(), pairs, closed, self.VALUE_ENDS))
        return calls


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

    def partial(self, text: str) -> list[PartialCall]:
        at = text.find(self.OPEN)
        if at < 0:
            return []
        calls = []
        for call in self.CALL.finditer(text, at):
            body = call.group(1)
            closed = call.group(0).endswith("</tool_call>")
            name, key, _ = body.partition("<arg_key>")
            name = name.strip()
            if not (key or closed) or not name or "\n" in name:
                break
            pairs = [
                (a.group(1), a.group(2), closed or a.group(0).endswith("</arg_value>"))
                for a in self.ARGUMENT.finditer(body)
            ]
            calls.append(self._partial_call(name, pairs, closed, ("</arg_value>", "</tool_call>")))
        return calls


class _MarkedCalls(ToolCallParser):
    """A format of special-token markers: the calls follow the text, each between CALL and END,
    its name then its JSON arguments (`_named` reads where each begins)."""

    needs_special_tokens = True
    SECTION = CALL = END = ""

    @abstractmethod
    def _named(self, body: str) -> tuple[str, int | None] | None:
        """A call's name, once whole, and where its arguments begin in `body` (None: not yet)."""

    def _bodies(self, text: str) -> tuple[int, list[str]]:
        """Where the calls begin in `text` (-1: none), and each call's text after its CALL."""
        at = text.find(self.SECTION)
        at = text.find(self.CALL) if at < 0 else at
        if at < 0:
            return -1, []
        bodies = []
        for found in re.finditer(re.escape(self.CALL), text[at:]):
            body = text[at + found.end() :]
            bodies.append(
                body[: min(i for i in (body.find(self.END), body.find(self.CALL), len(body)) if i >= 0)]
            )
        return at, bodies

    def parse(self, text: str) -> Parsed | None:
        at, bodies = self._bodies(text)
        calls = []
        decoder = json.JSONDecoder()
        for body in bodies:
            named = self._named(body)
            if named is None or named[1] is None or not named[0]:
                return None
            try:
                arguments, _ = decoder.raw_decode(body[named[1] :].lstrip())
            except ValueError:
                return None
            call = _call_of({"name": named[0], "arguments": arguments}, "arguments")
            if call is None:
                return None
            calls.append(call)
        return Parsed(text[:at], calls) if calls else None

    def streamable(self, text: str) -> int:
        return min(_text_before(text, self.SECTION), _text_before(text, self.CALL))

    def partial(self, text: str) -> list[PartialCall]:
        calls = []
        for body in self._bodies(text)[1]:
            named = self._named(body)
            if named is None or not named[0]:
                break
            start = skip_space(body, named[1]) if named[1] is not None else len(body)
            calls.append(
                PartialCall(named[0], canonical(body, start).text if body.startswith("{", start) else "")
            )
        return calls


class DeepSeekV3(_MarkedCalls):
    """DeepSeek-V3 and R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name
    ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (the code fence on its own lines)."""

    name = "deepseek_v3"
    SECTION, CALL, SEP, END = (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
    )
    FENCE = "```json"

    def _named(self, body: str) -> tuple[str, int | None] | None:
        _, sep, rest = body.partition(self.SEP)
        line, newline, _ = rest.partition("\n")
        if not (sep and newline):
            return None
        fence = body.find(self.FENCE)
        return line.strip(), (fence + len(self.FENCE) if fence >= 0 else None)


class DeepSeekV31(_MarkedCalls):
    """DeepSeek-V3.1 and later: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    name = "deepseek_v31"
    SECTION, CALL, SEP, END = DeepSeekV3.SECTION, DeepSeekV3.CALL, DeepSeekV3.SEP, DeepSeekV3.END

    def _named(self, body: str) -> tuple[str, int | None] | None:
        name, sep, _ = body.partition(self.SEP)
        return (name.strip(), len(name) + len(sep)) if sep else None


class KimiK2(_MarkedCalls):
    """Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`."""

    name = "kimi_k2"
    SECTION, CALL, ARGS, END = (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    )

    def _named(self, body: str) -> tuple[str, int | None] | None:
        ident, sep, _ = body.partition(self.ARGS)  # functions.<name>:<index>
        return (ident.strip().split(":")[0].split(".")[-1], len(ident) + len(sep)) if sep else None


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
    p.name: p
    for p in (
        Hermes,
        Llama3Json,
        Pythonic,
        Granite,
        Granite20bFc,
        Mistral,
        Qwen3Coder,
        Glm45,
        DeepSeekV3,
        DeepSeekV31,
        KimiK2,
    )
}
# vLLM's other names for the same formats
PARSERS |= {"llama4_json": Llama3Json, "llama4_pythonic": Pythonic, "glm47": Glm45, "qwen3_xml": Qwen3Coder}


def parser_named(name: str | None) -> ToolCallParser | None:
    """The parser TOOL_CALL_PARSER names (None: none); ValueError for an unknown name."""
    if not name:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
