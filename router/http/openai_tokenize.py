"""vLLM's tokenizer routes, at the root as vLLM serves them: POST /tokenize (a completion's
prompt, or a chat's messages rendered with the model's chat template) and POST /detokenize.

/tokenize is HF TGI's route too: http_app.py tells the two apart by the body (TGI's has
`inputs`, vLLM's `prompt` or `messages`). Fields, defaults and answers are vLLM's, and by
default the ids are those the model is given for the same prompt at /v1/completions or messages
at /v1/chat/completions. A prompt gets the tokenizer's special tokens unless
`add_special_tokens` is false. A chat's `add_special_tokens: true` adds them on top of the text
as the template wrote it, as vLLM does (a template that writes BOS then has two). `model` names
the served model or an adapter (adapters share the model's tokenizer); an unknown name is 404 as
at the other OpenAI routes. Tokenize calls count in the tgi_tokenize_* metrics.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.api.service import RequestError
from router.core.validation import ValidationError as RequestValidationError
from router.core.validation import check_in_vocabulary
from router.http.http_calls import describe_validation
from router.http.openai_api import ChatPromptError, OpenAIApi, error_reply, error_response, unknown_model
from router.http.openai_params import ChatMessage
from router.http.openai_tools import Tool


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def is_vllm_tokenize(body: Any) -> bool:
    """Whether a /tokenize body is vLLM's (`prompt` or `messages`, no TGI `inputs`)."""
    return isinstance(body, dict) and "inputs" not in body and ("prompt" in body or "messages" in body)


class TokenizeApi:
    """The two routes over the OpenAI door's model, tokenizer and chat template. /detokenize is
    on `router`; /tokenize is shared with TGI's and routed by http_app.py to `tokenize`."""

    def __init__(self, openai: OpenAIApi) -> None:
        self.openai = openai
        self.router = APIRouter(tags=["vLLM"])
        self.router.add_api_route(
            "/detokenize", self.detokenize, methods=["POST"], summary="Token ids to text (vLLM)"
        )

    async def tokenize(self, raw: dict[str, Any], request: Request) -> Response:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
        shape = TokenizeChat if "messages" in raw else TokenizeCompletion
        try:
            body: TokenizeCompletion | TokenizeChat = shape.model_validate(raw)
        except ValidationError as exc:
            return error_reply(400, describe_validation(exc))
        if self.openai.adapter_of(body.model) is None:
            return error_reply(404, unknown_model(body.model or ""))
        if isinstance(body, TokenizeChat):
            try:
                # as the chat route encodes it (the tokenizer's BOS in place of the template's),
                # or the template's text whole, special tokens added on top
                text = self.openai.chat_prompt(body, keep_bos=body.add_special_tokens)
            except ChatPromptError as exc:
                return error_reply(400, str(exc), exc.param)
            special = True
        else:
            text, special = body.prompt, body.add_special_tokens
        pool = self.openai.tokenizer
        strs = bool(body.return_token_strs)

        def job() -> tuple[dict[str, Any], int]:
            ids = pool.tokenizer.encode(text, add_special_tokens=special).ids
            answer = {
                "count": len(ids),
                "max_model_len": self.openai.max_sequence_length,
                "tokens": ids,
                "token_strs": [pool.piece(i) for i in ids] if strs else None,
            }
            return answer, len(ids)

        try:
            return JSONResponse(await self.openai.service.tokenize(pool, [text], job))
        except RequestError as exc:
            return error_response(exc)

    async def detokenize(self, body: Detokenize) -> Response:
        """vLLM's /detokenize: {prompt}, the ids decoded with their special tokens."""
        if self.openai.adapter_of(body.model) is None:
            return error_reply(404, unknown_model(body.model or ""))
        pool = self.openai.tokenizer
        size = pool.tokenizer.get_vocab_size(with_added_tokens=True)
        try:
            check_in_vocabulary(body.tokens, "token id", size)
        except RequestValidationError as exc:
            return error_reply(400, str(exc), "tokens")
        ids = body.tokens
        # off the event loop: a 4 MiB body holds a million ids
        text = await pool.run_tokenize_job((), lambda: pool.tokenizer.decode(ids, skip_special_tokens=False))
        return JSONResponse({"prompt": text})
