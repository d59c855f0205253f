"""The batcher's test harness: a Batcher over a FakeShard in this event loop, the requests it
runs, and waits on its calls and outputs (never on wall-clock sleeps). `make_harness` is a
fixture (conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from router.core.batch_weights import BatchWeights
from router.core.capacity import WeightCapacity
from router.core.detokenizer import Detokenizer
from router.core.entry import Entry, Output
from router.core.metrics import Metrics
from router.core.pacing import ONE_PER_TOKEN, StreamPacing
from router.core.thinking import ThinkingBudget
from router.core.validation import ResponseSpec, StoppingSpec, ValidatedRequest
from router.scheduling.batcher import Batcher
from router.scheduling.request_queue import RequestQueue
from tests.router.fakes import EOS, FakeShard
from text_generation_common.messages import SamplingParams


def make_request(
    prompt_len: int = 4,
    max_new: int = 5,
    *,
    deadline_s: float | None = None,
    stop: tuple[str, ...] = (),
    include_stop: bool = False,
    min_new: int = 0,
    details: bool = False,
    capped: bool = False,
    priority: int = 0,
    thinking: ThinkingBudget | None = None,
) -> ValidatedRequest:
    now = time.monotonic()
    return ValidatedRequest(
        text="x" * prompt_len,
        input_ids=tuple(range(10, 10 + prompt_len)),
        input_length=prompt_len,
        truncate_input_tokens=0,
        prefix_id="",
        prefix_length=0,
        sampling=SamplingParams(min_new_tokens=min_new),
        stopping=StoppingSpec(max_new, min_new, stop, include_stop, capped),
        response=ResponseSpec(generated_tokens=details, input_tokens=details, token_logprobs=details),
        received_at=now,
        deadline=now + deadline_s if deadline_s is not None else None,
        priority=priority,
        thinking=thinking,
    )


@dataclass
class Harness:
    shard: FakeShard
    queue: RequestQueue
    batcher: Batcher

    def submit(self, request: ValidatedRequest, stream: bool = False) -> Entry:
        entry = Entry(request, stream, pacing=self.batcher.pacing if stream else ONE_PER_TOKEN)
        self.queue.append([entry])
        return entry

    async def final(self, entry: Entry, timeout: float = 5) -> Output:
        async def until_final() -> Output:
            while not (out := await entry.outputs.get()).final:
                pass
            return out

        return await asyncio.wait_for(until_final(), timeout)

    async def all_outputs(self, entry: Entry, timeout: float = 5) -> list[Output]:
        outs: list[Output] = []
        while not outs or not outs[-1].final:
            outs.append(await asyncio.wait_for(entry.outputs.get(), timeout))
        return outs

    async def answers(self, entries: list[Entry]) -> list[tuple[Entry, list[Output]]]:
        """Each entry not cancelled with all its outputs, once every entry ended (a cancelled
        one once it is finished)."""
        answered = []
        for entry in entries:
            if entry.cancelled:
                await self.until(lambda e=entry: e.finished)
            else:
                answered.append((entry, await self.all_outputs(entry)))
        return answered

    def methods(self) -> list[str]:
        return [c.method for c in self.shard.calls]

    async def until(self, condition: Callable[[], bool], timeout: float = 5) -> None:
        """Until `condition` holds, checked each time a call reaches the shard."""

        async def wait() -> None:
            while not condition():
                await self.shard.next_call()

        await asyncio.wait_for(wait(), timeout)

    async def calls(self, n: int) -> None:
        """Until the shard has seen `n` calls."""
        await self.until(lambda: len(self.shard.calls) >= n)


@pytest.fixture
async def make_harness(detokenizer: Detokenizer) -> AsyncIterator:
    tasks = []

    def build(
        shard: FakeShard | None = None,
        *,
        max_batch_size: int = 8,
        max_waiting_tokens: int = 2,
        padding=1.0,
        max_prefill_tokens: int = 0,
        eager_joins: bool = False,
        pacing: StreamPacing = ONE_PER_TOKEN,
        max_decode_steps: int = 1,
        max_decode_call_s: float = 1.0,
        extra_eos_token_ids: tuple[int, ...] = (),
        by_priority: bool = False,
        preemption: bool = False,
    ):
        shard = shard or FakeShard()
        capacity = WeightCapacity(BatchWeights.from_model(shard.memory, padded=True), padding)
        metrics = Metrics(max_batch_size=max_batch_size)
        queue = RequestQueue(
            capacity,
            max_batch_size,
            metrics,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill=shard.chunked_prefill,
            by_priority=by_priority,
        )
        batcher = Batcher(
            shard,
            queue,
            detokenizer,
            metrics,
            eos_token_id=EOS,
            extra_eos_token_ids=extra_eos_token_ids,
            max_waiting_tokens=max_waiting_tokens,
            join_in_step=shard.chunked_prefill,  # as the router does for engines that chunk prompts
            eager_joins=eager_joins,
            pacing=pacing,
            max_decode_steps=max_decode_steps,
            max_decode_call_s=max_decode_call_s,
            preemption=preemption,
        )
        tasks.append(asyncio.create_task(batcher.run()))
        return Harness(shard, queue, batcher)

    yield build
    for task in tasks:
        task.cancel()
