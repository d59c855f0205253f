"""OpenAI's Responses API (POST /v1/responses), as the `openai` client's `responses.create` and
`responses.stream` call it: a request becomes a chat call of the OpenAI door (openai_api.py:
the same validation, chat template, tool calling, reasoning split and guided decoding), and
its answer, or its stream of chunks, is reshaped into a Response object, or the Responses
stream's typed events.

Input: `input` as a text or a list of items (messages of role user / system / developer /
assistant with text parts; function_call and function_call_output items; reasoning items,
whose text goes back to the template as the next assistant message's reasoning_content) and
`instructions` (a system message first). `tools` of type function, `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema), `max_output_tokens`,
`temperature`, `top_p`, `reasoning.effort` (the chat template's `reasoning_effort`),
`include: ["message.output_text.logprobs"]` with `top_logprobs`. Output items: reasoning (where
REASONING_PARSER splits the answer), message (output_text) and function_call; status
`incomplete` (reason `max_output_tokens`) when the token limit cut the answer.

With RESPONSES_STORE_SIZE, answers are kept (responses_store.py; `store`, true unless a request
says false): `previous_response_id` continues a kept one (its input and output items come before
the request's input; its `instructions` do not carry over), and GET /v1/responses/{id}, its
/input_items and DELETE /v1/responses/{id} read and drop them. Without it nothing is kept (the
answer says `store: false`) and `previous_response_id` is refused. `conversation`, `background`
and item references are refused with 400, as are tools of other types and input other than text.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as BodyError

from router.core.validation import ValidationError
from router.http.http_calls import describe_validation, refuse_body, sse
from router.http.openai_api import OpenAIApi, call_kind, error_reply
from router.http.openai_params import ChatRequest
from router.http.responses_store import Kept, MissingResponse, ResponseStore
from text_generation_common.logs import clip

TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")  # the second: accepted, none is made
ROLES = {"developer": "system"}  # chat templates know the older name


class ResponsesRequest(BaseModel):
    """The request body: OpenAI's fields; those that need stored responses or tools of other
    kinds are refused when set."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # accepted, no effect here
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    # prompt caching hints: this server's prefix cache (tgis_native) works without them
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # refused when set: they need what this server does not keep or run
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None


class ResponsesApi:
    """POST /v1/responses on the OpenAI door's router; with a store, GET and DELETE
    /v1/responses/{id} and GET /v1/responses/{id}/input_items."""

    def __init__(self, openai: OpenAIApi, store: ResponseStore | None = None) -> None:
        self.openai = openai
        self.store = store
        openai.router.add_api_route(
            "/responses", self.create, methods=["POST"], summary="Responses (OpenAI's Responses API)"
        )
        if store is None:
            return
        openai.router.add_api_route(
            "/responses/{response_id}", self.retrieve, methods=["GET"], summary="A kept Response"
        )
        openai.router.add_api_route(
            "/responses/{response_id}", self.delete, methods=["DELETE"], summary="Drop a kept Response"
        )
        openai.router.add_api_route(
            "/responses/{response_id}/input_items",
            self.input_items,
            methods=["GET"],
            summary="A kept Response's input items",
        )

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        history: list[dict[str, Any]] | None = None
        if body.previous_response_id is not None and self.store is not None:
            try:
                history = self.store.conversation(body.previous_response_id)
            except MissingResponse as exc:
                message = f"Previous response with id '{clip(exc.response_id)}' not found."
                return self._refused(request, message, body.stream, 404)
        try:
            chat = chat_request(body, history)
        except ValidationError as exc:
            return self._refused(request, str(exc), body.stream)
        except BodyError as exc:
            return self._refused(request, describe_validation(exc), body.stream)
        keep = None
        if self.store is not None and body.store is not False:
            keep = self._keeper(self.store, body)
        shape = ResponseShape(body, chat.model or self.openai.model_name, keep)
        return await self.openai.serve_chat(chat, request, shape)

    @staticmethod
    def _keeper(store: ResponseStore, body: ResponsesRequest) -> Callable[[dict[str, Any]], None]:
        """What keeps the call's Response once it is whole, with the call's own input items."""
        items = [{"id": _id("msg"), **item} if "id" not in item else item for item in input_items(body.input)]
        return lambda response: store.keep(Kept(response, items, body.previous_response_id))

    async def retrieve(self, response_id: str) -> Response:
        kept = self._kept(response_id)
        return JSONResponse(kept.response) if isinstance(kept, Kept) else kept

    async def delete(self, response_id: str) -> Response:
        assert self.store is not None
        if not self.store.delete(response_id):
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str) -> Response:
        kept = self._kept(response_id)
        if not isinstance(kept, Kept):
            return kept
        data = kept.input
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": False,
            }
        )

    def _kept(self, response_id: str) -> Kept | Response:
        assert self.store is not None
        kept = self.store.get(response_id)
        return kept if kept is not None else _not_found(response_id)

    def _refused(self, request: Request, message: str, stream: bool, status: int = 400) -> Response:
        """A body the conversion refuses: one validation failure of the route's kind."""
        kind = call_kind(ResponseShape.door, stream)
        refuse_body(self.openai.service, request, kind, ResponseShape.route, message)
        return error_reply(status, message)


def _not_found(response_id: str) -> Response:
    return error_reply(404, f"Response with id '{clip(response_id)}' not found.")


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as items (a text is one user message)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    return list(given)


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> ChatRequest:
    """The chat call of a Responses request, after `history` (the items of the conversation
    it continues; None: none kept). ValidationError for what is not served; pydantic's
    ValidationError for what the chat request's own model refuses."""
    if body.previous_response_id is not None and history is None:
        raise ValidationError(
            "previous_response_id needs responses kept: start the server with --responses-store-size"
        )
    refused = [
        ("conversation", body.conversation is not None),
        ("background", bool(body.background)),
        ("prompt", body.prompt is not None),
        ("max_tool_calls", body.max_tool_calls is not None),
        ('truncation "auto"', body.truncation == "auto"),
    ]
    for what, set_ in refused:
        if set_:
            raise ValidationError(f"{what} is not supported by this server")
    unknown = [item for item in body.include or () if item not in INCLUDABLE]
    if unknown:
        raise ValidationError(f"include {unknown[0]!r} is not supported by this server")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages([*(history or ()), *input_items(body.input)])
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream,
        "user": body.user,
    }
    if body.stream:
        fields["stream_options"] = {"include_usage": True}  # the usage of response.completed
    if LOGPROBS in (body.include or ()):
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    if body.tools:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if (fmt := _response_format((body.text or {}).get("format"))) is not None:
        fields["response_format"] = fmt
    if (effort := (body.reasoning or {}).get("effort")) is not None:
        fields["chat_template_kwargs"] = {"reasoning_effort": effort}
    return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def chat_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant message before it (or
    starts one), its output is a tool message, a reasoning item's text goes with the next
    assistant message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    thinking: list[str] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            role = str(item.get("role", ""))
            message: dict[str, Any] = {"role": ROLES.get(role, role), "content": _text(item.get("content"))}
            if role == "assistant" and thinking:
                message["reasoning_content"] = "".join(thinking)
                thinking.clear()
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or thinking:
                last = {"role": "assistant", "content": None}
                if thinking:
                    last["reasoning_content"] = "".join(thinking)
                    thinking.clear()
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else _text(output)
            messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": content}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise ValidationError("a reasoning item's content and summary must be lists of text parts")
            thinking.append("".join(str(p.get("text", "")) for p in parts))
        else:
            raise ValidationError(f"input items of type {kind!r} are not supported by this server")
    return messages


def _text(content: Any) -> str:
    """A message's content: a text, or its text parts joined (other parts refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError("input message content must be a text or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValidationError(f"input content of type {kind!r} is not supported by this server")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValidationError(f"tools of type {tool.get('type')!r} are not supported by this server")
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValidationError(f"tool_choice of type {choice.get('type')!r} is not supported by this server")


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert fmt is not None
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ValidationError(f"text.format {kind!r} is not supported by this server")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseShape:
    """One call's Response object and stream events, from its chat answer or chunks."""

    route = "v1/responses"
    door = "openai"

    def __init__(
        self, body: ResponsesRequest, model: str, keep: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """`keep`: what keeps the Response once it is whole (None: it is not kept)."""
        self.body = body
        self.model = model
        self.keep = keep
        self.id = _id("resp")
        self.created_at = int(time.time())

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return body  # the Responses API's errors are in OpenAI's shape

    def whole(self, response: dict[str, Any]) -> dict[str, Any]:
        """The call's last Response (completed, incomplete), kept where it is to be."""
        if self.keep is not None:
            self.keep(response)
        return response

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": self.keep is not None,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    # ---- unary ----------------------------------------------------------------------------

    def unary(self, answer: dict[str, Any]) -> dict[str, Any]:
        (choice,) = answer["choices"]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(message_item(_id("msg"), message.get("content") or "", "completed", logprobs))
        output += [call_item(_id("fc"), call, "completed") for call in calls]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if status == "incomplete" and "status" in output[-1]:  # the item the limit cut
            output[-1]["status"] = status
        return self.whole(self.response(status, output, _usage(answer.get("usage"))))

    # ---- streamed -------------------------------------------------------------------------

    async def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
        stream = _EventStream(self)
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        async with contextlib.aclosing(chunks) as chunks_:
            async for chunk in chunks_:
                if "error" in chunk:
                    for event in stream.failed(chunk["error"]):
                        yield event
                    return
                for event in stream.feed(chunk):
                    yield event
        for event in stream.end():
            yield event


class _EventStream:
    """The Responses stream's events of one call, item by item as the chat chunks come: each
    event numbered (`sequence_number`), each item opened, fed and closed in turn."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.item: dict[str, Any] | None = None  # the item being written
        self.text = ""  # its text (reasoning, message) or arguments (function_call)
        self.logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(payload, space=True)

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = _usage(chunk["usage"])
        events = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if thinking := delta.get("reasoning_content"):
                events += self._write("reasoning", thinking)
            if content := delta.get("content"):
                tokens = (choice.get("logprobs") or {}).get("content") or []
                events += self._write("message", content, tokens)
            for call in delta.get("tool_calls") or ():
                if "id" in call:  # a call begins
                    events += self._open_call(call)
                events += self._write("function_call", call.get("function", {}).get("arguments") or "")
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def _write(self, kind: str, text: str, tokens: list[dict[str, Any]] | None = None) -> list[str]:
        events = []
        if self.item is None or self.item["type"] != kind:
            events += self._close()
            events += self._open(kind)
        if not text:
            return events
        self.text += text
        if kind == "reasoning":
            events.append(
                self.event("response.reasoning_text.delta", **self._at(), content_index=0, delta=text)
            )
        elif kind == "message":
            self.logprobs += tokens or []
            events.append(
                self.event(
                    "response.output_text.delta",
                    **self._at(),
                    content_index=0,
                    delta=text,
                    logprobs=tokens or [],
                )
            )
        else:
            events.append(self.event("response.function_call_arguments.delta", **self._at(), delta=text))
        return events

    def _open(self, kind: str) -> list[str]:
        if kind == "reasoning":
            self.item = reasoning_item(_id("rs"), None)
        elif kind == "message":
            self.item = message_item(_id("msg"), None, "in_progress")
        else:
            raise AssertionError("a call opens with its id and name (_open_call)")
        events = [self.event("response.output_item.added", output_index=len(self.output), item=self.item)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        return events

    def _open_call(self, call: dict[str, Any]) -> list[str]:
        events = self._close()
        self.item = call_item(
            _id("fc"), {**call, "function": {**call["function"], "arguments": ""}}, "in_progress"
        )
        return [
            *events,
            self.event("response.output_item.added", output_index=len(self.output), item=self.item),
        ]

    def _close(self, last: bool = False) -> list[str]:
        """The events that end the item being written (none when there is none); `last`: the
        answer's last item, incomplete where the token limit cut it."""
        if self.item is None:
            return []
        status = "incomplete" if last and self.finish == "length" else "completed"
        kind, at, text = self.item["type"], self._at(), self.text
        events = []
        if kind == "reasoning":
            item = reasoning_item(self.item["id"], text)
            events.append(self.event("response.reasoning_text.done", **at, content_index=0, text=text))
        elif kind == "message":
            item = message_item(self.item["id"], text, status, self.logprobs)
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done", **at, content_index=0, text=text, logprobs=self.logprobs
                )
            )
            events.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        else:
            item = {**self.item, "arguments": text, "status": status}
            events.append(
                self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
            )
        events.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        self.output.append(item)
        self.item, self.text, self.logprobs = None, "", []
        return events

    def end(self) -> list[str]:
        events = []
        if self.item is None and not self.output:  # an empty answer is an empty message
            events += self._open("message")
        events += self._close(last=True)
        status = "incomplete" if self.finish == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        response = self.shape.whole(self.shape.response(status, self.output, self.usage))
        return [*events, self.event(kind, response=response)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        """The events of a call that failed after its stream began: an error, then the Response
        as failed (what was closed before stays in its output)."""
        message = str(error.get("message", ""))
        code = "server_error" if error.get("type") == "server_error" else "invalid_request"
        failed = {"code": code, "message": message}
        return [
            self.event("error", code=code, message=message, param=error.get("param")),
            self.event(
                "response.failed", response=self.shape.response("failed", self.output, self.usage, failed)
            ),
        ]


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    """A reasoning item (`text` None: opened, nothing written yet)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": None}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant message item of one output_text part (`text` None: opened, no part yet)."""
    parts = (
        []
        if text is None
        else [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
    )
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A function_call item of a chat tool call ({id, function: {name, arguments}})."""
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage["total_tokens"],
    }
