"""Left-padded batches of encoder-decoder requests (T5, BART, ...).

Both sides are left-padded rectangles:

    encoder_hidden     [B, Le, d]  encoder output, computed once in the prefill
    encoder_mask       [B, Le]
    decoder_input_ids  [B, 1]      pending decoder token (the start token before the prefill)
    decoder_mask       [B, Sd]     cached decoder positions + the pending one
    past               EncoderDecoderCache: self-attention Sd - 1 positions, cross-attention Le

Prune and concatenate cut or zero-fill padding on the left of both sides, as for causal batches.
Callers: HFTransformersEngine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch
from transformers.modeling_outputs import BaseModelOutput

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


class Seq2SeqLMBatch(PaddedBatch):
    RESUMABLE = False  # generated ids are the decoder's, not more of the encoder's prompt

    def __init__(
        self,
        batch_id: int,
        requests: list[GenerationRequest],
        chooser: TokenChooser,
        context: ModelContext,
        encoder_mask: torch.Tensor,
        encoder_lengths: list[int],
        decoder_input_ids: torch.Tensor,
        decoder_mask: torch.Tensor,
        decoder_lengths: list[int],
        encoder_input_ids: torch.Tensor | None = None,
        encoder_hidden: torch.Tensor | None = None,
        past: Any = None,
        prompts: list[list[int]] | None = None,
    ) -> None:
        super().__init__(batch_id, requests, chooser, context, prompts)
        self.encoder_mask = encoder_mask
        self.encoder_lengths = encoder_lengths
        self.decoder_input_ids = decoder_input_ids
        self.decoder_mask = decoder_mask
        self.decoder_lengths = decoder_lengths
        self.encoder_input_ids = encoder_input_ids  # until the prefill only
        self.encoder_hidden = encoder_hidden
        self.past = past
        self.virtual: list[torch.Tensor | None] | None = None  # encoder soft prompts, until the prefill
        self.decoder_virtual: list[torch.Tensor | None] | None = None  # decoder soft prompts, likewise

    @classmethod
    def from_requests(
        cls,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        context: ModelContext,
        adapters: Resolved | None = None,
    ) -> tuple[Self | None, list[RequestError]]:
        """`adapters`: a request's soft prompt goes in front of its encoder input (encoder.pt)
        and in front of the decoder start token (decoder.pt), as placeholder ids whose
        embeddings the prefill replaces."""
        valid, prompts, errors = cls.validate(requests, context, adapters)
        if not valid:
            return None, errors
        start = context.decoder_start_token_id
        assert start is not None, "encoder-decoder models need a decoder start token"
        device = context.device
        pad = context.pad_token_id
        encoder_rows, virtual = soft_prompt_rows(valid, prompts, adapters, "encoder", pad)
        encoder_ids, encoder_mask = left_pad_rows(encoder_rows, context.pad_token_id)
        rows = len(valid)
        decoder_rows, decoder_virtual = soft_prompt_rows(valid, [[start]] * rows, adapters, "decoder", pad)
        decoder_ids, decoder_mask = left_pad_rows(decoder_rows, pad)
        # Repetition penalty looks at decoder ids (start token + generated), as transformers does.
        chooser = TokenChooser.create(
            [r.params for r in valid],
            [[start]] * rows,
            context.eos_token_id,
            context.vocab_size,
            device,
            context.grammars,
            extra_eos_ids=context.extra_eos_token_ids,
        )
        batch = cls(
            batch_id,
            valid,
            chooser,
            context,
            encoder_mask.to(device),
            [len(r) for r in encoder_rows],
            decoder_ids.to(device),
            decoder_mask.to(device),
            [len(r) for r in decoder_rows],
            encoder_input_ids=encoder_ids.to(device),
            prompts=prompts,
        )
        if any(v is not None for v in virtual):
            batch.virtual = virtual
        if any(v is not None for v in decoder_virtual):
            batch.decoder_virtual = decoder_virtual
        if adapters is not None and adapters.loras:
            batch.loras = [adapters.loras.get(r.id) for r in valid]
        return batch, errors

    def forward(self, model: Any, all_logits: bool) -> torch.Tensor:
        if self.encoder_hidden is None:
            assert self.encoder_input_ids is not None
            encoder_inputs: dict[str, torch.Tensor] = {"input_ids": self.encoder_input_ids}
            if self.virtual is not None:
                encoder_inputs = {
                    "inputs_embeds": with_soft_prompts(
                        model, self.encoder_input_ids, self.encoder_lengths, self.virtual
                    )
                }
                self.virtual = None
            decoder_inputs: dict[str, torch.Tensor] = {"decoder_input_ids": self.decoder_input_ids}
            if self.decoder_virtual is not None:
                embeds = with_soft_prompts(
                    model, self.decoder_input_ids, self.decoder_lengths, self.decoder_virtual
                )
                decoder_inputs = {"decoder_inputs_embeds": embeds}
                self.decoder_virtual = None
            capacity = self.decoder_input_ids.shape[1] + self.remaining()
            out = model(
                **encoder_inputs,
                **decoder_inputs,
                attention_mask=self.encoder_mask,
                decoder_attention_mask=self.decoder_mask,
                past_key_values=kv_cache.new_cache(seq2seq=True, capacity=capacity),
                use_cache=True,
            )
            self.encoder_hidden = out.encoder_last_hidden_state
            self.encoder_input_ids = None
        else:
            out = model(
                encoder_outputs=BaseModelOutput(last_hidden_state=self.encoder_hidden),
                attention_mask=self.encoder_mask,
                decoder_input_ids=self.decoder_input_ids,
                decoder_attention_mask=self.decoder_mask,
                past_key_values=self.past,
                use_cache=True,
            )
        self.past = out.past_key_values
        return out.logits

    def append_tokens(self, next_ids: torch.Tensor) -> None:
        self.decoder_input_ids = next_ids.view(len(self.requests), 1)
        self.decoder_mask = extend_mask(self.decoder_mask)
        self.decoder_lengths = [n + 1 for n in self.decoder_lengths]
        self.prompts = None

    def _select(self, rows: list[int]) -> Self:
        assert self.encoder_hidden is not None, "only batches past their prefill are pruned"
        index = torch.tensor(rows, device=self.context.device)
        encoder_lengths = [self.encoder_lengths[i] for i in rows]
        decoder_lengths = [self.decoder_lengths[i] for i in rows]
        enc_width, dec_width = max(encoder_lengths), max(decoder_lengths)
        past = kv_cache.select(
            self.past,
            index,
            keep_last=dec_width - 1,
            capacity=dec_width - 1 + self.remaining(rows),
            cross_keep_last=enc_width,
        )
        return type(self)(
            self.batch_id,
            [self.requests[i] for i in rows],
            self.chooser.select(rows),
            self.context,
            self.encoder_mask.index_select(0, index)[:, -enc_width:],
            encoder_lengths,
            self.decoder_input_ids.index_select(0, index),
            self.decoder_mask.index_select(0, index)[:, -dec_width:],
            decoder_lengths,
            encoder_hidden=self.encoder_hidden.index_select(0, index)[:, -enc_width:],
            past=past,
        )

    @classmethod
    def _concatenate(cls, batches: Sequence[Self]) -> Self:
        first = batches[0]
        enc_width = max(b.encoder_mask.shape[1] for b in batches)
        dec_width = max(b.decoder_mask.shape[1] for b in batches)

        hidden = []
        for b in batches:
            assert b.encoder_hidden is not None, "only batches past their prefill are concatenated"
            hidden.append(pad_left(b.encoder_hidden, enc_width))
        return cls(
            first.batch_id,
            [r for b in batches for r in b.requests],
            TokenChooser.concatenate([b.chooser for b in batches]),
            first.context,
            torch.cat([pad_left(b.encoder_mask, enc_width) for b in batches]),
            [n for b in batches for n in b.encoder_lengths],
            torch.cat([b.decoder_input_ids for b in batches]),
            torch.cat([pad_left(b.decoder_mask, dec_width) for b in batches]),
            [n for b in batches for n in b.decoder_lengths],
            encoder_hidden=torch.cat(hidden),
            past=kv_cache.concatenate(
                [b.past for b in batches],
                length=dec_width - 1,
                capacity=dec_width - 1 + max(b.remaining() for b in batches),
                cross_length=enc_width,
            ),
        )
