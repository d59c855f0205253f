"""The internal protocol's edge: what the shard reports crosses protobuf unchanged."""

from __future__ import annotations

import pytest

from router.core.capacity import KVBlockCapacity, capacity_for
from text_generation_common import convert
from text_generation_common.engines import CapacityKind
from text_generation_common.messages import (
    Generation,
    GenerationRequest,
    InputTokens,
    KvBlocks,
    MemoryScalingModel,
    ModelInfo,
    NewBatch,
    RequestError,
    Speculation,
    StepOutput,
    TokenInfo,
    TopToken,
    WeightBudget,
)
from text_generation_common.pb import generate_pb2 as pb


@pytest.mark.parametrize(
    ("eager_joins", "capacity"),
    [(False, CapacityKind.KV_BLOCKS), (True, CapacityKind.KV_BLOCKS), (False, CapacityKind.PADDED_WEIGHTS)],
)
def test_model_info_round_trips(eager_joins: bool, capacity: CapacityKind) -> None:
    """A KV-blocks engine reports no batch-weight model (the router admits by blocks)."""
    weights = capacity is not CapacityKind.KV_BLOCKS
    memory = MemoryScalingModel(1.5, 0.25, 0.125, 1.0, 2.0, 4096)
    info = ModelInfo(
        seq2seq=False,
        eos_token_id=2,
        vocab_size=8192,
        max_sequence_length=2048,
        capacity=WeightBudget(memory, capacity is CapacityKind.PADDED_WEIGHTS)
        if weights
        else KvBlocks(16, 257),
        dtype="bfloat16",
        dtype_reason="asked for",
        chunked_prefill=True,
        eager_joins=eager_joins,
        compute_cpus=() if eager_joins else (0, 1, 5),  # a GPU shard reports none
        bos_token_id=None if eager_joins else 0,  # id 0 is an id, not "none"
        max_loras=0 if eager_joins else 4,
    )
    reply = convert.model_info_to_pb(info)
    back = convert.model_info_from_pb(reply)
    assert back == info and back.capacity.kind is capacity
    if not weights:
        assert isinstance(capacity_for(back, 1.0), KVBlockCapacity)
        reply.capacity_kind = pb.ModelInfoResponse.PADDED_WEIGHTS  # a weights kind needs its memory model
        with pytest.raises(ValueError, match="padded_weights capacity without its memory model"):
            convert.model_info_from_pb(reply)


def test_a_joining_batch_round_trips() -> None:
    join = NewBatch(7, (GenerationRequest(3, (1, 5, 9), 4), GenerationRequest(4, (1, 2), 8)))
    assert convert.new_batch_from_pb(convert.new_batch_to_pb(join)) == join


def test_a_step_with_several_tokens_per_request_round_trips() -> None:
    """Speculative decoding: a request's tokens of one step in order, and what was verified."""
    output = StepOutput(
        generations=[Generation(7, TokenInfo(11)), Generation(7, TokenInfo(12)), Generation(9, TokenInfo(5))],
        batch_id=3,
        pending=[4],
        speculation=[Speculation(proposed=3, accepted=1)],
    )
    back = convert.result_from_pb(convert.result_to_pb(output))
    assert back == output
    assert back.request_ids == [7, 9, 4]  # once each
    assert back.running_ids == {4, 7, 9}


def test_a_step_with_every_token_detail_and_input_tokens_round_trips() -> None:
    top = (TopToken(5, -0.25), TopToken(9, -1.5))
    output = StepOutput(
        generations=[Generation(1, TokenInfo(5, -0.25, 1, top)), Generation(2, TokenInfo(0, 0.0, 0))],
        errors=[RequestError(3, "boom")],
        input_tokens=[InputTokens(1, (TokenInfo(4, float("nan")), TokenInfo(5, -2.0, 3, top[:1])))],
        batch_id=0,
        forward_ns=12,
        guided_mask_ns=3,
    )
    result = convert.result_to_pb(output)
    back = convert.result_from_pb(result, convert.input_tokens_to_pb(output.input_tokens))
    assert back.generations == output.generations and back.errors == output.errors
    assert back.batch_id == 0 and (back.forward_ns, back.guided_mask_ns) == (12, 3)
    (item,) = back.input_tokens
    assert item.request_id == 1 and item.tokens[1] == output.input_tokens[0].tokens[1]
    assert item.tokens[0].token_id == 4 and item.tokens[0].logprob != item.tokens[0].logprob  # NaN kept
