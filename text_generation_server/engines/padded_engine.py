"""The engine of left-padded batches (batches/padded*.py) over a model its subclass loads:
hf_transformers (transformers modules) and hf_optimum_ort (an ONNX Runtime session). One step =
forward -> fp32 logits -> TokenChooser -> token details.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    ModelInfo,
    RequestError,
    StepOutput,
    WeightBudget,
)
from text_generation_server.batches.padded import ModelContext, PaddedBatch
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.step import ForwardTimer, choice_scores, choose_tokens, drop_failed
from text_generation_server.memory import MemoryFacts, estimate
from text_generation_server.sampling.token_details import encoder_input_token_infos, input_token_infos
from text_generation_server.utils.cpu import compute_cpus


class PaddedEngine(ModelEngine):
    """Steps over left-padded batches (padded_causal.py, padded_seq2seq.py) of a model that
    the subclass loads: `model` is what the batches' forward runs."""

    model: Any
    device: torch.device
    seq2seq: bool
    dtype_reason: str
    batch_type: type[PaddedBatch]
    context: ModelContext
    timer: ForwardTimer  # of the model's forward, on `device`

    def padded_info(self, config: ServerConfig, facts: MemoryFacts, dtype_name: str) -> ModelInfo:
        """What the router learns of the engine: limits, special tokens, the batch-weight model."""
        memory_model = estimate(
            config.estimate_memory,
            facts,
            max_sequence_length=self.context.max_sequence_length,
            max_batch_size=config.max_batch_size,
            safety_margin=config.batch_safety_margin,
        )
        return ModelInfo(
            seq2seq=self.seq2seq,
            eos_token_id=self.context.eos_token_id,
            extra_eos_token_ids=self.context.extra_eos_token_ids,
            sampling_defaults=self.context.sampling_defaults,
            bos_token_id=self.context.bos_token_id,
            max_loras=self.adapters.max_loras if self.adapters is not None else 0,
            vocab_size=self.context.vocab_size,
            max_sequence_length=self.context.max_sequence_length,
            capacity=WeightBudget(memory_model, padded=True),
            chunked_prefill=False,
            dtype=dtype_name,
            dtype_reason=self.dtype_reason,
            compute_cpus=compute_cpus(self.device),
        )

    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[PaddedBatch | None, list[RequestError]]:
        found = self.adapters.for_requests(requests) if self.adapters is not None else None
        return self.batch_type.from_requests(batch_id, requests, self.context, found)

    def generate_token(self, batch: Any, token_budget: int = 0) -> tuple[StepOutput, PaddedBatch | None]:
        assert isinstance(batch, PaddedBatch)
        with torch.inference_mode():
            return self._step(batch)

    def _step(self, batch: PaddedBatch) -> tuple[StepOutput, PaddedBatch | None]:
        first = batch.unprefilled
        want_input_logits = first and not self.seq2seq and batch.wants_input_logits
        self.timer.start()
        applied = (
            self.adapters.applied(batch.loras, self.device, by_rows=True)
            if self.adapters is not None
            else contextlib.nullcontext()
        )
        with applied:
            logits = batch.forward(self.model, all_logits=want_input_logits)
        # kept: a prefill's input-token details read the logits as they came
        last = choice_scores(logits[:, -1, :], batch.chooser, batch.requests, keep=True)
        self.timer.stop()
        next_ids, output = choose_tokens(last, batch.requests, batch.chooser)
        output.forward_ns = self.timer.elapsed_ns()  # after the ids' copy: no sync of its own
        if first:
            output.input_tokens = self._input_tokens(batch, logits if want_input_logits else None)
        batch.append_tokens(next_ids)
        return output, drop_failed(batch, output)

    def _input_tokens(self, batch: PaddedBatch, logits: torch.Tensor | None) -> list[InputTokens]:
        prompts = batch.prompts
        assert prompts is not None, "input tokens are known only in the prefill step"
        result = []
        for row, request in enumerate(batch.requests):
            if not request.details.input_tokens:
                continue
            ids = prompts[row]
            if self.seq2seq:
                infos = encoder_input_token_infos(ids, request.details)
            else:
                row_logits = logits[row, -len(ids) :] if logits is not None else None
                infos = input_token_infos(row_logits, ids, request.details)
            result.append(InputTokens(request.id, infos))
        return result
