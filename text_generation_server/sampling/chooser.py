"""Per-row next-token choice for a batch: parameters, RNG state and token history.

`TokenChooser` is owned by a Batch, one row per request, in batch row order. It survives the
batch's life: `select` (prune) and `concatenate` carry every row's generator, generated-token
count and token history along, so a seeded request draws the same random numbers whatever
batch it runs in.

Per step (`choose`), in TGIS order after OpenAI's logit_bias (added to the logits first, as vLLM
does), with vLLM's allowed_token_ids (every other token masked) and bad_words (a banned
sequence's last id masked where the generated ids end with the others) after step 1:
  1. EOS (every EOS id of the model, and the row's stop_token_ids) masked while fewer than
     min_new_tokens were generated, else the length penalty;
  2. repetition penalty over the prompt + generated ids, then OpenAI's presence and frequency
     penalties over the generated ids (each row's counts, kept on the device), or TGI's
     frequency penalty over the prompt + generated ids divided by their number;
  3. guided decoding: each constrained row's grammar masks what it does not allow (guided.py);
  4. if any row samples: temperature -> top-k -> top-p -> min-p -> typical-p (transformers'
     order; greedy rows untouched);
  5. greedy rows take the argmax; sampling rows draw from softmax(scores) by inverse transform
     (`sample`): one uniform number per row from the row's own torch.Generator.
Then `advance` records the chosen ids and feeds them to the rows' grammar matchers.

Speculative decoding (engines/step.py `choose_speculated`) chooses at several positions of a row
in one call: `trim_drafts` cuts each row's candidate tokens where the row could never take them,
`expand` makes a chooser with one row per position (each as the row would be after taking the
candidates before it), and after the accepted tokens are known `rewind` leaves each sampling
row's generator as if it had drawn once per token taken and `advance_many` records them. A
sampling row draws its numbers in the same order with or without speculation, so a seed gives
the same text either way.

Every per-row parameter and counter that a step reads on the device (warper plans, penalties,
min-new-token limits, length-penalty starts and decays, generated counts, the sampling rows, the
bad words and the last generated ids they are matched against) is a device tensor made when the
chooser is built (a batch is created, pruned or merged), and `advance` takes the chosen ids as
the device tensor they already are: a decode step copies nothing to the device (guided rows
excepted: their masks are made on the host).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from text_generation_common.guided import Grammars
from text_generation_common.messages import SamplingParams
from text_generation_server.sampling import guided
from text_generation_server.sampling import logits_process as lp
from text_generation_server.utils.transfer import to_device


def make_generator(seed: int | None, device: torch.device, drawn: int = 0) -> torch.Generator:
    """A generator seeded with `seed`, past the `drawn` numbers of as many tokens taken (a resumed
    request's). There is no random default: tensor-parallel ranks must draw the same numbers, so
    the router seeds every sampling request (inputs.py refuses one without a seed before it
    reaches a chooser)."""
    if seed is None:
        raise ValueError("a sampling request needs a seed")
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(drawn):
        draw(generator, device)
    return generator


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], drawn with one uniform number per row from the
    row's generator (`inverse_transform`). Exponential noise over the whole vocabulary (the
    argmax(p / E) way) drew `vocab` numbers per row: 13x slower per step at 32 rows of 8,192."""
    uniform = torch.cat([draw(g, probs.device) for g in generators])
    return inverse_transform(probs, uniform)


def draw(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The one uniform number [1] (float64) a sampling row draws per token."""
    return torch.rand(1, generator=generator, dtype=torch.float64, device=device)


def inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability passes `uniform` [rows] in [0, 1)
    of the row's total. Sums in float64, so that the smallest probabilities of a large
    vocabulary keep their share; a token of probability 0 (top-k, top-p, a grammar's mask) is
    never chosen."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # below the total (u * total may round up to it): the first cumulative sum past the target
    # then grew at its own token, whose probability is therefore not 0
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def first_max(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum [batch] int64. max() gives the same first-maximum index as
    argmax() in about half the time on CPU."""
    return scores.max(dim=-1).indices


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
        counts: torch.Tensor | None = None,
        prompt_lengths: Sequence[int] | None = None,
        extra_eos_ids: Sequence[int] = (),
        recent: torch.Tensor | None = None,
    ) -> None:
        """`extra_eos_ids`: the model's other EOS ids (RequestLimits.extra_eos_token_ids), each
        ending a row as `eos_token_id` does; `recent`: each row's last generated ids, as wide as
        the longest bad word needs or wider (None: none generated yet)."""
        self.params = list(params)
        # guided decoding: each row's llguidance matcher (None: free text)
        self.matchers = list(matchers) if matchers is not None else [None] * len(self.params)
        self.any_guided = any(m is not None for m in self.matchers)
        self.guided_ns = 0  # time in guided masks and matchers since the last `choose`
        self.histories = list(histories)  # prompt ids (after truncation) + generated ids, per row
        self.generated = list(generated)  # tokens generated so far, per row
        # ids of each row's history before its first generated one (the histories may be a token
        # behind `generated` while a step's ids are read back: engines/step.py)
        self.prompt_lengths = (
            list(prompt_lengths)
            if prompt_lengths is not None
            else [len(h) - g for h, g in zip(self.histories, self.generated, strict=True)]
        )
        self.generators = list(generators)  # None for greedy rows
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = tuple(extra_eos_ids)
        self.eos_ids = [eos_token_id, *self.extra_eos_ids]  # every id that ends a row
        self.vocab_size = vocab_size
        self.device = device

        self.sample_rows = [i for i, p in enumerate(self.params) if not p.greedy]
        # allowed_token_ids: [batch, vocab] bool, what each row may choose (every token in rows
        # without a list), kept only while some row has one
        self.allowed: torch.Tensor | None = None
        if any(p.allowed_token_ids for p in self.params):
            self.allowed = torch.ones((len(self.params), vocab_size), dtype=torch.bool, device=device)
            limited = [row for row, p in enumerate(self.params) if p.allowed_token_ids]
            self.allowed[to_device(limited, device)] = False
            index = self._positions([p.allowed_token_ids for p in self.params], device)
            if index is not None:
                self.allowed[index] = True
        # bad_words: each row's banned sequences, matched against its last generated ids (`recent`)
        self.bad_words = lp.BadWords.of([p.bad_words for p in self.params], device)
        self.recent: torch.Tensor | None = None
        if self.bad_words is not None and self.bad_words.width:
            width = self.bad_words.width
            if recent is None:
                recent = torch.full((len(self.params), width), lp.NO_TOKEN, dtype=torch.long, device=device)
                rows = zip(self.histories, self.prompt_lengths, strict=True)
                for row, generated in enumerate(h[n:][-width:] for h, n in rows):  # a resumed row's
                    if generated:
                        recent[row, width - len(generated) :] = to_device(generated, device)
            assert recent.shape[1] >= width, "a chooser's rows keep the ids their bad words need"
            self.recent = recent[:, recent.shape[1] - width :]
        # stop_token_ids: the (row, token) positions of every row's own ending ids, on the device
        self.stop_index = self._positions([p.stop_token_ids for p in self.params], device)
        # logit_bias: the (row, token) positions of every row's biases, and the biases, on the device
        self.bias_index = self._positions([[token for token, _ in p.logit_bias] for p in self.params], device)
        self.bias_values: torch.Tensor | None = None
        if self.bias_index is not None:
            biases = [bias for p in self.params for _, bias in p.logit_bias]
            self.bias_values = to_device(biases, device, torch.float32)
        self.any_min_new = any(p.min_new_tokens > 0 for p in self.params)
        self.any_length_penalty = any(
            p.length_penalty is not None and p.length_penalty.decay_factor != 1.0 for p in self.params
        )
        self.any_repetition_penalty = any(p.repetition_penalty != 1.0 for p in self.params)
        # Warper parameters of greedy rows are neutral: warpers never touch a greedy row.
        sampling = [p if not p.greedy else None for p in self.params]
        temperatures = [p.temperature if p else 1.0 for p in sampling]
        self.temperature = (
            to_device(temperatures, device, torch.float32) if any(t != 1.0 for t in temperatures) else None
        )
        self.top_k = lp.TopKPlan.of([p.top_k if p else 0 for p in sampling], vocab_size, device)
        self.top_p = lp.RowsPlan.of([p.top_p if p else 1.0 for p in sampling], device, transform=1.0)
        self.min_p = lp.RowsPlan.of([p.min_p if p else 0.0 for p in sampling], device, off=0.0)
        self.typical_p = lp.RowsPlan.of([p.typical_p if p else 1.0 for p in sampling], device)
        self.sample_rows_t = to_device(self.sample_rows, device) if self.sample_rows else None
        self.penalty = (
            to_device([p.repetition_penalty for p in self.params], device, torch.float32)
            if self.any_repetition_penalty
            else None
        )
        # tokens generated per row, on the device too, where min_new_tokens or a length penalty reads it
        self.generated_t = (
            to_device(self.generated, device) if self.any_min_new or self.any_length_penalty else None
        )
        self.min_new_t = (
            to_device([p.min_new_tokens for p in self.params], device) if self.any_min_new else None
        )
        self.length_start_t: torch.Tensor | None = None
        self.length_decay_t: torch.Tensor | None = None
        if self.any_length_penalty:
            penalties = [p.length_penalty for p in self.params]
            # rows without one: start past any length, decay 1.0 (factor 1)
            starts = [lp_.start_index if lp_ is not None else 2**62 for lp_ in penalties]
            decays = [float(lp_.decay_factor) if lp_ is not None else 1.0 for lp_ in penalties]
            self.length_start_t = to_device(starts, device)
            self.length_decay_t = to_device(decays, device, torch.float64)
        # [batch, vocab] bool: tokens each row has seen; kept only while some row penalises repeats.
        self.seen = seen if self.any_repetition_penalty else None
        if self.any_repetition_penalty and self.seen is None:
            self.seen = self._build_seen(self.histories)
        # OpenAI's penalties: [batch] each, and [batch, vocab] float32 counts of the generated
        # tokens (of the whole text for TGI's rows), kept only while some row has one
        self.any_additive_penalty = any(p.presence_penalty or p.frequency_penalty for p in self.params)
        self.presence_t: torch.Tensor | None = None
        self.frequency_t: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        # TGI's rows: [batch] the text's length so far (1.0 in other rows), the frequency's divisor
        self.length_t: torch.Tensor | None = None
        self.by_length_t: torch.Tensor | None = None
        if self.any_additive_penalty:
            self.presence_t = to_device([p.presence_penalty for p in self.params], device, torch.float32)
            self.frequency_t = to_device([p.frequency_penalty for p in self.params], device, torch.float32)
            self.counts = counts if counts is not None else self._build_counts()
            by_length = [p.frequency_by_length for p in self.params]
            if any(by_length):
                lengths = [n + g for n, g in zip(self.prompt_lengths, self.generated, strict=True)]
                self.length_t = to_device(
                    [float(n) if b else 1.0 for n, b in zip(lengths, by_length, strict=True)],
                    device,
                    torch.float32,
                )
                self.by_length_t = to_device([float(b) for b in by_length], device, torch.float32)

    @classmethod
    def create(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        eos_token_id: int,
        vocab_size: int,
        device: torch.device,
        grammars: Grammars | None = None,
        extra_eos_ids: Sequence[int] = (),
        generated: Sequence[int] | None = None,
    ) -> TokenChooser:
        """`grammars`: the model's, for rows with guided decoding (inputs.py refused those
        requests where the model has none); `extra_eos_ids`: the model's other EOS ids;
        `generated`: per row, how many of its prompt's last ids it generated before it was
        preempted (None: none). A resumed row goes on as it would have: its counts, penalties
        and bad words see those ids as generated, its generator has drawn once for each, its
        grammar has read them."""
        taken = list(generated) if generated is not None else [0] * len(params)
        generators = [
            None if p.greedy else make_generator(p.seed, device, n)
            for p, n in zip(params, taken, strict=True)
        ]
        matchers = None
        if any(p.guided is not None for p in params):
            assert grammars is not None, "guided requests reach a chooser only with the model's grammars"
            matchers = [grammars.matcher(p.guided) if p.guided is not None else None for p in params]
            cls._feed_matchers(
                matchers, [ids[len(ids) - n :] if n else [] for ids, n in zip(prompts, taken, strict=True)]
            )
        return cls(
            params,
            [list(ids) for ids in prompts],
            taken,
            generators,
            eos_token_id,
            vocab_size,
            device,
            matchers=matchers,
            extra_eos_ids=extra_eos_ids,
        )

    def __len__(self) -> int:
        return len(self.params)

    def _build_seen(self, histories: Sequence[list[int]]) -> torch.Tensor:
        seen = torch.zeros((len(histories), self.vocab_size), dtype=torch.bool, device=self.device)
        self._mark_seen(seen, histories)
        return seen

    @staticmethod
    def _positions(
        tokens: Sequence[Sequence[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row, token) of every entry of `tokens[row]`, repeats included, as one index on
        `device` (one copy of every row's ids, not one per row); None where there are none."""
        rows = [row for row, ids in enumerate(tokens) for _ in ids]
        if not rows:
            return None
        return to_device(rows, device), to_device([t for ids in tokens for t in ids], device)

    @staticmethod
    def _mark_seen(seen: torch.Tensor, tokens: Sequence[Sequence[int]]) -> None:
        """Mark `tokens[row]` seen in row `row` of `seen`."""
        if (index := TokenChooser._positions(tokens, seen.device)) is not None:
            seen[index] = True

    def _build_counts(self) -> torch.Tensor:
        """Each row's counts of its generated ids, of its whole history in TGI's rows."""
        counts = torch.zeros((len(self.params), self.vocab_size), dtype=torch.float32, device=self.device)
        rows = zip(self.histories, self.prompt_lengths, self.params, strict=True)
        self._count(counts, [h if p.frequency_by_length else h[n:] for h, n, p in rows])
        return counts

    @staticmethod
    def _count(counts: torch.Tensor, tokens: Sequence[Sequence[int]]) -> None:
        """Add one to `counts` at (row, token) for each of `tokens[row]`, repeats included."""
        if (index := TokenChooser._positions(tokens, counts.device)) is not None:
            counts.index_put_(index, torch.ones(len(index[0]), device=counts.device), accumulate=True)

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """Apply every logits processor; `scores` [batch, vocab] float32 is modified in place."""
        eos = self.eos_token_id
        masked_t: torch.Tensor | None = None
        if self.bias_index is not None and self.bias_values is not None:
            scores.index_put_(self.bias_index, self.bias_values, accumulate=True)
        if self.any_min_new:
            assert self.generated_t is not None and self.min_new_t is not None
            held = [g < p.min_new_tokens for g, p in zip(self.generated, self.params, strict=True)]
            if all(held):  # the host counts are the device's: no mask to compute
                for column in self.eos_ids:
                    scores[:, column] = lp.NEG_INF
                self._hold_stop_ids(scores, None)
            elif any(held):
                masked_t = self.generated_t < self.min_new_t
                scores = lp.apply_min_new_tokens(scores, self.eos_ids, masked_t)
                self._hold_stop_ids(scores, masked_t)
        if self.any_length_penalty and self._length_penalty_applies():
            assert self.generated_t is not None and self.length_start_t is not None
            assert self.length_decay_t is not None
            past = self.generated_t - self.length_start_t
            active = past > 0
            if masked_t is not None:
                active &= ~masked_t
            factors = torch.where(active, self.length_decay_t.pow(past.clamp(min=0)), 1.0)
            scores = lp.apply_length_penalty(scores, self.eos_ids, factors)
        if self.bad_words is not None:
            scores = self.bad_words.apply(scores, self.recent)
        if self.allowed is not None:
            scores = lp.apply_allowed(scores, self.allowed)
        if self.seen is not None and self.penalty is not None:
            scores = lp.apply_repetition_penalty(scores, self.seen, self.penalty)
        if self.counts is not None and self.presence_t is not None and self.frequency_t is not None:
            frequency = self.frequency_t if self.length_t is None else self.frequency_t / self.length_t
            scores = lp.apply_additive_penalties(scores, self.counts, self.presence_t, frequency)
        if self.any_guided:
            started = time.perf_counter_ns()
            guided.apply_masks(self.matchers, scores, eos)
            self.guided_ns = time.perf_counter_ns() - started
        if self.sample_rows:
            if self.temperature is not None:
                scores = lp.apply_temperature(scores, self.temperature)
            if self.top_k is not None:
                scores = lp.top_k_with(scores, self.top_k)
            if self.top_p is not None:
                scores = lp.top_p_with(scores, self.top_p)
            if self.min_p is not None:
                scores = lp.min_p_with(scores, self.min_p)
            if self.typical_p is not None:
                scores = lp.typical_p_with(scores, self.typical_p)
        return scores

    def _hold_stop_ids(self, scores: torch.Tensor, held_t: torch.Tensor | None) -> None:
        """Each row's own stop_token_ids get -inf where the row is held by min_new_tokens
        (`held_t` [batch] bool; None: every row is)."""
        if self.stop_index is None:
            return
        rows_t, tokens_t = self.stop_index
        if held_t is None:
            scores[rows_t, tokens_t] = lp.NEG_INF
        else:
            scores[rows_t, tokens_t] = scores[rows_t, tokens_t].masked_fill(held_t[rows_t], lp.NEG_INF)

    def _length_penalty_applies(self) -> bool:
        """Whether some row is past its length penalty's start and not held by min_new_tokens
        (host counts: nothing read from the device)."""
        for g, p in zip(self.generated, self.params, strict=True):
            penalty = p.length_penalty
            if penalty is None or penalty.decay_factor == 1.0 or g < p.min_new_tokens:
                continue
            if g > penalty.start_index:
                return True
        return False

    @property
    def plain(self) -> bool:
        """Every row is greedy and no processor changes its scores: each row's choice is the
        first maximum of its logits as they are."""
        return not (
            self.sample_rows
            or self.allowed is not None
            or self.bad_words is not None
            or self.bias_values is not None
            or self.any_min_new
            or self.any_length_penalty
            or self.any_repetition_penalty
            or self.any_additive_penalty
            or self.any_guided
        )

    def choose(
        self, logits: torch.Tensor, first_max: Callable[[torch.Tensor], torch.Tensor] = first_max
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Process `logits` [batch, vocab] float32 (in place) and pick one token per row;
        `first_max`: the greedy rows' choice, each row's first maximum (engines pass a faster
        one where they have it).

        Returns (next_ids [batch] int64, final scores [batch, vocab]), both on the device.
        """
        scores = self.process(logits)
        generators = [self.generators[i] for i in self.sample_rows]
        if len(generators) == len(self.params):  # every row samples
            return sample(scores.softmax(dim=-1), generators), scores
        next_ids = first_max(scores)
        if self.sample_rows_t is not None:
            probs = scores.index_select(0, self.sample_rows_t).softmax(dim=-1)
            next_ids.index_copy_(0, self.sample_rows_t, sample(probs, generators))
        return next_ids, scores

    def finished(self, max_new_tokens: Sequence[int]) -> bool:
        """Every row has had its last token for sure: its `max_new_tokens` (per row), or EOS (or
        one of its stop_token_ids) once its min_new_tokens are out (the router ends the request
        there). Stop sequences and deadlines are the router's to know."""
        eos = self.eos_ids
        rows = zip(self.histories, self.generated, self.params, max_new_tokens, strict=True)
        for history, generated, params, most in rows:
            if generated >= most:
                continue
            if generated == 0 or generated < params.min_new_tokens:
                return False
            if history[-1] not in eos and history[-1] not in params.stop_token_ids:
                return False
        return True

    def advance(self, next_ids: Sequence[int], next_ids_t: torch.Tensor | None = None) -> None:
        """Record the tokens just chosen: host-side ids in batch row order, and the same ids as
        the device tensor `choose` returned (None: made from the host ids)."""
        self.advance_on_device(next_ids_t if next_ids_t is not None else to_device(next_ids, self.device))
        self.guided_ns += self.record(self.histories, self.matchers, next_ids)

    def advance_on_device(self, next_ids_t: torch.Tensor) -> None:
        """What the next `choose` reads of the tokens just chosen (`next_ids_t` [batch], on the
        device, not read back): one more token generated per row (the host counts too: every
        row takes one) and the tokens seen. `record` adds the ids to the histories once they
        are on the host; a step may be chosen in between (engines/step.py)."""
        for row in range(len(self.generated)):
            self.generated[row] += 1
        if self.generated_t is not None:
            self.generated_t += 1
        if self.seen is not None:
            self.seen.scatter_(1, next_ids_t.view(-1, 1), True)
        if self.counts is not None:
            ids = next_ids_t.view(-1, 1)
            self.counts.scatter_add_(1, ids, torch.ones(ids.shape, device=self.counts.device))
        if self.length_t is not None and self.by_length_t is not None:
            self.length_t += self.by_length_t
        if self.recent is not None:
            self.recent = torch.cat([self.recent[:, 1:], next_ids_t.view(-1, 1)], dim=1)

    @staticmethod
    def record(
        histories: Sequence[list[int]], matchers: Sequence[Any | None], next_ids: Sequence[int]
    ) -> int:
        """Append each row's chosen id to its history and feed it to its grammar (the lists and
        matchers of the rows the ids were chosen for: a row's history list is the same object in
        every chooser made from it by `select` and `concatenate`). Returns the grammars' time (ns)."""
        for history, token in zip(histories, next_ids, strict=True):
            history.append(token)
        return TokenChooser._feed_matchers(matchers, [[token] for token in next_ids])

    @staticmethod
    def _feed_matchers(matchers: Sequence[Any | None], tokens: Sequence[Sequence[int]]) -> int:
        """Feed each constrained row its tokens (guided.advance); the time it took (ns), 0 when
        no row is constrained."""
        if not any(m is not None for m in matchers):
            return 0
        started = time.perf_counter_ns()
        guided.advance(matchers, tokens)
        return time.perf_counter_ns() - started

    def advance_many(self, tokens: Sequence[Sequence[int]]) -> None:
        """Record several tokens per row (speculative decoding), in order; `tokens` in batch row
        order, one list per row (empty: the row took none)."""
        for row, ids in enumerate(tokens):
            self.histories[row].extend(ids)
            self.generated[row] += len(ids)
        if self.generated_t is not None or self.length_t is not None:
            taken = to_device([len(ids) for ids in tokens], self.device)
            if self.generated_t is not None:
                self.generated_t += taken
            if self.length_t is not None and self.by_length_t is not None:
                self.length_t += self.by_length_t * taken
        if self.seen is not None:
            self._mark_seen(self.seen, tokens)
        if self.counts is not None:
            self._count(self.counts, tokens)
        if self.recent is not None:
            self.recent = lp.shifted(self.recent, tokens)
        self.guided_ns += self._feed_matchers(self.matchers, tokens)

    # ---- speculative decoding ---------------------------------------------------------------------

    def trim_drafts(
        self, drafts: Sequence[Sequence[int]], owners: Sequence[int] | None = None
    ) -> list[list[int]]:
        """Each draft's candidate tokens (of row owners[i], default row i) up to the first its
        row could never take: those after an EOS (the request ends there) and those its grammar
        refuses."""
        eos = set(self.eos_ids)
        trimmed = []
        for i, draft in enumerate(drafts):
            row = owners[i] if owners is not None else i
            stops = self.params[row].stop_token_ids
            ends = [j for j, token in enumerate(draft) if token in eos or token in stops]
            cut = list(draft[: ends[0] + 1] if ends else draft)
            matcher = self.matchers[row]
            if matcher is not None and cut:
                cut = cut[: guided.allowed_prefix(matcher, cut)]
            trimmed.append(cut)
        return trimmed

    def expand(self, drafts: Sequence[Sequence[int]], owners: Sequence[int] | None = None) -> TokenChooser:
        """A chooser with len(drafts[i]) + 1 rows for draft i, of row owners[i] (default: row i):
        its j-th is that row after it took drafts[i][:j] (history, generated count, seen tokens,
        generated-token counts, grammar state; the row's own parameters and generator, so
        position j draws the row's j-th number). A row may own several drafts (candidate chains)
        only where it is greedy. Drafts must be trimmed (`trim_drafts`)."""
        owners = list(owners) if owners is not None else list(range(len(drafts)))
        rows = [owner for owner, draft in zip(owners, drafts, strict=True) for _ in range(len(draft) + 1)]
        taken = [draft[:j] for draft in drafts for j in range(len(draft) + 1)]
        seen, counts, recent, index = None, None, None, self._rows_index(rows)
        if self.seen is not None and index is not None:
            seen = self.seen.index_select(0, index)
            self._mark_seen(seen, taken)
        if self.counts is not None and index is not None:
            counts = self.counts.index_select(0, index)
            self._count(counts, taken)
        if self.recent is not None and index is not None:
            recent = lp.shifted(self.recent.index_select(0, index), taken)
        matchers: list[Any | None] = []
        started: set[int] = set()
        for owner, draft in zip(owners, drafts, strict=True):
            matcher = self.matchers[owner]
            if owner in started and matcher is not None:  # a matcher is read by one row at a time
                matcher = matcher.deep_copy()
            started.add(owner)
            matchers += guided.positions(matcher, draft)
        return TokenChooser(
            [self.params[i] for i in rows],
            [[*self.histories[i], *ids] for i, ids in zip(rows, taken, strict=True)],
            [self.generated[i] + len(ids) for i, ids in zip(rows, taken, strict=True)],
            [self.generators[i] for i in rows],
            self.eos_token_id,
            self.vocab_size,
            self.device,
            seen,
            matchers,
            counts,
            [self.prompt_lengths[i] for i in rows],
            self.extra_eos_ids,
            recent,
        )

    def generator_states(self, rows: Sequence[int]) -> list[torch.Tensor | None]:
        """The generator state of each of `rows` (None: a greedy row), to `rewind` to."""
        return [g.get_state() if (g := self.generators[row]) is not None else None for row in rows]

    def rewind(
        self, rows: Sequence[int], states: Sequence[torch.Tensor | None], draws: Sequence[int]
    ) -> None:
        """Set each sampling row of `rows` back to its state before `expand`'s choice, then draw
        the number of times it took a token: as if it had stepped once per token."""
        for row, state, count in zip(rows, states, draws, strict=True):
            generator = self.generators[row]
            if generator is None or state is None:
                continue
            generator.set_state(state)
            for _ in range(count):
                draw(generator, self.device)

    def select(self, rows: Sequence[int]) -> TokenChooser:
        """A chooser for the given rows (in that order), carrying their state."""
        seen, counts, recent, index = None, None, None, self._rows_index(rows)
        if self.seen is not None and index is not None:
            seen = self.seen[index]
        if self.counts is not None and index is not None:
            counts = self.counts[index]
        if self.recent is not None and index is not None:
            recent = self.recent[index]
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
            counts,
            [self.prompt_lengths[i] for i in rows],
            self.extra_eos_ids,
            recent,
        )

    def _rows_index(self, rows: Sequence[int]) -> torch.Tensor | None:
        """`rows` on the device, where some per-row tensor is to be taken from them."""
        carried = self.seen is not None or self.counts is not None or self.recent is not None
        return to_device(rows, self.device) if carried else None

    @classmethod
    def concatenate(cls, choosers: Sequence[TokenChooser]) -> TokenChooser:
        first = choosers[0]
        seen = counts = None
        if any(c.any_repetition_penalty for c in choosers):
            seen = torch.cat([c.seen if c.seen is not None else c._build_seen(c.histories) for c in choosers])
        if any(c.any_additive_penalty for c in choosers):
            counts = torch.cat([c.counts if c.counts is not None else c._build_counts() for c in choosers])
        recent = None
        if widths := [c.recent.shape[1] for c in choosers if c.recent is not None]:
            # rows of narrower (or no) windows have no longer bad words: unknown ids are no match
            recent = torch.cat([_widened(c.recent, len(c), max(widths), first.device) for c in choosers])
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
            counts,
            [n for c in choosers for n in c.prompt_lengths],
            first.extra_eos_ids,
            recent,
        )


def _widened(recent: torch.Tensor | None, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """`recent` [rows, <= width] (None: nothing kept) as [rows, width], unknown ids on the left."""
    kept = recent if recent is not None else torch.empty((rows, 0), dtype=torch.long, device=device)
    if kept.shape[1] == width:
        return kept
    unknown = torch.full((rows, width - kept.shape[1]), lp.NO_TOKEN, dtype=torch.long, device=device)
    return torch.cat([unknown, kept], dim=1)
