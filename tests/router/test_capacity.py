"""router/core/capacity.py: the capacity interface the queue and the batcher use, its TGIS-weights
implementation for both kinds, and the choice by the kind the shard reports."""

from __future__ import annotations

import pytest

from router.core.capacity import Admission, CapacityError, KVBlockCapacity, Load, WeightCapacity, capacity_for
from text_generation_common.engines import CapacityKind
from text_generation_common.messages import (
    KvBlocks,
    KvCacheState,
    MemoryScalingModel,
    ModelInfo,
    StepOutput,
    WeightBudget,
)


def info(kind: CapacityKind, limit: int = 100, prefill_per_token: float = 1.0) -> ModelInfo:
    memory = MemoryScalingModel(prefill_per_token, 0.0, 0.0, 1.0, 1.0, limit)
    return ModelInfo(False, 2, 1000, 512, WeightBudget(memory, padded=kind is CapacityKind.PADDED_WEIGHTS))


def test_the_kind_the_shard_reports_chooses_the_policy() -> None:
    padded = capacity_for(info(CapacityKind.PADDED_WEIGHTS), 0.2)
    packed = capacity_for(info(CapacityKind.UNPADDED_WEIGHTS), 0.2)
    assert isinstance(padded, WeightCapacity) and padded.kind is CapacityKind.PADDED_WEIGHTS
    assert isinstance(packed, WeightCapacity) and packed.kind is CapacityKind.UNPADDED_WEIGHTS
    loads = [Load(10, 5), Load(2, 5)]
    assert padded.prefill_tokens(loads) == 20 and packed.prefill_tokens(loads) == 12
    assert padded.usage(loads) == pytest.approx(0.3) and packed.usage(loads) == pytest.approx(0.22)


def test_admission_verdicts() -> None:
    padded = capacity_for(info(CapacityKind.PADDED_WEIGHTS, limit=40), max_prefill_padding=0.3)
    assert padded.admit([], [], Load(10, 10)) is Admission.FITS
    assert padded.admit([], [], Load(30, 30)) is Admission.NEVER_FITS
    # Peak (10 + 10) * 2 = 40 fits only by the exact walk (the quick bound says 44).
    assert padded.admit([Load(10, 10)], [], Load(1, 12)) is Admission.FITS_AT_PEAK
    # Prefill budget: 40 - 10 (running) = 30 < prefill weight 12 * 3; the peak (26) fits.
    costly = capacity_for(info(CapacityKind.PADDED_WEIGHTS, limit=40, prefill_per_token=3.0), 0.3)
    assert costly.admit([Load(10, 1)], [], Load(12, 1)) is Admission.PREFILL_TOO_BIG
    # Padding of a prefill of a 10-token and a 2-token prompt: 8 / 20 > 0.3.
    assert padded.admit([], [Load(10, 2)], Load(2, 2)) is Admission.TOO_MUCH_PADDING
    assert padded.can_grow([]) and not padded.can_grow([Load(20, 1), Load(20, 1)])


def test_one_request_of_the_longest_length_must_fit() -> None:
    capacity_for(info(CapacityKind.PADDED_WEIGHTS, limit=600), 0.2).check_fits_alone(512)
    with pytest.raises(CapacityError, match=r"max_sequence length \(512\) .* \(512 > 100\)"):
        capacity_for(info(CapacityKind.PADDED_WEIGHTS, limit=100), 0.2).check_fits_alone(512)


# ---- KV blocks ---------------------------------------------------------------------------------


def kv_capacity(total_blocks: int = 11, block_size: int = 4) -> KVBlockCapacity:
    model = ModelInfo(False, 2, 1000, 512, KvBlocks(block_size, total_blocks))
    capacity = capacity_for(model, 0.2)
    assert isinstance(capacity, KVBlockCapacity)
    return capacity


def reported(used: int, reserved: int, total: int = 11) -> StepOutput:
    return StepOutput(kv_cache=KvCacheState(total, used, reserved))


def test_kv_blocks_admit_a_request_at_its_longest_beside_the_chosen_ones() -> None:
    capacity = kv_capacity()  # 10 usable blocks of 4 tokens (one held back for health checks)
    assert capacity.blocks(Load(5, 3)) == 2 and capacity.blocks(Load(5, 4)) == 3
    assert capacity.admit([], [], Load(20, 20)) is Admission.FITS  # exactly 10 blocks
    assert capacity.admit([], [], Load(20, 21)) is Admission.NEVER_FITS
    assert capacity.admit([], [Load(8, 8)], Load(12, 12)) is Admission.FITS  # 4 + 6
    assert capacity.admit([], [Load(8, 8)], Load(12, 13)) is Admission.NEVER_FITS  # 4 + 7
    assert capacity.prefill_tokens([Load(8, 8), Load(3, 1)]) == 11


def test_kv_blocks_count_the_shards_report_or_the_running_requests_whichever_is_tighter() -> None:
    capacity = kv_capacity()
    running = [Load(8, 8), Load(8, 8)]  # 4 blocks each at their longest
    assert capacity.admit(running, [], Load(4, 4)) is Admission.FITS  # 8 + 2
    assert capacity.admit(running, [], Load(4, 5)) is Admission.NEVER_FITS  # 8 + 3
    # the shard shares a prefix block between the two: 7 blocks committed, room for 3 more
    capacity.observe(reported(used=5, reserved=2))
    assert capacity.admit(running, [], Load(4, 5)) is Admission.FITS
    assert capacity.usage(running) == pytest.approx(0.7)
    # a report that still counts a request which finished since: the running ones bound it
    capacity.observe(reported(used=9, reserved=1))
    assert capacity.admit(running, [], Load(4, 4)) is Admission.FITS
    assert capacity.can_grow(running) and not capacity.can_grow([*running, Load(4, 4)])
    # no running request: nothing is committed, whatever the last report said
    assert capacity.admit([], [], Load(20, 20)) is Admission.FITS and capacity.usage([]) == 0.0
    capacity.observe(StepOutput())  # an output without a report changes nothing
    assert capacity.state is not None and capacity.state.used_blocks == 9


def test_kv_blocks_refuse_what_the_whole_cache_cannot_hold_and_start_with_any_cache(caplog) -> None:
    capacity = kv_capacity()
    assert capacity.refusal(Load(30, 10)) is None
    assert capacity.refusal(Load(30, 11)) == (
        "input tokens plus max_new_tokens (30 + 11) need 11 KV-cache blocks of 4 tokens; "
        "the whole cache holds 10"
    )
    capacity.check_fits_alone(40)
    assert not caplog.records
    capacity.check_fits_alone(41)  # longer requests are refused at validation, with a warning here
    assert "fewer than max_sequence_length 41" in caplog.text
    with pytest.raises(CapacityError, match="too few to run a request"):
        kv_capacity(total_blocks=1).check_fits_alone(4)
    with pytest.raises(CapacityError, match="reports a KV cache of 0 blocks"):
        kv_capacity(total_blocks=0)
