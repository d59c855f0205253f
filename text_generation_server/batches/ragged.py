"""Ragged batches: requests that each run at their own length, with prompts that may be computed
over several steps (chunked prefill).

A RaggedBatch holds two kinds of request:
  - decoding: past their prompt; rows of the TokenChooser (`requests`, chooser row order);
  - prefilling: prompt not fully computed yet (`prefilling`, in arrival order).
Per step an engine asks `plan_prompts(token_budget)` for the prompt chunks to compute beside one
token per decoding row, runs its forward pass, then `finish_prompts(chunks)` records them: the
requests whose prompts are complete join the chooser after the existing rows, so the logits of
a step are [decoding rows..., completed prompts...] in that order. `states` holds each
request's engine state by id (its KV blocks, for the paged engine) and follows prune and
concatenate. Used by the paged `tgis_native` engine and the fake test engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch

from text_generation_common.messages import GenerationRequest, RequestError
from text_generation_server.batches.batch import Batch
from text_generation_server.batches.inputs import RequestLimits, split_valid
from text_generation_server.batches.padded import soft_prompt_rows
from text_generation_server.sampling.chooser import TokenChooser

if TYPE_CHECKING:
    from text_generation_server.adapters import Resolved


@dataclass(eq=False, slots=True)
class Prefilling:
    """A request whose prompt is not fully computed yet."""

    request: GenerationRequest
    # what the KV cache holds: the soft prompt's placeholders, the truncated ids, then (resumed)
    # the ids generated before
    prompt: list[int]
    computed: int = 0  # prompt tokens already computed
    prompt_logits: list[torch.Tensor] | None = None  # chunks' logits, kept for input-token details
    virtual: torch.Tensor | None = None  # the soft prompt's embeddings [virtual_length, hidden]
    cached: int = 0  # prompt tokens found in the prefix cache (not computed)

    @property
    def virtual_length(self) -> int:
        return 0 if self.virtual is None else int(self.virtual.shape[0])

    @property
    def ids(self) -> list[int]:
        """The request's own (truncated) input ids and any generated before, without the soft prompt."""
        return self.prompt[self.virtual_length :]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt tokens [start, end) of one prefilling request, computed in this step."""

    item: Prefilling
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.item.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.item.prompt[self.start : self.end]

    @property
    def virtual(self) -> torch.Tensor | None:
        """The soft-prompt embeddings of this chunk's first tokens (None: it has none)."""
        item = self.item
        if item.virtual is None or self.start >= item.virtual_length:
            return None
        return item.virtual[self.start : min(self.end, item.virtual_length)]


class RaggedBatch(Batch):
    def __init__(
        self,
        batch_id: int,
        requests: list[GenerationRequest],
        chooser: TokenChooser | None,
        prefilling: list[Prefilling],
        limits: RequestLimits,
        device: torch.device,
        states: dict[int, Any] | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.requests = requests  # decoding requests = the chooser's rows
        self.chooser = chooser  # None while no request is past its prompt
        self.prefilling = prefilling
        self.limits = limits
        self.device = device
        self.states: dict[int, Any] = states if states is not None else {}

    @property
    def histories(self) -> list[list[int]]:
        """Prompt + generated ids of every decoding row."""
        return self.chooser.histories if self.chooser is not None else []

    @classmethod
    def from_requests(
        cls,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        limits: RequestLimits,
        device: torch.device,
        adapters: Resolved | None = None,
    ) -> tuple[Self | None, list[RequestError]]:
        """A batch of the valid requests, all prefilling (None: none is valid), and the errors
        of the others. `adapters`: a soft prompt's virtual tokens are computed first, as
        placeholders (id 0) whose embeddings the engine replaces; LoRA adapters are the
        engine's business."""
        valid, prompts, errors = split_valid(
            requests, limits, adapters.prefix_lengths() if adapters else None
        )
        if not valid:
            return None, errors
        rows, virtual = soft_prompt_rows(valid, prompts, adapters, "decoder", 0)
        prefilling = [Prefilling(r, row, virtual=v) for r, row, v in zip(valid, rows, virtual, strict=True)]
        return cls(batch_id, [], None, prefilling, limits, device), errors

    def plan_prompts(self, token_budget: int) -> list[Chunk]:
        """The prompt chunks of this step: in order, at most `token_budget` tokens (0 = all)."""
        budget = token_budget or sum(len(p.prompt) for p in self.prefilling)
        chunks = []
        for item in self.prefilling:
            if budget <= 0:
                break
            end = min(len(item.prompt), item.computed + budget)
            chunks.append(Chunk(item, item.computed, end))
            budget -= end - item.computed
        return chunks

    def finish_prompts(self, chunks: Sequence[Chunk]) -> list[Prefilling]:
        """Record the computed chunks; the completed requests join the chooser (returned)."""
        for chunk in chunks:
            chunk.item.computed = chunk.end
        done = [c.item for c in chunks if c.completes]
        if done:
            limits = self.limits
            joined = TokenChooser.create(
                [p.request.params for p in done],
                [p.ids for p in done],
                limits.eos_token_id,
                limits.vocab_size,
                self.device,
                limits.grammars,
                extra_eos_ids=limits.extra_eos_token_ids,
                generated=[len(p.request.generated_ids) for p in done],
            )
            before = [self.chooser] if self.chooser is not None else []
            self.chooser = TokenChooser.concatenate([*before, joined])
            self.requests = [*self.requests, *(p.request for p in done)]
            self.prefilling = [p for p in self.prefilling if p.computed < len(p.prompt)]
        return done

    @classmethod
    def concatenate(cls, batches: Sequence[Self]) -> Self:
        choosers = [b.chooser for b in batches if b.chooser is not None]
        first = batches[0]
        return cls(
            first.batch_id,
            [r for b in batches for r in b.requests],
            TokenChooser.concatenate(choosers) if choosers else None,
            [p for b in batches for p in b.prefilling],
            first.limits,
            first.device,
            {k: v for b in batches for k, v in b.states.items()},
        )

    def prune(self, completed_ids: set[int]) -> Self | None:
        rows = [i for i, r in enumerate(self.requests) if r.id not in completed_ids]
        prefilling = [p for p in self.prefilling if p.request.id not in completed_ids]
        if not rows and not prefilling:
            return None
        if len(rows) == len(self.requests) and len(prefilling) == len(self.prefilling):
            return self
        chooser = self.chooser.select(rows) if self.chooser is not None and rows else None
        states = {k: v for k, v in self.states.items() if k not in completed_ids}
        requests = [self.requests[i] for i in rows]
        return type(self)(self.batch_id, requests, chooser, prefilling, self.limits, self.device, states)

    def remaining(self) -> int:
        generated = self.chooser.generated if self.chooser is not None else []
        running = [r.max_new_tokens - g for r, g in zip(self.requests, generated, strict=True)]
        return max(running + [p.request.max_new_tokens for p in self.prefilling], default=0)

    def done_ids(self) -> set[int]:
        generated = self.chooser.generated if self.chooser is not None else []
        return {r.id for r, g in zip(self.requests, generated, strict=True) if g >= r.max_new_tokens}

    def ended(self) -> bool:
        if self.prefilling or self.chooser is None:
            return False
        return self.chooser.finished([r.max_new_tokens for r in self.requests])

    @property
    def pending_ids(self) -> list[int]:
        return [p.request.id for p in self.prefilling]

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests] + self.pending_ids


def cached_prompts(completed: Sequence[Prefilling]) -> list[tuple[int, int]]:
    """(request id, prompt tokens found in the prefix cache) of the prompts just completed that
    found any (StepOutput.cached_prompts)."""
    return [(p.request.id, p.cached) for p in completed if p.cached]
