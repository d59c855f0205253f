"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), as the
`anthropic` client and tools built on it (Claude Code among them) call it, and as vLLM serves
it: a request becomes a chat call of the OpenAI door (openai_api.py: the same validation, chat
template, tool calling, reasoning split and guided decoding), and its answer, or its stream of
chunks, is reshaped into a Message, or the Messages stream's events.

Input: `system` (a text or text blocks), `messages` of role user / assistant whose content is a
text or blocks: text; tool_use (an assistant's call, back to the template as its tool_calls);
tool_result (the call's output, a tool message); thinking (the next assistant message's
reasoning_content). `tools` (name, description, input_schema), `tool_choice` (auto, any: at
least one call, tool: that one, none; `disable_parallel_tool_use`), `max_tokens`,
`stop_sequences`, `temperature`, `top_p`, `top_k` (gone from the 2026 client's signature: its
`extra_body`), `metadata.user_id`, `output_config` (`effort`: the chat template's
reasoning_effort; `format` json_schema: guided decoding), `thinking` (`type` enabled or adaptive
/ disabled turns the chat template's thinking switches on / off: Qwen3's `enable_thinking`,
Granite's and DeepSeek's `thinking`; with REASONING_PARSER, `budget_tokens` caps the thinking
as the chat door's `thinking_token_budget` does). Output blocks: thinking (where
REASONING_PARSER splits the answer), text, tool_use; `stop_reason` end_turn, max_tokens,
stop_sequence (with `stop_sequence`) or tool_use. `cache_control` marks are accepted (the
prefix cache needs none), as are `service_tier`, `speed`, `inference_geo`, `diagnostics`,
`user_profile_id`, `workspace_id`, and `anthropic-version` / `anthropic-beta` headers.
Images, documents, server tools (web search, code execution, ...), MCP servers and containers
are refused with 400, by name. Errors are in Anthropic's shape: {"type": "error", "error":
{"type", "message"}}.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as BodyError

from router.api.service import RequestError
from router.core.validation import ValidationError
from router.http.http_calls import describe_validation, refuse_body, sse
from router.http.openai_api import ChatPromptError, OpenAIApi, call_kind, error_response, unknown_model
from router.http.openai_params import ChatRequest

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn / stop_sequence
THINKING = {"enabled": True, "adaptive": True, "disabled": False}  # `thinking.type` -> thinking on


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """The request body: Anthropic's fields; those for what this server does not run are
    refused when set."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # effort: the chat template's reasoning_effort; format: guided decoding by its JSON Schema
    output_config: dict[str, Any] | None = None
    # type enabled / adaptive / disabled: the chat template's thinking switches; budget_tokens: the
    # most the thinking may take, where the server reads the model's thinking (REASONING_PARSER)
    thinking: dict[str, Any] | None = None
    # accepted, no effect here (the prefix cache needs no marks; one tier, one place, one speed)
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused when set
    container: str | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    context_management: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """/v1/messages/count_tokens: a request without what generation needs."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class MessagesApi:
    """POST /v1/messages and /v1/messages/count_tokens on the OpenAI door's router."""

    def __init__(self, openai: OpenAIApi) -> None:
        self.openai = openai
        openai.router.add_api_route(
            "/messages", self.create, methods=["POST"], summary="Messages (Anthropic's Messages API)"
        )
        openai.router.add_api_route(
            "/messages/count_tokens",
            self.count_tokens,
            methods=["POST"],
            summary="The input tokens of a Messages request (Anthropic's)",
        )

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        try:
            chat = chat_request(body, budgets=self.openai.reasoning is not None)
        except ValidationError as exc:
            return self._refused(request, str(exc), body.stream)
        except BodyError as exc:
            return self._refused(request, describe_validation(exc), body.stream)
        return await self.openai.serve_chat(chat, request, MessageShape(body.model))

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        if self.openai.adapter_of(body.model) is None:
            return _error_reply(404, unknown_model(body.model))
        try:
            fields = {**body.model_dump(exclude_none=True), "max_tokens": 1}
            chat = chat_request(MessagesRequest.model_validate(fields))
            text = self.openai.chat_prompt(chat)
        except (ValidationError, ChatPromptError) as exc:
            return _error_reply(400, str(exc))
        except BodyError as exc:
            return _error_reply(400, describe_validation(exc))
        pool = self.openai.tokenizer

        def job() -> tuple[dict[str, int], int]:
            count = len(pool.tokenizer.encode(text, add_special_tokens=True).ids)
            return {"input_tokens": count}, count

        try:
            return JSONResponse(await self.openai.service.tokenize(pool, [text], job))
        except RequestError as exc:
            return error_response(exc, MessageShape(body.model))

    def _refused(self, request: Request, message: str, stream: bool) -> Response:
        """A body the conversion refuses: one validation failure of the route's kind, 400."""
        kind = call_kind(MessageShape.door, stream)
        refuse_body(self.openai.service, request, kind, MessageShape.route, message)
        return _error_reply(400, message)


def _error_reply(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message), status)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def chat_request(body: MessagesRequest, *, budgets: bool = False) -> ChatRequest:
    """The chat call of a Messages request (ValidationError for what is not served; pydantic's
    ValidationError for what the chat request's own model refuses)."""
    for what, given in (
        ("container", body.container is not None),
        ("mcp_servers", bool(body.mcp_servers)),
        ("context_management", body.context_management is not None),
    ):
        if given:
            raise ValidationError(f"{what} is not supported by this server")
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for message in body.messages:
        messages += chat_messages(message)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_tokens,
        "stop": body.stop_sequences,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stream": body.stream,
        "user": (body.metadata or {}).get("user_id"),
    }
    if body.stream:  # the prompt's tokens in message_start, the answer's in message_delta
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if body.tools:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        choice, parallel = _chat_tool_choice(body.tool_choice)
        fields["tool_choice"], fields["parallel_tool_calls"] = choice, parallel
    output = body.output_config or {}
    variables: dict[str, Any] = {}
    if (effort := output.get("effort")) is not None:
        variables["reasoning_effort"] = effort
    if (switch := THINKING.get(str((body.thinking or {}).get("type")))) is not None:
        # the switches chat templates read: Qwen3's enable_thinking, Granite's and DeepSeek's thinking
        variables |= {"enable_thinking": switch, "thinking": switch}
        if switch and budgets:  # a server that reads the model's thinking holds it to the budget
            fields["thinking_token_budget"] = (body.thinking or {}).get("budget_tokens")
    if variables:
        fields["chat_template_kwargs"] = variables
    if (fmt := output.get("format")) is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise ValidationError(f"output_config.format {kind!r} is not supported by this server")
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.get("schema")},
        }
    return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def chat_messages(message: InputMessage) -> list[dict[str, Any]]:
    """One input message as chat messages: a user's tool results are tool messages (before its
    text), an assistant's tool uses its tool_calls and its thinking its reasoning_content."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, thinking, results = [], [], [], []
    for block in message.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            function = {"name": str(block.get("name", "")), "arguments": arguments}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            thinking.append(str(block.get("thinking", "")))  # redacted: nothing to give back
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            output = _text(content) if content else ""
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": output}
            )
        else:
            raise ValidationError(f"{message.role} content of type {kind!r} is not supported by this server")
    if message.role == "user":
        return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]
    answer: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        answer["tool_calls"] = calls
    if thinking:
        answer["reasoning_content"] = "".join(thinking)
    return [answer]


def _text(content: Any) -> str:
    """A text, or text blocks joined (other blocks refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError("content must be a text or a list of text blocks")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise ValidationError(f"content of type {kind!r} is not supported by this server")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type", "custom")
    if kind != "custom" or "name" not in tool:
        raise ValidationError(f"tools of type {kind!r} are not supported by this server")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise ValidationError(f"tool_choice of type {kind!r} is not supported by this server")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _stop(finish: str | None, stop_reason: Any, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish and vLLM's
    stop_reason (the stop sequence that ended it); `called`: the answer holds a tool use (a
    forced call's chat finish is `stop`, Anthropic's `tool_use`)."""
    if finish is None:
        return None, None
    if finish in STOP_REASONS:
        return STOP_REASONS[finish], None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> Any:
    """A call's arguments as tool_use input: the object, or the text where it does not parse
    (a call cut by max_tokens)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class MessageShape:
    """One call's Message and stream events, from its chat answer or chunks."""

    route = "v1/messages"
    door = "anthropic"

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = _id("msg")

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return anthropic_error(status, str(body["error"]["message"]))

    def message(self, content: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": message_usage(usage),
        }

    def unary(self, answer: dict[str, Any]) -> dict[str, Any]:
        (choice,) = answer["choices"]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function["name"],
                    "input": _input(function["arguments"]),
                }
            )
        whole = self.message(content, answer.get("usage"))
        called = any(block["type"] == "tool_use" for block in content)
        whole["stop_reason"], whole["stop_sequence"] = _stop(
            choice["finish_reason"], choice.get("stop_reason"), called
        )
        return whole

    async def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
        stream = _EventStream(self)
        async with contextlib.aclosing(chunks) as chunks_:
            async for chunk in chunks_:
                if "error" in chunk:
                    status = int(chunk["error"].get("code") or 500)
                    yield _event("error", anthropic_error(status, str(chunk["error"].get("message", ""))))
                    return
                for event in stream.feed(chunk):
                    yield event
        for event in stream.end():
            yield event


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\n" + sse(payload, space=True)


def message_usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage of a chat call's: the prompt tokens the shard found in its prefix cache
    are cache_read_input_tokens, and input_tokens the others, as Anthropic counts them."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.get("completion_tokens", 0),
    }


class _EventStream:
    """The Messages stream's events of one call, block by block as the chat chunks come."""

    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = -1  # its index
        self.usage: dict[str, Any] | None = None
        self.finish: tuple[str | None, Any] = (None, None)  # the chat's finish and stop_reason
        self.called = False  # a tool_use block was sent

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        events = []
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            message = self.shape.message([], self.usage)
            events.append(_event("message_start", {"type": "message_start", "message": message}))
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if thinking := delta.get("reasoning_content"):
                events += self._write("thinking", {"type": "thinking_delta", "thinking": thinking})
            if text := delta.get("content"):
                events += self._write("text", {"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or ():
                function = call.get("function", {})
                if "id" in call:  # a call begins (a forced one streams its arguments after)
                    self.called = True
                    events += self._close()
                    block = {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": function.get("name", ""),
                        "input": {},
                    }
                    events += self._open("tool_use", block)
                if arguments := function.get("arguments"):
                    events += self._delta({"type": "input_json_delta", "partial_json": arguments})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"], choice.get("stop_reason")
        return events

    def _write(self, kind: str, delta: dict[str, Any]) -> list[str]:
        events = []
        if self.block != kind:
            events += self._close()
            start = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events += self._open(kind, start)
        return events + self._delta(delta)

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        self.block, self.index = kind, self.index + 1
        payload = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [_event("content_block_start", payload)]

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        payload = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return [_event("content_block_delta", payload)]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def end(self) -> list[str]:
        events = self._close()
        reason, sequence = _stop(*self.finish, self.called)
        usage = message_usage(self.usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        return [*events, _event("message_stop", {"type": "message_stop"})]
