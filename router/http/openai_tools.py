"""OpenAI tool calling at the chat door, as vLLM serves it without a model-specific parser.

`tools` (functions with JSON-Schema parameters) reach the chat template as transformers passes
them (`tools=[{"type": "function", "function": {...}}, ...]`), and `tool_choice` decides what
the model may answer:
  - "none" (the default without tools): text, as without tools; the template still sees them;
  - {"type": "function", "function": {"name": N}}: one call of N, its arguments constrained by
    guided decoding to N's parameters schema; finish_reason "stop" (OpenAI's, for a forced call);
  - "required": one or more calls (one with parallel_tool_calls false), constrained to a JSON
    array of {"name", "parameters"} objects of the given tools; finish_reason "tool_calls".
"auto" (OpenAI's default when tools are given) would need a parser of each model family's own
call format; it is refused with one line. A named call cut by max_tokens keeps its incomplete
arguments (finish_reason "length"); a list of calls cut before its JSON is complete is returned
as text, finish_reason "length". Assistant messages that carry `tool_calls` reach the template
with their arguments as objects (templates write them with `tojson`), `tool` messages as they are.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.core.validation import ValidationError
from text_generation_common.guided import schema_text
from text_generation_common.messages import Guided, GuidedKind

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
    """How the answer is read: text, one call of `name`, or a list of calls."""

    kind: Literal["text", "named", "required"]
    name: str = ""

    @property
    def calls(self) -> bool:
        return self.kind != "text"


TEXT = ToolMode("text")


def tool_mode(tools: list[Tool] | None, choice: ToolChoiceParam | None) -> ToolMode:
    """The mode `tool_choice` asks for (unset: "auto" with tools, as OpenAI has it, else "none");
    ValidationError where it cannot be served."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return TEXT
    if choice == "auto":
        raise ValidationError(
            'tool_choice "auto" (the default with tools) is not supported by this server: '
            'name a function, or use "required" or "none"'
        )
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
    """The constraint on the answer of a mode that calls tools (None for text); `parallel`: a
    list of calls may hold more than one."""
    if not mode.calls:
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


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The calls in an answer of a mode that calls tools, as OpenAI's message.tool_calls: a
    named call's arguments are the text as it is; None where a list of calls is not complete
    JSON (cut by max_tokens)."""
    if mode.kind == "named":
        return [_call(mode.name, text)]
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
