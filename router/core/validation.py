"""Parameter conversion and validation with TGIS's defaults, order and exact messages.

The doors hand over RequestParams (grpc_params.py converts TGIS's protobuf Parameters) and the
input texts; out come
ValidatedRequests (typed, tokenized, with seeds and capped max_new_tokens) or a
ValidationError whose message is TGIS's, byte for byte. Order (tgis-api §9.1): parameter
checks 1-11, the guided-decoding extension, the soft-prompt lookup (12), tokenization (13),
then the length checks of each input (14, 15) in request order, each input first refused if it
has no tokens at all (and no soft prompt). An input whose size in bytes alone proves check 14
fails is not tokenized (input_bound.py): its message then says "at least N" tokens.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from router.core.call_ends import CallEnds
from router.core.capacity import Capacity, Load
from router.core.input_bound import min_tokens
from router.core.metrics import Metrics
from router.core.thinking import ThinkingBudget, ThinkingMarkers
from router.core.tokenizer import TokenizerError, TokenizerPool
from text_generation_common.guided import UNAVAILABLE, Grammars, GuidedError
from text_generation_common.logs import clip
from text_generation_common.messages import (
    GenerationRequest,
    Guided,
    RequestedDetails,
    SamplingParams,
)

DEFAULT_MAX_NEW_TOKENS = 20
MIN_TEMPERATURE = 0.05
MAX_STOP_SEQUENCES = 6
MAX_STOP_SEQUENCE_BYTES = 240
MAX_TOP_N_TOKENS = 10
MAX_ADDITIVE_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's and TGI's range)
MAX_LOGIT_BIAS = 100.0  # |a logit_bias value| (OpenAI's range)
MAX_BAD_WORDS = 128  # vLLM's bad_words: words per request
MAX_BAD_WORD_TOKENS = 32  # tokens per bad word (the shard matches the generated ids' last ones)

Input = str | Sequence[int]  # an input's text, or its token ids
STOP_SEQUENCES_MESSAGE = (
    f"can specify at most {MAX_STOP_SEQUENCES} non-empty stop sequences, "
    f"each not more than {MAX_STOP_SEQUENCE_BYTES} UTF8 bytes"
)
EMPTY_INPUT_MESSAGE = "input must not be empty: the text has no tokens"
PREFIX_CACHE_CAPACITY = 256
PREFIX_CACHE_TTL_S = 3600.0


class ValidationError(ValueError):
    """A request is invalid; str(error) is the client-facing message (INVALID_ARGUMENT)."""


class UnknownAdapterError(ValidationError):
    """The request's adapter_id names nothing in the shards' store (still INVALID_ARGUMENT, as
    TGIS answers; the OpenAI door, where the id is the request's `model`, answers 404)."""


THINKING_OFF_MESSAGE = (
    "thinking_token_budget needs the server started with --reasoning-parser, serving a decoder-only model"
)
PRIORITY_OFF_MESSAGE = (
    "priority is not served by this server's scheduling policy (fcfs): start it with "
    "--scheduling-policy priority"
)
PRIORITY_BOUND = 2**31  # |priority| below it
TWO_ADAPTERS_MESSAGE = "prefix_id and adapter_id name different adapters: set only one of them"


@dataclass(frozen=True, slots=True)
class StoppingSpec:
    max_new_tokens: int  # after defaulting and capping
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = False
    capped: bool = False  # max_new_tokens was lowered to fit: hitting it is TOKEN_LIMIT
    time_limit_ms: int = 0  # 0 = none


@dataclass(frozen=True, slots=True)
class ResponseSpec:
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0
    skip_special_tokens: bool | None = None  # the text leaves special tokens out (None: the server's rule)


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """One input ready to queue."""

    text: str  # the prompt, kept only when the response echoes it (input_text); else ""
    input_ids: tuple[int, ...]  # what the shard needs of the tokenization (see shard_input_ids)
    input_length: int  # after truncation, without the prefix
    truncate_input_tokens: int
    prefix_id: str  # TGIS soft prompt
    prefix_length: int  # virtual tokens of the soft prompt or adapter
    sampling: SamplingParams  # with the seed actually used
    stopping: StoppingSpec
    response: ResponseSpec
    received_at: float  # time.monotonic() at receipt
    deadline: float | None = None  # time.monotonic() after which TIME_LIMIT applies
    adapter_id: str = ""  # adapter of any stored kind (then prefix_id is "")
    call_end_ids: frozenset[int] = frozenset()  # tokens that may complete a stop sequence (call_ends.py)
    priority: int = 0  # SCHEDULING_POLICY=priority: waits behind the lower values
    cache_salt: str = ""  # vLLM's: no prefix-cache blocks shared with other salts
    thinking: ThinkingBudget | None = None  # a limit on a reasoning model's thinking (thinking.py)

    @property
    def adapter(self) -> str:
        """The adapter the request runs with, of either kind ("" for none)."""
        return self.adapter_id or self.prefix_id

    @property
    def seed(self) -> int:
        """The seed to report (0 for greedy)."""
        return 0 if self.sampling.greedy else (self.sampling.seed or 0)

    def shard_request(self, request_id: int) -> GenerationRequest:
        r = self.response
        return GenerationRequest(
            id=request_id,
            input_ids=self.input_ids,
            max_new_tokens=self.stopping.max_new_tokens,
            truncate_input_tokens=self.truncate_input_tokens,
            params=self.sampling,
            details=RequestedDetails(
                input_tokens=r.input_tokens,
                logprobs=r.token_logprobs,
                ranks=r.token_ranks,
                top_n_tokens=r.top_n_tokens,
            ),
            prefix_id=self.prefix_id,
            adapter_id=self.adapter_id,
            call_end_ids=self.call_end_ids,
            cache_salt=self.cache_salt,
        )


@dataclass(frozen=True, slots=True)
class RequestParams:
    """A request's parameters, door-neutral, before validation: what each API door converts its
    own parameters into (grpc_params.py: TGIS's conversion, tgis-api §3)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingSpec = field(default_factory=lambda: StoppingSpec(DEFAULT_MAX_NEW_TOKENS))
    response: ResponseSpec = field(default_factory=ResponseSpec)
    truncate_input_tokens: int = 0
    priority: int | None = None  # in line before higher values (SCHEDULING_POLICY=priority); None: 0
    # vLLM's bad_words: validation tokenizes them into sampling.bad_words
    bad_words: tuple[str, ...] = ()
    # vLLM's cache_salt: the request's prompt shares prefix-cache blocks only with the same salt
    cache_salt: str = ""
    # vLLM's thinking_token_budget (Anthropic's thinking.budget_tokens): the most tokens a
    # reasoning model thinks before its thinking is ended for it (thinking.py); None: no limit
    thinking_budget: int | None = None
    reads_thinking: bool = False  # the answer is read for a reasoning model's thinking (counted)
    # the most likeliest tokens a generated or prompt token may name: the adapter's 10 (TGIS's
    # doors), OpenAI's 20 (its door, as vLLM's max_logprobs)
    top_n_limit: int = MAX_TOP_N_TOKENS


def http_sampling(
    sample: bool,
    *,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    typical_p: float | None = None,
    min_p: float | None = None,
    seed: int | None,
    repetition_penalty: float | None,
    guided: Guided | None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    frequency_by_length: bool = False,
) -> SamplingParams:
    """The HTTP doors' sampling parameters (None: not given) -> SamplingParams: greedy unless
    `sample` (each door decides by its API's rule), every field not given at its neutral value;
    the penalties apply to greedy choices too. `frequency_by_length`: the frequency penalty in
    TGI's form (SamplingParams)."""
    chosen = SamplingParams(
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        frequency_by_length=frequency_by_length,
        guided=guided,
    )
    if not sample:
        return chosen
    return replace(
        chosen,
        temperature=1.0 if temperature is None else temperature,
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p,
        typical_p=1.0 if typical_p is None else typical_p,
        min_p=min_p or 0.0,
        seed=seed,
    )


def tokenizer_error_message(exc: Exception) -> str:
    """TGIS's message for an input the tokenizer fails on (check 13), the detail clipped."""
    return f"tokenizer error {clip(str(exc))}"


def shard_input_ids(ids: list[int], truncate_input_tokens: int) -> tuple[int, ...]:
    """The ids to send: all of them, or for a truncated input its last `truncate_input_tokens`
    + 1, so that the shard still sees a longer input, truncates it and puts BOS back exactly as
    it would with the whole list, while a long prompt's ids are not kept and sent."""
    keep = truncate_input_tokens
    return tuple(ids[-(keep + 1) :] if 0 < keep < len(ids) - 1 else ids)


FLOAT32_MAX = 3.4028234663852886e38  # the shard holds sampling parameters in float32


def held(value: float) -> float:
    """`value` as the shard will hold it (float32): past float32's range it is infinite. The HTTP
    doors read float64, gRPC float32; every door's numbers are checked as held."""
    return math.copysign(math.inf, value) if abs(value) > FLOAT32_MAX else value


def check_in_vocabulary(tokens: Sequence[int], what: str, vocab_size: int) -> None:
    """ValidationError for the first of `tokens` outside the vocabulary, named `what`."""
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ValidationError(f"{what} {token} is not in the vocabulary (0 to {vocab_size - 1})")


def check_params(p: RequestParams, max_new_tokens: int, vocab_size: int) -> None:
    """Checks 1-11 of tgis-api §9.1, in order, with the HTTP doors' own parameters among them
    (`vocab_size`: the model's logits, which logit_bias ids must be in)."""
    s, st, r = p.sampling, p.stopping, p.response
    # NOTE: comparisons are written so that NaN and infinities fail them (TGIS lets NaN through).
    temperature = held(s.temperature)
    if temperature != 0.0 and not (MIN_TEMPERATURE <= temperature < math.inf):
        raise ValidationError(f"temperature must be >= {MIN_TEMPERATURE}")
    if not 0.0 < held(s.top_p) <= 1.0:
        raise ValidationError("top_p must be > 0.0 and <= 1.0")
    if held(s.typical_p) > 1.0:
        raise ValidationError("typical_p must be <= 1.0")
    if not 0.0 <= s.min_p <= 1.0:  # the OpenAI door's only
        raise ValidationError("min_p must be >= 0.0 and <= 1.0")
    if s.top_k < 0:
        raise ValidationError("top_k must be strictly positive")
    if st.max_new_tokens > max_new_tokens:
        raise ValidationError(f"max_new_tokens must be <= {max_new_tokens}")
    if st.min_new_tokens > st.max_new_tokens:
        raise ValidationError("min_new_tokens must be <= max_new_tokens")
    if not 0.0 < held(s.repetition_penalty) < math.inf:
        raise ValidationError("repetition_penalty must be > 0.0")
    for name, penalty in (
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ):
        if not -MAX_ADDITIVE_PENALTY <= penalty <= MAX_ADDITIVE_PENALTY:  # the HTTP doors' only
            raise ValidationError(f"{name} must be >= {-MAX_ADDITIVE_PENALTY} and <= {MAX_ADDITIVE_PENALTY}")
    # the OpenAI door's only
    check_in_vocabulary(s.stop_token_ids, "stop_token_ids:", vocab_size)
    check_in_vocabulary(s.allowed_token_ids, "allowed_token_ids:", vocab_size)
    for token, bias in s.logit_bias:
        check_in_vocabulary((token,), "logit_bias token id", vocab_size)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValidationError(f"logit_bias values must be >= {-MAX_LOGIT_BIAS} and <= {MAX_LOGIT_BIAS}")
    lp = s.length_penalty
    if lp is not None and not 1.0 <= held(lp.decay_factor) <= 10.0:
        raise ValidationError("length_penalty must be >= 1.0 and <= 10.0")
    if len(st.stop_sequences) > MAX_STOP_SEQUENCES:
        raise ValidationError(STOP_SEQUENCES_MESSAGE)
    wants_details = r.token_logprobs or r.token_ranks or r.top_n_tokens > 0
    if wants_details and not (r.input_tokens or r.generated_tokens):
        raise ValidationError("must request input and/or generated tokens to request extra token detail")
    if r.top_n_tokens > p.top_n_limit:  # not checked by TGIS; the adapter's limit and message
        raise ValidationError(f"top_n_tokens ({r.top_n_tokens}) must be <= {p.top_n_limit}")
    if any(not seq or len(seq.encode()) > MAX_STOP_SEQUENCE_BYTES for seq in st.stop_sequences):
        raise ValidationError(STOP_SEQUENCES_MESSAGE)


class PrefixLengths:
    """Soft-prompt lengths by id, looked up once through the shards (LRU + TTL, as TGIS)."""

    def __init__(self, lookup: Callable[[str, bool], Awaitable[int]], metrics: Metrics) -> None:
        self._lookup = lookup
        self._metrics = metrics
        self._entries: dict[tuple[bool, str], tuple[int, float]] = {}

    async def get(self, prefix_id: str, adapter: bool = False) -> int:
        """Virtual tokens of soft prompt `prefix_id` (`adapter`: of the adapter of that id)."""
        now = time.monotonic()
        key = (adapter, prefix_id)
        hit = self._entries.pop(key, None)
        if hit is not None and now - hit[1] < PREFIX_CACHE_TTL_S:
            self._entries[key] = hit  # most recently used last
            self._metrics.inc("tgi_adapter_lookup_cache_hits")
            return hit[0]
        try:
            length = await self._lookup(prefix_id, adapter)
        except Exception:
            self._metrics.inc("tgi_prompt_load_failure")
            raise
        self._metrics.observe("tgi_prompt_load_duration", time.monotonic() - now)
        self.remember(prefix_id, length, adapter, now)
        return length

    def remember(self, prefix_id: str, length: int, adapter: bool = False, now: float | None = None) -> None:
        """`prefix_id`'s length as a lookup found it (or as an adapter added at run time has it)."""
        self._entries[(adapter, prefix_id)] = (length, time.monotonic() if now is None else now)
        while len(self._entries) > PREFIX_CACHE_CAPACITY:
            del self._entries[next(iter(self._entries))]

    def forget(self, adapter_id: str) -> None:
        """An adapter removed at run time: the next request naming it asks the shards again."""
        self._entries.pop((True, adapter_id), None)


class Validator:
    def __init__(
        self,
        tokenizer: TokenizerPool,
        prefixes: PrefixLengths,
        metrics: Metrics,
        *,
        max_sequence_length: int,
        max_new_tokens: int,
        vocab_size: int,
        capacity: Capacity | None = None,
        grammars: Grammars | None = None,
        call_ends: CallEnds | None = None,
        by_priority: bool = False,
        thinking: ThinkingMarkers | None = None,
    ) -> None:
        """`vocab_size`: the model's logits; `call_ends`: where decode calls run several steps,
        the tokens each request's stop sequences give the shard to end a call on (None: none);
        `by_priority`: SCHEDULING_POLICY=priority (else a priority other than 0 is refused);
        `thinking`: the served reasoning format's markers, where a thinking budget can be held
        (None: a budget is refused)."""
        self.tokenizer = tokenizer
        self.call_ends = call_ends
        self.grammars = grammars  # guided decoding over the model's tokenizer (None: not offered)
        self.capacity = capacity  # refuses requests larger than the whole batch can ever hold
        self.prefixes = prefixes
        self.metrics = metrics
        self.max_sequence_length = max_sequence_length
        self.max_new_tokens = max_new_tokens
        self.vocab_size = vocab_size
        self.by_priority = by_priority
        self.thinking = thinking

    async def validate(
        self,
        texts: Sequence[Input],
        params: RequestParams | None,
        prefix_id: str,
        received_at: float,
        adapter_id: str = "",
    ) -> list[ValidatedRequest]:
        """`texts`: each input's text, or its token ids as they are (the OpenAI door's token
        prompts: no tokenization, no BOS added). `prefix_id` (TGIS) names a soft prompt;
        `adapter_id` an adapter of any stored kind. Both may be set only to the same id, which
        then counts as an adapter id."""
        p = params or RequestParams()
        check_params(p, self.max_new_tokens, self.vocab_size)
        if p.priority and not self.by_priority:
            raise ValidationError(PRIORITY_OFF_MESSAGE)
        if p.priority is not None and not -PRIORITY_BOUND < p.priority < PRIORITY_BOUND:
            raise ValidationError(f"priority must be > -{PRIORITY_BOUND} and < {PRIORITY_BOUND}")
        thinking = self._thinking(p)
        if p.sampling.guided is not None:
            await self._check_guided(p.sampling.guided)
        if p.bad_words:
            p = replace(p, sampling=replace(p.sampling, bad_words=await self._bad_word_ids(p.bad_words)))
        if adapter_id and prefix_id:
            if adapter_id != prefix_id:
                raise ValidationError(TWO_ADAPTERS_MESSAGE)
            prefix_id = ""
        prefix_length = 0
        if prefix_id or adapter_id:
            prefix_length = await self._prefix_length(prefix_id or adapter_id, adapter=bool(adapter_id))
        # Inputs that are surely too long (check 14 on a lower bound of their length) are not
        # tokenized; their error is raised in request order below, like every length error.
        too_long = [
            self._surely_too_long(t, p.truncate_input_tokens, prefix_length) if isinstance(t, str) else None
            for t in texts
        ]
        try:
            encoded = await self.tokenizer.encode_batch(
                [t for t, error in zip(texts, too_long, strict=True) if error is None and isinstance(t, str)]
            )
        except TokenizerError as exc:
            raise ValidationError(tokenizer_error_message(exc)) from exc
        for ids in encoded:
            self.metrics.observe("tgi_request_raw_input_length", len(ids))
        deadline = received_at + p.stopping.time_limit_ms / 1000 if p.stopping.time_limit_ms else None
        call_end_ids = frozenset[int]()
        if self.call_ends:  # a request's stop token ids end a call as a stop sequence's tokens do
            call_end_ids = await self.call_ends.ids(p.stopping.stop_sequences) | set(
                p.sampling.stop_token_ids
            )
        remaining = iter(encoded)
        validated = []
        for given, error in zip(texts, too_long, strict=True):
            if error is not None:
                raise ValidationError(error)
            text, ids = (given, next(remaining)) if isinstance(given, str) else ("", self._token_ids(given))
            finished = self._finish(text, ids, p, prefix_id, prefix_length, received_at, deadline)
            validated.append(replace(finished, call_end_ids=call_end_ids))
        if adapter_id or p.priority or p.cache_salt or thinking:
            validated = [
                replace(
                    v,
                    adapter_id=adapter_id,
                    priority=p.priority or 0,
                    cache_salt=p.cache_salt,
                    thinking=thinking,
                )
                for v in validated
            ]
        for v in validated:
            self.metrics.observe("tgi_request_input_length", v.input_length)
            self.metrics.observe("tgi_request_max_new_tokens", p.stopping.max_new_tokens)
        self.metrics.observe("tgi_request_validation_duration", time.monotonic() - received_at)
        return validated

    def _thinking(self, p: RequestParams) -> ThinkingBudget | None:
        """The request's thinking budget (its budget None where its thinking is only counted);
        none where it asks for neither, or where guided decoding constrains its whole output
        (it then thinks not at all; a constraint on the answer after the thinking leaves the
        thinking to the budget)."""
        if p.thinking_budget is not None:
            if self.thinking is None:
                raise ValidationError(THINKING_OFF_MESSAGE)
            if p.thinking_budget < 1:
                raise ValidationError(f"thinking_token_budget must be >= 1, got {p.thinking_budget}")
        elif not p.reads_thinking or self.thinking is None:
            return None
        guided = p.sampling.guided
        if guided is not None and guided.after_thinking is None:
            return None
        return ThinkingBudget(p.thinking_budget, self.thinking)

    async def _bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as the token sequences the shard bans: each word as written (less
        leading spaces) and, where the tokenizer makes a different first token of it, after a
        space (a word in the middle of a text), as vLLM tokenizes them."""
        if len(words) > MAX_BAD_WORDS:
            raise ValidationError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}")
        if any(not word.strip() for word in words):
            raise ValidationError("bad_words may not hold an empty word")
        texts = [variant for word in words for variant in (word.lstrip(), " " + word.lstrip())]
        try:
            encoded = await self.tokenizer.encode_batch(texts, special=False)
        except TokenizerError as exc:
            raise ValidationError(tokenizer_error_message(exc)) from exc
        sequences: list[tuple[int, ...]] = []
        for word, plain, spaced in zip(words, encoded[::2], encoded[1::2], strict=True):
            for ids in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
                if not ids:
                    raise ValidationError(f"bad_words: {clip(word)!r} makes no tokens")
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValidationError(
                        f"bad_words: {clip(word)!r} is {len(ids)} tokens, more than {MAX_BAD_WORD_TOKENS}"
                    )
                check_in_vocabulary(ids, "bad_words: token id", self.vocab_size)
                sequences.append(tuple(ids))
        return tuple(sequences)

    def _token_ids(self, ids: Sequence[int]) -> list[int]:
        """A prompt given as token ids, each checked against the vocabulary."""
        check_in_vocabulary(ids, "prompt token id", self.vocab_size)
        return list(ids)

    def _surely_too_long(self, text: str, truncate: int, prefix_length: int) -> str | None:
        """Check 14's message when the input's length bound alone fails it, else None."""
        at_least = min_tokens(text, self.tokenizer.max_token_bytes)
        limit = self.max_sequence_length
        if truncate and at_least >= truncate:
            at_least = truncate  # then exactly: the input keeps its last `truncate` tokens
            shown = str(truncate)
        else:
            shown = f"at least {at_least}"
        if at_least + prefix_length < limit:
            return None
        return f"input tokens ({shown}) plus prefix length ({prefix_length}) must be < {limit}"

    async def _check_guided(self, guided: Guided) -> None:
        """The constraint must compile for this tokenizer (off the event loop: a large schema
        or grammar takes milliseconds; compiled ones are cached)."""
        if self.grammars is None:
            raise ValidationError(UNAVAILABLE)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.grammars.check, guided)
        except GuidedError as exc:
            raise ValidationError(f"invalid {guided.kind.value} for guided decoding: {exc}") from None

    async def _prefix_length(self, prefix_id: str, adapter: bool) -> int:
        try:
            return await self.prefixes.get(prefix_id, adapter)
        except Exception as exc:
            what = "adapter" if adapter else "prompt prefix"
            # the shard client marks a lookup the shard answered NOT_FOUND
            refusal = UnknownAdapterError if adapter and getattr(exc, "not_found", False) else ValidationError
            raise refusal(f"can't retrieve {what} with id '{clip(prefix_id)}': {clip(str(exc))}") from exc

    def _finish(
        self,
        text: str,
        ids: list[int],
        p: RequestParams,
        prefix_id: str,
        prefix_length: int,
        received_at: float,
        deadline: float | None,
    ) -> ValidatedRequest:
        n = len(ids) if not p.truncate_input_tokens else min(len(ids), p.truncate_input_tokens)
        limit = self.max_sequence_length
        if n + prefix_length == 0:  # a model cannot start from nothing (no BOS, no soft prompt)
            raise ValidationError(EMPTY_INPUT_MESSAGE)
        if n + prefix_length >= limit:
            raise ValidationError(
                f"input tokens ({n}) plus prefix length ({prefix_length}) must be < {limit}"
            )
        st = p.stopping
        if n + prefix_length + st.min_new_tokens > limit:
            raise ValidationError(
                f"input tokens ({n}) plus prefix length ({prefix_length}) plus min_new_tokens "
                f"({st.min_new_tokens}) must be <= {limit}"
            )
        stopping = st
        if n + prefix_length + st.max_new_tokens > limit:
            stopping = replace(st, max_new_tokens=limit - n - prefix_length, capped=True)
        if self.capacity is not None:
            refusal = self.capacity.refusal(Load(n + prefix_length, stopping.max_new_tokens))
            if refusal is not None:
                raise ValidationError(refusal)
        sampling = p.sampling
        if not sampling.greedy and sampling.seed is None:
            sampling = replace(sampling, seed=secrets.randbits(32))
        return ValidatedRequest(
            text=text if p.response.input_text else "",
            input_ids=shard_input_ids(ids, p.truncate_input_tokens),
            input_length=n,
            truncate_input_tokens=p.truncate_input_tokens,
            prefix_id=prefix_id,
            prefix_length=prefix_length,
            sampling=sampling,
            stopping=stopping,
            response=p.response,
            received_at=received_at,
            deadline=deadline,
        )
