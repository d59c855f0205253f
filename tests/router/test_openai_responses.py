"""OpenAI's Responses API over the chat door (router/http/openai_responses.py): a request's chat
call, the Response object made from the chat answer, and the typed stream events made from the
chat chunks, as the `openai` client's models read them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router.core.validation import ValidationError
from router.http.openai_responses import ResponsesApi, ResponseShape, ResponsesRequest, chat_request
from router.http.responses_store import MissingResponse, ResponseStore

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_a_request_is_the_chat_call_it_asks_for() -> None:
    chat = chat_request(
        request(
            model="m",
            instructions="be brief",
            input=[
                {"role": "developer", "content": "terse"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "weather "},
                        {"type": "input_text", "text": "in Oslo?"},
                    ],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "look it up"}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "weather",
                    "arguments": '{"city": "Rome"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sunny."}],
                },
            ],
            max_output_tokens=7,
            temperature=0.5,
            top_p=0.9,
            tools=[{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
            reasoning={"effort": "low"},
            include=["message.output_text.logprobs", "reasoning.encrypted_content"],
            top_logprobs=3,
            stream=True,
            store=True,
            metadata={"k": "v"},
            prompt_cache_key="team-a",
            prompt_cache_retention="24h",
        )
    )
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "terse"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "reasoning_content": "look it up",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert (chat.model, chat.max_completion_tokens, chat.temperature, chat.top_p) == ("m", 7, 0.5, 0.9)
    assert chat.tools is not None and chat.tools[0].function.name == "weather"
    assert chat.tools[0].function.parameters == WEATHER
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "weather"
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
    }
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert (chat.logprobs, chat.top_logprobs, chat.stream) == (True, 3, True)
    assert chat.stream_options is not None and chat.stream_options.include_usage
    plain = chat_request(request())
    assert [m.model_dump(exclude_none=True) for m in plain.messages] == [{"role": "user", "content": "hi"}]
    assert plain.response_format is None and not plain.logprobs and plain.tools is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id needs responses kept: start the server"),
        ({"background": True}, "background is not supported by this server"),
        ({"conversation": "conv_1"}, "conversation is not supported by this server"),
        ({"truncation": "auto"}, 'truncation "auto" is not supported by this server'),
        ({"include": ["file_search_call.results"]}, "include 'file_search_call.results' is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported by this server"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice of type 'file_search' is not supported"),
        ({"text": {"format": {"type": "xml"}}}, "text.format 'xml' is not supported by this server"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input items of type 'item_reference' are not"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input content of type 'input_image' is not supported by this server",
        ),
    ],
)
def test_what_is_not_served_is_refused_by_name(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        chat_request(request(**fields))
    assert str(info.value).startswith(message)


def chat_answer(message: dict[str, Any], finish: str = "stop", logprobs: Any = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish,
                "logprobs": logprobs,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def parsed(payload: dict[str, Any]) -> Response:
    return Response.model_validate(payload)


def test_the_response_object_of_a_chat_answer() -> None:
    shape = ResponseShape(request(max_output_tokens=3), "m")
    tokens = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    answer = parsed(
        shape.unary(
            chat_answer({"content": "Hi", "reasoning_content": "greet"}, logprobs={"content": tokens})
        )
    )
    assert answer.id.startswith("resp_") and answer.status == "completed" and answer.model == "m"
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output[0].content is not None and answer.output[0].content[0].text == "greet"
    assert answer.output_text == "Hi" and answer.output[1].content[0].logprobs[0].logprob == -0.5
    assert answer.usage is not None and (answer.usage.input_tokens, answer.usage.output_tokens) == (5, 3)
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    ]
    answer = parsed(shape.unary(chat_answer({"content": None, "tool_calls": calls}, "tool_calls")))
    (call,) = answer.output
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call",
        "call_1",
        "weather",
        '{"city":"Oslo"}',
    )
    cut = parsed(shape.unary(chat_answer({"content": "abc"}, "length")))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.output[-1].status == "incomplete" and answer.output[-1].status == "completed"
    assert cut.incomplete_details.reason == "max_output_tokens"
    empty = parsed(shape.unary(chat_answer({"content": ""})))
    assert empty.output_text == "" and [item.type for item in empty.output] == ["message"]


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def streamed(shape: ResponseShape, chunks: list[dict[str, Any]]) -> list[Any]:
    async def source() -> AsyncGenerator[dict[str, Any], None]:
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [event async for event in shape.events(source())]

    events = []
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for text in asyncio.run(collect()):
        name, data = text.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(adapter.validate_python(payload))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_the_stream_events_of_chat_chunks() -> None:
    calls = [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
        },
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    token = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    events = streamed(
        ResponseShape(request(stream=True), "m"),
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "think"}),
            chunk({"reasoning_content": "ing"}),
            chunk({"content": "Hi"}, logprobs={"content": [token]}),
            chunk({"content": " there"}),
            chunk({"tool_calls": calls}, "tool_calls"),
            USAGE,
        ],
    )
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output_text == "Hi there" and final.output[1].content[0].logprobs[0].token == "Hi"
    assert [(i.output_index, i.item.id) for i in events if i.type == "response.output_item.done"] == [
        (n, item.id) for n, item in enumerate(final.output)
    ]
    assert [item.call_id for item in final.output[2:]] == ["call_1", "call_2"]
    assert final.usage is not None and final.usage.output_tokens == 4 and final.status == "completed"


def test_a_named_call_streams_its_arguments_and_a_cut_answer_is_incomplete() -> None:
    opening = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
        ],
    }
    events = streamed(
        ResponseShape(request(stream=True), "m"),
        [
            chunk(opening),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty"'}}]}, "length"),
            USAGE,
        ],
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == ['{"ci', 'ty"']
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].arguments == '{"city"'
    assert events[-1].response.output[0].status == "incomplete"
    empty = streamed(
        ResponseShape(request(stream=True), "m"),
        [chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), USAGE],
    )
    assert empty[-1].type == "response.completed" and empty[-1].response.output_text == ""


def test_a_failure_after_the_stream_began_ends_it_as_failed() -> None:
    failure = {
        "error": {
            "message": "Request failed during generation: boom",
            "type": "server_error",
            "param": None,
            "code": 500,
        }
    }
    events = streamed(ResponseShape(request(stream=True), "m"), [chunk({"content": "Hi"}), failure])
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"


def test_kept_responses_make_the_conversation_a_continuation_reads() -> None:
    """With a store, each whole Response (unary, or the stream's last) is kept with the call's
    own input items; a continuation's chat call has the conversation's items before its input
    (the earlier instructions not carried over); the oldest go past the store's size."""
    store = ResponseStore(2)
    first_body = request(instructions="be brief", input="hi")
    first = ResponseShape(first_body, "m", ResponsesApi._keeper(store, first_body))
    answer = first.unary(chat_answer({"role": "assistant", "content": "Hello!"}))
    assert answer["store"] is True and store.get(answer["id"]) is not None
    (item,) = store.get(answer["id"]).input
    assert item["id"].startswith("msg_") and item["content"] == [{"type": "input_text", "text": "hi"}]
    second_body = request(input="and?", previous_response_id=answer["id"])
    history = store.conversation(answer["id"])
    chat = chat_request(second_body, history)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "and?"},
    ]
    second = ResponseShape(second_body, "m", ResponsesApi._keeper(store, second_body))
    events = streamed(second, [chunk({"role": "assistant", "content": "Bye"}), chunk(finish="stop"), USAGE])
    last = events[-1].response
    assert last.previous_response_id == answer["id"] and last.store is True
    assert [m.content for m in chat_request(request(input="x"), store.conversation(last.id)).messages] == [
        "hi",
        "Hello!",
        "and?",
        "Bye",
        "x",
    ]
    unkept_body = request(input="no", store=False)
    assert (
        ResponseShape(unkept_body, "m").unary(chat_answer({"role": "assistant", "content": "."}))["store"]
        is False
    )
    third_body = request(input="third")
    ResponseShape(third_body, "m", ResponsesApi._keeper(store, third_body)).unary(
        chat_answer({"role": "assistant", "content": "3"})
    )
    assert store.get(answer["id"]) is None  # two kept: the first went
    with pytest.raises(MissingResponse) as missing:
        store.conversation(last.id)
    assert missing.value.response_id == answer["id"]
    assert store.delete(last.id) and not store.delete(last.id)


def test_reasoning_effort_is_a_chat_template_variable() -> None:
    """OpenAI's chat `reasoning_effort` reaches the template as `reasoning_effort`, beside
    chat_template_kwargs (whose own value wins)."""
    from router.http.openai_params import template_variables

    assert template_variables(None, None) is None and template_variables({"a": 1}, None) == {"a": 1}
    assert template_variables(None, "low") == {"reasoning_effort": "low"}
    assert template_variables({"reasoning_effort": "high", "a": 1}, "low") == {
        "reasoning_effort": "high",
        "a": 1,
    }
