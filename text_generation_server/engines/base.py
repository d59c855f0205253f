"""The engine contract: load a model, build batches for it, run one step over a batch.

The shard server (server.py, through batch_manager.py) calls an engine only from its single
worker thread:
  engine.new_batch(id, requests)      -> (Batch | None, [RequestError])
  engine.generate_token(batch, token_budget) -> (StepOutput, Batch | None)
  engine.concatenate(batches)         -> Batch
  engine.release(request_ids)         requests gone from every batch (after each call)
  engine.kv_state()                   the paged KV cache after a call (None: no paged cache)
  engine.launch(batch, token_budget)  -> Launched | None   (engines that pipeline steps)
  engine.finish(launched)             -> StepOutput
Engines see dataclasses from text_generation_common/messages.py, never protobuf, and nothing
here assumes torch or transformers: what an engine needs to know about its model (devices,
special tokens, forward-signature facts) is its own business. What every engine shares is in
step.py (choosing, token details, failed rows) and batches/inputs.py (request limits and
checks, truncation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from text_generation_common.messages import (
    GenerationRequest,
    KvCacheState,
    ModelInfo,
    RequestError,
    StepOutput,
)
from text_generation_server.batches.batch import Batch
from text_generation_server.config import ServerConfig

if TYPE_CHECKING:  # torch stays out of this module
    from text_generation_server.adapters import AdapterSet


@dataclass(eq=False)
class Launched:
    """A step queued on the device and not read back yet (`ModelEngine.launch`): `batch` is the
    batch as the step leaves it (the next step may be launched on it before this one is read),
    `request_ids` the requests the step answers (`finish`). Engines subclass it with what
    they need to read the step back."""

    batch: Batch
    request_ids: list[int]


class ModelEngine(ABC):
    info: ModelInfo  # reported to the router; its capacity kind matches the engine's registry entry
    pipelined: bool = False  # `launch` queues steps (PIPELINE_STEPS): run ahead to use it
    adapters: AdapterSet | None = None  # soft prompts and LoRA, in engines that take them

    @abstractmethod
    def __init__(self, config: ServerConfig) -> None:
        """Load the model named by `config` (local files only)."""

    @abstractmethod
    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[Batch | None, list[RequestError]]:
        """Build a batch of the valid requests; the invalid ones come back as errors."""

    @abstractmethod
    def generate_token(self, batch: Batch, token_budget: int = 0) -> tuple[StepOutput, Batch | None]:
        """Run one forward pass (the batch knows whether it is its prefill) and choose one token per
        request whose prompt is fully computed. Returns the step's output and the batch to
        cache (requests that failed in this step are removed; None when nothing is left).
        Every request of the batch is answered: a generation, an error, or (engines with
        chunked prefill, whose info says so) a pending id while its prompt is computed at most
        `token_budget` tokens per step (0 = whole prompts; always 0 for other engines).
        `StepOutput.batch_id` is left for the caller."""

    def concatenate(self, batches: Sequence[Batch]) -> Batch:
        return type(batches[0]).concatenate(batches)

    def release(self, request_ids: Iterable[int]) -> None:
        """These requests left every batch (finished, cancelled, failed, dropped, cleared): free
        what the engine holds for them outside their batches (tgis_native: KV blocks). Called
        by the BatchManager after every call; ids it never saw are ignored."""
        return None

    def kv_state(self) -> KvCacheState | None:
        """The paged KV cache over every live request, reported with each call (engines whose
        capacity kind is KV_BLOCKS); None for the others."""
        return None

    def launch(self, batch: Batch, token_budget: int = 0) -> Launched | None:
        """Pipelined steps: queue `batch`'s next step on the device without waiting for it, so
        that the step after it can be queued before this one is read back (`finish`) and the
        device never waits for the host between them. The batch moves on as if the step were
        done (its requests' counts, sampling state and KV); requests that have had every token
        they may take launched leave it (their last token is the previous step's). None: this
        engine or this batch does not pipeline (the caller steps it with `generate_token`);
        then nothing changed."""
        return None

    def finish(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and answer its requests (`launched.request_ids`), as
        `generate_token` would have; failed rows are errors (the caller prunes them)."""
        raise NotImplementedError(f"{type(self).__name__} does not launch steps")
