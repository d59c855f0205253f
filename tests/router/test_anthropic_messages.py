"""Anthropic's Messages API over the chat door (router/http/anthropic_messages.py): a request's
chat call, the Message made from a chat answer and the stream events made from chat chunks, as
the `anthropic` client's own models read them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from router.core.validation import ValidationError
from router.http.anthropic_messages import MessageShape, MessagesRequest, chat_request

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 9, **fields})


def test_a_request_is_the_chat_call_it_asks_for() -> None:
    chat = chat_request(
        request(
            system=[
                {"type": "text", "text": "be ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "brief"},
            ],
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": "down",
                            "is_error": True,
                        },
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
            tools=[{"name": "weather", "description": "d", "input_schema": CITY}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["\n\n"],
            temperature=0.5,
            top_k=4,
            metadata={"user_id": "u"},
            output_config={"effort": "low", "format": {"type": "json_schema", "schema": CITY}},
            thinking={"type": "enabled", "budget_tokens": 1024},
            stream=True,
        )
    )
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "And?"},
    ]
    assert chat.tools is not None and chat.tools[0].function.parameters == CITY
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.stop, chat.temperature, chat.top_k, chat.user, chat.max_completion_tokens) == (
        ["\n\n"],
        0.5,
        4,
        "u",
        9,
    )
    assert chat.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True, "thinking": True}
    plain = [{"role": "user", "content": "x"}]
    off = chat_request(request(messages=plain, thinking={"type": "disabled"}))
    assert off.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    assert chat_request(request(messages=plain)).chat_template_kwargs is None
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": CITY}}
    assert chat.stream_options is not None and chat.stream_options.continuous_usage_stats
    named = chat_request(
        request(messages=[{"role": "user", "content": "x"}], tool_choice={"type": "tool", "name": "w"})
    )
    assert named.tool_choice is not None and named.tool_choice.function.name == "w"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "user content of type 'image'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x"}]}]},
            "user content of type 'tool_use'",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools of type 'web_search_20250305'",
        ),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers is not supported by this server"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format 'xml' is not supported"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice of type 'sometimes' is not supported"),
    ],
)
def test_what_is_not_served_is_refused_by_name(fields: dict, message: str) -> None:
    body = request(**{"messages": [{"role": "user", "content": "x"}], **fields})
    with pytest.raises(ValidationError, match=message):
        chat_request(body)


def chat_answer(message: dict[str, Any], finish: str = "stop", stop_reason: Any = None) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}
    return {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_the_message_of_a_chat_answer() -> None:
    shape = MessageShape("m")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
    }
    whole = Message.model_validate(
        shape.unary(
            chat_answer(
                {"role": "assistant", "content": "Hi", "reasoning_content": "think", "tool_calls": [call]}
            )
        )
    )
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[2].input == {"city": "Rome"} and whole.content[2].id == "call_1"
    assert (whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens) == ("tool_use", 5, 3)
    for finish, reason, expected in [
        ("length", None, ("max_tokens", None)),
        ("stop", "\n\n", ("stop_sequence", "\n\n")),
        ("stop", None, ("end_turn", None)),
        ("stop", 7, ("end_turn", None)),
    ]:
        made = Message.model_validate(
            shape.unary(chat_answer({"role": "assistant", "content": "x"}, finish, reason))
        )
        assert (made.stop_reason, made.stop_sequence) == expected
    assert shape.error(404, {"error": {"message": "gone"}}) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "gone"},
    }


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}
    return {"choices": [choice], "usage": usage}


def streamed(shape: MessageShape, chunks: list[dict[str, Any]]) -> list[Any]:
    async def source() -> AsyncGenerator[dict[str, Any], None]:
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [event async for event in shape.events(source())]

    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    events = []
    for text in asyncio.run(collect()):
        name, data = text.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload if payload["type"] == "error" else adapter.validate_python(payload))
    return events


def test_the_stream_events_of_chat_chunks() -> None:
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"ci'},
    }
    more = {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}
    events = streamed(
        MessageShape("m"),
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "hm"}),
            chunk({"content": "Sure."}),
            chunk({"tool_calls": [call]}),
            chunk({"tool_calls": [more]}, "stop"),
        ],
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.usage.input_tokens == 5
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "text", "tool_use"] and starts[2].name == "weather"
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1, 2]
    arguments = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 2
    )
    assert json.loads(arguments) == {"city": "Oslo"}
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens == 2
    failed = streamed(
        MessageShape("m"), [chunk({"content": "a"}), {"error": {"message": "boom", "code": 500}}]
    )
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
