"""SPECULATOR_BATCH_GATE=measured: what a speculating step costs against a plain one, timed on
the engine itself at start-up (speculation/gate.py weighs it against the tokens taken).

At each row count of `measured_rows` (powers of two up to SPECULATOR_MAX_BATCH_SIZE) a batch of
that many requests (PROMPT_TOKENS of a repeated random pattern, greedy) is prefilled, then steps
through the engine's own `generate_token`, WARM_STEPS + TIMED_STEPS rounds of a step without
candidates and a step with the full lookahead on every row (the speculator's own proposal, padded
to the limit where it proposes fewer, so that the step verifies as many rows as a speculating
step may), at 1 row also a step with one candidate. The ratio of the median step times is the
cost: the kinds alternate, so that a machine whose speed drifts (a shared host, frequency steps)
moves them alike. The costs at 1 row of 2 .. most - 1 candidates lie on the line between those of
1 and of the most (each verified row costs the same), never below 1 candidate's: they decide how
many candidates a request asks for (speculation.Lookahead). The requests are
released after each count (their KV blocks return to the pool, the speculator forgets them),
prefix caching is off meanwhile, so the engine serves as it would have without the measurement.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from text_generation_common.messages import GenerationRequest
from text_generation_server import distributed
from text_generation_server.batches.ragged import RaggedBatch
from text_generation_server.speculation import Lookahead, Speculator
from text_generation_server.speculation.gate import SpeculationGate, StepCosts, measured_rows

if TYPE_CHECKING:
    from text_generation_server.engines.tgis_native.engine import TgisNativeEngine

logger = logging.getLogger(__name__)

WARM_STEPS = 2
TIMED_STEPS = 5
PROMPT_TOKENS = 128
PATTERN_TOKENS = 8  # the prompt repeats these (n-gram lookup finds its candidates there)
MIN_PROMPT_TOKENS = 8
BATCH_ID = -1  # batch and request ids the router never uses
RATIO_SCALE = 10_000  # ratios agreed between ranks as integers


class FullLookahead(Speculator):
    """`inner`'s proposals, each row's first chain padded to its limit with the row's last token."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_hidden = inner.needs_hidden
        self.chains = inner.chains
        self.network = inner.network

    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        chains = self.propose_chains(requests, histories, limits, hidden, [False] * len(limits))
        return [row[0] for row in chains]

    def propose_chains(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None,
        several: Sequence[bool],
    ) -> list[list[list[int]]]:
        proposed = self.inner.propose_chains(requests, histories, limits, hidden, several)
        filled = []
        for chains, history, limit in zip(proposed, histories, limits, strict=True):
            first = list(chains[0]) if chains else []
            filled.append([first + [history[-1]] * (limit - len(first)), *chains[1:]])
        return filled

    def release(self, request_ids: Iterable[int]) -> None:
        self.inner.release(request_ids)


def measure(engine: TgisNativeEngine, most_rows: int) -> StepCosts | None:
    """The cost of a speculating step at each measured row count that the KV cache holds, 1 row at
    least (None: MAX_NEW_TOKENS or the sequence length leave too few steps to time)."""
    speculate = engine.speculate
    first = (0, 1, speculate) if speculate > 1 else (0, speculate)  # candidates per row, at 1 row
    # a plain step takes one token, a speculating one up to 1 + its candidates: within MAX_NEW_TOKENS
    per_round = sum(1 + k for k in first)
    steps = min(WARM_STEPS + TIMED_STEPS, (engine.context.max_new_tokens - 1) // per_round)
    new_tokens = steps * per_round + 1
    prompt_tokens = min(PROMPT_TOKENS, engine.context.max_sequence_length - new_tokens - 1)
    if steps <= WARM_STEPS or prompt_tokens < MIN_PROMPT_TOKENS:
        return None
    rng = random.Random(0)
    vocab = engine.context.vocab_size
    pattern = [rng.randrange(min(16, vocab - 1), vocab) for _ in range(PATTERN_TOKENS)]
    prompt = tuple((pattern * -(-prompt_tokens // PATTERN_TOKENS))[:prompt_tokens])
    assert engine.speculator is not None
    chains = engine.speculator.chains  # a candidate tree's other chains write forks
    per_sequence = -(-(prompt_tokens + new_tokens + speculate) // engine.block_size) * chains
    counts: list[int] = []
    plain: list[float] = []
    speculating: list[float] = []
    one_candidate = 0.0
    with _measuring(engine):
        for rows in measured_rows(most_rows):
            if rows > 1 and rows * per_sequence > engine.kv.pool.free - engine.allocations.reserved_blocks:
                logger.info(
                    "speculation's cost measured up to %d rows: the KV cache holds no more", counts[-1]
                )
                break
            requests = [GenerationRequest(-(i + 1), prompt, new_tokens) for i in range(rows)]
            times = _time_steps(engine, requests, steps, first if rows == 1 else (0, speculate))
            counts.append(rows)
            plain.append(times[0])
            speculating.append(times[-1])
            if rows == 1:
                one_candidate = times[1]

    def agreed(ratio: float) -> float:
        """Every rank of a sharded model must speculate at the same steps, and its requests ask
        for as many candidates: the largest of their costs."""
        return distributed.agree_max(round(ratio * RATIO_SCALE), engine.device) / RATIO_SCALE

    ratios = tuple(agreed(s / p) for p, s in zip(plain, speculating, strict=True))
    low, high = agreed(one_candidate / plain[0]), ratios[0]
    high = max(low, high)
    slope = (high - low) / (speculate - 1) if speculate > 1 else 0.0
    return StepCosts(tuple(counts), ratios, tuple(low + slope * k for k in range(speculate)))


@contextmanager
def _measuring(engine: TgisNativeEngine) -> Iterator[None]:
    """Meanwhile prefix caching off (no prompt of the measurement is cached or counted) and the
    speculator padded to every row's limit (FullLookahead); afterwards the gate, the speculator
    and prefix caching as they were."""
    saved = engine.prefix_caching, engine.gate, engine.speculator
    assert engine.speculator is not None
    try:
        engine.prefix_caching = False
        engine.speculator = FullLookahead(engine.speculator)
        yield
    finally:
        engine.prefix_caching, engine.gate, engine.speculator = saved


def _time_steps(
    engine: TgisNativeEngine, requests: list[GenerationRequest], steps: int, kinds: Sequence[int]
) -> list[float]:
    """Median seconds of a step of `requests` with each of `kinds` candidates on every row (0:
    plain; `steps` of each, in turn, the first WARM_STEPS of each not timed)."""
    batch, errors = engine.new_batch(BATCH_ID, requests)
    assert batch is not None and not errors, f"measuring speculation: {errors}"
    try:
        while batch.prefilling:
            batch = _step(engine, batch)
        seconds: list[list[float]] = [[] for _ in kinds]
        for step in range(steps):
            for kind, candidates in enumerate(kinds):
                batch, elapsed = _timed_step(engine, batch, candidates)
                if step >= WARM_STEPS:
                    seconds[kind].append(elapsed)
    finally:
        engine.release([r.id for r in requests])
    return [statistics.median(times) for times in seconds]


def _timed_step(engine: TgisNativeEngine, batch: RaggedBatch, candidates: int) -> tuple[RaggedBatch, float]:
    """One step, plain (0) or with every row asking `candidates`, and its seconds."""
    if candidates:  # every row asks them (no pause after a miss)
        engine.gate = SpeculationGate(len(batch.states))
        for state in batch.states.values():
            state.lookahead = Lookahead(candidates)
    else:
        engine.gate = SpeculationGate(0)  # no step speculates
    start = time.perf_counter()
    batch = _step(engine, batch)
    return batch, time.perf_counter() - start


def _step(engine: TgisNativeEngine, batch: RaggedBatch) -> RaggedBatch:
    output, after = engine.generate_token(batch, 0)
    assert after is not None and not output.errors, "measuring speculation: a step failed"
    return after
