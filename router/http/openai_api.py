"""The OpenAI door: GET /v1/models, POST /v1/completions and /v1/chat/completions, streamed
(SSE, `data: [DONE]` last) or not, with OpenAI's parameter names and error shape (POST
/v1/responses reshapes chat calls: openai_responses.py).

The request bodies and their parameters: openai_params.py (OpenAI's defaults, vLLM's
extensions, what is refused).

`n` > 1 and lists of prompts run as separate requests in the same batch (one concurrency
permit each); their choices stream interleaved, each chunk naming its `index`.

`model` names the served model (MODEL_NAME, or left out) or, as vLLM serves LoRA adapters, an
adapter of the shards' store (PREFIX_STORE_PATH/<id>/ with an adapter_config.json: LoRA or
PEFT prompt tuning), which the request then runs with (TGIS's adapter_id); /v1/models lists the
served model and the store's adapters, each with the served model as its `parent`.

Status codes: 400 invalid_request_error (validation), 404 (an unknown model), 429 (overloaded),
500 server_error (generation failed), 503 (draining). A failure after a stream began is its
last event before `[DONE]`: {"error": {...}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from router.api.service import CallInfo, GenerationService, RequestError, UnknownAdapter
from router.core.entry import Output
from router.core.stopping import StopReason
from router.core.tokenizer import TokenizerPool
from router.core.validation import (
    Input,
    ValidatedRequest,
    ValidationError,
)
from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.http_calls import EventStream, sse, tenant_of, until_disconnected
from router.http.openai_params import (
    MAX_CHOICES,
    ChatMessage,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    StreamOptions,
    completion_prompts,
    request_params,
    template_variables,
    text_content,
    tool_mode_of,
    unsupported,
)
from router.http.openai_tools import (
    TEXT,
    HeldAnswer,
    Tool,
    ToolMode,
    merged,
    read,
    template_message,
    template_tools,
)
from router.http.reasoning import ReasoningFormat, ReasoningStream, split
from router.http.tool_parsers import ToolCallParser, call_id
from text_generation_common.defaults import storable_adapter_id
from text_generation_common.logs import clip
from text_generation_common.messages import AdapterListing, TokenInfo, truncated_ids

LOWEST_LOGPROB = -9999.0  # vLLM's stand-in for -inf in JSON answers
LISTING_TTL_S = 5.0  # /v1/models reads the adapter store at most this often
FINISH_REASONS = {StopReason.EOS_TOKEN: "stop", StopReason.STOP_SEQUENCE: "stop"}  # else "length"
STATUS = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "UNAUTHENTICATED": 401,
    "CANCELLED": 499,
}


def unknown_model(name: str) -> str:
    return f"The model `{clip(name)}` does not exist."


def call_kind(door: str, stream: bool) -> str:
    """A call's kind in the metrics (metrics.KINDS): its door's, `_stream` where it streams."""
    return f"{door}_stream" if stream else door


def error_json(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_reply(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An answer of `status` in OpenAI's error shape."""
    return JSONResponse(error_json(status, message, param), status, headers=headers)


def error_response(exc: RequestError, shape: AnswerShape | None = None) -> JSONResponse:
    """The refusal or failure in OpenAI's error shape, or in `shape`'s."""
    status = 500 if exc.cause == "generation" else STATUS.get(exc.code, 500)
    if shape is None:
        return error_reply(status, exc.message, exc.param)
    return JSONResponse(shape.error(status, error_json(status, exc.message, exc.param)), status)


class ChatPromptError(Exception):
    """Messages the chat template cannot render into a prompt; `param`: the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatParts(Protocol):
    """What a chat prompt is rendered from (a chat request's, or a chat tokenize request's)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[Tool] | None
    chat_template_kwargs: dict[str, Any] | None
    documents: list[dict[str, Any]] | None


class AnswerShape(Protocol):
    """Another route's wire format over a chat call (the Responses API, openai_responses.py;
    Anthropic's Messages API, anthropic_messages.py)."""

    route: str  # the call's name in spans and logs
    door: str  # the call's kind in the metrics (metrics.KINDS, less _stream)

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        """The route's error body for one in OpenAI's shape."""
        ...

    def unary(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The route's answer, from the chat completion's."""
        ...

    def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
        """The route's SSE events, from the chat completion's chunks (closes `chunks`)."""
        ...


@dataclass
class _Answer:
    """How to answer one OpenAI call: its requests (choice i = requests[i]) and the answer's fields."""

    id: str
    kind: str  # completion | chat
    requests: list[ValidatedRequest]
    prompts: list[str]  # each choice's prompt text, for echo (empty without echo)
    echo: bool
    logprobs: bool
    created: int
    model: str  # as the request named it: the served model or an adapter
    top_n: int = 0  # the likeliest tokens each logprob names (top_logprobs)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs and n likeliest per token
    token_ids: bool = False  # return_token_ids
    as_ids: bool = False  # return_tokens_as_token_ids
    tools: ToolMode = TEXT
    parser: ToolCallParser | None = None  # the model's call format, for the request's functions
    reasoning: ReasoningFormat | None = None  # a chat's thinking is split from its answer
    include_reasoning: bool = True  # the thinking is answered (reasoning_content)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


class OpenAIApi:
    """The routes, bound to the shared GenerationService."""

    def __init__(
        self,
        service: GenerationService,
        tokenizer: TokenizerPool,
        *,
        model_name: str,
        max_sequence_length: int,
        max_new_tokens: int,
        chat_template: ChatTemplate | None,
        tool_parser: ToolCallParser | None = None,
        reasoning: ReasoningFormat | None = None,
        sampling_defaults: Mapping[str, float] = MappingProxyType({}),
        list_adapters: Callable[[], Awaitable[AdapterListing]] | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        """`tool_parser`: the model's tool call format (TOOL_CALL_PARSER), for tool_choice "auto";
        `reasoning`: how the model writes its thinking (REASONING_PARSER), split from chat answers;
        `sampling_defaults`: the model's (generation_config.json), for what requests leave unset;
        `list_adapters`: the adapters of the shards' store, for /v1/models (None: none listed);
        `bos_token_id`: the model's (ModelInfo), put back first in a truncated prompt's ids."""
        self.service = service
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_sequence_length = max_sequence_length
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.sampling_defaults = sampling_defaults
        self.list_adapters = list_adapters
        self._listing = (-math.inf, AdapterListing())  # the last listing, and when it came
        self.bos_token_id = bos_token_id
        self.created = int(time.time())
        self.router = APIRouter(prefix="/v1", tags=["OpenAI"])
        self.router.add_api_route(
            "/models", self.models, methods=["GET"], summary="The served model and its adapters (OpenAI)"
        )
        self.router.add_api_route(
            "/models/{model:path}", self.model, methods=["GET"], summary="One model or adapter (OpenAI)"
        )
        self.router.add_api_route(
            "/completions", self.completions, methods=["POST"], summary="Completions (OpenAI)"
        )
        self.router.add_api_route(
            "/chat/completions", self.chat_completions, methods=["POST"], summary="Chat completions (OpenAI)"
        )

    # ---- routes ---------------------------------------------------------------------------

    async def models(self) -> Response:
        """The served model, then the adapters of the store that requests may name (vLLM's
        fields: `root`, and `parent` the served model; `truncated` when the listing was cut)."""
        listing = await self._adapters()
        if isinstance(listing, Response):
            return listing
        data = [self._model_entry(self.model_name, None)]
        data += [self._model_entry(adapter, self.model_name) for adapter in listing.ids]
        answer: dict[str, Any] = {"object": "list", "data": data}
        if listing.truncated:
            answer["truncated"] = True
        return JSONResponse(answer)

    async def model(self, model: str) -> Response:
        """OpenAI's retrieve: the served model's entry, or a listed adapter's; 404 otherwise."""
        if model == self.model_name:
            return JSONResponse(self._model_entry(model, None))
        listing = await self._adapters() if storable_adapter_id(model) else AdapterListing()
        if isinstance(listing, Response):
            return listing
        if model not in listing.ids:
            return error_reply(404, unknown_model(model))
        return JSONResponse(self._model_entry(model, self.model_name))

    async def _adapters(self) -> AdapterListing | Response:
        """The store's adapters, read at most every LISTING_TTL_S (clients poll /v1/models); a
        500 answer where the shard could not list them."""
        if self.list_adapters is None:
            return AdapterListing()
        listed_at, listing = self._listing
        if time.monotonic() - listed_at > LISTING_TTL_S:
            try:
                listing = await self.list_adapters()
            except Exception as exc:  # the shard's failure, answered rather than hidden
                return error_reply(500, f"could not list the adapters: {clip(str(exc))}")
            self._listing = time.monotonic(), listing
        return listing

    def adapters_changed(self) -> None:
        """Adapters were added or removed at run time: the next /v1/models lists them again."""
        self._listing = (-math.inf, AdapterListing())

    def _model_entry(self, name: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "text-generation-server",
            "root": name,
            "parent": parent,
            "max_model_len": self.max_sequence_length,
        }

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter id `model` names ("" for the served model), None for a name that no
        adapter can have."""
        if model is None or model == self.model_name:
            return ""
        return model if storable_adapter_id(model) else None

    def _adapter_named(self, body: CommonRequest) -> str:
        """The adapter id the request's `model` names; RequestError (404) for a name no adapter
        can have."""
        adapter = self.adapter_of(body.model)
        if adapter is None:
            raise self.service.refuse(unknown_model(body.model or ""), "NOT_FOUND")
        return adapter

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """Text completion of a prompt (or of each prompt of a list)."""
        prompts = completion_prompts(body.prompt)
        top_n = body.logprobs or 0
        return await self.serve(
            body, request, "completion", prompts, top_n, body.logprobs is not None, body.echo
        )

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        """The assistant's reply to the messages, rendered with the model's chat template (inside
        the call: a refusal of the messages is the call's)."""
        return await self.serve_chat(body, request)

    async def serve_chat(
        self, body: ChatRequest, request: Request, shape: AnswerShape | None = None
    ) -> Response:
        """The chat call of `body`, answered as a chat completion or as `shape` reshapes it."""
        top_n = (body.top_logprobs or 0) if body.logprobs else 0
        return await self.serve(body, request, "chat", None, top_n, body.logprobs, False, shape)

    def chat_prompt(self, body: ChatParts, *, keep_bos: bool = False) -> str:
        """The messages rendered with the model's chat template (`keep_bos`: ChatTemplate.render's);
        ChatPromptError when they cannot be."""
        if self.chat_template is None:
            message = (
                "this model has no chat template (its tokenizer_config.json has no chat_template): "
                "use /v1/completions"
            )
            raise ChatPromptError(message, "messages")
        if body.continue_final_message and body.add_generation_prompt:
            raise ChatPromptError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false"
            )
        try:
            messages = [
                template_message({**m.model_dump(exclude_none=True), "content": text_content(m)})
                for m in body.messages
            ]
            return self.chat_template.render(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=template_tools(body.tools),
                variables=template_variables(
                    body.chat_template_kwargs, getattr(body, "reasoning_effort", None)
                ),
                continue_final_message=body.continue_final_message,
                keep_bos=keep_bos,
                documents=body.documents,
            )
        except ValidationError as exc:
            raise ChatPromptError(str(exc)) from exc
        except ChatTemplateError as exc:
            raise ChatPromptError(str(exc), "messages") from exc

    # ---- the call -------------------------------------------------------------------------

    async def serve(
        self,
        body: CommonRequest,
        request: Request,
        kind: str,
        prompts: list[Input] | None,  # None: the chat's one prompt, rendered inside the call
        top_n: int,
        logprobs: bool,
        echo: bool,
        shape: AnswerShape | None = None,
    ) -> Response:
        """The call of `body`, answered as a chat completion or a completion (`kind`), or as
        `shape` reshapes that answer (another route's wire format over the same call)."""
        door = call_kind(shape.door if shape is not None else "openai", body.stream)
        count = (1 if prompts is None else len(prompts)) * body.n
        headers = list(request.headers.items())
        route = shape.route if shape is not None else f"v1/{kind}"
        call = self.service.open_call(door, route, headers, count, tenant_of(request))
        try:
            self._check(body, count)
            adapter = self._adapter_named(body)
            call.admit()
            try:
                params = request_params(
                    body,
                    max_new_tokens=self.max_new_tokens,
                    top_n=top_n,
                    logprobs=logprobs,
                    stream=body.stream,
                    tool_parser=self.tool_parser,
                    defaults=self.sampling_defaults,
                    reasoning=self.reasoning,
                )
            except ValidationError as exc:
                raise self.service.refuse(str(exc)) from exc
            if prompts is None:
                assert isinstance(body, ChatRequest)
                try:
                    prompts = [self.chat_prompt(body)]
                except ChatPromptError as exc:
                    raise self.service.refuse(str(exc), param=exc.param) from exc
            texts = [p for p in prompts for _ in range(body.n)]
            try:
                validated = await call.validate(texts, params, adapter_id=adapter)
            except UnknownAdapter as exc:  # counted as a validation failure once, by the service
                raise RequestError("NOT_FOUND", unknown_model(adapter), exc.cause) from None
            echoed = [t if isinstance(t, str) else self._decoded(t) for t in texts] if echo else []
        except RequestError as exc:
            call.close()
            return error_response(exc, shape)
        validated = _distinct_seeds(validated, body.seed)
        tools = tool_mode_of(body, self.tool_parser)
        answer = _Answer(
            id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}",
            kind=kind,
            requests=validated,
            prompts=echoed,
            echo=echo,
            logprobs=logprobs,
            created=int(time.time()),
            model=body.model or self.model_name,
            top_n=top_n,
            prompt_logprobs=body.prompt_logprobs,
            token_ids=body.return_token_ids,
            as_ids=body.return_tokens_as_token_ids,
            tools=tools,
            parser=self._parser_for(body, tools),
            # a chat's thinking is read apart (a constraint shapes the answer after it)
            reasoning=self.reasoning if params.reads_thinking else None,
            include_reasoning=getattr(body, "include_reasoning", True),
        )
        if body.stream:
            options = body.stream_options or StreamOptions()
            continuous = options.include_usage and options.continuous_usage_stats
            if shape is not None:
                chunks = self._chunks(answer, call.info, options.include_usage, continuous)
                return EventStream(shape.events(chunks), call)
            return EventStream(self._events(answer, call.info, options.include_usage, continuous), call)
        with call:
            try:
                outputs = await until_disconnected(request, self.service.generate(validated, call.info))
            except RequestError as exc:
                return error_response(exc, shape)
        whole = self._answer(answer, outputs)
        return JSONResponse(shape.unary(whole) if shape is not None else whole)

    def _parser_for(self, body: CommonRequest, tools: ToolMode) -> ToolCallParser | None:
        """The model's call format bound to the request's functions, where the model may call."""
        if tools.kind != "auto" or self.tool_parser is None or not isinstance(body, ChatRequest):
            return None
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools or ()}
        return self.tool_parser.for_tools(schemas)

    def _check(self, body: CommonRequest, count: int) -> None:
        """The door's own refusals, before admission (RequestError)."""
        if count > MAX_CHOICES:
            raise self.service.refuse(f"n x prompts must be <= {MAX_CHOICES}, got {count}")
        if count == 0:
            raise self.service.refuse("prompt must not be empty", param="prompt")
        if (refusal := unsupported(body)) is not None:
            raise self.service.refuse(refusal)
        if body.stream and body.prompt_logprobs is not None:  # vLLM's refusal and message
            message = "`prompt_logprobs` are not available when `stream=True`."
            raise self.service.refuse(message, param="prompt_logprobs")

    def _answer(self, answer: _Answer, outputs: Sequence[Output]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            echoed = answer.prompts[index] if answer.echo else ""
            text = echoed + output.text
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": _finish(output.stop_reason),
                "stop_reason": _stop_reason(output),
            }
            if answer.kind == "chat":
                thinking = None
                if answer.reasoning is not None:
                    thinking, text = split(answer.reasoning, text)
                reading = read(answer.tools, text, answer.parser)
                choice["message"] = {"role": "assistant", "content": reading.content}
                if thinking is not None and answer.include_reasoning:
                    choice["message"]["reasoning_content"] = thinking
                if reading.calls is not None:
                    choice["message"]["tool_calls"] = reading.calls
                choice["finish_reason"] = reading.finish or choice["finish_reason"]
                choice["logprobs"] = self._chat_logprobs(output.tokens, answer) if answer.logprobs else None
            else:
                choice["text"] = text
                choice["logprobs"] = (
                    self._completion_logprobs(output, len(echoed), answer) if answer.logprobs else None
                )
                if answer.token_ids:
                    choice["prompt_token_ids"] = self._prompt_ids(answer.requests[index])
                if answer.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(output, answer)
            if answer.token_ids:
                choice["token_ids"] = [t.token_id for t in output.tokens]
            choices.append(choice)
        whole = {
            "id": answer.id,
            "object": answer.object,
            "created": answer.created,
            "model": answer.model,
            "choices": choices,
            "usage": _usage(answer.requests, outputs),
        }
        if answer.token_ids and answer.kind == "chat":  # one prompt for every choice
            whole["prompt_token_ids"] = self._prompt_ids(answer.requests[0])
        if answer.prompt_logprobs is not None and answer.kind == "chat":
            whole["prompt_logprobs"] = self._prompt_logprobs(outputs[0], answer)
        return whole

    def _prompt_ids(self, request: ValidatedRequest) -> list[int]:
        """The prompt's ids as the model reads them (a truncated one's last ids, BOS first)."""
        return truncated_ids(request.input_ids, request.truncate_input_tokens, self.bos_token_id)

    async def _events(
        self, answer: _Answer, info: CallInfo, usage: bool, continuous: bool = False
    ) -> AsyncGenerator[str, None]:
        """The chunks as SSE events, then [DONE]."""
        async with contextlib.aclosing(self._chunks(answer, info, usage, continuous)) as chunks:
            async for chunk in chunks:
                yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def _chunks(
        self, answer: _Answer, info: CallInfo, usage: bool, continuous: bool = False
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The chunks of every choice as its tokens come, then usage (if asked); a failure is
        the last, as {"error": ...}. `continuous`: every choice's chunk with its usage so far too."""
        queue: asyncio.Queue[tuple[int, Output | RequestError | None]] = asyncio.Queue()

        async def pump(index: int, v: ValidatedRequest) -> None:
            try:
                async with contextlib.aclosing(self.service.stream(v, info)) as outputs:
                    async for output in outputs:
                        queue.put_nowait((index, output))
            except RequestError as exc:
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        pumps = [asyncio.ensure_future(pump(i, v)) for i, v in enumerate(answer.requests)]
        final: dict[int, Output] = {}
        held: dict[int, HeldAnswer] = {}
        thoughts: dict[int, ReasoningStream] = {}
        unsent: dict[int, list[TokenInfo]] = {}  # tokens of text held back, for their logprobs
        offsets = [len(answer.prompts[i]) if answer.echo else 0 for i in range(len(answer.requests))]
        generated = [0] * len(answer.requests)

        prompted: set[int] = set()  # return_token_ids: the choices whose prompt ids went out

        def sent(chunk: dict[str, Any], index: int) -> dict[str, Any]:
            if answer.token_ids and index not in prompted:
                ids = self._prompt_ids(answer.requests[index])
                if answer.kind != "chat":
                    chunk["choices"][0]["prompt_token_ids"] = ids
                elif not prompted:  # a chat's one prompt, in the first chunk
                    chunk["prompt_token_ids"] = ids
                prompted.add(index)
            if continuous:
                prompt, made = answer.requests[index].input_length, generated[index]
                chunk["usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": made,
                    "total_tokens": prompt + made,
                }
            return chunk

        try:
            if answer.kind == "chat":
                for index in range(len(answer.requests)):
                    yield sent(self._chunk(answer, index, _opening(answer.tools), None, None), index)
            elif answer.echo:
                for index in range(len(answer.requests)):
                    yield sent(self._chunk(answer, index, answer.prompts[index], None, None), index)
            running = len(pumps)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, RequestError):
                    yield error_json(500 if item.cause == "generation" else 400, item.message)
                    break
                if item.final:
                    final[index] = item
                generated[index] = max(generated[index], item.generated_tokens)
                if answer.reasoning is not None:
                    thought = thoughts.setdefault(index, ReasoningStream(answer.reasoning))
                    chunk, answered = self._think(answer, index, thought, item, unsent)
                    if chunk is not None:
                        yield sent(chunk, index)
                    if answered is None:
                        continue
                    item = answered
                if answer.tools.kind in ("auto", "required"):  # calls read from the answer (HeldAnswer)
                    held.setdefault(index, HeldAnswer(answer.tools, answer.parser))
                    if (chunk := self._held_chunk(answer, index, held[index], item)) is not None:
                        yield sent(chunk, index)
                    continue
                yield sent(self._delta(answer, index, item, offsets), index)
                offsets[index] += len(item.text)
            else:
                if usage:
                    outputs = [final[i] for i in range(len(answer.requests))]
                    yield self._chunk(answer, None, None, None, None) | {
                        "usage": _usage(answer.requests, outputs)
                    }
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _think(
        self,
        answer: _Answer,
        index: int,
        thought: ReasoningStream,
        output: Output,
        unsent: dict[int, list[TokenInfo]],
    ) -> tuple[dict[str, Any] | None, Output | None]:
        """A streamed output split into thinking and answer: the chunk of its thinking (if any),
        and the output with its answer's text only (None: nothing of it to send yet). Tokens
        go out with the thinking where no answer text comes with them."""
        thinking, text = thought.feed(output.text)
        if output.final:
            more_thinking, more_text = thought.end()
            thinking, text = thinking + more_thinking, text + more_text
        tokens = unsent.pop(index, []) + output.tokens
        chunk = None
        if thinking:
            if answer.include_reasoning:
                chunk = self._chunk(
                    answer, index, {"reasoning_content": thinking}, None, None if text else tokens
                )
            if not text:
                tokens = []
        if not text and not output.final:
            if tokens:
                unsent[index] = tokens
            return chunk, None
        return chunk, replace(output, text=text, tokens=tokens)

    def _delta(self, answer: _Answer, index: int, output: Output, offsets: list[int]) -> dict[str, Any]:
        finish = _finish(output.stop_reason) if output.final else None
        if answer.kind == "chat":
            if not output.text and finish:
                delta: dict[str, Any] = {}
            elif answer.tools.kind == "named":
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": output.text}}]}
            else:
                delta = {"content": output.text}
            return _stopped(self._chunk(answer, index, delta, finish, output.tokens), output)
        logprobs = self._completion_logprobs(output, offsets[index], answer) if answer.logprobs else None
        return _stopped(self._chunk(answer, index, output.text, finish, output.tokens, logprobs), output)

    def _held_chunk(
        self, answer: _Answer, index: int, held: HeldAnswer, output: Output
    ) -> dict[str, Any] | None:
        """The chunk (if any) of a choice whose answer may hold calls (HeldAnswer): the content
        that is text for sure and the calls' deltas as they come; at the end the rest. Token
        logprobs go out with the next chunk sent."""
        held.tokens.extend(output.tokens)
        content, calls = held.add(output.text)
        delta: dict[str, Any] = {"content": content} if content else {}
        if not output.final:
            if calls:
                delta["tool_calls"] = calls
            return self._held_send(answer, index, held, delta, None) if delta else None
        reading, more = held.end()
        if reading.content:
            delta["content"] = content + reading.content
        if calls or more:
            delta["tool_calls"] = merged(calls + more)
        chunk = self._held_send(answer, index, held, delta, reading.finish or _finish(output.stop_reason))
        return _stopped(chunk, output)

    def _held_send(
        self, answer: _Answer, index: int, held: HeldAnswer, delta: dict[str, Any], finish: str | None
    ) -> dict[str, Any]:
        tokens, held.tokens = held.tokens, []
        return self._chunk(answer, index, delta, finish, tokens)

    def _chunk(
        self,
        answer: _Answer,
        index: int | None,
        content: Any,
        finish: str | None,
        tokens: Sequence[TokenInfo] | None = None,
        logprobs: Any = None,
    ) -> dict[str, Any]:
        """One streamed chunk; `tokens`: those whose text it carries (a chat's logprobs and the
        token ids are made of them; a completion's `logprobs` come made); None for the chunks
        that carry no generated text (openings, echo)."""
        chunk: dict[str, Any] = {
            "id": answer.id,
            "object": "chat.completion.chunk" if answer.kind == "chat" else "text_completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [],
        }
        if index is not None:
            if answer.kind == "chat" and answer.logprobs and tokens is not None:
                logprobs = self._chat_logprobs(tokens, answer)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
            choice["delta" if answer.kind == "chat" else "text"] = content
            if answer.token_ids:
                choice["token_ids"] = [t.token_id for t in tokens or ()]
            chunk["choices"] = [choice]
        return chunk

    # ---- token details --------------------------------------------------------------------

    def _decoded(self, ids: Sequence[int]) -> str:
        """A prompt given as token ids, as text (for echo)."""
        text: str = self.tokenizer.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def _name(self, token_id: int, as_ids: bool) -> str:
        """How logprobs name a token: its text, or (return_tokens_as_token_ids) `token_id:<id>`."""
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    def _completion_logprobs(self, output: Output, offset: int, answer: _Answer) -> dict[str, Any]:
        """The output's tokens' logprobs, after the prompt's with echo: offsets from 0, the first
        one's logprob (which nothing predicts) null, as vLLM answers them; tokens named by id
        with `as_ids` (the offsets still count the text)."""
        pieces, offsets, logprobs, tops = [], [], [], []
        prompt = (output.input_tokens or ()) if answer.echo else ()
        for tokens_, at in ((prompt, 0), (output.tokens, offset)):
            for t in tokens_:
                pieces.append(self._name(t.token_id, answer.as_ids))
                offsets.append(at)
                at += len(self.tokenizer.token_text(t.token_id))
                first = t.logprob != t.logprob  # NaN: the prompt's first token
                logprobs.append(None if first else t.logprob)
                top = {self._name(x.token_id, answer.as_ids): x.logprob for x in t.top_tokens[: answer.top_n]}
                tops.append(None if first else top)
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, tokens: Sequence[TokenInfo], answer: _Answer) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            piece = self.tokenizer.token_text(token_id)
            name = self._name(token_id, answer.as_ids)
            return {"token": name, "logprob": logprob, "bytes": list(piece.encode())}

        return {
            "content": [
                entry(t.token_id, t.logprob)
                | {"top_logprobs": [entry(top.token_id, top.logprob) for top in t.top_tokens[: answer.top_n]]}
                for t in tokens
            ]
        }

    def _prompt_logprobs(self, output: Output, answer: _Answer) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first (nothing predicts it),
        else {"<id>": {"logprob", "rank", "decoded_token"}} of the token, then of the
        `prompt_logprobs` likeliest (rank 1 first; the token once where it is among them)."""

        def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
            # as vLLM writes an impossible token's logprob (JSON has no infinities)
            value = max(logprob, LOWEST_LOGPROB)
            return {"logprob": value, "rank": rank, "decoded_token": self._name(token_id, answer.as_ids)}

        answers: list[dict[str, Any] | None] = []
        for t in output.input_tokens or ():
            if t.logprob != t.logprob:  # NaN: the first token (every token of an encoder's prompt)
                answers.append(None)
                continue
            ranked = {str(t.token_id): entry(t.token_id, t.logprob, t.rank)}
            for rank, top in enumerate(t.top_tokens[: answer.prompt_logprobs], 1):
                ranked.setdefault(str(top.token_id), entry(top.token_id, top.logprob, rank))
            answers.append(ranked)
        return answers


def _distinct_seeds(requests: list[ValidatedRequest], seed: int | None) -> list[ValidatedRequest]:
    """With a seed and several choices, choice i samples with seed + i (else all would agree)."""
    if seed is None or len(requests) == 1:
        return requests
    return [
        r if r.sampling.greedy else replace(r, sampling=replace(r.sampling, seed=(seed + i) % 2**63))
        for i, r in enumerate(requests)
    ]


def _opening(tools: ToolMode) -> dict[str, Any]:
    """A chat choice's first streamed delta: the role, and a named call's id and name."""
    if tools.kind in ("text", "auto"):
        return {"role": "assistant", "content": ""}
    opening: dict[str, Any] = {"role": "assistant", "content": None}
    if tools.kind == "named":
        call = {"id": call_id(), "type": "function", "function": {"name": tools.name, "arguments": ""}}
        opening["tool_calls"] = [{"index": 0, **call}]
    return opening


def _finish(reason: StopReason) -> Literal["stop", "length"]:
    return "stop" if FINISH_REASONS.get(reason) else "length"


def _stop_reason(output: Output) -> str | int | None:
    """vLLM's `stop_reason`: the stop sequence or the request's stop token id that ended the
    answer; None for the model's EOS and the token limit."""
    if output.stop_reason is StopReason.STOP_SEQUENCE:
        return output.stop_sequence
    return output.stop_token


def _stopped(chunk: dict[str, Any], output: Output) -> dict[str, Any]:
    """A streamed chunk, with its choice's `stop_reason` where it is the choice's last."""
    if output.final:
        chunk["choices"][0]["stop_reason"] = _stop_reason(output)
    return chunk


def _usage(requests: Sequence[ValidatedRequest], outputs: Sequence[Output]) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the shard found in its prefix cache (cached_tokens)
    and the tokens of a reasoning model's thinking (reasoning_tokens: with REASONING_PARSER)."""
    prompt = sum(r.input_length for r in requests)
    completion = sum(o.generated_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outputs)},
        "completion_tokens_details": {"reasoning_tokens": sum(o.reasoning_tokens for o in outputs)},
    }


def _sse(payload: dict[str, Any]) -> str:
    return sse(payload, space=True)
