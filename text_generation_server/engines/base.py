"""The engine contract: load a model, build batches for it, run one step over a batch.

The shard server (server.py) calls an engine only from its single worker thread:
  engine.new_batch(id, requests)      -> (Batch | None, [RequestError])
  engine.generate_token(batch, first) -> (StepOutput, Batch | None)
Engines see dataclasses from outputs.py, never protobuf.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from text_generation_common.messages import GenerationRequest, ModelInfo, RequestError, StepOutput
from text_generation_server.batch import Batch
from text_generation_server.config import ServerConfig


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What batches need to know about the model they hold state for."""

    device: torch.device
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None  # set iff the tokenizer prepends BOS (re-inserted on truncation)
    max_sequence_length: int
    max_new_tokens: int  # largest max_new_tokens a request may ask for
    accepts_position_ids: bool = True  # causal models: pass explicit position ids
    accepts_logits_to_keep: bool = True  # the model can skip logits of positions we do not need
    decoder_start_token_id: int | None = None  # encoder-decoder models


class ModelEngine(ABC):
    info: ModelInfo

    @abstractmethod
    def __init__(self, config: ServerConfig) -> None:
        """Load the model named by `config` (local files only)."""

    @abstractmethod
    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[Batch | None, list[RequestError]]:
        """Build a batch of the valid requests; the invalid ones come back as errors."""

    @abstractmethod
    def generate_token(self, batch: Batch, first: bool) -> tuple[StepOutput, Batch | None]:
        """Run one forward pass (`first`: the prefill of a new batch) and choose one token per
        request. Returns the step's output and the batch to cache (requests that failed in this
        step are removed; None when nothing is left). `StepOutput.batch_id` is left for the
        caller."""

    def concatenate(self, batches: Sequence[Batch]) -> Batch:
        return type(batches[0]).concatenate(batches)
