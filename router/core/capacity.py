"""Capacity: whether a waiting request can join the running ones, what a prefill costs, and how
full the batch is. One interface, one implementation per capacity kind the shard reports in
ModelInfo (text_generation_common/engines.py CapacityKind); request_queue.py and batcher.py
use only this interface.

    kind               implementation     admission rule
    PADDED_WEIGHTS     WeightCapacity     TGIS batch weights of left-padded batches (batch_weights.py)
    UNPADDED_WEIGHTS   WeightCapacity     the same weights over packed batches
    KV_BLOCKS          KVBlockCapacity    the blocks of a paged KV cache a request may need at its
                                          longest, against those the shard has not promised

A request is seen as a Load: (in, out) tokens, where in = prompt + prefix (+ generated so far
once running) and out = tokens it may still generate; in + out is its longest length.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from router.core.batch_weights import BatchWeights
from text_generation_common.engines import CapacityKind
from text_generation_common.messages import KvBlocks, KvCacheState, ModelInfo, StepOutput

logger = logging.getLogger(__name__)


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

    def refusal(self, load: Load) -> str | None:
        """Why a request of `load` can never run, however empty the batch (None: it can)."""
        return None


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


class KVBlockCapacity(Capacity):
    """Admission by the blocks of the shard's paged KV cache (vLLM's rule, on TGIS's queue).

    A request may need blocks(in + out) at its longest. The shard reports after every step
    what its live requests hold and may still take (`KvCacheState.committed_blocks`: a prefix
    block shared by several of them counts once, and a prefix-cache hit on such a block is not
    needed again). A candidate fits when its own need fits beside that, beside the candidates
    already chosen for the same prefill, and beside HELD_BACK_BLOCKS kept for the /health
    probe, so a running request never runs out of blocks.

    The report is one call old: requests that finished since are still in it (the next call
    prunes them), so the running requests are bounded by their own needs as well and the
    tighter of the two counts. With no running request nothing is committed: every batch was
    dropped. A candidate counts its whole need at admission; what a prefix-cache hit on blocks
    that live requests hold saves shows in the shard's next report.
    """

    kind = CapacityKind.KV_BLOCKS
    HELD_BACK_BLOCKS = 1  # for the one-token health probe, never admitted around

    def __init__(self, block_size: int, total_blocks: int) -> None:
        if block_size < 1 or total_blocks < 1:
            raise CapacityError(
                f"the shard reports a KV cache of {total_blocks} blocks of {block_size} tokens"
            )
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.usable_blocks = max(0, total_blocks - self.HELD_BACK_BLOCKS)
        self.state: KvCacheState | None = None  # the last report

    def blocks(self, load: Load) -> int:
        """Blocks a request of `load` holds at its longest."""
        return -(-(load.in_tokens + load.out_tokens) // self.block_size)

    def committed(self, running: Sequence[Load]) -> int:
        """Blocks that the running requests hold or may still take (an upper bound)."""
        if not running:
            return 0
        own = sum(self.blocks(load) for load in running)
        return own if self.state is None else min(own, self.state.committed_blocks)

    def can_grow(self, running: Sequence[Load]) -> bool:
        return self.committed(running) < self.usable_blocks

    def admit(self, running: Sequence[Load], chosen: Sequence[Load], candidate: Load) -> Admission:
        needed = sum(self.blocks(load) for load in (*chosen, candidate))
        if self.committed(running) + needed > self.usable_blocks:
            return Admission.NEVER_FITS
        return Admission.FITS

    def prefill_tokens(self, loads: Sequence[Load]) -> int:
        return sum(load.in_tokens for load in loads)

    def usage(self, running: Sequence[Load]) -> float:
        return min(1.0, self.committed(running) / self.usable_blocks) if self.usable_blocks else 1.0

    def check_fits_alone(self, max_sequence_length: int) -> None:
        if self.usable_blocks < 1:
            raise CapacityError(
                f"the KV cache has {self.total_blocks} blocks of {self.block_size} tokens: too few to "
                f"run a request beside the {self.HELD_BACK_BLOCKS} block held back for health checks"
            )
        if self.usable_blocks * self.block_size < max_sequence_length:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_sequence_length %d: longer requests "
                "are refused at validation",
                self.usable_blocks * self.block_size,
                max_sequence_length,
            )

    def observe(self, output: StepOutput) -> None:
        if output.kv_cache is not None:
            self.state = output.kv_cache

    def refusal(self, load: Load) -> str | None:
        needed = self.blocks(load)
        if needed <= self.usable_blocks:
            return None
        return (
            f"input tokens plus max_new_tokens ({load.in_tokens} + {load.out_tokens}) need {needed} "
            f"KV-cache blocks of {self.block_size} tokens; the whole cache holds {self.usable_blocks}"
        )


def capacity_for(info: ModelInfo, max_prefill_padding: float) -> Capacity:
    """The capacity policy of what the shard reported."""
    reported = info.capacity
    if isinstance(reported, KvBlocks):
        return KVBlockCapacity(reported.block_size, reported.total_blocks)
    return WeightCapacity(BatchWeights.from_model(reported.memory, reported.padded), max_prefill_padding)
