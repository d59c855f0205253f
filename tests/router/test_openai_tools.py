"""OpenAI tool calling at the chat door (router/http/openai_tools.py): which tool_choice is served,
the constraint each asks for, the calls read back from the answer, and what the template sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.core.validation import ValidationError
from router.http.chat_template import ChatTemplate
from router.http.openai_tools import (
    TEXT,
    NamedToolChoice,
    Tool,
    ToolMode,
    guided_for,
    template_message,
    template_tools,
    tool_calls,
    tool_mode,
)
from text_generation_common.guided import Grammars
from text_generation_common.messages import GuidedKind

CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": CITY}}),
    Tool.model_validate({"type": "function", "function": {"name": "now", "description": "the time"}}),
]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_the_served_tool_choices_and_the_refused_ones() -> None:
    assert tool_mode(None, None) == TEXT and tool_mode(TOOLS, "none") == TEXT
    assert tool_mode(TOOLS, "required") == ToolMode("required")
    assert tool_mode(TOOLS, named("now")) == ToolMode("named", "now")
    for tools, choice, message in [
        (TOOLS, None, 'tool_choice "auto" (the default with tools) is not supported by this server'),
        (TOOLS, "auto", 'tool_choice "auto" (the default with tools) is not supported by this server'),
        (None, "required", "tool_choice needs tools"),
        ([], named("now"), "tool_choice needs tools"),
        (TOOLS, named("later"), "tool_choice names the function 'later', which is not among tools"),
    ]:
        with pytest.raises(ValidationError) as error:
            tool_mode(tools, choice)
        assert str(error.value).startswith(message)


def test_the_constraints_compile_and_describe_the_calls(tokenizer_dir: Path) -> None:
    assert guided_for(TOOLS, TEXT) is None
    weather = guided_for(TOOLS, ToolMode("named", "weather"))
    now = guided_for(TOOLS, ToolMode("named", "now"))
    required = guided_for(TOOLS, ToolMode("required"))
    assert weather is not None and now is not None and required is not None
    assert weather.kind == GuidedKind.JSON_SCHEMA and json.loads(weather.spec) == CITY
    assert json.loads(now.spec) == {"type": "object"}  # a function without a schema takes any object
    schema = json.loads(required.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["weather"], ["now"]]
    assert [o["properties"]["parameters"] for o in options] == [CITY, {"type": "object"}]
    assert "maxItems" not in schema
    single = guided_for(TOOLS, ToolMode("required"), parallel=False)
    assert single is not None and json.loads(single.spec) == {**schema, "maxItems": 1}
    grammars = Grammars((tokenizer_dir / "tokenizer.json").read_text(), 2000, 2)
    for constraint in (weather, now, required, single):
        grammars.check(constraint)


def test_the_calls_are_read_back_from_the_answer() -> None:
    (call,) = tool_calls(ToolMode("named", "weather"), '{"city": "Ro') or []  # cut: kept as it is
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Ro'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    required = ToolMode("required")
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    calls = tool_calls(required, text) or []
    assert [c["function"] for c in calls] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert len({c["id"] for c in calls}) == 2
    for broken in ('[{"name": "weather", "param', "[]", '{"name": "now"}', "[1]", '[{"name": 3}]'):
        assert tool_calls(required, broken) is None, broken


def test_the_template_sees_the_tools_and_earlier_calls_with_object_arguments() -> None:
    template = ChatTemplate(
        "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% else %}{{ m.content }}{% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered = template.render([template_message(m) for m in messages], tools=template_tools(TOOLS))
    assert rendered == '[weather][now]user:Weather?;assistant:{"city": "Oslo"}"not json";tool:sunny;'
    assert template.render(messages[:1], tools=template_tools(None)) == "user:Weather?;"
    assert template_tools(TOOLS) == [
        {"type": "function", "function": {"name": "weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "now", "description": "the time"}},
    ]
