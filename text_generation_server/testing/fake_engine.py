"""A fake engine: every part of the engine contract, and no model weights.

The "model" is a fixed random table: the logits of the next token are
`table[last token] + position[length % POSITIONS]`, so a request's tokens depend only on its
own ids, whatever batch it runs in, as with a real model. It reads the vocabulary size and the
special tokens from the model directory's config.json (the tiny test models), validates and
truncates requests like every engine (batches/inputs.py) and post-processes steps with the
shared kit (engines/step.py), so sampling, penalties and token details are the real ones.

Batches are ragged (batches/ragged.py, as in the paged engine), with chunked prefill. Used by
the engine conformance suite (tests/engines/) beside the registered engines, with its
own step-by-step reference as the oracle; it needs no transformers model, so tests of the shard
server and the router can run a real shard on it in milliseconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    MemoryScalingModel,
    ModelInfo,
    RequestError,
    StepOutput,
    TokenInfo,
    WeightBudget,
)
from text_generation_server.batches.batch import Batch
from text_generation_server.batches.inputs import RequestLimits
from text_generation_server.batches.ragged import Prefilling, RaggedBatch
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.step import choose_tokens, drop_failed
from text_generation_server.sampling.token_details import input_token_infos

POSITIONS = 64
TABLE_SEED = 1234
DEFAULT_SEQUENCE_LENGTH = 2048


class FakeModel:
    def __init__(self, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(TABLE_SEED)
        self.table = torch.randn(vocab_size, vocab_size, generator=generator) * 3
        self.position = torch.randn(POSITIONS, vocab_size, generator=generator)

    def next_logits(self, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [B, vocab] of the token after each history."""
        last = torch.tensor([h[-1] for h in histories])
        lengths = torch.tensor([len(h) % POSITIONS for h in histories])
        return self.table[last] + self.position[lengths]

    def prompt_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(ids), vocab], row i predicting token i + 1."""
        return self.next_logits([ids[: i + 1] for i in range(len(ids))])


class FakeEngine(ModelEngine):
    def __init__(self, config: ServerConfig) -> None:
        model_config = json.loads((Path(config.model_name) / "config.json").read_text())
        if model_config.get("is_encoder_decoder"):
            raise ValueError("the fake engine serves decoder-only models only")
        vocab_size = int(model_config["vocab_size"])
        self.limits = RequestLimits(
            vocab_size=vocab_size,
            eos_token_id=int(model_config["eos_token_id"]),
            bos_token_id=model_config.get("bos_token_id"),
            max_sequence_length=config.max_sequence_length or DEFAULT_SEQUENCE_LENGTH,
            max_new_tokens=config.max_new_tokens,
        )
        self.model = FakeModel(vocab_size)
        self.info = ModelInfo(
            seq2seq=False,
            eos_token_id=self.limits.eos_token_id,
            vocab_size=vocab_size,
            max_sequence_length=self.limits.max_sequence_length,
            capacity=WeightBudget(MemoryScalingModel(1.0, 0.0, 0.0, 1.0, 1.0, 2**40), padded=False),
            chunked_prefill=True,
            dtype="float32",
            dtype_reason="the fake engine's table",
        )

    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[RaggedBatch | None, list[RequestError]]:
        return RaggedBatch.from_requests(batch_id, requests, self.limits, torch.device("cpu"))

    def generate_token(self, batch: Batch, token_budget: int = 0) -> tuple[StepOutput, RaggedBatch | None]:
        assert isinstance(batch, RaggedBatch)
        chunks = batch.plan_prompts(token_budget)
        completed = batch.finish_prompts(chunks)  # the histories are prompt + generated ids
        input_tokens = [  # details of each prompt, with its first token
            InputTokens(p.request.id, self._prompt_details(p))
            for p in completed
            if p.request.details.input_tokens
        ]
        if batch.chooser is None:
            return StepOutput(pending=batch.pending_ids), batch
        start = time.perf_counter_ns()
        logits = self.model.next_logits(batch.histories)
        forward_ns = time.perf_counter_ns() - start
        _, output = choose_tokens(logits, batch.requests, batch.chooser, forward_ns)  # appends to histories
        output.input_tokens = input_tokens
        output.pending = batch.pending_ids
        return output, drop_failed(batch, output)

    def _prompt_details(self, item: Prefilling) -> tuple[TokenInfo, ...]:
        return input_token_infos(self.model.prompt_logits(item.prompt), item.prompt, item.request.details)

    def reference(self, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens of one prompt, step by step: the oracle of the conformance suite."""
        history = list(input_ids)
        for _ in range(max_new_tokens):
            token = int(self.model.next_logits([history])[0].argmax())
            history.append(token)
            if token == self.limits.eos_token_id:
                break
        return history[len(input_ids) :]
