"""Capacity: whether a waiting request can join the running ones, what a prefill costs, and how
full the batch is. One interface, one implementation per capacity kind the shard reports in
ModelInfo (text_generation_common/engines.py CapacityKind); request_queue.py and batcher.py
use only this interface.

    kind               implementation     admission rule
    PADDED_WEIGHTS     WeightCapacity     TGIS batch weights of left-padded batches (batch_weights.py)
    UNPADDED_WEIGHTS   WeightCapacity     the same weights over packed batches

A request is seen as a Load: (in, out) tokens, where in = prompt + prefix (+ generated so far
once running) and out = tokens it may still generate. The KV-block kind of the paged engine
fits here as another Capacity: `admit` checks the blocks a candidate needs (less those a
prefix-cache hit saves, from the prompt's block hashes carried in its Load) against the free
blocks the shard reports with each step (`observe`), `prefill_tokens` counts the uncached
tokens, and `usage` is used / total blocks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from router.batch_weights import BatchWeights
from text_generation_common.engines import CapacityKind
from text_generation_common.messages import ModelInfo, StepOutput


class Load(NamedTuple):
    """What one request asks of the batch."""

    in_tokens: int
    out_tokens: int


class Admission(enum.Enum):
    """The verdict on one candidate (the queue counts the refusals as TGIS's metrics do)."""

    FITS = "fits"
    FITS_AT_PEAK = "fits_at_peak"  # fits, by the exact peak check rather than the quick bound
    NEVER_FITS = "never_fits"  # would exceed the capacity before the batch finishes
    PREFILL_TOO_BIG = "prefill_too_big"  # the prefill alone needs more than is free now
    TOO_MUCH_PADDING = "too_much_padding"  # the prefill would waste too much on padding


class CapacityError(ValueError):
    """The model cannot serve even one request of the configured length."""


class Capacity(ABC):
    kind: CapacityKind

    @abstractmethod
    def can_grow(self, running: Sequence[Load]) -> bool:
        """Is there room for any new request beside `running`?"""

    @abstractmethod
    def admit(self, running: Sequence[Load], chosen: Sequence[Load], candidate: Load) -> Admission:
        """May `candidate` join `running` in one prefill with `chosen` (already admitted)?"""

    @abstractmethod
    def prefill_tokens(self, loads: Sequence[Load]) -> int:
        """Prompt positions a forward over `loads` computes (the token budget's unit)."""

    @abstractmethod
    def usage(self, running: Sequence[Load]) -> float:
        """Share of the capacity `running` holds, 0..1."""

    @abstractmethod
    def check_fits_alone(self, max_sequence_length: int) -> None:
        """CapacityError unless one request of `max_sequence_length` tokens fits."""

    def observe(self, output: StepOutput) -> None:  # noqa: B027 - optional hook
        """Learn from a step's output (kinds whose state lives in the shard)."""


class WeightCapacity(Capacity):
    """TGIS's batch weights, padded or unpadded (batch_weights.py has the formulas)."""

    def __init__(self, weights: BatchWeights, max_prefill_padding: float) -> None:
        self.weights = weights
        self.max_prefill_padding = max_prefill_padding
        self.kind = CapacityKind.PADDED_WEIGHTS if weights.padded else CapacityKind.UNPADDED_WEIGHTS

    def can_grow(self, running: Sequence[Load]) -> bool:
        return self._prefill_budget(running) > 0

    def _prefill_budget(self, running: Sequence[Load]) -> int:
        w = self.weights
        return w.limit if not running or w.limit == 0 else w.limit - w.initial_weight(running)

    def admit(self, running: Sequence[Load], chosen: Sequence[Load], candidate: Load) -> Admission:
        w = self.weights
        verdict = Admission.FITS
        if w.max_weight([*running, *chosen, candidate]) > w.limit:
            if w.exceeds([*running, *chosen], candidate):
                return Admission.NEVER_FITS
            verdict = Admission.FITS_AT_PEAK
        prefill = [*chosen, candidate]
        if w.prefill_weight(prefill) > self._prefill_budget(running):
            return Admission.PREFILL_TOO_BIG
        if w.padding_fraction(prefill) > self.max_prefill_padding:
            return Admission.TOO_MUCH_PADDING
        return verdict

    def prefill_tokens(self, loads: Sequence[Load]) -> int:
        return self.weights.batch_tokens(loads)

    def usage(self, running: Sequence[Load]) -> float:
        w = self.weights
        return w.max_weight(running) / w.limit if w.limit else 0.0

    def check_fits_alone(self, max_sequence_length: int) -> None:
        w = self.weights
        longest = [Load(max_sequence_length, 1)]
        prefill = w.prefill_weight(longest)
        if prefill > w.limit or w.initial_weight(longest) > w.limit:
            raise CapacityError(
                f"The provided max_sequence length ({max_sequence_length}) results in a prefill batch "
                f"weight that exceeds the estimated capacity ({prefill} > {w.limit})"
            )


def capacity_for(info: ModelInfo, max_prefill_padding: float) -> Capacity:
    """The capacity policy of the kind the shard reported."""
    if info.capacity in (CapacityKind.PADDED_WEIGHTS, CapacityKind.UNPADDED_WEIGHTS):
        padded = info.capacity is CapacityKind.PADDED_WEIGHTS
        return WeightCapacity(BatchWeights.from_model(info.memory, padded), max_prefill_padding)
    raise CapacityError(f"the shard reports capacity kind {info.capacity.value!r}, unknown to this router")
