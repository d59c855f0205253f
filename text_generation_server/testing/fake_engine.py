"""A fake engine: every part of the engine contract, and no model weights.

The "model" is a fixed random table: the logits of the next token are
`table[last token] + position[length % POSITIONS]`, so a request's tokens depend only on its
own ids, whatever batch it runs in, as with a real model. It reads the vocabulary size and the
special tokens from the model directory's config.json (the tiny test models), validates and
truncates requests like every engine (engines/inputs.py) and post-processes steps with the
shared kit (engines/step.py), so sampling, penalties and token details are the real ones.

Used by the engine conformance suite (tests/engines/) beside the registered engines, with its
own step-by-step reference as the oracle; it needs no transformers model, so tests of the shard
server and the router can run a real shard on it in milliseconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from text_generation_common.engines import CapacityKind
from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    MemoryScalingModel,
    ModelInfo,
    RequestError,
    StepOutput,
    TokenInfo,
)
from text_generation_server.batch import Batch
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine, RequestLimits
from text_generation_server.engines.inputs import split_valid
from text_generation_server.engines.step import choose_tokens, drop_failed
from text_generation_server.sampling.chooser import TokenChooser
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


@dataclass(slots=True)
class Prefilling:
    """A request whose prompt is not fully computed yet (chunked prefill)."""

    request: GenerationRequest
    prompt: list[int]  # truncated
    computed: int = 0


class FakeBatch(Batch):
    """Requests and their sampling state: the chooser's histories (prompt + generated ids) are
    all the "KV cache" the fake model needs. Requests join as `prefilling` and move to the
    chooser (row order: by completion) in the step that computes the rest of their prompt."""

    def __init__(
        self,
        batch_id: int,
        requests: list[GenerationRequest],
        chooser: TokenChooser | None,
        prefilling: list[Prefilling],
        limits: RequestLimits,
    ) -> None:
        self.batch_id = batch_id
        self.requests = requests  # the chooser's rows
        self.chooser = chooser  # None while no request is past its prompt
        self.prefilling = prefilling
        self.limits = limits

    @property
    def histories(self) -> list[list[int]]:
        return self.chooser.histories if self.chooser is not None else []

    @classmethod
    def from_requests(
        cls, batch_id: int, requests: Sequence[GenerationRequest], context: Any
    ) -> tuple[Self | None, list[RequestError]]:
        assert isinstance(context, RequestLimits)
        valid, prompts, errors = split_valid(requests, context)
        if not valid:
            return None, errors
        prefilling = [Prefilling(r, p) for r, p in zip(valid, prompts, strict=True)]
        return cls(batch_id, [], None, prefilling, context), errors

    def compute_prompts(self, token_budget: int) -> list[Prefilling]:
        """Compute up to `token_budget` prompt tokens (0 = all), in order; the requests whose
        prompts are now complete join the chooser and are returned."""
        budget = token_budget or sum(len(p.prompt) for p in self.prefilling)
        done = []
        for item in self.prefilling:
            chunk = min(len(item.prompt) - item.computed, budget)
            item.computed += chunk
            budget -= chunk
            if item.computed == len(item.prompt):
                done.append(item)
        if done:
            limits = self.limits
            joined = TokenChooser.create(
                [p.request.params for p in done],
                [p.prompt for p in done],
                limits.eos_token_id,
                limits.vocab_size,
                torch.device("cpu"),
            )
            self.chooser = (
                joined if self.chooser is None else TokenChooser.concatenate([self.chooser, joined])
            )
            self.requests += [p.request for p in done]
            self.prefilling = [p for p in self.prefilling if p not in done]
        return done

    @classmethod
    def concatenate(cls, batches: Sequence[Self]) -> Self:
        choosers = [b.chooser for b in batches if b.chooser is not None]
        return cls(
            batches[0].batch_id,
            [r for b in batches for r in b.requests],
            TokenChooser.concatenate(choosers) if choosers else None,
            [p for b in batches for p in b.prefilling],
            batches[0].limits,
        )

    def prune(self, completed_ids: set[int]) -> Self | None:
        rows = [i for i, r in enumerate(self.requests) if r.id not in completed_ids]
        prefilling = [p for p in self.prefilling if p.request.id not in completed_ids]
        if not rows and not prefilling:
            return None
        if len(rows) == len(self.requests) and len(prefilling) == len(self.prefilling):
            return self
        chooser = self.chooser.select(rows) if self.chooser is not None and rows else None
        return type(self)(self.batch_id, [self.requests[i] for i in rows], chooser, prefilling, self.limits)

    def remaining(self) -> int:
        generated = self.chooser.generated if self.chooser is not None else []
        running = [r.max_new_tokens - g for r, g in zip(self.requests, generated, strict=True)]
        return max(running + [p.request.max_new_tokens for p in self.prefilling], default=0)

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests] + [p.request.id for p in self.prefilling]


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
            memory=MemoryScalingModel(1.0, 0.0, 0.0, 1.0, 1.0, 2**40),
            capacity=CapacityKind.UNPADDED_WEIGHTS,
            chunked_prefill=True,
            dtype="float32",
            dtype_reason="the fake engine's table",
        )

    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[FakeBatch | None, list[RequestError]]:
        return FakeBatch.from_requests(batch_id, requests, self.limits)  # prompts run in generate_token

    def generate_token(
        self, batch: Batch, first: bool, token_budget: int = 0
    ) -> tuple[StepOutput, FakeBatch | None]:
        assert isinstance(batch, FakeBatch)
        completed = batch.compute_prompts(token_budget)
        input_tokens = [  # details of each prompt, with its first token
            InputTokens(
                p.request.id,
                input_token_infos(self.model.prompt_logits(p.prompt), p.prompt, p.request.details),
            )
            for p in completed
            if p.request.details.input_tokens
        ]
        pending = [p.request.id for p in batch.prefilling]
        if batch.chooser is None:
            return StepOutput(pending=pending), batch
        start = time.perf_counter_ns()
        logits = self.model.next_logits(batch.histories)
        forward_ns = time.perf_counter_ns() - start
        _, output = choose_tokens(logits, batch.requests, batch.chooser, forward_ns)  # appends to histories
        output.input_tokens = input_tokens
        output.pending = pending
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
