"""The router's side of the internal protocol: talking to the model shards.

`ShardClient` is what the batcher and the health check need (typed, no protobuf);
`GrpcShardClient` implements it over Unix-socket gRPC: it discovers every shard from shard 0,
sends Prefill / Health / ClearCache to all shards concurrently (tensor-parallel shards must all
run every step) and uses shard 0's answer; decode steps go as messages of one NextTokens stream
per shard, opened at the first step and again after a step fails (a unary call per step cost
the router about twice the CPU of a stream message and the shard three times, over the
Unix socket); ModelInfo and ListAdapters come from shard 0; EndSteps goes to a single shard
only (a sharded model's calls run all their steps); PrefixLookup goes to all shards with a 5 s
timeout.
Failures become ShardCallError with TGIS's reasons (oom / connection / error) and messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from text_generation_common import convert
from text_generation_common.messages import (
    AdapterCacheState,
    AdapterListing,
    CachedBatchRef,
    GenerationRequest,
    ModelInfo,
    NewBatch,
    StepOutput,
)
from text_generation_common.pb import generate_pb2 as pb
from text_generation_common.pb import generate_pb2_grpc

logger = logging.getLogger(__name__)

PREFIX_LOOKUP_TIMEOUT_S = 5.0
LIST_ADAPTERS_TIMEOUT_S = 10.0
ADD_ADAPTER_TIMEOUT_S = 120.0  # reads a whole adapter from disk
END_STEPS_TIMEOUT_S = 1.0
OOM_MESSAGE = "GPU out of memory"
CONNECTION_MESSAGE = "Could not connect to Text Generation server"
# Keepalive pings notice a shard that stopped answering (crashed, frozen) within about two
# seconds even while a call waits on it; the shard's server accepts pings this often.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 1000),
]


class ShardCallError(Exception):
    """A shard call failed as a whole. reason: oom | connection | error (metric label);
    `status`: the shard's gRPC status code's name where it answered one (NOT_FOUND: an unknown
    prompt prefix or adapter; ALREADY_EXISTS: an adapter name taken)."""

    def __init__(self, reason: str, message: str, status: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason

    @property
    def not_found(self) -> bool:
        return self.status == "NOT_FOUND"


class ShardClient(Protocol):
    async def model_info(self) -> ModelInfo: ...

    async def prefill(
        self,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        to_prune: Sequence[CachedBatchRef],
        token_budget: int = 0,
    ) -> StepOutput: ...

    def next_token(
        self,
        batches: Sequence[CachedBatchRef],
        token_budget: int = 0,
        join: NewBatch | None = None,
        steps: int = 1,
        call: int = 0,
    ) -> Awaitable[StepOutput | None]:
        """Start one decode call; await the result. Its send goes at the loop's next turn once
        the returned awaitable runs as a task (the batcher makes it one and yields once, so the
        send is not queued behind the streams it wakes next). `token_budget`: most
        prompt tokens of pending requests to compute (chunked prefill); 0 = all. `join`: new
        requests that join the batch in this step (engines with chunked prefill). `steps`: most
        decode steps to run, their tokens answered together (NextTokenRequest.steps); `call`
        names them for `end_steps` (0: not named)."""
        ...

    async def end_steps(self, call: int) -> None:
        """Ask the shard to end decode call `call` after the step it is computing (a request
        waits to join); best effort, answered at once."""
        ...

    async def prefix_lookup(self, prefix_id: str, adapter: bool = False) -> int: ...

    async def list_adapters(self) -> AdapterListing:
        """The adapters of the shards' store that requests may name (shard 0's listing)."""
        ...

    async def add_adapter(self, adapter_id: str, path: str, replace: bool = False) -> int:
        """Serve the adapter saved at `path` (on the shards' host) as `adapter_id`, loaded now on
        every shard: its virtual tokens (0 for LoRA)."""
        ...

    async def remove_adapter(self, adapter_id: str) -> None:
        """Stop serving an adapter added by name (every shard)."""
        ...

    async def health(self) -> None: ...

    async def clear_cache(self) -> None: ...


def _call_error(error: grpc.aio.AioRpcError) -> ShardCallError:
    code = error.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ShardCallError("oom", OOM_MESSAGE)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ShardCallError("connection", f"{CONNECTION_MESSAGE}: {error.details()}")
    return ShardCallError("error", error.details() or code.name, code.name)


class StepStream:
    """One shard's NextTokens stream: a request written, then its answer read, one step at a
    time. A step that fails or is cancelled midway drops the stream (its answer may still come);
    the next step opens a new one."""

    def __init__(self, stub: generate_pb2_grpc.TextGenerationServiceStub) -> None:
        self._stub = stub
        self._call: Any = None

    async def step(self, request: pb.NextTokenRequest) -> pb.NextTokenResponse:
        call = self._call
        if call is None:
            call = self._call = self._stub.NextTokens()
        try:
            await call.write(request)
            reply = await call.read()
            if reply is grpc.aio.EOF:  # a stream that failed raises its status instead
                raise ShardCallError("connection", f"{CONNECTION_MESSAGE}: the shard ended its step stream")
        except BaseException:
            self._call = None
            call.cancel()
            raise
        assert isinstance(reply, pb.NextTokenResponse)
        return reply

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class GrpcShardClient:
    def __init__(
        self,
        stubs: Sequence[generate_pb2_grpc.TextGenerationServiceStub],
        channels: Sequence[grpc.aio.Channel],
    ):
        self._stubs = list(stubs)
        self._channels = list(channels)
        self._steps = [StepStream(stub) for stub in self._stubs]
        self.on_adapter_state: Callable[[AdapterCacheState], None] | None = None  # metrics

    @classmethod
    async def connect(cls, master_uds_path: str) -> GrpcShardClient:
        """Connect to shard 0 and, through its ServiceDiscovery, to every shard."""
        master = grpc.aio.insecure_channel(f"unix://{master_uds_path}", options=GRPC_OPTIONS)
        stub = generate_pb2_grpc.TextGenerationServiceStub(master)
        try:
            urls = list((await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())).urls)
        except grpc.aio.AioRpcError as exc:
            await master.close()
            raise _call_error(exc) from exc
        channels = [master] + [grpc.aio.insecure_channel(url, options=GRPC_OPTIONS) for url in urls[1:]]
        logger.info("connected to %d shard(s): %s", len(urls), ", ".join(urls))
        return cls([generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels], channels)

    async def close(self) -> None:
        for stream in self._steps:
            stream.close()
        for channel in self._channels:
            await channel.close()

    def _start(self, method: str, request: object, timeout: float | None = None) -> list[Any]:
        """Start `method` on every shard (grpc.aio schedules each send at once)."""
        return [getattr(stub, method)(request, timeout=timeout) for stub in self._stubs]

    @staticmethod
    async def _first_reply(calls: list[Any], wait_all: bool = False) -> object:
        """Shard 0's reply (the first error if any call fails; `wait_all`: once every call has
        ended). One shard's call is awaited as it is: gathering it would wrap it in a task of
        its own every step."""
        try:
            if len(calls) == 1:
                return await calls[0]
            replies = await asyncio.gather(*calls, return_exceptions=wait_all)
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
        except grpc.aio.AioRpcError as exc:
            raise _call_error(exc) from exc
        return replies[0]

    async def _all(self, method: str, request: object, timeout: float | None = None) -> object:
        """Call `method` on every shard; shard 0's reply (the first error if any fails)."""
        return await self._first_reply(self._start(method, request, timeout))

    async def model_info(self) -> ModelInfo:
        try:
            reply = await self._stubs[0].ModelInfo(pb.ModelInfoRequest())
        except grpc.aio.AioRpcError as exc:
            raise _call_error(exc) from exc
        return convert.model_info_from_pb(reply)

    async def prefill(
        self,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        to_prune: Sequence[CachedBatchRef],
        token_budget: int = 0,
    ) -> StepOutput:
        request = pb.PrefillRequest(
            batch=convert.new_batch_to_pb(NewBatch(batch_id, tuple(requests))),
            to_prune=convert.cached_batches_to_pb(to_prune),
            token_budget=token_budget,
        )
        reply = await self._all("Prefill", request)
        assert isinstance(reply, pb.PrefillResponse)
        return convert.result_from_pb(reply.result, reply.input_tokens)

    def next_token(
        self,
        batches: Sequence[CachedBatchRef],
        token_budget: int = 0,
        join: NewBatch | None = None,
        steps: int = 1,
        call: int = 0,
    ) -> Awaitable[StepOutput | None]:
        request = pb.NextTokenRequest(
            batches=convert.cached_batches_to_pb(batches),
            token_budget=token_budget,
            join=convert.new_batch_to_pb(join) if join is not None else None,
            steps=steps,
            call=call,
        )
        if len(self._steps) == 1:  # its write starts when the caller's task first runs
            return self._next_token_result([self._steps[0].step(request)])
        # several shards: each step a task now, so that every write starts at the next turn
        return self._next_token_result([asyncio.ensure_future(s.step(request)) for s in self._steps])

    async def _next_token_result(self, steps: list[Awaitable[pb.NextTokenResponse]]) -> StepOutput | None:
        """Shard 0's answer to the step (the first error if any shard fails), once every shard's
        step has ended: a stream is never left with an answer due."""
        reply = await self._first_reply(steps, wait_all=True)
        assert isinstance(reply, pb.NextTokenResponse)
        return convert.result_from_pb(reply.result, reply.input_tokens) if reply.HasField("result") else None

    async def end_steps(self, call: int) -> None:
        """One shard only: the ranks of a sharded model must run the same steps, so their calls
        run to the end. A failure is left to the call itself to report."""
        if len(self._stubs) != 1:
            return
        try:
            await self._stubs[0].EndSteps(pb.EndStepsRequest(call=call), timeout=END_STEPS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.debug("EndSteps for call %d failed: %s", call, exc)

    async def prefix_lookup(self, prefix_id: str, adapter: bool = False) -> int:
        """The virtual-token count of soft prompt `prefix_id` (`adapter`: of the adapter stored
        under that id, 0 for kinds without virtual tokens)."""
        lookup = (
            pb.PrefixLookupRequest(adapter_id=prefix_id)
            if adapter
            else pb.PrefixLookupRequest(prefix_id=prefix_id)
        )
        return self._loaded(await self._all("PrefixLookup", lookup, PREFIX_LOOKUP_TIMEOUT_S))

    def _loaded(self, reply: object) -> int:
        """An adapter's length from a shard's answer to its load, the caches it reports passed on."""
        assert isinstance(reply, pb.PrefixLookupResponse)
        if reply.HasField("adapters") and self.on_adapter_state is not None:
            self.on_adapter_state(convert.adapter_cache_from_pb(reply.adapters))
        return reply.prefix_length

    async def list_adapters(self) -> AdapterListing:
        """Shard 0's listing: every shard reads the same store."""
        try:
            reply = await self._stubs[0].ListAdapters(
                pb.ListAdaptersRequest(), timeout=LIST_ADAPTERS_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise _call_error(exc) from exc
        return AdapterListing(tuple(reply.adapter_ids), reply.truncated)

    async def add_adapter(self, adapter_id: str, path: str, replace: bool = False) -> int:
        request = pb.AddAdapterRequest(adapter_id=adapter_id, path=path, replace=replace)
        return self._loaded(await self._all("AddAdapter", request, ADD_ADAPTER_TIMEOUT_S))

    async def remove_adapter(self, adapter_id: str) -> None:
        await self._all(
            "RemoveAdapter", pb.RemoveAdapterRequest(adapter_id=adapter_id), PREFIX_LOOKUP_TIMEOUT_S
        )

    async def health(self) -> None:
        await self._all("Health", pb.HealthRequest())

    async def clear_cache(self) -> None:
        await self._all("ClearCache", pb.ClearCacheRequest())
