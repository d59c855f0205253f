"""The OpenAI door's requests: the bodies of /v1/completions and /v1/chat/completions (pydantic
models, unknown fields refused) and their conversion into RequestParams, which every door's
validation then checks (TGIS's messages).

OpenAI's defaults hold: temperature 1.0 (sampling; 0 = greedy), stop sequences left out of the
text, max_tokens up to the server's MAX_NEW_TOKENS when unset, `presence_penalty` and
`frequency_penalty` over the tokens generated so far (as vLLM applies them, greedy choices too).
Extensions as vLLM accepts them: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`truncate_prompt_tokens`, `stop_token_ids`, `allowed_token_ids`, `ignore_eos` (the model's EOS
is masked until max_tokens), `include_stop_str_in_output`, `skip_special_tokens`, `priority`,
`return_token_ids`, `structured_outputs` and the older guided_* fields, and the chat's
`thinking_token_budget` (router/core/thinking.py). `logit_bias` ({token id:
-100 to 100}) is added to the logits before any other processing, as vLLM does. `tools` and
`tool_choice`: openai_tools.py. Parameters that would change the answer and are not served
(response formats other than text, suffix, best_of > 1) are refused with 400; metadata fields
(`user`, `metadata`, `store`, ...) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.core.validation import (
    Input,
    RequestParams,
    ResponseSpec,
    StoppingSpec,
    ValidationError,
    http_sampling,
)
from router.http.openai_tools import TEXT, Tool, ToolChoiceParam, ToolMode, guided_for, tool_mode
from router.http.reasoning import ReasoningFormat
from router.http.tool_parsers import ToolCallParser
from text_generation_common.guided import schema_text
from text_generation_common.messages import Guided, GuidedKind, ThinkingMarks

MAX_CHOICES = 16  # n, or prompts in one call
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (vLLM's default max_logprobs)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its name for guided decoding since v0.10.2; the guided_*
    fields were removed in v0.12): one constraint; the options that change what it allows and
    are not served refuse the request."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON Schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="Lark or GBNF")
    json_object: bool | None = None
    # JSON is written compact either way (README): a whitespace choice changes nothing served
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # one backend: nothing to fall back to
    disable_additional_properties: bool = Field(default=False, description="not served: false only")
    whitespace_pattern: str | None = Field(default=None, description="not served")
    structural_tag: str | None = Field(default=None, description="not served")

    def guides(self) -> list[Guided]:
        found = _guides(self.json_, self.regex, self.choice, self.grammar)
        return [Guided(GuidedKind.JSON), *found] if self.json_object else found

    def unserved(self) -> str | None:
        """The first option set that this server does not serve, or None."""
        if self.disable_additional_properties:
            return "structured_outputs.disable_additional_properties"
        if self.whitespace_pattern is not None:
            return "structured_outputs.whitespace_pattern"
        if self.structural_tag is not None:
            return "structured_outputs.structural_tag"
        return None


class CommonRequest(BaseModel):
    """The parameters both routes take."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, description="default 1.0; 0 = greedy")
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, description="-2.0 to 2.0; 0 = off")
    frequency_penalty: float | None = Field(default=None, description="-2.0 to 2.0; 0 = off")
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id -> -100 to 100, added to its logit before any other processing"
    )
    best_of: int | None = Field(default=None, description="not served: 1 or unset only")
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = Field(default=None, description="0 to 1; 0 = off")
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, description="keep the prompt's last n tokens"
    )
    stop_token_ids: list[int] | None = Field(
        default=None, description="ids that end the answer as EOS does (their text kept, as vLLM keeps it)"
    )
    allowed_token_ids: list[int] | None = Field(default=None, description="the only ids the answer may have")
    bad_words: list[str] | None = Field(
        default=None,
        description="words the answer may not hold: each one's last token is banned after the others",
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int | None = Field(
        default=None, description="SCHEDULING_POLICY=priority: lower values wait less (vLLM's)"
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="the prompt shares prefix-cache blocks only with requests of the same salt (vLLM's)",
    )
    return_token_ids: bool = Field(
        default=False, description="the prompt's and each choice's token ids beside the text (vLLM's)"
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="the prompt's tokens' logprobs, each with the n likeliest tokens in its place (vLLM's)",
    )
    return_tokens_as_token_ids: bool = Field(
        default=False, description='logprobs name tokens as "token_id:<id>" (vLLM\'s)'
    )
    skip_special_tokens: bool | None = Field(
        default=None,
        description="leave special tokens out of the text (default: the server's OUTPUT_SPECIAL_TOKENS)",
    )
    spaces_between_special_tokens: bool = Field(default=True, description="not served: true only")
    # guided decoding: OpenAI's response_format, or one of vLLM's guided_* extensions
    response_format: dict[str, Any] | None = Field(
        default=None, description="text, json_object or json_schema ({json_schema: {schema}})"
    )
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(CommonRequest):
    # a text, texts, a prompt's token ids (taken as they are) or several prompts' token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = Field(default=None, description="not served")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template may use them

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    thinking_token_budget: int | None = Field(
        default=None,
        description="the most tokens a reasoning model thinks before its thinking is ended for it "
        "(vLLM's; needs REASONING_PARSER)",
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, description="functions the model may call")
    tool_choice: ToolChoiceParam | None = Field(
        default=None, description='"none", "required" or {"type": "function", "function": {"name": ...}}'
    )
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True  # extension: render the assistant turn's opening
    # vLLM's extension: the answer continues the final (assistant) message
    continue_final_message: bool = False
    # vLLM's extension: more variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: the chat template's `reasoning_effort` (chat_template_kwargs may set it too)
    reasoning_effort: str | None = None
    # vLLM's: false leaves the thinking out of the answer (it is still read apart)
    include_reasoning: bool = True
    # vLLM's extension: texts to ground the answer in, for templates that read `documents`
    documents: list[dict[str, Any]] | None = None


def template_variables(kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any] | None:
    """A chat template's own variables: chat_template_kwargs, and OpenAI's reasoning_effort
    where the request gives it (chat_template_kwargs' own wins)."""
    if reasoning_effort is None:
        return kwargs
    return {"reasoning_effort": reasoning_effort, **(kwargs or {})}


def unsupported(body: CommonRequest) -> str | None:
    """Why parameters this server does not serve refuse the request, or None."""
    checks: list[tuple[bool, str]] = [
        (body.best_of is not None and body.best_of > 1, "best_of > 1"),
        (not body.spaces_between_special_tokens, "spaces_between_special_tokens false"),
    ]
    if isinstance(body, CompletionRequest):
        checks.append((body.suffix is not None, "suffix"))
    fmt = (body.response_format or {}).get("type", "text")
    checks.append((fmt not in RESPONSE_FORMATS, f"response_format {fmt}"))
    if body.structured_outputs is not None and (option := body.structured_outputs.unserved()):
        checks.append((True, option))
    for refused, what in checks:
        if refused:
            return f"{what} is not supported by this server"
    return None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _guides(
    schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None, grammar: str | None
) -> list[Guided]:
    """The constraints of vLLM's fields that are set (structured_outputs' or guided_*)."""
    found = []
    if schema is not None:
        found.append(Guided(GuidedKind.JSON_SCHEMA, schema_text(schema)))
    if regex is not None:
        found.append(Guided(GuidedKind.REGEX, regex))
    if choice is not None:
        found.append(Guided(GuidedKind.CHOICE, choices=tuple(choice)))
    if grammar is not None:
        found.append(Guided(GuidedKind.GRAMMAR, grammar))
    return found


def guided_of(body: CommonRequest) -> Guided | None:
    """The request's constraint: response_format, one guided_* field or one of
    structured_outputs' (ValidationError for more than one, or a json_schema format without
    its schema)."""
    found: list[Guided] = []
    fmt = body.response_format or {}
    if fmt.get("type") == "json_object":
        found.append(Guided(GuidedKind.JSON))
    elif fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValidationError("response_format json_schema needs json_schema.schema")
        found.append(Guided(GuidedKind.JSON_SCHEMA, schema_text(schema)))
    found += _guides(body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar)
    if body.structured_outputs is not None:
        found += body.structured_outputs.guides()
    if len(found) > 1:
        raise ValidationError(
            "only one constraint may be given: one of response_format (json), structured_outputs' json, "
            "json_object, regex, choice and grammar, guided_json, guided_regex, guided_choice and "
            "guided_grammar"
        )
    return found[0] if found else None


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Input]:
    """The prompts of /v1/completions, each a text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    prompts: list[Input] = []
    for item in prompt:
        if isinstance(item, int):  # one prompt of token ids
            return [[int(token) for token in prompt]]  # type: ignore[arg-type]
        prompts.append(item)
    return prompts


def _skip_special_tokens(
    body: CommonRequest, tools: ToolMode, parser: ToolCallParser | None, thinking: ReasoningFormat | None
) -> bool | None:
    """The request's skip_special_tokens; where unset, false if the answer may hold markers that
    are special tokens (calls of the model's format, where it may call; a chat's thinking, where
    the model's reasoning format is read), as vLLM sets it: the parsers must see them."""
    if body.skip_special_tokens is not None:
        return body.skip_special_tokens
    calls = tools.kind == "auto" and parser is not None and parser.needs_special_tokens
    return False if calls or (thinking is not None and thinking.needs_special_tokens) else None


def tool_mode_of(body: CommonRequest, parser: ToolCallParser | None) -> ToolMode:
    """How a chat's answer is read (openai_tools.py; `parser`: the model's call format, for
    "auto"); completions are text."""
    return tool_mode(body.tools, body.tool_choice, parser) if isinstance(body, ChatRequest) else TEXT


def logit_bias_of(body: CommonRequest) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias) pairs by id (ValidationError for a key that
    is not a token id; validation checks the ids against the vocabulary and the biases' range)."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValidationError(f"logit_bias keys must be token ids, not {key[:40]!r}") from None
        pairs.append((token, bias))
    if len({token for token, _ in pairs}) < len(pairs):  # "7" and "07"
        raise ValidationError("logit_bias names a token id more than once")
    return tuple(sorted(pairs))


def text_content(message: ChatMessage) -> Any:
    """A message's content for the template: text parts joined; other parts refused."""
    if not isinstance(message.content, list):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text":
            raise ValidationError(f"content of type {part.get('type')} is not supported")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def request_params(
    body: CommonRequest,
    *,
    max_new_tokens: int,
    top_n: int,
    logprobs: bool,
    stream: bool,
    tool_parser: ToolCallParser | None = None,
    defaults: Mapping[str, float] = MappingProxyType({}),
    reasoning: ReasoningFormat | None = None,
) -> RequestParams:
    """OpenAI's parameters -> RequestParams (validated afterwards like every door's);
    `defaults`: the model's sampling parameters (ModelInfo.sampling_defaults), for those the
    request leaves unset; `reasoning`: the model's reasoning format (REASONING_PARSER), read from
    chat answers that no constraint shapes."""

    def given(value: float | None, name: str) -> float | None:
        return value if value is not None else defaults.get(name)

    temperature = given(body.temperature, "temperature")
    temperature = 1.0 if temperature is None else temperature
    top_k = given(body.top_k, "top_k")
    guided = guided_of(body)
    tools = tool_mode_of(body, tool_parser)
    if tools.constrained:
        assert isinstance(body, ChatRequest)
        if guided is not None:
            raise ValidationError(
                "a tool_choice that calls tools cannot be combined with response_format or guided_*"
            )
        guided = guided_for(body.tools, tools, parallel=body.parallel_tool_calls is not False)
    sampling = http_sampling(
        temperature != 0.0,
        temperature=temperature,
        top_k=None if top_k is None else round(top_k),
        top_p=given(body.top_p, "top_p"),
        min_p=given(body.min_p, "min_p"),
        seed=body.seed,
        repetition_penalty=given(body.repetition_penalty, "repetition_penalty"),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        guided=guided,
    )
    sampling = replace(
        sampling,
        logit_bias=logit_bias_of(body),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        allowed_token_ids=tuple(body.allowed_token_ids or ()),
    )
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens or max_new_tokens
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    tokens = stream or logprobs or top_n > 0 or body.return_token_ids
    prompt_logprobs = body.prompt_logprobs is not None
    # a chat answer is read for the model's thinking (where its template variables let it think);
    # a constraint shapes the answer after it
    thinking = None
    if reasoning is not None and isinstance(body, ChatRequest):
        thinking = reasoning.for_chat(template_variables(body.chat_template_kwargs, body.reasoning_effort))
    if thinking is not None and guided is not None:
        marks = ThinkingMarks(thinking.opened_by_prompt, thinking.starts, thinking.ends)
        sampling = replace(sampling, guided=replace(guided, after_thinking=marks))
    return RequestParams(
        sampling=sampling,
        stopping=StoppingSpec(
            max_new_tokens=limit,
            min_new_tokens=limit if body.ignore_eos else body.min_tokens,
            stop_sequences=tuple(stops),
            include_stop_sequence=body.include_stop_str_in_output,
        ),
        response=ResponseSpec(
            generated_tokens=tokens,
            # echo with logprobs: the prompt's tokens too, as vLLM answers them
            input_tokens=(logprobs and getattr(body, "echo", False)) or prompt_logprobs,
            token_logprobs=logprobs or top_n > 0 or prompt_logprobs,
            token_ranks=prompt_logprobs,
            # one number serves both: each answer takes as many as it was asked for
            top_n_tokens=max(top_n, body.prompt_logprobs or 0),
            skip_special_tokens=_skip_special_tokens(body, tools, tool_parser, thinking),
        ),
        truncate_input_tokens=body.truncate_prompt_tokens or 0,
        priority=body.priority,
        bad_words=tuple(body.bad_words or ()),
        cache_salt=body.cache_salt or "",
        # a chat that does not think keeps within any budget (without REASONING_PARSER, refused)
        thinking_budget=None if reasoning and not thinking else getattr(body, "thinking_token_budget", None),
        reads_thinking=thinking is not None,
        top_n_limit=MAX_TOP_LOGPROBS,
    )
