"""The HF TGI REST door: POST /generate, /generate_stream (SSE), / (either, by `stream`),
/tokenize and GET /info, with TGI's parameter names, defaults, answers and error shape.

Parameters become RequestParams and go through the same validation as gRPC (TGIS's messages).
Where TGI and TGIS differ, TGI's behaviour wins at this door:
  - sampling is on with `do_sample` or when any of temperature, top_k, top_p, typical_p is
    set to a value other than its neutral one (1.0, 0, 1.0, 1.0), as TGI decides; a
    temperature of 0 means greedy (TGI refuses it);
  - max_new_tokens defaults to 100 (at most the server's MAX_NEW_TOKENS); 0 is refused;
  - stop sequences stay in the generated text; return_full_text puts the prompt in front;
  - stream events carry one token each (ids, logprobs, `special`), the last one the whole
    text and the details;
  - frequency_penalty (-2.0 to 2.0) as TGI applies it: each token's score less the penalty
    times the token's share of the text so far (its count over the prompt and the generated
    tokens, divided by their number; TGI divides by its padded batch's longest text instead).
  - best_of n (<= MAX_BEST_OF, sampling only, no seed, not streamed, TGI's rules and messages):
    n sampled answers, the one of the highest sum of token logprobs returned, the others in
    details.best_of_sequences.
Parameters TGI has and this server does not serve (watermark) are refused with 422, never
ignored; unknown ones too. `grammar` is guided decoding:
{"type": "json", "value": <JSON Schema>} or {"type": "regex", "value": <regex>}.

Status codes: 422 validation (error_type "validation"), 429 overloaded (over
MAX_CONCURRENT_REQUESTS, or too much text waiting for tokenization), 424 generation (the
request failed while generating), 503 unavailable (draining). A failure after a stream began
is its last event: {"error": ..., "error_type": "generation"}.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from router.api.service import Call, CallInfo, GenerationService, RequestError
from router.core.entry import Output
from router.core.stopping import StopReason
from router.core.tokenizer import TokenizerPool
from router.core.validation import (
    MAX_STOP_SEQUENCES,
    RequestParams,
    ResponseSpec,
    StoppingSpec,
    ValidatedRequest,
    http_sampling,
)
from router.http.http_calls import EventStream, sse, tenant_of, until_disconnected
from text_generation_common.guided import schema_text
from text_generation_common.messages import Guided, GuidedKind, TokenInfo

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's
HTTP_STATUS = {
    "INVALID_ARGUMENT": 422,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "UNAUTHENTICATED": 401,
    "CANCELLED": 499,  # the client is gone; nobody reads it
}
ERROR_TYPES = {
    "validation": "validation",
    "overloaded": "overloaded",
    "tokenizer_busy": "overloaded",
    "draining": "unavailable",
    "generation": "generation",
}
FINISH_REASONS = {
    StopReason.MAX_TOKENS: "length",
    StopReason.TOKEN_LIMIT: "length",
    StopReason.TIME_LIMIT: "length",
    StopReason.EOS_TOKEN: "eos_token",
    StopReason.STOP_SEQUENCE: "stop_sequence",
}


class Grammar(BaseModel):
    """TGI's grammar parameter."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "regex"]
    value: Any


def guided_of(grammar: Grammar | None) -> Guided | None:
    if grammar is None:
        return None
    if grammar.type == "json":
        return Guided(GuidedKind.JSON_SCHEMA, schema_text(grammar.value))
    return Guided(GuidedKind.REGEX, str(grammar.value))


class Parameters(BaseModel):
    """TGI's generation parameters (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")

    adapter_id: str | None = Field(
        default=None, description="a stored adapter or soft prompt (TGIS's adapter_id)"
    )
    best_of: int | None = Field(
        default=None, description="n sampled answers, the likeliest returned (<= max_best_of in /info)"
    )
    decoder_input_details: bool = Field(default=False, description="return the prompt's tokens with logprobs")
    details: bool = Field(default=False, description="return finish reason, token ids, logprobs and seed")
    do_sample: bool = Field(default=False, description="sample instead of greedy decoding")
    frequency_penalty: float | None = Field(
        default=None, description="-2.0 to 2.0; 0 = off: less this times the token's share of the text"
    )
    grammar: Grammar | None = Field(default=None, description="guided decoding: a JSON schema or a regex")
    max_new_tokens: int | None = Field(default=None, ge=1, description=f"default {DEFAULT_MAX_NEW_TOKENS}")
    repetition_penalty: float | None = Field(default=None, description="> 0; 1.0 = off")
    return_full_text: bool | None = Field(
        default=False, description="put the prompt in front of the generated text"
    )
    seed: int | None = Field(default=None, ge=0, lt=2**64, description="sampling seed")
    stop: list[str] = Field(default_factory=list, description="stop sequences (kept in the text)")
    temperature: float | None = Field(default=None, description="0 = greedy; else >= 0.05")
    top_k: int | None = Field(default=None, description="> 0")
    top_n_tokens: int | None = Field(
        default=None, ge=0, description="the n most likely tokens at each step (<= 10)"
    )
    top_p: float | None = Field(default=None, description="in (0, 1]")
    truncate: int | None = Field(default=None, ge=0, description="keep only the prompt's last n tokens")
    typical_p: float | None = Field(default=None, description="<= 1.0")
    watermark: bool = Field(default=False, description="not served: false only")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str
    parameters: Parameters = Field(default_factory=lambda: Parameters())
    stream: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str
    parameters: Parameters | None = None  # accepted as TGI does; tokenization ignores them


def unsupported(p: Parameters) -> str | None:
    """Why TGI parameters this server does not serve refuse the request, or None."""
    if p.watermark:
        return "watermark is not supported by this server"
    return None


def best_of_refusal(p: Parameters, *, stream: bool, max_best_of: int) -> str | None:
    """TGI's checks of best_of, with its messages (None: fine)."""
    n = 1 if p.best_of is None else p.best_of
    if not 0 < n <= max_best_of:
        return f"`best_of` must be > 0 and <= {max_best_of}. Given: {n}"
    if n > 1 and stream:
        return "`best_of` != 1 is not allowed for this endpoint"
    if n > 1 and not _sampling_wanted(p):
        return "you must use sampling when `best_of` is > 1"
    if n > 1 and p.seed is not None:
        return "`seed` must not be set when `best_of` > 1"
    return None


def _sampling_wanted(p: Parameters) -> bool:
    """TGI's rule: do_sample, or any sampling parameter away from its neutral value."""
    if p.temperature == 0.0:
        return False
    return (
        p.do_sample
        or p.temperature not in (None, 1.0)
        or p.top_k not in (None, 0)
        or p.top_p not in (None, 1.0)
        or p.typical_p not in (None, 1.0)
    )


def request_params(p: Parameters, *, stream: bool, max_new_tokens: int) -> RequestParams:
    """TGI's parameters -> RequestParams (validated afterwards like every door's)."""
    sampling = http_sampling(
        _sampling_wanted(p),
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        typical_p=p.typical_p,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty,
        guided=guided_of(p.grammar),
        frequency_penalty=p.frequency_penalty,
        frequency_by_length=bool(p.frequency_penalty),
    )
    top_n = p.top_n_tokens or 0
    tokens = p.details or stream or top_n > 0
    return RequestParams(
        sampling=sampling,
        stopping=StoppingSpec(
            max_new_tokens=p.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens),
            stop_sequences=tuple(p.stop),
            include_stop_sequence=True,
        ),
        response=ResponseSpec(
            input_text=bool(p.return_full_text),
            generated_tokens=tokens,
            input_tokens=p.decoder_input_details,
            token_logprobs=tokens or p.decoder_input_details,
            top_n_tokens=top_n,
        ),
        truncate_input_tokens=p.truncate or 0,
    )


def error_response(exc: RequestError) -> JSONResponse:
    status = HTTP_STATUS.get(exc.code, 424 if exc.cause == "generation" else 500)
    return JSONResponse({"error": exc.message, "error_type": ERROR_TYPES.get(exc.cause, exc.cause)}, status)


class TgiRest:
    """The routes, bound to the shared GenerationService."""

    def __init__(
        self,
        service: GenerationService,
        tokenizer: TokenizerPool,
        *,
        info: dict[str, Any],
        max_new_tokens: int,
    ) -> None:
        """`info`: /info's fields (info_fields), max_best_of among them."""
        self.service = service
        self.tokenizer = tokenizer
        self.info_fields = info
        self.max_new_tokens = max_new_tokens
        self.max_best_of = int(info.get("max_best_of", 1))
        raw = tokenizer.tokenizer
        self._special = {i for i, t in raw.get_added_tokens_decoder().items() if t.special}
        self.router = APIRouter(tags=["HF TGI"])
        self.router.add_api_route("/generate", self.generate, methods=["POST"], summary="Generate (TGI)")
        self.router.add_api_route(
            "/generate_stream",
            self.generate_stream,
            methods=["POST"],
            summary="Generate, streamed as SSE (TGI)",
        )
        self.router.add_api_route(
            "/", self.compat, methods=["POST"], summary="Generate or stream, by `stream` (TGI)"
        )
        self.router.add_api_route("/info", self.info, methods=["GET"], summary="Model and server info (TGI)")

    # ---- routes ---------------------------------------------------------------------------

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        """One generation; `details` adds tokens, logprobs, finish reason and seed."""
        try:
            answer = await until_disconnected(request, self._generate(body, request))
        except RequestError as exc:
            return error_response(exc)
        return JSONResponse(answer)

    async def compat(self, body: GenerateRequest, request: Request) -> Response:
        """TGI's `POST /`: a stream when `stream` is true, else a one-element list."""
        if body.stream:
            return await self.generate_stream(body, request)
        try:
            answer = await until_disconnected(request, self._generate(body, request))
        except RequestError as exc:
            return error_response(exc)
        return JSONResponse([answer])

    async def generate_stream(self, body: GenerateRequest, request: Request) -> Response:
        """Server-sent events: `data:{token, generated_text: null, details: null}` per token, the
        last one with the whole text and the details."""
        call = self.service.open_call(
            "rest_stream", "generate_stream", list(request.headers.items()), 1, tenant_of(request)
        )
        try:
            if body.parameters.decoder_input_details:
                raise self.service.refuse(
                    "decoder_input_details == true is not supported when streaming tokens"
                )
            call.admit()
            (validated,) = await self._validate(call, body, stream=True)
        except RequestError as exc:
            call.close()
            return error_response(exc)
        return EventStream(self._events(validated, body.inputs, call.info), call)

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """The prompt's tokens: id, text and character offsets (TGI's /tokenize; http_app.py
        routes the bodies of TGI's shape here)."""
        text = body.inputs

        def job() -> tuple[list[dict[str, Any]], int]:
            encoding = self.tokenizer.tokenizer.encode(text, add_special_tokens=True)
            tokens = [
                {"id": i, "text": text[start:stop], "start": start, "stop": stop}
                for i, (start, stop) in zip(encoding.ids, encoding.offsets, strict=True)
            ]
            return tokens, len(tokens)

        try:
            return JSONResponse(await self.service.tokenize(self.tokenizer, [text], job))
        except RequestError as exc:
            return error_response(exc)

    async def info(self) -> dict[str, Any]:
        """TGI's /info: the model and the limits this server applies."""
        return dict(self.info_fields)

    # ---- generation -----------------------------------------------------------------------

    async def _validate(self, call: Call, body: GenerateRequest, *, stream: bool) -> list[ValidatedRequest]:
        """The request, or its best_of requests (each with its own random seed)."""
        p = body.parameters
        refusal = unsupported(p) or best_of_refusal(p, stream=stream, max_best_of=self.max_best_of)
        if refusal is not None:
            raise self.service.refuse(refusal)
        params = request_params(p, stream=stream, max_new_tokens=self.max_new_tokens)
        n = p.best_of or 1
        if n > 1:  # the answers are compared by their tokens' logprobs
            params = replace(
                params, response=replace(params.response, generated_tokens=True, token_logprobs=True)
            )
        return await call.validate([body.inputs] * n, params, adapter_id=p.adapter_id or "")

    async def _generate(self, body: GenerateRequest, request: Request) -> dict[str, Any]:
        headers = list(request.headers.items())
        n = body.parameters.best_of or 1
        with self.service.open_call("rest", "generate", headers, n, tenant_of(request)) as call:
            call.admit()
            validated = await self._validate(call, body, stream=False)
            outputs = await self.service.generate(validated, call.info)
        # the likeliest answer (TGI's rule: the highest sum of its tokens' logprobs; the first of equals)
        best = max(range(len(outputs)), key=lambda i: (sum(t.logprob for t in outputs[i].tokens), -i))
        answer: dict[str, Any] = {"generated_text": self._full_text(body, outputs[best].text)}
        if body.parameters.details:
            others = [
                {
                    "generated_text": self._full_text(body, outputs[i].text),
                    **self._details(validated[i], outputs[i]),
                }
                for i in range(n)
                if i != best
            ]
            answer["details"] = {
                **self._details(validated[best], outputs[best]),
                "best_of_sequences": others or None,
            }
        return answer

    async def _events(
        self, validated: ValidatedRequest, prompt: str, call: CallInfo
    ) -> AsyncGenerator[str, None]:
        """The SSE body: one event per token, or an error event when generation fails."""
        text = []
        try:
            async with contextlib.aclosing(self.service.stream(validated, call)) as outputs:
                async for output in outputs:
                    text.append(output.text)
                    yield sse(self._event(validated, output, prompt, "".join(text)))
        except RequestError as exc:
            yield sse({"error": exc.message, "error_type": ERROR_TYPES.get(exc.cause, exc.cause)})

    def _event(self, validated: ValidatedRequest, output: Output, prompt: str, text: str) -> dict[str, Any]:
        token = output.tokens[-1] if output.tokens else None
        event: dict[str, Any] = {
            "index": output.generated_tokens,
            "token": self._token(token, output.text) if token else None,
            "generated_text": None,
            "details": None,
        }
        if token is not None and validated.response.top_n_tokens:
            event["top_tokens"] = [self._top(top) for top in token.top_tokens]
        if output.final:
            event["generated_text"] = (prompt if validated.response.input_text else "") + text
            event["details"] = {
                "finish_reason": FINISH_REASONS.get(output.stop_reason, "length"),
                "generated_tokens": output.generated_tokens,
                "seed": None if validated.sampling.greedy else validated.seed,
                "input_length": validated.input_length,
            }
        return event

    # ---- answer pieces --------------------------------------------------------------------

    def _full_text(self, body: GenerateRequest, text: str) -> str:
        return body.inputs + text if body.parameters.return_full_text else text

    def _details(self, validated: ValidatedRequest, output: Output) -> dict[str, Any]:
        details: dict[str, Any] = {
            "finish_reason": FINISH_REASONS.get(output.stop_reason, "length"),
            "generated_tokens": output.generated_tokens,
            "seed": None if validated.sampling.greedy else validated.seed,
            "prefill": [self._input_token(t) for t in output.input_tokens or ()],
            "tokens": [self._token(t) for t in output.tokens],
        }
        if validated.response.top_n_tokens:
            details["top_tokens"] = [[self._top(top) for top in t.top_tokens] for t in output.tokens]
        return details

    def _token(self, t: TokenInfo, text: str | None = None) -> dict[str, Any]:
        return {
            "id": t.token_id,
            "text": self.tokenizer.token_text(t.token_id) if text is None else text,
            "logprob": t.logprob,
            "special": t.token_id in self._special,
        }

    def _input_token(self, t: TokenInfo) -> dict[str, Any]:
        logprob = None if t.logprob != t.logprob else t.logprob  # NaN (the first token) -> null
        return {"id": t.token_id, "text": self.tokenizer.token_text(t.token_id), "logprob": logprob}

    def _top(self, top: Any) -> dict[str, Any]:
        return {
            "id": top.token_id,
            "text": self.tokenizer.token_text(top.token_id),
            "logprob": top.logprob,
            "special": top.token_id in self._special,
        }


def info_fields(
    *,
    model_id: str,
    dtype: str,
    max_concurrent_requests: int,
    max_sequence_length: int,
    max_new_tokens: int,
    max_batch_size: int,
    max_waiting_tokens: int,
    max_batch_prefill_tokens: int,
    version: str,
    max_best_of: int = 1,
) -> dict[str, Any]:
    """TGI's /info fields, filled with this server's values (null where it has none)."""
    return {
        "model_id": model_id,
        "model_sha": None,
        "model_dtype": dtype,
        "model_device_type": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": max_concurrent_requests,
        "max_best_of": max_best_of,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_tokens": max_sequence_length - 1,
        "max_total_tokens": max_sequence_length,
        "max_new_tokens": max_new_tokens,
        "max_batch_size": max_batch_size,
        "max_waiting_tokens": max_waiting_tokens,
        "max_batch_prefill_tokens": max_batch_prefill_tokens or None,
        "router": "text-generation-router",
        "version": version,
        "sha": None,
        "docker_label": None,
    }
