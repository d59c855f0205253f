"""Typed messages between the router and the shards, and between the shard's gRPC edge and
its engines.

convert.py turns protobuf into these and back; the router's batcher and the shard's engines
see only these. Flow: router GenerationRequest -> PrefillRequest -> GenerationRequest ->
Batch.from_requests -> engine.generate_token -> StepOutput -> GenerateResult -> StepOutput.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from text_generation_common.engines import CapacityKind

# Batch id of the router's health-check prefill: answered, never cached.
HEALTH_CHECK_BATCH_ID = 2**64 - 1


@dataclass(frozen=True, slots=True)
class LengthPenalty:
    start_index: int  # generated-token count after which the EOS boost starts
    decay_factor: float  # boost = |score[eos]| * (decay_factor ** k - 1), k = generated - start_index


class GuidedKind(enum.Enum):
    """What a guided-decoding constraint's spec is (vllm-tgis-adapter's `guided` oneof)."""

    JSON = "json"  # any JSON value (TGIS ResponseFormat.JSON; OpenAI json_object): no spec
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema document
    REGEX = "regex"  # spec: a regular expression the whole output must match
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: a context-free grammar (Lark syntax)


@dataclass(frozen=True, slots=True)
class ThinkingMarks:
    """How a reasoning model's thinking opens (any of `starts`, or the prompt opens it) and
    closes (any of `ends`), as text."""

    opened_by_prompt: bool
    starts: tuple[str, ...]
    ends: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Guided:
    """A constraint on a request's generated text (checked by the router, applied by the shard);
    with `after_thinking`, on the answer after a reasoning model's thinking (which is free)."""

    kind: GuidedKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    after_thinking: ThinkingMarks | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token of one request is chosen (all logits processing is per request)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    typical_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0 = off: tokens less likely than min_p x the likeliest are dropped
    min_new_tokens: int = 0  # EOS masked while fewer tokens were generated
    seed: int | None = None  # sampling generator seed; the router sets one for every sampling request
    repetition_penalty: float = 1.0  # 1.0 = off
    # OpenAI's additive penalties over the tokens generated so far (0 = off): a token's score
    # less frequency_penalty per time it was generated, less presence_penalty once it was
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # TGI's form instead: the counts cover the prompt's tokens as well as the generated ones, and
    # frequency_penalty is divided by their number (the text's length so far)
    frequency_by_length: bool = False
    # OpenAI's logit_bias: (token id, added to its logit before any other processing), ids unique
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's stop_token_ids: this request's own ids that end it as EOS does
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's allowed_token_ids: the only ids this request may choose (empty: any)
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token sequences: each sequence's last id is banned where the ids
    # generated so far end with the ones before it (a one-id sequence: always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    length_penalty: LengthPenalty | None = None
    guided: Guided | None = None  # guided decoding: the output must satisfy it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class RequestedDetails:
    """Which token details a request wants back."""

    input_tokens: bool = False
    logprobs: bool = False
    ranks: bool = False
    top_n_tokens: int = 0

    @property
    def any_token_detail(self) -> bool:
        return self.logprobs or self.ranks or self.top_n_tokens > 0


def truncated_ids(ids: Sequence[int], keep: int, bos_token_id: int | None) -> list[int]:
    """The prompt ids the model reads: the last `keep` of `ids` (0: all), with BOS back as the
    first kept token where the tokenizer puts one first (`truncate_input_tokens: 1` leaves BOS)."""
    kept = list(ids)
    if 0 < keep < len(kept):
        kept = kept[-keep:]
        if bos_token_id is not None:
            kept[0] = bos_token_id
    return kept


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to generate for, as the router sends it."""

    id: int
    input_ids: tuple[int, ...]  # tokenized with special tokens, untruncated
    max_new_tokens: int
    truncate_input_tokens: int = 0  # keep the last N ids (BOS re-inserted); 0 = all
    params: SamplingParams = field(default_factory=SamplingParams)
    details: RequestedDetails = field(default_factory=RequestedDetails)
    prefix_id: str = ""  # soft prompt (TGIS); "" = none
    adapter_id: str = ""  # adapter of whatever kind is stored under the id; "" = none
    # tokens that may complete one of its stop sequences: a call of several steps ends after one
    call_end_ids: frozenset[int] = frozenset()
    cache_salt: str = ""  # vLLM's: prompts of other salts never share its prefix-cache blocks
    # a preempted request, resumed: the ids it generated before (computed after the prompt, then
    # generation goes on as if it had never stopped); () = a new request
    generated_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CachedBatchRef:
    """A batch cached in the shard and the requests to drop from it before use."""

    batch_id: int
    completed_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NewBatch:
    """Requests that join the running batch inside a decode step (NextToken's `join`)."""

    batch_id: int
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True, slots=True)
class TopToken:
    token_id: int
    logprob: float = 0.0  # 0.0 when logprobs were not requested


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A token with the details its request asked for (zero values = not requested)."""

    token_id: int
    logprob: float = 0.0  # NaN for the first input token
    rank: int = 0  # 1-based
    top_tokens: tuple[TopToken, ...] = ()


FIRST_INPUT_TOKEN_LOGPROB = math.nan


@dataclass(frozen=True, slots=True)
class Generation:
    """The token one request produced in one step."""

    request_id: int
    token: TokenInfo


@dataclass(frozen=True, slots=True)
class InputTokens:
    request_id: int
    tokens: tuple[TokenInfo, ...]


@dataclass(frozen=True, slots=True)
class RequestError:
    """A failure confined to one request; the request is no longer in the batch."""

    request_id: int
    message: str


@dataclass(frozen=True, slots=True)
class AdapterCacheState:
    """The shard's loaded adapters: resident now, and loads / evictions since start."""

    resident_prompts: int = 0
    resident_loras: int = 0
    prompt_loads: int = 0
    lora_loads: int = 0
    prompt_evictions: int = 0
    lora_evictions: int = 0


@dataclass(frozen=True, slots=True)
class AdapterListing:
    """The adapter ids of the shards' store that requests may name, sorted."""

    ids: tuple[str, ...] = ()
    truncated: bool = False  # the store holds more than one listing answers


@dataclass(frozen=True, slots=True)
class KvCacheState:
    """A paged KV cache after a step, over every request the shard holds (KV_BLOCKS engines)."""

    total_blocks: int
    used_blocks: int  # held by live requests (a block shared through the prefix cache counts once)
    reserved_blocks: int  # still to be taken by live requests, each at its longest
    cached_blocks: int = 0  # prefix-cache blocks no live request holds (reclaimable)
    prefix_query_tokens: int = 0  # since start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # since start: of those, found cached

    @property
    def committed_blocks(self) -> int:
        """Blocks the live requests hold or may still take."""
        return self.used_blocks + self.reserved_blocks


@dataclass(frozen=True, slots=True)
class Speculation:
    """One row's speculation in a step: candidate tokens verified, and how many were taken."""

    proposed: int
    accepted: int


@dataclass(slots=True)
class StepOutput:
    """The result of one prefill or decode call: every live request of the call is answered by
    generations, an error, or a pending id (still running, no token this step, e.g. its prompt is
    only partly computed). A request has one generation per step, or several in order when the
    engine speculates (their candidate tokens verified in the step's forward); an output of a
    call that ran several steps (NextTokenRequest.steps) carries each step's in turn."""

    generations: list[Generation] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    input_tokens: list[InputTokens] = field(default_factory=list)
    batch_id: int | None = None  # id the batch is cached under; None = nothing cached
    forward_ns: int = 0
    pending: list[int] = field(default_factory=list)  # request ids
    kv_cache: KvCacheState | None = None  # KV_BLOCKS engines: the cache after this step
    guided_mask_ns: int = 0  # guided decoding: token masks and matchers (0: no constrained row)
    speculation: list[Speculation] = field(default_factory=list)  # one per row that speculated
    steps: int = 0  # forwards whose tokens this output carries (forward_ns is their sum)
    # (request id, prompt tokens found in the prefix cache) of the prompts completed in the call
    cached_prompts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def request_ids(self) -> list[int]:
        """The requests this output answers (tokens, an error or a pending entry each), once each."""
        generated = list(dict.fromkeys(g.request_id for g in self.generations))
        return generated + [e.request_id for e in self.errors] + self.pending

    @property
    def running_ids(self) -> set[int]:
        """The requests still in the batch after this step (a token or pending)."""
        return {g.request_id for g in self.generations} | set(self.pending)

    def without(self, completed_ids: set[int]) -> StepOutput:
        """This output less the answers to `completed_ids`."""
        return StepOutput(
            [g for g in self.generations if g.request_id not in completed_ids],
            [e for e in self.errors if e.request_id not in completed_ids],
            list(self.input_tokens),
            self.batch_id,
            self.forward_ns,
            [i for i in self.pending if i not in completed_ids],
            self.kv_cache,
            self.guided_mask_ns,
            self.speculation,
            self.steps,
            [c for c in self.cached_prompts if c[0] not in completed_ids],
        )

    @classmethod
    def merged(cls, outputs: Sequence[StepOutput]) -> StepOutput:
        """One output answering every request of `outputs`, in their order (several steps'
        tokens for a request stay in the order of the outputs); forward time and steps summed,
        the KV cache as the last left it."""
        states = [o.kv_cache for o in outputs if o.kv_cache is not None]
        return cls(
            [g for o in outputs for g in o.generations],
            [e for o in outputs for e in o.errors],
            [t for o in outputs for t in o.input_tokens],
            forward_ns=sum(o.forward_ns for o in outputs),
            pending=[i for o in outputs for i in o.pending],
            kv_cache=states[-1] if states else None,
            guided_mask_ns=sum(o.guided_mask_ns for o in outputs),
            speculation=[s for o in outputs for s in o.speculation],
            steps=sum(o.steps for o in outputs),
            cached_prompts=[c for o in outputs for c in o.cached_prompts],
        )


@dataclass(frozen=True, slots=True)
class MemoryScalingModel:
    """Batch-weight coefficients and limit (formulas in proto/generate.proto)."""

    prefill_linear_coef0: float
    prefill_quadratic_coef0: float
    prefill_quadratic_coef1: float
    nexttoken_linear_coef0: float
    nexttoken_linear_coef1: float
    weight_limit: int


@dataclass(frozen=True, slots=True)
class WeightBudget:
    """Capacity as TGIS's batch weights: each request weighs by its lengths under `memory`, the
    batch's weight stays under its limit; `padded`: prompts weigh at the longest one's length
    (left-padded batches: PADDED_WEIGHTS), else each at its own (UNPADDED_WEIGHTS)."""

    memory: MemoryScalingModel
    padded: bool = True

    @property
    def kind(self) -> CapacityKind:
        return CapacityKind.PADDED_WEIGHTS if self.padded else CapacityKind.UNPADDED_WEIGHTS


@dataclass(frozen=True, slots=True)
class KvBlocks:
    """Capacity as the paged KV cache's blocks: `total_blocks` of `block_size` tokens each."""

    block_size: int
    total_blocks: int

    @property
    def kind(self) -> CapacityKind:
        return CapacityKind.KV_BLOCKS


Capacity = WeightBudget | KvBlocks  # what an engine reports of its capacity: one kind, its facts


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Static facts about the loaded model, reported to the router."""

    seq2seq: bool
    eos_token_id: int
    vocab_size: int
    max_sequence_length: int
    capacity: Capacity  # its kind is the engine's registry entry's (text_generation_common/engines.py)
    dtype: str = ""  # what the weights and activations are in ("bfloat16", ...)
    dtype_reason: str = ""  # why that dtype ("the CPU has AMX-BF16", "asked for ...")
    chunked_prefill: bool = False  # the engine honours a per-step prompt-token budget
    eager_joins: bool = False  # decode-only steps replay CUDA graphs, steps with prompt chunks do not
    # the CPUs the forward computes on (the shard's affinity) when the engine runs on the CPU;
    # empty where an accelerator computes: a router on the same CPUs slows the forward it waits for
    compute_cpus: tuple[int, ...] = ()
    # the model's other end-of-sequence ids: each ends a request as eos_token_id does
    extra_eos_token_ids: tuple[int, ...] = ()
    # the sampling parameters generation_config.json sets (name, value): the OpenAI door's
    # defaults for requests that leave them unset, as vLLM's
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # the tokenizer's BOS where it puts one first (and back first when a prompt is truncated)
    bos_token_id: int | None = None
    max_loras: int = 0  # LoRA adapters the shard keeps resident at most; 0: it applies none
