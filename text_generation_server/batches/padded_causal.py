"""Left-padded rectangular batches of decoder-only requests, with a transformers KV cache.

State between steps (B rows, S attention columns = cached positions + the pending token):

    input_ids       [B, 1]   the token each row feeds next (the whole prompt before prefill)
    attention_mask  [B, S]   1 for real positions; padding is on the left
    position_ids    [B, 1]   absolute position of the pending token (padding excluded)
    past            Cache    S - 1 cached positions per layer
    lengths         list     real positions per row (row i uses the last lengths[i] columns)

Prune selects rows and cuts the padding no remaining row needs; concatenate left-pads every
batch to the longest and stacks them. Neither recomputes anything.
Callers: HFTransformersEngine (engines/hf_transformers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch

from text_generation_common.messages import GenerationRequest, RequestError
from text_generation_server.batches import kv_cache
from text_generation_server.batches.kv_cache import pad_left
from text_generation_server.batches.padded import (
    ModelContext,
    PaddedBatch,
    extend_mask,
    left_pad_rows,
    soft_prompt_rows,
    with_soft_prompts,
)
from text_generation_server.sampling.chooser import TokenChooser

if TYPE_CHECKING:
    from text_generation_server.adapters import Resolved


class CausalLMBatch(PaddedBatch):
    def __init__(
        self,
        batch_id: int,
        requests: list[GenerationRequest],
        chooser: TokenChooser,
        context: ModelContext,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        lengths: list[int],
        past: Any = None,
        prompts: list[list[int]] | None = None,
    ) -> None:
        super().__init__(batch_id, requests, chooser, context, prompts)
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.lengths = lengths
        self.past = past
        self.virtual: list[torch.Tensor | None] | None = None  # soft prompts, until the prefill

    @classmethod
    def from_requests(
        cls,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        context: ModelContext,
        adapters: Resolved | None = None,
    ) -> tuple[Self | None, list[RequestError]]:
        """`soft_prompts`: the soft prompt of each request that names one (by request id); its
        virtual tokens go in front of the prompt (placeholder ids whose embeddings the prefill
        replaces), counted in positions and the attention mask as PEFT's prompt tuning does."""
        valid, prompts, errors = cls.validate(requests, context, adapters)
        if not valid:
            return None, errors
        rows, virtual = soft_prompt_rows(valid, prompts, adapters, "decoder", context.pad_token_id)
        input_ids, attention_mask = left_pad_rows(rows, context.pad_token_id)
        # Positions count real tokens only (padding gets 0), as transformers' generate does.
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 0)
        device = context.device
        chooser = TokenChooser.create(
            [r.params for r in valid],
            prompts,
            context.eos_token_id,
            context.vocab_size,
            device,
            context.grammars,
            extra_eos_ids=context.extra_eos_token_ids,
            generated=[len(r.generated_ids) for r in valid],
        )
        batch = cls(
            batch_id,
            valid,
            chooser,
            context,
            input_ids.to(device),
            attention_mask.to(device),
            position_ids.to(device),
            [len(r) for r in rows],
            prompts=prompts,
        )
        if any(v is not None for v in virtual):
            batch.virtual = virtual
        if adapters is not None and adapters.loras:
            batch.loras = [adapters.loras.get(r.id) for r in valid]
        return batch, errors

    def forward(self, model: Any, all_logits: bool) -> torch.Tensor:
        """Run the model on the pending tokens; returns logits [B, positions, vocab] (all prompt
        positions when `all_logits`, else the last one)."""
        kwargs: dict[str, Any] = {}
        if self.context.accepts_position_ids:
            kwargs["position_ids"] = self.position_ids
        if self.context.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 0 if all_logits else 1
        if self.virtual is not None:
            kwargs["inputs_embeds"] = with_soft_prompts(model, self.input_ids, self.lengths, self.virtual)
            self.virtual = None
        else:
            kwargs["input_ids"] = self.input_ids
        out = model(
            attention_mask=self.attention_mask,
            past_key_values=self.past if self.past is not None else self._prefill_cache(),
            use_cache=True,
            **kwargs,
        )
        self.past = out.past_key_values
        return out.logits

    def _prefill_cache(self) -> Any:
        return kv_cache.new_cache(seq2seq=False, capacity=self.input_ids.shape[1] + self.remaining())

    def append_tokens(self, next_ids: torch.Tensor) -> None:
        """Make `next_ids` [B] the pending tokens of the next step."""
        self.input_ids = next_ids.view(len(self.requests), 1)
        self.attention_mask = extend_mask(self.attention_mask)
        self.position_ids = self.position_ids[:, -1:] + 1
        self.lengths = [n + 1 for n in self.lengths]
        self.prompts = None

    # the KV cache's row and length surgery (kv_cache.py); a subclass whose cache is another
    # kind (hf_optimum_ort: plain tensors) brings its own
    @staticmethod
    def _select_past(past: Any, rows: torch.Tensor, keep_last: int, capacity: int) -> Any:
        return kv_cache.select(past, rows, keep_last=keep_last, capacity=capacity)

    @staticmethod
    def _concatenate_past(pasts: Sequence[Any], length: int, capacity: int) -> Any:
        return kv_cache.concatenate(pasts, length=length, capacity=capacity)

    def _select(self, rows: list[int]) -> Self:
        index = torch.tensor(rows, device=self.context.device)
        lengths = [self.lengths[i] for i in rows]
        width = max(lengths)
        past = self._select_past(self.past, index, width - 1, width - 1 + self.remaining(rows))
        return type(self)(
            self.batch_id,
            [self.requests[i] for i in rows],
            self.chooser.select(rows),
            self.context,
            self.input_ids.index_select(0, index),
            self.attention_mask.index_select(0, index)[:, -width:],
            self.position_ids.index_select(0, index),
            lengths,
            past,
        )

    @classmethod
    def _concatenate(cls, batches: Sequence[Self]) -> Self:
        first = batches[0]
        width = max(b.attention_mask.shape[1] for b in batches)
        return cls(
            first.batch_id,
            [r for b in batches for r in b.requests],
            TokenChooser.concatenate([b.chooser for b in batches]),
            first.context,
            torch.cat([b.input_ids for b in batches]),
            torch.cat([pad_left(b.attention_mask, width) for b in batches]),
            torch.cat([b.position_ids for b in batches]),
            [n for b in batches for n in b.lengths],
            cls._concatenate_past(
                [b.past for b in batches], width - 1, width - 1 + max(b.remaining() for b in batches)
            ),
        )
