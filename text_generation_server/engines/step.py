"""The per-step post-processing every engine shares: from the logits of the last position of
each row to the step's output.

    logits [B, vocab] fp32 (choice_scores; on CPU the model's dtype where nothing else reads them)
                           --NaN check--> failed rows (RequestError, TGIS's message)
                           --chooser.choose--> next ids [B], final scores
       (on CPU the NaN check and the greedy rows' first maxima in one kernel pass: `_choose`)
                           --chooser.advance_on_device--> sampling state moves on (every row)
       (start_choice: all on the device; the ids' copy to the host queued)
                           --token details--> TokenInfo per row (what each request asked for)
                           --TokenChooser.record--> ids into the histories and grammars
       (end_choice: once the copy is done)
    -> (next ids, StepOutput with a Generation per finite row and an error per NaN row)

An engine times its forward pass (`ForwardTimer`: no host sync of its own), calls
`choose_tokens` (both halves at once), feeds the next ids back into its batch (`append_tokens`
or its own equivalent), then `drop_failed` removes the rows that failed. An engine that
pipelines steps calls `start_choice` when it launches a step and `end_choice` when it reads it
back, launching the next step in between. Rows are in batch order; the chooser and `requests`
must be in that order too.

Speculative decoding (`choose_speculated`): a row with candidate tokens d1..dk has the logits of
k + 1 positions (after its last token, after d1, ...). The chooser picks a token at every
position as the row would be there (sampling/chooser.py `expand`); the row takes the token of
position 0, and of position j + 1 while the token of position j equals d(j+1). Each token taken
is what a step without speculation would have chosen (for sampling rows too: the row's generator
draws in the same order and is rewound to one draw per token taken), so greedy and seeded
output are the same with or without speculation, and sampling keeps the model's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from text_generation_common.messages import (
    Generation,
    GenerationRequest,
    RequestError,
    Speculation,
    StepOutput,
)
from text_generation_server.batches.batch import Batch
from text_generation_server.kernels import cpu_kernels
from text_generation_server.sampling.chooser import TokenChooser, first_max
from text_generation_server.sampling.token_details import generated_token_infos
from text_generation_server.utils.transfer import to_device

NAN_LOGITS_MESSAGE = "Token decoding error: the model produced NaN logits"

B = TypeVar("B", bound=Batch)


def choose_tokens(
    logits: torch.Tensor, requests: Sequence[GenerationRequest], chooser: TokenChooser, forward_ns: int = 0
) -> tuple[torch.Tensor, StepOutput]:
    """Choose the next token of every row of `logits` [B, vocab] (float32, modified in place).

    Returns the next ids [B] (every row, failed ones included, so that the batch's tensors keep
    their shape until `drop_failed`) and the step's output.
    """
    chosen = start_choice(logits, chooser)
    output = end_choice(chosen, requests)
    output.forward_ns = forward_ns
    return chosen.next_ids, output


@dataclass(slots=True, eq=False)
class Chosen:
    """A step's choice, queued on the device and not yet read back: the next ids [B], the final
    scores [B, vocab], the ids and NaN flags on their way to the host (`host`, complete once
    `ready` has passed; on CPU the tensor itself), and the rows' token histories (to record the
    ids in once read)."""

    next_ids: torch.Tensor
    scores: torch.Tensor
    nan: torch.Tensor  # [B] bool: rows whose logits hold NaN
    host: torch.Tensor | None  # on CUDA: the ids, then the NaN flags, on their way to pinned memory
    ready: Any  # torch.cuda.Event | None
    histories: list[list[int]]
    matchers: list[Any]
    guided_ns: int


def start_choice(logits: torch.Tensor, chooser: TokenChooser) -> Chosen:
    """Choose every row's next token on the device and queue the step's one device-to-host copy
    (the ids and the NaN rows) without waiting for it. The chooser moves on at once on the
    device (generated counts, seen tokens: `advance_on_device`), so a next step can be chosen
    before this one is read back; `end_choice` records the ids on the host."""
    next_ids, scores, nan = _choose(logits, chooser)
    host = ready = None
    if next_ids.device.type == "cuda":
        both = _joined(next_ids, nan)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    chooser.advance_on_device(next_ids)
    return Chosen(next_ids, scores, nan, host, ready, chooser.histories, chooser.matchers, chooser.guided_ns)


def _choose(logits: torch.Tensor, chooser: TokenChooser) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chooser.choose(logits)` (next ids, final scores) and the NaN rows of `logits` as they come
    (read before the chooser's processors change them). On CPU, where our kernels are loaded, the
    rows' first maxima and NaN flags come from one pass of `first_max`: a chooser that changes no
    score needs nothing else, others take their greedy rows' first maxima from it too."""
    if not _on_first_max(logits):
        nan = torch.isnan(logits.amax(dim=-1))  # amax propagates NaN; 15x cheaper than any()
        next_ids, scores = chooser.choose(logits)
        return next_ids, scores, nan
    ids, nan = cpu_kernels.first_max(logits)
    if chooser.plain:
        return ids, logits, nan
    assert logits.dtype == torch.float32, "the chooser's processors work on float32 scores (choice_scores)"
    next_ids, scores = chooser.choose(logits, first_max=greedy_ids)
    return next_ids, scores, nan


def choice_scores(
    logits: torch.Tensor, chooser: TokenChooser, requests: Sequence[GenerationRequest], keep: bool
) -> torch.Tensor:
    """What a step's choice reads (`start_choice`, `choose_tokens`, `choose_speculated`: whose
    expanded chooser is plain where the step's is): `logits` [B, vocab] as they
    are, in the model's dtype, where our CPU kernel makes the whole choice (a plain chooser) and
    no row asks for token details (nothing else reads them: no float32 copy of the vocabulary's
    scores); else a float32 copy, which the chooser's processors change in place. `keep`: copy
    float32 logits too (the caller reads them again, or its next forward overwrites them)."""
    if chooser.plain and _on_first_max(logits) and not any(r.details.any_token_detail for r in requests):
        return logits
    scores = logits.float()
    return scores.clone() if keep and scores.data_ptr() == logits.data_ptr() else scores


def _on_first_max(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and cpu_kernels.loaded()
    )


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum of `scores` [B, vocab] (argmax's index where no row holds a NaN):
    our CPU kernel's one pass where it serves, else ATen's."""
    return cpu_kernels.first_max(scores)[0] if _on_first_max(scores) else first_max(scores)


def _joined(ids: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """The ids, then the NaN flags as ids' dtype: one tensor, so one device-to-host copy (read_ids
    splits it)."""
    return torch.cat((ids, nan.to(ids.dtype)))


def read_ids(
    ids: torch.Tensor, nan: torch.Tensor, host: torch.Tensor | None = None
) -> tuple[list[int], Sequence[int]]:
    """The chosen ids and the NaN flags (true: NaN) on the host: from `host` (both, `_joined` and
    copied there before), else one copy of both from a GPU, or read as they are on CPU (no copy to
    join them for: two operations fewer)."""
    if host is None and ids.device.type == "cuda":
        host = _joined(ids, nan)
    if host is None:
        return ids.tolist(), nan.tolist()
    both = host.tolist()
    return both[: len(ids)], both[len(ids) :]


def end_choice(chosen: Chosen, requests: Sequence[GenerationRequest]) -> StepOutput:
    """Wait for `chosen`'s ids (`requests` in its row order), record them in the rows' histories
    and grammars, and make the step's output (forward_ns left to the caller)."""
    if chosen.ready is not None:
        chosen.ready.synchronize()
    # NOTE: the step's one device-to-host copy, read: the chosen ids and the NaN rows
    next_list, nan_rows = read_ids(chosen.next_ids, chosen.nan, chosen.host)
    infos = generated_token_infos(chosen.scores, next_list, [r.details for r in requests])
    guided_ns = chosen.guided_ns + TokenChooser.record(chosen.histories, chosen.matchers, next_list)
    output = StepOutput(guided_mask_ns=guided_ns)
    for request, info, nan in zip(requests, infos, nan_rows, strict=True):
        if nan:
            output.errors.append(RequestError(request.id, NAN_LOGITS_MESSAGE))
        else:
            output.generations.append(Generation(request.id, info))
    return output


@dataclass(slots=True)
class Verified:
    """What a speculative step took, in batch row order."""

    taken: list[list[int]]  # the tokens each row took (one at least, unless its logits are NaN)
    accepted: list[int]  # how many of its candidates they include
    chain: list[int]  # which of its candidate chains they follow (0 for a row without any)
    output: StepOutput  # each request's generations in order; a Speculation per row that had candidates


def choose_speculated(
    logits: torch.Tensor,
    requests: Sequence[GenerationRequest],
    chooser: TokenChooser,
    chains: Sequence[Sequence[Sequence[int]]],
) -> Verified:
    """Verify each row's candidate chains `chains[row]` (one at least, an empty one for a row
    without candidates; several only for greedy rows; each trimmed: TokenChooser.trim_drafts)
    against `logits` [sum(len(c) + 1), vocab] float32: every chain's positions in order, the
    rows' chains in order (modified in place).

    Each chain takes its first token and each next while the one before equals its candidate;
    a row follows the chain that took the most (the first of those: chains share their root, so
    equal prefixes choose equal tokens). A row whose logits are NaN at its first position takes
    nothing (an error in the output); NaN later keeps the tokens before it.
    """
    assert all(len(c) == 1 or chooser.generators[row] is None for row, c in enumerate(chains)), (
        "a sampling row draws along one chain"
    )
    flat = [chain for row_chains in chains for chain in row_chains]
    owners = [row for row, row_chains in enumerate(chains) for _ in row_chains]
    expanded = chooser.expand(flat, owners)
    speculating = [row for row, row_chains in enumerate(chains) if any(row_chains)]
    states = chooser.generator_states(speculating)
    chosen_t, scores, nan = _choose(logits, expanded)
    chosen, nan_rows = read_ids(chosen_t, nan)
    taken: list[list[int]] = []
    accepted: list[int] = []
    winners: list[int] = []
    kept: list[int] = []  # the expanded rows whose tokens are taken
    start = 0
    for row_chains in chains:
        best: tuple[list[int], list[int]] = ([], [])  # tokens, their expanded rows
        winner = 0
        for index, chain in enumerate(row_chains):
            tokens, positions = [], []
            for j in range(len(chain) + 1):
                if nan_rows[start + j]:  # the tokens before it stand; the row fails at its next step
                    break
                tokens.append(chosen[start + j])
                positions.append(start + j)
                if j == len(chain) or chosen[start + j] != chain[j]:
                    break
            if len(tokens) > len(best[0]):
                best, winner = (tokens, positions), index
            start += len(chain) + 1
        taken.append(best[0])
        kept += best[1]
        winners.append(winner)
        chain = row_chains[winner]
        accepted.append(sum(1 for t, d in zip(best[0], chain, strict=False) if t == d))
    chooser.rewind(speculating, states, [len(taken[row]) for row in speculating])
    details = [requests[row].details for row, tokens in enumerate(taken) for _ in tokens]
    wanted = any(d.any_token_detail for d in details)
    rows = scores.index_select(0, to_device(kept, scores.device)) if wanted else scores
    infos = iter(generated_token_infos(rows, [chosen[v] for v in kept], details))
    chooser.guided_ns = 0
    chooser.advance_many(taken)
    output = StepOutput(guided_mask_ns=expanded.guided_ns + chooser.guided_ns)
    for request, tokens in zip(requests, taken, strict=True):
        if not tokens:
            output.errors.append(RequestError(request.id, NAN_LOGITS_MESSAGE))
        output.generations += [Generation(request.id, next(infos)) for _ in tokens]
    output.speculation = [
        Speculation(len(chains[row][winners[row]]), accepted[row]) for row in speculating if taken[row]
    ]
    return Verified(taken, accepted, winners, output)


def drop_failed(batch: B, output: StepOutput) -> B | None:
    """`batch` without the requests that failed in `output` (None when none is left)."""
    if not output.errors:
        return batch
    return batch.prune({e.request_id for e in output.errors})


class ForwardTimer:
    """Forward time without a host sync: host time on CPU, CUDA events on a GPU (read after the
    step's device-to-host copy has synchronized)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start_ns = 0
        self._elapsed_ns = 0
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._start_ns = time.perf_counter_ns()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._elapsed_ns = time.perf_counter_ns() - self._start_ns

    def elapsed_ns(self) -> int:
        """The last forward's time (on CUDA: call after a sync, e.g. the ids' copy to the host)."""
        return self.lap()()

    def lap(self) -> Callable[[], int]:
        """The last forward's time, to be read later (on CUDA once its step is read back: a
        forward may start before the one before it is read)."""
        if self._events is not None:
            start, end = self._events

            def elapsed() -> int:
                end.synchronize()
                return int(start.elapsed_time(end) * 1e6)

            return elapsed
        elapsed_ns = self._elapsed_ns
        return lambda: elapsed_ns
