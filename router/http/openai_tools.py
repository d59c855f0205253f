"""OpenAI tool calling at the chat door, as vLLM serves it.

`tools` (functions with JSON-Schema parameters) reach the chat template as transformers passes
them (`tools=[{"type": "function", "function": {...}}, ...]`), and `tool_choice` decides what
the model may answer:
  - "none" (the default without tools): text, as without tools; the template still sees them;
  - "auto" (the default with tools): text or calls in the model's own format, read by the
    parser TOOL_CALL_PARSER names (tool_parsers.py); finish_reason "tool_calls" where it called;
  - {"type": "function", "function": {"name": N}}: one call of N, its arguments constrained by
    guided decoding to N's parameters schema; finish_reason "stop" (OpenAI's, for a forced call);
  - "required": one or more calls (one with parallel_tool_calls false), constrained to a JSON
    array of {"name", "parameters"} objects of the given tools; finish_reason "tool_calls".
Without a parser, "auto" is refused with one line. A named call cut by max_tokens keeps its
incomplete arguments (finish_reason "length"); a list of calls cut before its JSON is complete
is returned as text, finish_reason "length". Assistant messages that carry `tool_calls` reach
the template with their arguments as objects (templates write them with `tojson`), `tool`
messages as they are.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.core.validation import ValidationError
from router.http.tool_parsers import PartialCall, ToolCallParser, call_id, function_call, scan_calls
from text_generation_common.guided import schema_text
from text_generation_common.messages import Guided, GuidedKind, TokenInfo

logger = logging.getLogger(__name__)

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a function without a schema


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ...: the template may read them

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceParam = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolMode:
    """How the answer is read: text; text or calls in the model's format (auto); one call of
    `name` (named); a list of calls (required)."""

    kind: Literal["text", "auto", "named", "required"]
    name: str = ""

    @property
    def constrained(self) -> bool:
        """The answer is a call, or a list of calls, by guided decoding."""
        return self.kind in ("named", "required")


TEXT = ToolMode("text")


@dataclass(frozen=True)
class Reading:
    """An answer as the chat's message: its text (None beside calls that have none), its calls
    (None: it made none) and the finish_reason its calls give (None: the stop reason's)."""

    content: str | None
    calls: list[dict[str, Any]] | None = None
    finish: str | None = None


def tool_mode(
    tools: list[Tool] | None, choice: ToolChoiceParam | None, parser: ToolCallParser | None = None
) -> ToolMode:
    """The mode `tool_choice` asks for (unset: "auto" with tools, as OpenAI has it, else "none");
    ValidationError where it cannot be served (`parser`: the model's, for "auto")."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and not tools):
        return TEXT
    if choice == "auto":
        if parser is None:
            raise ValidationError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                '--tool-call-parser: name a function, or use "required" or "none"'
            )
        return ToolMode("auto")
    if not tools:
        raise ValidationError("tool_choice needs tools")
    if choice == "required":
        return ToolMode("required")
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise ValidationError(f"tool_choice names the function {name[:64]!r}, which is not among tools")
    return ToolMode("named", name)


def guided_for(tools: list[Tool] | None, mode: ToolMode, parallel: bool = True) -> Guided | None:
    """The constraint on the answer of a mode that is constrained (None for the others);
    `parallel`: a list of calls may hold more than one."""
    if not mode.constrained:
        return None
    assert tools is not None
    if mode.kind == "named":
        function = next(t.function for t in tools if t.function.name == mode.name)
        return Guided(GuidedKind.JSON_SCHEMA, schema_text(function.parameters or ANY_OBJECT))
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return Guided(GuidedKind.JSON_SCHEMA, schema_text(schema))


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """`tools` as chat templates read them (transformers' `tools` argument)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for the template: an assistant's tool calls with their arguments as objects
    where they are JSON objects (templates write them with `tojson`)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_with_object_arguments(call) for call in calls]}


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        parsed = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def read(mode: ToolMode, text: str, parser: ToolCallParser | None = None, sent: int = 0) -> Reading:
    """A whole answer of `mode` as the chat's message: a named call's arguments are the text as
    it is; a list of calls that is not complete JSON (cut by max_tokens), or an auto answer
    whose calls do not parse, is text. `sent`: the answer's first characters, streamed already
    as content (text for sure: no call begins in them), left out."""
    if mode.kind == "named":
        return Reading(None, [function_call(mode.name, text)])
    if mode.kind == "required" and (calls := _listed_calls(text)) is not None:
        return Reading(None, calls, "tool_calls")
    if mode.kind == "auto" and parser is not None and (parsed := parser.parse(text)) is not None:
        return Reading(parsed.content[sent:].strip() or None, parsed.calls, "tool_calls")
    return Reading(text[sent:])


def _listed_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return None
    return [function_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]


READ_EVERY_CHUNK = 1024  # HeldAnswer reads the calls at every chunk of answers up to this long,
READ_AGAIN_FRACTION = 16  # then again once the answer grew by this share


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str  # sent so far


class HeldAnswer:
    """One streamed choice of a mode whose answer may hold calls (auto, required): the text that
    is content whatever comes next goes out as it comes (auto only), each call once its name is
    whole, then its arguments as they settle (tool_parsers.py `partial`; "required": the listed
    calls), the rest at the end. The deltas are OpenAI's: a call's first one has its index, id,
    type and name (arguments ""), the next ones the index and more arguments."""

    def __init__(self, mode: ToolMode, parser: ToolCallParser | None) -> None:
        self.mode, self.parser = mode, parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.tokens: list[TokenInfo] = []  # the answer's tokens not yet sent (their logprobs)
        self.calls: list[_SentCall] = []  # the calls sent so far
        self._read_at = 0  # the answer's length from which the calls are read again

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the call deltas to send now, of the answer grown by `text`."""
        self.text += text
        if self.mode.kind == "required":
            return "", self._deltas(listed_partial(self.text)) if self._read_again() else []
        if self.mode.kind != "auto" or self.parser is None:
            return "", []
        deltas = self._deltas(self.parser.partial(self.text)) if self._read_again() else []
        upto = self.parser.streamable(self.text)
        if upto <= self.sent:
            return "", deltas
        out, self.sent = self.text[self.sent : upto], upto
        return out, deltas

    def _read_again(self) -> bool:
        """Whether the calls are to be read from the answer now: each reading reads it whole, so
        past READ_EVERY_CHUNK characters they are read once it has grown by a sixteenth (a long
        call's arguments then go out in pieces of a sixteenth of the answer, and reading costs
        about 17 times its length in all, not its square: a 25 kB call read at every 4-character
        chunk took 8 s of the router's loop, 0.04 s so)."""
        if len(self.text) < self._read_at:
            return False
        if len(self.text) > READ_EVERY_CHUNK:
            self._read_at = len(self.text) + len(self.text) // READ_AGAIN_FRACTION
        return True

    def end(self) -> tuple[Reading, list[dict[str, Any]]]:
        """The whole answer, less the content already sent, and its call deltas not sent yet."""
        reading = read(self.mode, self.text, self.parser, self.sent)
        if reading.calls is None:
            if self.calls:
                logger.warning("calls were streamed but the whole answer's do not parse: it is text")
            return reading, []
        whole = [PartialCall(c["function"]["name"], c["function"]["arguments"]) for c in reading.calls]
        return reading, self._deltas(whole, [c["id"] for c in reading.calls])

    def _deltas(self, calls: list[PartialCall], ids: list[str] | None = None) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                sent = _SentCall(ids[index] if ids else call_id(), call.name, "")
                self.calls.append(sent)
                function = {"name": call.name, "arguments": ""}
                deltas.append({"index": index, "id": sent.id, "type": "function", "function": function})
            sent = self.calls[index]
            if call.name != sent.name or not call.arguments.startswith(sent.arguments):
                logger.warning("call %d: the whole answer's call does not go on from the one streamed", index)
                continue
            if len(call.arguments) > len(sent.arguments):
                more, sent.arguments = call.arguments[len(sent.arguments) :], call.arguments
                deltas.append({"index": index, "function": {"arguments": more}})
        return deltas


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call deltas with those of one index made one (its arguments in order)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and out[-1]["index"] == delta["index"]:
            last = out[-1]
            arguments = last["function"]["arguments"] + delta["function"]["arguments"]
            out[-1] = {**last, "function": {**last["function"], "arguments": arguments}}
        else:
            out.append(delta)
    return out


def listed_partial(text: str) -> list[PartialCall]:
    """The calls begun in an answer of "required" mode (a JSON list of {"name", "parameters"})."""
    return scan_calls(text, 0, ("parameters",), listed=True)
