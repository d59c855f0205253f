"""Per-request input checks and left truncation, shared by every batch type.

A request that fails a check becomes a RequestError beside its batch instead of failing the
batch. The router validates user input first; these checks keep a shard safe from any client
of the internal protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from text_generation_common.guided import UNAVAILABLE, Grammars, GuidedError
from text_generation_common.messages import GenerationRequest, RequestError, truncated_ids


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What every engine checks a request against."""

    vocab_size: int
    eos_token_id: int
    bos_token_id: int | None  # set iff the tokenizer prepends BOS (re-inserted on truncation)
    max_sequence_length: int
    max_new_tokens: int  # largest max_new_tokens a request may ask for
    # guided decoding over the model's tokenizer (None: the model has no tokenizer.json)
    grammars: Grammars | None = field(default=None, kw_only=True)
    # the model's other end-of-sequence ids (a list in config.json or generation_config.json, the
    # tokenizer's EOS): each ends a request as eos_token_id does
    extra_eos_token_ids: tuple[int, ...] = field(default=(), kw_only=True)
    # the sampling parameters generation_config.json sets (name, value), which the OpenAI door
    # uses where a request leaves them unset, as vLLM does
    sampling_defaults: tuple[tuple[str, float], ...] = field(default=(), kw_only=True)


UNSEEDED_MESSAGE = "a sampling request needs a seed (the router sets one for every sampling request)"


def truncated_input_ids(request: GenerationRequest, bos_token_id: int | None) -> list[int]:
    """Keep the last `truncate_input_tokens` ids; BOS-adding tokenizers get BOS back as the first
    kept token (so `truncate_input_tokens: 1` leaves only BOS)."""
    return truncated_ids(request.input_ids, request.truncate_input_tokens, bos_token_id)


def split_valid(
    requests: Sequence[GenerationRequest],
    limits: RequestLimits,
    prefix_lengths: Mapping[int, int] | None = None,
    *,
    resumable: bool = True,
) -> tuple[list[GenerationRequest], list[list[int]], list[RequestError]]:
    """Split requests into (valid, their truncated ids, errors of the others); a resumed
    request's ids are its truncated prompt's followed by those it generated before.
    `prefix_lengths`: virtual tokens of the soft prompt of each request that names one and
    whose prompt the engine found (the others fail with TGIS's message); `resumable`: False
    where the model continues no generated ids (encoder-decoder), which refuses resumed requests."""
    valid: list[GenerationRequest] = []
    prompts: list[list[int]] = []
    errors: list[RequestError] = []
    found = prefix_lengths or {}
    for request in requests:
        ids = truncated_input_ids(request, limits.bos_token_id)
        named = request.prefix_id or request.adapter_id
        message = request_error(request, ids, limits, found.get(request.id) if named else 0)
        if message is None and request.generated_ids:
            message = _resume_error(request, limits) if resumable else NOT_RESUMABLE
        if message is None:
            valid.append(request)
            prompts.append([*ids, *request.generated_ids])
        else:
            errors.append(RequestError(request.id, message))
    return valid, prompts, errors


NOT_RESUMABLE = "an encoder-decoder model cannot resume a request from its generated ids"


def _resume_error(request: GenerationRequest, limits: RequestLimits) -> str | None:
    """Why a resumed request's generated ids cannot be continued, or None."""
    generated = request.generated_ids
    if len(generated) >= request.max_new_tokens:
        return (
            f"a resumed request has {len(generated)} of its max_new_tokens ({request.max_new_tokens}) already"
        )
    bad = next((t for t in generated if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        return f"generated token id {bad} is outside the vocabulary (size {limits.vocab_size})"
    return None


def _parameter_error(request: GenerationRequest) -> str | None:
    p = request.params
    checks = (
        (math.isfinite(p.temperature) and p.temperature >= 0.0, f"temperature {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p {p.top_p}"),
        (0.0 < p.typical_p <= 1.0, f"typical_p {p.typical_p}"),
        (
            math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0.0,
            f"repetition_penalty {p.repetition_penalty}",
        ),
        (
            p.length_penalty is None
            or (math.isfinite(p.length_penalty.decay_factor) and p.length_penalty.decay_factor >= 1.0),
            f"length_penalty decay_factor {p.length_penalty.decay_factor if p.length_penalty else ''}",
        ),
    )
    for ok, what in checks:
        if not ok:
            return f"invalid sampling parameter: {what}"
    if not p.greedy and p.seed is None:  # never a per-rank random seed: ranks must agree
        return UNSEEDED_MESSAGE
    return None


def request_error(
    request: GenerationRequest, input_ids: list[int], context: RequestLimits, prefix_length: int | None = 0
) -> str | None:
    """Why `request` (with its truncated `input_ids` behind `prefix_length` virtual tokens;
    None: the soft prompt it names was not found) cannot run, or None."""
    if prefix_length is None:
        if request.adapter_id:
            return f"Error retrieving adapter '{request.adapter_id}'"
        return f"Error retrieving prompt prefix '{request.prefix_id}'"
    if not input_ids:
        return "request has no input tokens"
    bad = next((t for t in input_ids if not 0 <= t < context.vocab_size), None)
    if bad is not None:
        return f"input token id {bad} is outside the vocabulary (size {context.vocab_size})"
    if request.max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {request.max_new_tokens}"
    if request.max_new_tokens > context.max_new_tokens:
        return f"max_new_tokens must be <= {context.max_new_tokens}"
    if len(input_ids) + prefix_length + request.max_new_tokens > context.max_sequence_length:
        prefix = f" plus prefix length ({prefix_length})" if prefix_length else ""
        return (
            f"input tokens ({len(input_ids)}){prefix} plus max_new_tokens ({request.max_new_tokens}) "
            f"must be <= {context.max_sequence_length}"
        )
    return _parameter_error(request) or _guided_error(request, context)


def _guided_error(request: GenerationRequest, context: RequestLimits) -> str | None:
    guided = request.params.guided
    if guided is None:
        return None
    if context.grammars is None:
        return UNAVAILABLE
    try:
        context.grammars.check(guided)  # cached: the matcher is made from it right after
    except GuidedError as exc:
        return f"invalid {guided.kind.value} for guided decoding: {exc}"
    return None
