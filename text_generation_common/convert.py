"""Every conversion between the internal protobuf messages and outputs.py dataclasses, in both
directions: the shard (server.py) reads requests and writes results, the router
(router/scheduling/shard_client.py) writes requests and reads results.

Zero values of proto3 scalars that mean "off" are normalised on reading (top_p / typical_p <= 0
and repetition_penalty 0 -> 1.0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from text_generation_common.engines import CapacityKind
from text_generation_common.messages import (
    AdapterCacheState,
    CachedBatchRef,
    Capacity,
    Generation,
    GenerationRequest,
    Guided,
    GuidedKind,
    InputTokens,
    KvBlocks,
    KvCacheState,
    LengthPenalty,
    MemoryScalingModel,
    ModelInfo,
    NewBatch,
    RequestedDetails,
    RequestError,
    SamplingParams,
    Speculation,
    StepOutput,
    ThinkingMarks,
    TokenInfo,
    TopToken,
    WeightBudget,
)
from text_generation_common.pb import generate_pb2 as pb

CAPACITY_TO_PB = {
    CapacityKind.PADDED_WEIGHTS: pb.ModelInfoResponse.PADDED_WEIGHTS,
    CapacityKind.UNPADDED_WEIGHTS: pb.ModelInfoResponse.UNPADDED_WEIGHTS,
    CapacityKind.KV_BLOCKS: pb.ModelInfoResponse.KV_BLOCKS,
}
ADAPTER_CACHE_FIELDS = tuple(AdapterCacheState.__dataclass_fields__)
KV_CACHE_FIELDS = (
    "total_blocks",
    "used_blocks",
    "reserved_blocks",
    "cached_blocks",
    "prefix_query_tokens",
    "prefix_hit_tokens",
)


def sampling_params_from_pb(p: pb.NextTokenChooserParameters) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        typical_p=p.typical_p if p.typical_p > 0 else 1.0,
        min_p=p.min_p,
        min_new_tokens=p.min_new_tokens,
        seed=p.seed if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        frequency_by_length=p.frequency_by_length,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        stop_token_ids=tuple(p.stop_token_ids),
        allowed_token_ids=tuple(p.allowed_token_ids),
        bad_words=tuple(tuple(s.ids) for s in p.bad_words),
        length_penalty=(
            LengthPenalty(p.length_penalty.start_index, p.length_penalty.decay_factor)
            if p.HasField("length_penalty")
            else None
        ),
        guided=guided_from_pb(p.guided) if p.HasField("guided") else None,
    )


def guided_from_pb(g: pb.Guided) -> Guided:
    marks = g.after_thinking
    return Guided(
        GuidedKind(g.kind),
        g.spec,
        tuple(g.choices),
        ThinkingMarks(marks.opened_by_prompt, tuple(marks.starts), tuple(marks.ends))
        if g.HasField("after_thinking")
        else None,
    )


def request_from_pb(r: pb.Request) -> GenerationRequest:
    d = r.details
    return GenerationRequest(
        id=r.id,
        input_ids=tuple(r.input_ids),
        max_new_tokens=r.max_new_tokens,
        truncate_input_tokens=r.truncate_input_tokens,
        params=sampling_params_from_pb(r.parameters),
        details=RequestedDetails(
            input_tokens=d.input_tokens, logprobs=d.logprobs, ranks=d.ranks, top_n_tokens=d.top_n_tokens
        ),
        prefix_id=r.prefix_id,
        adapter_id=r.adapter_id,
        call_end_ids=frozenset(r.call_end_ids),
        cache_salt=r.cache_salt,
        generated_ids=tuple(r.generated_ids),
    )


def new_batch_from_pb(batch: pb.Batch) -> NewBatch:
    return NewBatch(batch.id, tuple(request_from_pb(r) for r in batch.requests))


def new_batch_to_pb(batch: NewBatch) -> pb.Batch:
    return pb.Batch(id=batch.batch_id, requests=[request_to_pb(r) for r in batch.requests])


def cached_batches_from_pb(batches: Iterable[pb.CachedBatch]) -> list[CachedBatchRef]:
    return [CachedBatchRef(b.id, tuple(b.completed_ids)) for b in batches]


def token_to_pb(info: TokenInfo, request_id: int = 0) -> pb.Token:
    token = pb.Token()
    _fill_token(token, info, request_id)
    return token


def _fill_token(token: pb.Token, info: TokenInfo, request_id: int) -> None:
    """Set `token` (a new message, e.g. from a repeated field's add()) to `info`."""
    token.request_id = request_id
    token.token_id = info.token_id
    token.logprob = info.logprob
    token.rank = info.rank
    if info.top_tokens:
        token.top_tokens.extend(pb.TopToken(token_id=t.token_id, logprob=t.logprob) for t in info.top_tokens)


def result_to_pb(out: StepOutput) -> pb.GenerateResult:
    result = pb.GenerateResult(
        errors=[pb.RequestError(request_id=e.request_id, message=e.message) for e in out.errors],
        forward_ns=out.forward_ns,
        pending_ids=out.pending,
        guided_mask_ns=out.guided_mask_ns,
        speculation=[pb.Speculation(proposed=x.proposed, accepted=x.accepted) for x in out.speculation],
        cached_prompts=[pb.CachedPrompt(request_id=i, tokens=n) for i, n in out.cached_prompts],
        steps=out.steps,
    )
    add = result.tokens.add  # one step's tokens, filled in place (a third of building each message)
    for g in out.generations:
        _fill_token(add(), g.token, g.request_id)
    if out.batch_id is not None:
        result.batch_id = out.batch_id
    if out.kv_cache is not None:
        result.kv_cache.CopyFrom(
            pb.KvCacheState(**{name: getattr(out.kv_cache, name) for name in KV_CACHE_FIELDS})
        )
    return result


def input_tokens_to_pb(items: Iterable[InputTokens]) -> list[pb.InputTokens]:
    return [pb.InputTokens(request_id=i.request_id, tokens=[token_to_pb(t) for t in i.tokens]) for i in items]


MEMORY_FIELDS = [f.name for f in dataclasses.fields(MemoryScalingModel)]


def model_info_to_pb(info: ModelInfo) -> pb.ModelInfoResponse:
    response = pb.ModelInfoResponse(
        model_type=pb.ModelInfoResponse.SEQ2SEQ_LM if info.seq2seq else pb.ModelInfoResponse.CAUSAL_LM,
        eos_token_id=info.eos_token_id,
        extra_eos_token_ids=info.extra_eos_token_ids,
        sampling_defaults=dict(info.sampling_defaults),
        capacity_kind=CAPACITY_TO_PB[info.capacity.kind],
        chunked_prefill=info.chunked_prefill,
        eager_joins=info.eager_joins,
        vocab_size=info.vocab_size,
        max_sequence_length=info.max_sequence_length,
        dtype=info.dtype,
        dtype_reason=info.dtype_reason,
        compute_cpus=info.compute_cpus,
        bos_token_id=info.bos_token_id,
        max_loras=info.max_loras,
    )
    capacity = info.capacity
    if isinstance(capacity, KvBlocks):
        response.kv_block_size, response.kv_total_blocks = capacity.block_size, capacity.total_blocks
    else:
        memory = {name: getattr(capacity.memory, name) for name in MEMORY_FIELDS}
        response.memory_scaling_model.CopyFrom(pb.MemoryScalingModel(**memory))
    return response


# ---- router side: requests out, results in -----------------------------------------------------


def sampling_params_to_pb(p: SamplingParams) -> pb.NextTokenChooserParameters:
    out = pb.NextTokenChooserParameters(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        typical_p=p.typical_p,
        min_p=p.min_p,
        min_new_tokens=p.min_new_tokens,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        frequency_by_length=p.frequency_by_length,
    )
    out.logit_bias.update(dict(p.logit_bias))
    out.stop_token_ids.extend(p.stop_token_ids)
    out.allowed_token_ids.extend(p.allowed_token_ids)
    for ids in p.bad_words:
        out.bad_words.add(ids=ids)
    if p.seed is not None:
        out.seed = p.seed
    if p.length_penalty is not None:
        out.length_penalty.start_index = p.length_penalty.start_index
        out.length_penalty.decay_factor = p.length_penalty.decay_factor
    if p.guided is not None:
        out.guided.kind = p.guided.kind.value
        out.guided.spec = p.guided.spec
        out.guided.choices.extend(p.guided.choices)
        if (marks := p.guided.after_thinking) is not None:
            out.guided.after_thinking.opened_by_prompt = marks.opened_by_prompt
            out.guided.after_thinking.starts.extend(marks.starts)
            out.guided.after_thinking.ends.extend(marks.ends)
    return out


def request_to_pb(r: GenerationRequest) -> pb.Request:
    d = r.details
    return pb.Request(
        id=r.id,
        prefix_id=r.prefix_id,
        adapter_id=r.adapter_id,
        input_ids=r.input_ids,
        truncate_input_tokens=r.truncate_input_tokens,
        max_new_tokens=r.max_new_tokens,
        parameters=sampling_params_to_pb(r.params),
        details=pb.RequestedDetails(
            input_tokens=d.input_tokens, logprobs=d.logprobs, ranks=d.ranks, top_n_tokens=d.top_n_tokens
        ),
        call_end_ids=r.call_end_ids,
        cache_salt=r.cache_salt,
        generated_ids=r.generated_ids,
    )


def cached_batches_to_pb(refs: Iterable[CachedBatchRef]) -> list[pb.CachedBatch]:
    return [pb.CachedBatch(id=r.batch_id, completed_ids=r.completed_ids) for r in refs]


def token_from_pb(t: pb.Token) -> TokenInfo:
    top = t.top_tokens
    return TokenInfo(
        t.token_id, t.logprob, t.rank, tuple(TopToken(x.token_id, x.logprob) for x in top) if top else ()
    )


def result_from_pb(result: pb.GenerateResult, input_tokens: Iterable[pb.InputTokens] = ()) -> StepOutput:
    return StepOutput(
        generations=[Generation(t.request_id, token_from_pb(t)) for t in result.tokens],
        errors=[RequestError(e.request_id, e.message) for e in result.errors],
        input_tokens=[
            InputTokens(i.request_id, tuple(token_from_pb(t) for t in i.tokens)) for i in input_tokens
        ],
        batch_id=result.batch_id if result.HasField("batch_id") else None,
        forward_ns=result.forward_ns,
        guided_mask_ns=result.guided_mask_ns,
        pending=list(result.pending_ids),
        kv_cache=(
            KvCacheState(**{name: getattr(result.kv_cache, name) for name in KV_CACHE_FIELDS})
            if result.HasField("kv_cache")
            else None
        ),
        speculation=[Speculation(x.proposed, x.accepted) for x in result.speculation],
        cached_prompts=[(c.request_id, c.tokens) for c in result.cached_prompts],
        steps=result.steps,
    )


def capacity_from_pb(info: pb.ModelInfoResponse) -> Capacity:
    """The capacity a shard reports; ValueError for a kind this side does not know or a weights
    kind without its memory model."""
    kind = {v: k for k, v in CAPACITY_TO_PB.items()}.get(info.capacity_kind)
    if kind is CapacityKind.KV_BLOCKS:
        return KvBlocks(info.kv_block_size, info.kv_total_blocks)
    if kind is None:
        raise ValueError(f"the shard reports capacity kind {info.capacity_kind}, unknown to this router")
    if not info.HasField("memory_scaling_model"):
        raise ValueError(f"the shard reports {kind.value} capacity without its memory model")
    m = info.memory_scaling_model
    memory = MemoryScalingModel(**{name: getattr(m, name) for name in MEMORY_FIELDS})
    return WeightBudget(memory, padded=kind is CapacityKind.PADDED_WEIGHTS)


def model_info_from_pb(info: pb.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        seq2seq=info.model_type == pb.ModelInfoResponse.SEQ2SEQ_LM,
        eos_token_id=info.eos_token_id,
        vocab_size=info.vocab_size,
        max_sequence_length=info.max_sequence_length,
        capacity=capacity_from_pb(info),
        chunked_prefill=info.chunked_prefill,
        eager_joins=info.eager_joins,
        dtype=info.dtype,
        dtype_reason=info.dtype_reason,
        compute_cpus=tuple(info.compute_cpus),
        extra_eos_token_ids=tuple(info.extra_eos_token_ids),
        sampling_defaults=tuple(sorted(info.sampling_defaults.items())),
        bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
        max_loras=info.max_loras,
    )


def adapter_cache_to_pb(state: AdapterCacheState) -> pb.AdapterCacheState:
    return pb.AdapterCacheState(**{name: getattr(state, name) for name in ADAPTER_CACHE_FIELDS})


def adapter_cache_from_pb(state: pb.AdapterCacheState) -> AdapterCacheState:
    return AdapterCacheState(**{name: getattr(state, name) for name in ADAPTER_CACHE_FIELDS})
