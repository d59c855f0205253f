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
    `ast` (parsed, never run; only literal values).
An answer whose calls do not parse is the message's text, as if it had none. While streaming,
`streamable` says how much of the answer so far is text for sure: the rest is held back until
the answer ends (then its calls come in one chunk, or the held text).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from abc import ABC, abstractmethod
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

    @abstractmethod
    def parse(self, text: str) -> Parsed | None:
        """The calls in a whole answer; None when it has none (or they do not parse)."""

    @abstractmethod
    def streamable(self, text: str) -> int:
        """How many characters of the answer so far are text whatever comes next."""


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


class Hermes(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed | None:
        blocks = list(self.BLOCK.finditer(text))
        if not blocks:
            return None
        calls = []
        for block in blocks:
            try:
                value = json.loads(block.group(1))
            except ValueError:
                return None
            call = _call_of(value, "arguments")
            if call is None:
                return None
            calls.append(call)
        return Parsed(self.BLOCK.sub("", text), calls)

    def streamable(self, text: str) -> int:
        at = text.find(self.OPEN)
        return at if at >= 0 else len(text) - held_prefix(text, self.OPEN)


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
        start = text.lstrip()
        if not start or start.startswith("{") or self.TAG.startswith(start[: len(self.TAG)]):
            return 0  # it may be (or still become) a call: all of it waits
        return len(text)


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
        start = text.lstrip()
        return 0 if not start or start.startswith("[") else len(text)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (Hermes, Llama3Json, Pythonic)}


def parser_named(name: str | None) -> ToolCallParser | None:
    """The parser TOOL_CALL_PARSER names (None: none); ValueError for an unknown name."""
    if not name:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
