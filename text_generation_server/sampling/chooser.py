"""Per-row next-token choice for a batch: parameters, RNG state and token history.

`TokenChooser` is owned by a Batch, one row per request, in batch row order. It survives the
batch's life: `select` (prune) and `concatenate` carry every row's generator, generated-token
count and token history along, so a seeded request draws the same random numbers whatever
batch it runs in.

Per step (`choose`), in TGIS order:
  1. EOS masked while fewer than min_new_tokens were generated, else the length penalty;
  2. repetition penalty over the prompt + generated ids;
  3. guided decoding: each constrained row's grammar masks what it does not allow (guided.py);
  4. if any row samples: temperature -> top-k -> top-p -> typical-p (greedy rows untouched);
  5. greedy rows take the argmax, sampling rows argmax(softmax / Exponential(1)) drawn from the
     row's own torch.Generator.
Then `advance` records the chosen ids and feeds them to the rows' grammar matchers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from text_generation_common.guided import Grammars
from text_generation_common.messages import SamplingParams
from text_generation_server.sampling import guided
from text_generation_server.sampling import logits_process as lp


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded with `seed`. There is no random default: tensor-parallel ranks must
    draw the same numbers, so the router seeds every sampling request (inputs.py refuses one
    without a seed before it reaches a chooser)."""
    if seed is None:
        raise ValueError("a sampling request needs a seed")
    return torch.Generator(device=device).manual_seed(seed)


class TokenChooser:
    def __init__(
        self,
        params: Sequence[SamplingParams],
        histories: Sequence[list[int]],
        generated: Sequence[int],
        generators: Sequence[torch.Generator | None],
        eos_token_id: int,
        vocab_size: int,
        device: torch.device,
        seen: torch.Tensor | None = None,
        matchers: Sequence[Any | None] | None = None,
    ) -> None:
        self.params = list(params)
        # guided decoding: each row's llguidance matcher (None: free text)
        self.matchers = list(matchers) if matchers is not None else [None] * len(self.params)
        self.any_guided = any(m is not None for m in self.matchers)
        self.guided_ns = 0  # time in guided masks and matchers since the last `choose`
        self.histories = list(histories)  # prompt ids (after truncation) + generated ids, per row
        self.generated = list(generated)  # tokens generated so far, per row
        self.generators = list(generators)  # None for greedy rows
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.device = device

        self.sample_rows = [i for i, p in enumerate(self.params) if not p.greedy]
        self.any_min_new = any(p.min_new_tokens > 0 for p in self.params)
        self.any_length_penalty = any(
            p.length_penalty is not None and p.length_penalty.decay_factor != 1.0 for p in self.params
        )
        self.any_repetition_penalty = any(p.repetition_penalty != 1.0 for p in self.params)
        # Warper parameters of greedy rows are neutral: warpers never touch a greedy row.
        sampling = [p if not p.greedy else None for p in self.params]
        self.top_k = [p.top_k if p else 0 for p in sampling]
        self.top_p = [p.top_p if p else 1.0 for p in sampling]
        self.typical_p = [p.typical_p if p else 1.0 for p in sampling]
        temperatures = [p.temperature if p else 1.0 for p in sampling]
        self.temperature = (
            torch.tensor(temperatures, dtype=torch.float32, device=device)
            if any(t != 1.0 for t in temperatures)
            else None
        )
        self.penalty = (
            torch.tensor([p.repetition_penalty for p in self.params], dtype=torch.float32, device=device)
            if self.any_repetition_penalty
            else None
        )
        # [batch, vocab] bool: tokens each row has seen; kept only while some row penalises repeats.
        self.seen = seen if self.any_repetition_penalty else None
        if self.any_repetition_penalty and self.seen is None:
            self.seen = self._build_seen(self.histories)

    @classmethod
    def create(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        eos_token_id: int,
        vocab_size: int,
        device: torch.device,
        grammars: Grammars | None = None,
    ) -> TokenChooser:
        """`grammars`: the model's, for rows with guided decoding (inputs.py refused those
        requests where the model has none)."""
        generators = [None if p.greedy else make_generator(p.seed, device) for p in params]
        matchers = None
        if any(p.guided is not None for p in params):
            assert grammars is not None, "guided requests reach a chooser only with the model's grammars"
            matchers = [grammars.matcher(p.guided) if p.guided is not None else None for p in params]
        return cls(
            params,
            [list(ids) for ids in prompts],
            [0] * len(params),
            generators,
            eos_token_id,
            vocab_size,
            device,
            matchers=matchers,
        )

    def __len__(self) -> int:
        return len(self.params)

    def _build_seen(self, histories: Sequence[list[int]]) -> torch.Tensor:
        seen = torch.zeros((len(histories), self.vocab_size), dtype=torch.bool, device=self.device)
        for row, ids in enumerate(histories):
            if ids:
                seen[row, torch.tensor(ids, device=self.device)] = True
        return seen

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """Apply every logits processor; `scores` [batch, vocab] float32 is modified in place."""
        eos = self.eos_token_id
        if self.any_min_new:
            masked = [g < p.min_new_tokens for g, p in zip(self.generated, self.params, strict=True)]
            if any(masked):
                scores = lp.apply_min_new_tokens(scores, eos, torch.tensor(masked, device=self.device))
        else:
            masked = [False] * len(self.params)
        if self.any_length_penalty:
            factors = [
                1.0
                if m or p.length_penalty is None or g <= p.length_penalty.start_index
                else float(p.length_penalty.decay_factor) ** (g - p.length_penalty.start_index)
                for g, p, m in zip(self.generated, self.params, masked, strict=True)
            ]
            if any(f != 1.0 for f in factors):
                factor_t = torch.tensor(factors, dtype=torch.float64, device=self.device)
                scores = lp.apply_length_penalty(scores, eos, factor_t)
        if self.seen is not None and self.penalty is not None:
            scores = lp.apply_repetition_penalty(scores, self.seen, self.penalty)
        if self.any_guided:
            started = time.perf_counter_ns()
            guided.apply_masks(self.matchers, scores, eos)
            self.guided_ns = time.perf_counter_ns() - started
        if self.sample_rows:
            if self.temperature is not None:
                scores = lp.apply_temperature(scores, self.temperature)
            scores = lp.apply_top_k(scores, self.top_k)
            scores = lp.apply_top_p(scores, self.top_p)
            scores = lp.apply_typical_p(scores, self.typical_p)
        return scores

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Process `logits` [batch, vocab] float32 (in place) and pick one token per row.

        Returns (next_ids [batch] int64, final scores [batch, vocab]).
        """
        scores = self.process(logits)
        # max() gives the same first-maximum index as argmax() in about half the time on CPU.
        next_ids = scores.max(dim=-1).indices
        if self.sample_rows:
            rows = self.sample_rows
            probs = scores[rows].softmax(dim=-1)
            noise = torch.stack(
                [torch.empty_like(probs[0]).exponential_(1.0, generator=self.generators[i]) for i in rows]
            )
            next_ids[rows] = probs.div_(noise).argmax(dim=-1)
        return next_ids, scores

    def advance(self, next_ids: Sequence[int]) -> None:
        """Record the tokens just chosen (host-side ids, batch row order)."""
        for row, token in enumerate(next_ids):
            self.histories[row].append(token)
            self.generated[row] += 1
        if self.seen is not None:
            rows = torch.arange(len(next_ids), device=self.device)
            self.seen[rows, torch.tensor(next_ids, device=self.device)] = True
        if self.any_guided:
            started = time.perf_counter_ns()
            guided.advance(self.matchers, next_ids)
            self.guided_ns += time.perf_counter_ns() - started

    def select(self, rows: Sequence[int]) -> TokenChooser:
        """A chooser for the given rows (in that order), carrying their state."""
        seen = None
        if self.seen is not None:
            seen = self.seen[torch.tensor(rows, device=self.device)]
        return TokenChooser(
            [self.params[i] for i in rows],
            [self.histories[i] for i in rows],
            [self.generated[i] for i in rows],
            [self.generators[i] for i in rows],
            self.eos_token_id,
            self.vocab_size,
            self.device,
            seen,
            [self.matchers[i] for i in rows],
        )

    @classmethod
    def concatenate(cls, choosers: Sequence[TokenChooser]) -> TokenChooser:
        first = choosers[0]
        seen = None
        if any(c.any_repetition_penalty for c in choosers):
            seen = torch.cat([c.seen if c.seen is not None else c._build_seen(c.histories) for c in choosers])
        return cls(
            [p for c in choosers for p in c.params],
            [h for c in choosers for h in c.histories],
            [g for c in choosers for g in c.generated],
            [g for c in choosers for g in c.generators],
            first.eos_token_id,
            first.vocab_size,
            first.device,
            seen,
            [m for c in choosers for m in c.matchers],
        )
