"""When speculation pays (SPECULATOR_BATCH_GATE=measured): per number of decoding rows, what a
speculating step costs against a plain one, measured by the engine at start-up, weighed against
the tokens a decoding row takes per speculating step while serving.

A step of b decoding rows speculates while b <= the paying row count P, the most rows at which

    tokens per row and speculating step (recent)  >  cost(b) = speculating / plain step time at b

cost(b) is the measured ratio at the smallest measured row count >= b (the largest measured one
past them); the tokens are a decaying mean over the rows of the speculating steps (the last
~1 / (1 - DECAY) rows count: ~200 steps of one row, ~13 of 16). P moves with a margin
(HYSTERESIS), so that a mean hovering at a cost does not flip it every step: up while the
mean exceeds the next count's cost by the margin, down while it falls short of P's own cost by
it; it is logged whenever it changes. Until MIN_STEPS steps have
speculated every row count up to SPECULATOR_MAX_BATCH_SIZE does; above P one step in
PROBE_EVERY still speculates, so that the mean follows what the requests do now.
SPECULATOR_BATCH_GATE=fixed: every step of at most SPECULATOR_MAX_BATCH_SIZE rows speculates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_STEPS = 8  # speculating steps before their tokens decide
PROBE_EVERY = 32  # steps the gate holds back between two that speculate anyway
DECAY = 0.995  # per decoding row recorded: the weight left to the earlier rows' tokens
HYSTERESIS = 0.05  # relative margin around a cost before P moves past it


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Speculating / plain step time, measured at each of `rows` decoding rows (ascending), every
    row with its most candidates; `lookahead`: at one row, with 1, 2, ... up to the most
    candidates (a request's Lookahead chooses by them; empty: not measured)."""

    rows: tuple[int, ...]
    ratios: tuple[float, ...]
    lookahead: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.ratios) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"step costs need ascending row counts, one ratio each: {self}")

    def ratio(self, rows: int) -> float:
        """The cost at `rows` decoding rows: of the smallest measured count at least as large
        (the cost grows with the rows), else of the largest measured."""
        for measured, ratio in zip(self.rows, self.ratios, strict=True):
            if measured >= rows:
                return ratio
        return self.ratios[-1]

    def describe(self) -> str:
        rows = " / ".join(map(str, self.rows))
        text = f"at {rows} rows " + " / ".join(f"{x:.2f}x" for x in self.ratios)
        if len(self.lookahead) > 1:
            counts = " / ".join(str(k) for k in range(1, len(self.lookahead) + 1))
            text += f", at 1 row with {counts} candidates " + " / ".join(f"{x:.2f}x" for x in self.lookahead)
        return text


class SpeculationGate:
    """Whether a step of b decoding rows speculates. `costs` None: every step of at most
    `most_rows` (SPECULATOR_BATCH_GATE=fixed)."""

    def __init__(self, most_rows: int, costs: StepCosts | None = None) -> None:
        self.most_rows = most_rows
        self.costs = costs
        self.paying = most_rows  # P: the most rows at which speculation pays
        self.steps = 0  # speculating steps recorded
        self._tokens = 0.0  # decaying sums over them
        self._rows = 0.0
        self._held = 0  # steps held back since the last that speculated

    @property
    def tokens_per_row(self) -> float | None:
        """Recent tokens per decoding row and speculating step (None before any)."""
        return self._tokens / self._rows if self._rows else None

    def allows(self, rows: int) -> bool:
        if rows < 1 or rows > self.most_rows:
            return False
        if self.costs is None or self.steps < MIN_STEPS or rows <= self.paying:
            return True
        self._held += 1
        if self._held >= PROBE_EVERY:
            self._held = 0
            return True
        return False

    def record(self, rows: int, tokens: int) -> None:
        """A speculating step of `rows` decoding rows took `tokens` tokens for them."""
        if self.costs is None or rows < 1:
            return
        self.steps += 1
        kept = DECAY**rows
        self._tokens = self._tokens * kept + tokens
        self._rows = self._rows * kept + rows
        self._held = 0
        if self.steps >= MIN_STEPS:
            self._move(self.costs, self._tokens / self._rows)

    def _move(self, costs: StepCosts, gain: float) -> None:
        """P after the mean moved to `gain` (from none at the first judgement); logged when it
        changes."""
        first = self.steps == MIN_STEPS
        paying = 0 if first else self.paying
        while paying < self.most_rows and gain > costs.ratio(paying + 1) * (1 + HYSTERESIS):
            paying += 1
        while paying > 0 and gain < costs.ratio(paying) * (1 - HYSTERESIS):
            paying -= 1
        if paying == self.paying and not first:
            return
        self.paying = paying
        if paying:
            logger.info(
                "speculation pays while at most %d row%s decode (%.2f tokens per row and speculating step)",
                paying,
                "" if paying == 1 else "s",
                gain,
            )
        else:
            logger.info(
                "speculation does not pay at any batch size now (%.2f tokens per row and speculating "
                "step against a cost of %.2fx at 1 row); one step in %d still speculates",
                gain,
                costs.ratio(1),
                PROBE_EVERY,
            )


def measured_rows(most_rows: int) -> list[int]:
    """The row counts whose step costs are measured: powers of two below SPECULATOR_MAX_BATCH_SIZE
    and itself."""
    counts: list[int] = []
    rows = 1
    while rows < most_rows:
        counts.append(rows)
        rows *= 2
    return [*counts, most_rows]
