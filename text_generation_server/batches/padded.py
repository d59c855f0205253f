"""What the left-padded batch types share: requests, sampling state, validation, pruning.

Subclasses (padded_causal.py, padded_seq2seq.py) hold the model tensors and implement
`forward`, `append_tokens`, `_select` (rows kept, in order) and `concatenate`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch

from text_generation_common.messages import GenerationRequest, RequestError
from text_generation_server.batches.batch import Batch
from text_generation_server.batches.inputs import RequestLimits, split_valid
from text_generation_server.lora import LoraWeights

if TYPE_CHECKING:
    from text_generation_server.adapters import Resolved
from text_generation_server.sampling.chooser import TokenChooser


@dataclass(frozen=True, slots=True)
class ModelContext(RequestLimits):
    """What padded batches of a transformers model need to know about it."""

    device: torch.device
    pad_token_id: int
    accepts_position_ids: bool = True  # causal models: pass explicit position ids
    accepts_logits_to_keep: bool = True  # the model can skip logits of positions we do not need
    decoder_start_token_id: int | None = None  # encoder-decoder models


def left_pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], mask [B, L]) with every row right-aligned; built on the CPU."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


def soft_prompt_rows(
    requests: Sequence[GenerationRequest],
    prompts: Sequence[list[int]],
    adapters: Resolved | None,
    part: str,
    placeholder: int,
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Each request's ids behind one placeholder per virtual token of its soft prompt's `part`
    ("decoder" or "encoder"), and those embeddings (None for a request without)."""
    found = adapters.prompts if adapters else {}
    virtual: list[torch.Tensor | None] = [
        getattr(found[r.id], part) if r.id in found else None for r in requests
    ]
    rows = [
        [placeholder] * (v.shape[0] if v is not None else 0) + p
        for v, p in zip(virtual, prompts, strict=True)
    ]
    return rows, virtual


def with_soft_prompts(
    model: Any, ids: torch.Tensor, lengths: Sequence[int], virtual: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Input embeddings of left-padded rows `ids` [B, S] (row i's real tokens are its last
    lengths[i]), each row's soft prompt written over the placeholders in front of its input."""
    embeds = model.get_input_embeddings()(ids)
    width = ids.shape[1]
    for row, tensor in enumerate(virtual):
        if tensor is not None:
            start = width - lengths[row]
            embeds[row, start : start + tensor.shape[0]] = tensor
    return embeds


def extend_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, S] -> [B, S + 1] with the new column set (the pending token of every row)."""
    return torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)


class PaddedBatch(Batch):
    def __init__(
        self,
        batch_id: int,
        requests: list[GenerationRequest],
        chooser: TokenChooser,
        context: ModelContext,
        prompts: list[list[int]] | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.requests = requests
        self.chooser = chooser
        self.context = context
        self.prompts = prompts  # truncated prompt ids, until the prefill step only
        self.loras: list[LoraWeights | None] = [None] * len(requests)  # each row's LoRA adapter

    @property
    def unprefilled(self) -> bool:
        """No step ran yet: the next one is the prefill (the prompts are known until then)."""
        return self.prompts is not None

    @classmethod
    @abstractmethod
    def from_requests(
        cls,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        context: ModelContext,
        adapters: Resolved | None = None,
    ) -> tuple[Self | None, list[RequestError]]:
        """A batch of the valid requests (None: none is valid) and the errors of the others;
        `adapters`: the soft prompts and LoRA adapters found for the requests that name one."""

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)

    # the model reads its generated ids as prompt: a preempted request resumes from them
    RESUMABLE = True

    @classmethod
    def validate(
        cls, requests: Sequence[GenerationRequest], context: ModelContext, adapters: Resolved | None = None
    ) -> tuple[list[GenerationRequest], list[list[int]], list[RequestError]]:
        """Split requests into (valid, their truncated ids then any generated before a resume,
        errors of the others); `adapters`: the adapters found for requests that name one."""
        prefix_lengths = adapters.prefix_lengths() if adapters else None
        return split_valid(requests, context, prefix_lengths, resumable=cls.RESUMABLE)

    def remaining(self, rows: Sequence[int] | None = None) -> int:
        """The most tokens any of `rows` (default: all) may still generate."""
        rows = range(len(self.requests)) if rows is None else rows
        generated = self.chooser.generated
        return max((self.requests[i].max_new_tokens - generated[i] for i in rows), default=0)

    def done_ids(self) -> set[int]:
        generated = self.chooser.generated
        return {r.id for r, g in zip(self.requests, generated, strict=True) if g >= r.max_new_tokens}

    def ended(self) -> bool:
        return self.chooser.finished([r.max_new_tokens for r in self.requests])

    @property
    def wants_input_logits(self) -> bool:
        """Some request wants details of its prompt tokens (needs logits at every position)."""
        return any(r.details.input_tokens and r.details.any_token_detail for r in self.requests)

    def prune(self, completed_ids: set[int]) -> Self | None:
        rows = [i for i, r in enumerate(self.requests) if r.id not in completed_ids]
        if not rows:
            return None
        if len(rows) == len(self.requests):
            return self
        selected = self._select(rows)
        selected.loras = [self.loras[i] for i in rows]
        return selected

    @classmethod
    def concatenate(cls, batches: Sequence[Self]) -> Self:
        merged = cls._concatenate(batches)
        merged.loras = [w for b in batches for w in b.loras]
        return merged

    @classmethod
    @abstractmethod
    def _concatenate(cls, batches: Sequence[Self]) -> Self:
        """The batches stacked in order (rows follow each other)."""

    @abstractmethod
    def forward(self, model: Any, all_logits: bool) -> torch.Tensor:
        """Run the model on the pending tokens; logits [B, positions, vocab]."""

    @abstractmethod
    def append_tokens(self, next_ids: torch.Tensor) -> None:
        """Make `next_ids` [B] the pending tokens of the next step."""

    @abstractmethod
    def _select(self, rows: list[int]) -> Self:
        """A batch of the given rows, in that order."""
