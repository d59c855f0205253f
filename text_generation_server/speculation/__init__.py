"""Speculative decoding: candidate tokens proposed per running request, verified by the engine
in its next forward (engines/step.py `choose_speculated`), so that one forward may take several
tokens of a row.

    Speculator.propose(requests, histories, limits[, hidden])
                                            -> candidates per row (each at most its limit; any
                                               row may get none and steps normally)
    Speculator.propose_chains(..., several)  -> candidate chains per row, best first: several
                                               where `several[i]` allows and the speculator has
                                               them (the MLP speculator's candidate trees), else
                                               its one chain
    Speculator.release(request ids)         what it keeps for finished requests is dropped
    Lookahead                               per request: how many candidates to ask for next,
                                            by how many of its last ones were taken and what
                                            a step with more candidates costs (and a pause
                                            after repeated misses)

Speculators:
  - IBM's MLP speculator (SPECULATOR_NAME, mlp.py): small heads over the target's last hidden
    state, one per token ahead; train.py makes one for a model by self-distillation;
  - a draft model (SPECULATOR_NAME naming a smaller causal LM of the same vocabulary, draft.py):
    greedy tokens of its own, on its own paged KV cache;
  - n-gram (prompt lookup, SPECULATE=N without a speculator model, ngram.py): the tokens that
    followed the latest earlier occurrence of the row's last few tokens in its prompt and output.

The engine (tgis_native) asks only while at most SPECULATOR_MAX_BATCH_SIZE rows decode: past
that a step is no longer bound by reading the weights, and verifying candidates costs more
than it saves. Below it, gate.py decides per step by the cost of a speculating step measured at
start-up (SPECULATOR_BATCH_GATE=measured) against the tokens the rows have lately taken.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from text_generation_server.config import ServerConfig


@dataclass(frozen=True, slots=True)
class Target:
    """What a speculator must agree with: the model it speculates for."""

    vocab_size: int  # logits per position
    hidden_size: int
    dtype: torch.dtype
    dtype_name: str  # as DTYPE names it
    device: torch.device
    max_sequence_length: int
    tokenizer: Path | None  # its tokenizer.json, where it has one


class Speculator(ABC):
    name: str  # how the start-up log names it
    needs_hidden = False  # propose reads the target's last hidden state of each row
    chains = 1  # most candidate chains it proposes per row (propose_chains)
    network: torch.nn.Module | None = None  # its own model, whose linears the engine lays out on CPU

    @abstractmethod
    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """Candidate tokens to follow each row's history (prompt + generated ids), at most
        limits[i] for row i (0: none asked). `requests`: each row's request id. `hidden`
        [rows, hidden size] (speculators that need it): the target's final hidden state at each
        row's last position, the one whose logits chose the row's last token."""

    def propose_chains(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None,
        several: Sequence[bool],
    ) -> list[list[list[int]]]:
        """Each row's candidate chains, the likeliest first, each at most limits[i] tokens; more
        than one only where `several[i]` (rows whose verification can try several: greedy ones).
        Chains cut to the same tokens may repeat: the engine keeps one of each, after trimming
        them (TokenChooser.trim_drafts). A speculator with one guess per row proposes that one."""
        proposed = self.propose(requests, histories, limits, hidden)
        return [[chain] if chain else [] for chain in proposed]

    def share_lm_head(self, panels: torch.Tensor) -> int:
        """The target's LM head, packed in panels for our CPU kernel (kernels/weight_layout.py
        PanelLinear): a speculator whose own output layers hold the same values may read it
        instead of its copy. How many of its output layers do (0: none)."""
        return 0

    def release(self, request_ids: Iterable[int]) -> None:
        """These requests are gone: drop what is kept for them (a draft model's KV blocks)."""
        return None


MAX_PAUSE = 8  # most steps a request that keeps missing waits between tries
ACCEPT_DECAY = 0.7  # per verification: the weight left to a request's earlier ones (~3 count)
PRIOR = (1.5, 2.0)  # candidates taken / tried that a request's estimate starts from (0.75)


def best_lookahead(taken: float, costs: Sequence[float]) -> int:
    """The candidates k (0..len(costs)) that give the most tokens per unit of step time, when
    each is taken with probability `taken` while the ones before it were: 1 + taken + ... +
    taken^k tokens for costs[k - 1] (a step with k candidates / a plain step; 1 token for 1
    without any); the fewest of equal ones."""
    best, best_rate, tokens, term = 0, 1.0, 1.0, 1.0
    for k, cost in enumerate(costs, start=1):
        term *= taken
        tokens += term
        if tokens / cost > best_rate * (1 + 1e-9):
            best, best_rate = k, tokens / cost
    return best


@dataclass(slots=True)
class Lookahead:
    """How many candidates a request asks for (at most `most`), and when it pauses: asks for none
    for 2, 4, ... up to MAX_PAUSE steps, then for one again, so that a row that cannot be
    predicted costs little.

    With `costs` (what a one-row step with 1..most candidates costs against a plain one, measured
    at start-up: SPECULATOR_BATCH_GATE=measured) the number that pays best (best_lookahead) at
    the request's recent acceptance, the share of the candidates it tried that were taken (a
    decaying mean over its last few verifications; a position counts as tried up to the first
    one refused); it pauses where none pays. Without costs: one more than it took last time, or
    one more than it was offered when it took them all; it pauses after two verifications in a
    row that took none."""

    most: int
    costs: tuple[float, ...] = ()
    limit: int = 0
    misses: int = 0  # verifications in a row that took no candidate (with costs: after which none paid)
    pause: int = 0  # steps still to go without candidates
    hits: float = PRIOR[0]  # decaying counts of candidates taken / tried
    tries: float = PRIOR[1]

    def __post_init__(self) -> None:
        if self.costs and len(self.costs) != self.most:
            raise ValueError(f"a lookahead of {self.most} needs {self.most} costs, got {self.costs}")
        if not self.limit:
            self.limit = max(1, best_lookahead(self.acceptance, self.costs)) if self.costs else self.most

    @property
    def acceptance(self) -> float:
        """Recent share of tried candidates that were taken."""
        return self.hits / self.tries

    def ask(self) -> int:
        """The candidates to ask for at this step (0 while paused)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.limit

    def taken(self, proposed: int, accepted: int) -> None:
        self.hits = self.hits * ACCEPT_DECAY + accepted
        self.tries = self.tries * ACCEPT_DECAY + accepted + (accepted < proposed)
        if self.costs:
            best = best_lookahead(self.acceptance, self.costs)
            self.limit = max(1, best)
            self.misses = 0 if best else self.misses + 1
            if self.misses:
                self.pause = min(2**self.misses, MAX_PAUSE)
            return
        grown = proposed + 1 if accepted == proposed else accepted + 1
        self.limit = max(1, min(self.most, grown))
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= 2:
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE)


DEFAULT_DRAFT_TOKENS = 4  # candidates per row from a draft model when SPECULATE is not set


def speculator_for(config: ServerConfig, target: Target) -> tuple[Speculator, int] | None:
    """The speculator the config asks for and the most candidates a row may ask for (None: off).
    SPECULATOR_NAME: an MLP speculator (config.json model_type mlp_speculator; SPECULATE, where
    set, lowers its number of heads) or else a draft model (SPECULATE candidates, default
    DEFAULT_DRAFT_TOKENS); without it n-gram lookup with SPECULATE candidates."""
    if config.speculator_name:
        from text_generation_server.speculation import mlp
        from text_generation_server.utils.hub import resolve_model_dir

        path = resolve_model_dir(config.speculator_name, config.speculator_revision)
        if mlp.is_mlp_speculator(path):
            model = mlp.load_speculator(path, target)
            n_candidates, top_k = config.speculator_n_candidates, config.speculator_top_k_tokens_per_head
            speculator = mlp.MlpSpeculator(model, path, n_candidates, top_k)
            heads = speculator.model.config.n_predict
            return speculator, min(config.speculate or heads, heads)
        if config.speculator_n_candidates is not None or config.speculator_top_k_tokens_per_head is not None:
            raise ValueError(
                f"SPECULATOR_N_CANDIDATES / SPECULATOR_TOP_K_TOKENS_PER_HEAD shape an MLP speculator's "
                f"candidates; {path} is a draft model"
            )
        from text_generation_server.speculation.draft import DraftSpeculator

        return DraftSpeculator.load(path, config, target), config.speculate or DEFAULT_DRAFT_TOKENS
    if config.speculate <= 0:
        return None
    from text_generation_server.speculation.ngram import NgramSpeculator

    return NgramSpeculator(), config.speculate
