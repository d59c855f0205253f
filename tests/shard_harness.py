"""Test helpers: run a shard server in a background thread and drive it like a router.

`running_shard(engine, config)` starts the real grpc.aio server on a Unix socket in its own
event-loop thread and yields a synchronous stub. `Driver` plays the router's part of the
protocol: it assigns batch ids, prefills, runs next-token steps, prunes requests once they
reach max_new_tokens or EOS, and records every request's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from text_generation_common.pb import generate_pb2 as pb
from text_generation_common.pb import generate_pb2_grpc
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.server import start_server


@contextlib.contextmanager
def running_shard(
    engine: ModelEngine, config: ServerConfig
) -> Iterator[generate_pb2_grpc.TextGenerationServiceStub]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server, servicer = await start_server(engine, config)
        started.set()
        try:
            await stop.wait()
            await server.stop(0)
        finally:
            servicer.close()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("shard server did not start")
    channel = grpc.insecure_channel(f"unix://{config.socket_path}")
    try:
        yield generate_pb2_grpc.TextGenerationServiceStub(channel)
    finally:
        channel.close()
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


def make_request(
    request_id: int,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    typical_p: float = 0.0,
    seed: int | None = None,
    min_new_tokens: int = 0,
    repetition_penalty: float = 0.0,
    length_penalty: tuple[int, float] | None = None,
    truncate: int = 0,
    input_tokens: bool = False,
    logprobs: bool = False,
    ranks: bool = False,
    top_n: int = 0,
    prefix_id: str = "",
) -> pb.Request:
    params = pb.NextTokenChooserParameters(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        min_new_tokens=min_new_tokens,
        repetition_penalty=repetition_penalty,
    )
    if seed is not None:
        params.seed = seed
    if length_penalty is not None:
        params.length_penalty.start_index, params.length_penalty.decay_factor = length_penalty
    return pb.Request(
        id=request_id,
        input_ids=list(input_ids),
        max_new_tokens=max_new_tokens,
        truncate_input_tokens=truncate,
        parameters=params,
        details=pb.RequestedDetails(
            input_tokens=input_tokens, logprobs=logprobs, ranks=ranks, top_n_tokens=top_n
        ),
        prefix_id=prefix_id,
    )


@dataclass
class _BatchRef:
    batch_id: int
    live: list[int]  # request ids still running
    completed: list[int]  # of those, the ones to drop at the next call

    def pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(id=self.batch_id, completed_ids=self.completed)


@dataclass
class Driver:
    """Router stand-in: one running batch that prefilled batches join at the next step; a
    request stops at its max_new_tokens or at EOS (when `stop_at_eos`)."""

    stub: generate_pb2_grpc.TextGenerationServiceStub
    eos_token_id: int
    stop_at_eos: bool = True
    tokens: dict[int, list[pb.Token]] = field(default_factory=dict)
    input_tokens: dict[int, list[pb.Token]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    max_new: dict[int, int] = field(default_factory=dict)
    running: _BatchRef | None = None
    pending: list[_BatchRef] = field(default_factory=list)  # prefilled, not yet merged
    next_batch_id: int = 1

    def ids(self, request_id: int) -> list[int]:
        return [t.token_id for t in self.tokens[request_id]]

    def _finished(self, request_id: int) -> bool:
        toks = self.tokens[request_id]
        if len(toks) >= self.max_new[request_id]:
            return True
        return self.stop_at_eos and bool(toks) and toks[-1].token_id == self.eos_token_id

    def _absorb(self, result: pb.GenerateResult) -> _BatchRef | None:
        for token in result.tokens:
            self.tokens[token.request_id].append(token)
        for error in result.errors:
            self.errors[error.request_id] = error.message
        if not result.HasField("batch_id"):
            return None
        live = [t.request_id for t in result.tokens]
        return _BatchRef(result.batch_id, live, [r for r in live if self._finished(r)])

    def prefill(self, requests: Sequence[pb.Request]) -> pb.PrefillResponse:
        """Prefill a new batch, pruning the running one; the next step merges the two."""
        for r in requests:
            self.max_new[r.id] = r.max_new_tokens
            self.tokens[r.id] = []
        batch_id, self.next_batch_id = self.next_batch_id, self.next_batch_id + 1
        to_prune = [self.running.pb()] if self.running is not None and self.running.completed else []
        response = self.stub.Prefill(
            pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=requests), to_prune=to_prune)
        )
        if to_prune and self.running is not None:
            live = [r for r in self.running.live if r not in self.running.completed]
            self.running = _BatchRef(self.running.batch_id, live, []) if live else None
        for item in response.input_tokens:
            self.input_tokens[item.request_id] = list(item.tokens)
        new = self._absorb(response.result)
        if new is not None:
            self.pending.append(new)
        return response

    def step(self) -> bool:
        """One next-token call over the running and prefilled batches; False when none is left."""
        batches = [b.pb() for b in ([self.running] if self.running else []) + self.pending]
        self.pending = []
        if not batches:
            return False
        response = self.stub.NextToken(pb.NextTokenRequest(batches=batches))
        self.running = self._absorb(response.result) if response.HasField("result") else None
        return self.running is not None

    def run(self, steps: int | None = None) -> None:
        """Run steps until every request finished (or `steps` steps)."""
        count = 0
        while (steps is None or count < steps) and self.step():
            count += 1
