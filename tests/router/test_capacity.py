"""router/capacity.py: the capacity interface the queue and the batcher use, its TGIS-weights
implementation for both kinds, and the choice by the kind the shard reports."""

from __future__ import annotations

import pytest

from router.capacity import Admission, CapacityError, Load, WeightCapacity, capacity_for
from text_generation_common.engines import CapacityKind
from text_generation_common.messages import MemoryScalingModel, ModelInfo


def info(kind: CapacityKind, limit: int = 100, prefill_per_token: float = 1.0) -> ModelInfo:
    memory = MemoryScalingModel(prefill_per_token, 0.0, 0.0, 1.0, 1.0, limit)
    return ModelInfo(False, 2, 1000, 512, memory, capacity=kind)


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
