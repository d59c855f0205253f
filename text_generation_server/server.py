"""The shard's gRPC server (internal protocol, generate.v1) on a Unix socket.

ShardServicer converts protobuf through convert.py and runs all model work on one dedicated
worker thread (never on the asyncio loop), so Health and ModelInfo answer even during a long
step. Errors become status codes here and only here:

    ShardError subclasses  -> NOT_FOUND / INVALID_ARGUMENT (the call's own input was wrong)
    out of memory          -> RESOURCE_EXHAUSTED
    anything else          -> UNKNOWN "Unexpected <class ...>: ..." (logged with its traceback)

With more than one shard (tensor parallelism), a step that raises stops the shard instead
(distributed.end_shard): its peers fail their next collective, and the launcher stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from text_generation_common import convert
from text_generation_common.pb import generate_pb2 as pb
from text_generation_common.pb import generate_pb2_grpc
from text_generation_server import distributed
from text_generation_server.adapters import AdapterExists, AdapterSet
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import ModelEngine
from text_generation_server.errors import (
    BatchNotFoundError,
    InvalidBatchError,
    PrefixNotFoundError,
    ShardError,
    is_out_of_memory,
)
from text_generation_server.lora import AdapterError

logger = logging.getLogger(__name__)

T = TypeVar("T")
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # The router pings every second to notice a frozen shard (router/scheduling/shard_client.py).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]
STATUS_OF_ERROR: dict[type[ShardError], grpc.StatusCode] = {
    BatchNotFoundError: grpc.StatusCode.NOT_FOUND,
    PrefixNotFoundError: grpc.StatusCode.NOT_FOUND,
    InvalidBatchError: grpc.StatusCode.INVALID_ARGUMENT,
    AdapterExists: grpc.StatusCode.ALREADY_EXISTS,
}


def worker_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-worker")


def load_engine(config: ServerConfig) -> tuple[ModelEngine, ThreadPoolExecutor]:
    """Load the configured engine on the worker thread that will run its steps.

    NOTE: torch's OpenMP thread pools belong to the thread that first runs parallel work: a
    model loaded on one thread and stepped on another ran up to 1.8x slower per decode step
    here (two pools competing for two cores), so loading happens on the step thread too.
    """
    from text_generation_server.engines import get_engine_class

    engine_class = get_engine_class(config.deployment_framework)
    executor = worker_thread()
    try:
        return executor.submit(engine_class, config).result(), executor
    except BaseException:
        executor.shutdown(wait=False)
        raise


class ShardServicer(generate_pb2_grpc.TextGenerationServiceServicer):
    def __init__(
        self, engine: ModelEngine, config: ServerConfig, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.batches = BatchManager(
            engine,
            config.max_batch_size,
            functools.partial(distributed.end_shard, config.rank) if config.world_size > 1 else None,
        )
        self.executor = executor or worker_thread()

    async def _run(
        self,
        context: grpc.aio.ServicerContext,
        fn: Callable[..., T],
        *args: Any,
        then_run_ahead: bool = False,
    ) -> T:
        """Run `fn` on the worker thread; exceptions end the call with their status code.
        `then_run_ahead`: once `fn` returns, the worker goes on with the next decode step of the
        cached batches (BatchManager.run_ahead) while the answer is sent."""
        loop = asyncio.get_running_loop()
        job = (
            functools.partial(self._then_run_ahead, fn, *args)
            if then_run_ahead
            else functools.partial(fn, *args)
        )
        try:
            return await loop.run_in_executor(self.executor, job)
        except Exception as exc:  # every failure must become a status code
            await self._abort(context, exc)

    def _then_run_ahead(self, fn: Callable[..., T], *args: Any) -> T:
        result = fn(*args)
        with contextlib.suppress(RuntimeError):  # the executor is shutting down
            self.executor.submit(self.batches.run_ahead)
        return result

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        if isinstance(exc, ShardError):
            await context.abort(STATUS_OF_ERROR.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        if is_out_of_memory(exc):
            logger.error("out of memory: %s", exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}")
        logger.exception("unexpected error in shard call")
        await context.abort(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    async def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: Any
    ) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=self.config.shard_urls())

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any) -> pb.ModelInfoResponse:
        return convert.model_info_to_pb(self.engine.info)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        return pb.HealthResponse()

    async def ClearCache(self, request: pb.ClearCacheRequest, context: Any) -> pb.ClearCacheResponse:
        await self._run(context, self.batches.clear)
        return pb.ClearCacheResponse()

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        requests = [convert.request_from_pb(r) for r in request.batch.requests]
        to_prune = convert.cached_batches_from_pb(request.to_prune)
        output = await self._run(
            context,
            self.batches.prefill,
            request.batch.id,
            requests,
            to_prune,
            request.token_budget,
            then_run_ahead=self.config.run_ahead,
        )
        return pb.PrefillResponse(
            result=convert.result_to_pb(output),
            input_tokens=convert.input_tokens_to_pb(output.input_tokens),
        )

    async def NextToken(self, request: pb.NextTokenRequest, context: Any) -> pb.NextTokenResponse:
        refs = convert.cached_batches_from_pb(request.batches)
        join = convert.new_batch_from_pb(request.join) if request.HasField("join") else None
        output = await self._run(
            context,
            self.batches.next_token,
            refs,
            request.token_budget,
            join,
            max(1, request.steps),
            request.call,
            then_run_ahead=self.config.run_ahead,
        )
        if output is None:
            return pb.NextTokenResponse()
        return pb.NextTokenResponse(
            result=convert.result_to_pb(output),
            input_tokens=convert.input_tokens_to_pb(output.input_tokens),
        )

    async def NextTokens(
        self, requests: AsyncIterator[pb.NextTokenRequest], context: Any
    ) -> AsyncIterator[pb.NextTokenResponse]:
        """The router's decode steps over one stream: each answered as NextToken answers it; a
        failure ends the stream with its status."""
        async for request in requests:
            yield await self.NextToken(request, context)

    async def EndSteps(self, request: pb.EndStepsRequest, context: Any) -> pb.EndStepsResponse:
        """End the named decode call after its step in progress (the worker reads it between
        steps). The ranks of a sharded model would stop at different steps: they ignore it."""
        if self.config.world_size == 1:
            self.batches.end_steps(request.call)
        return pb.EndStepsResponse()

    async def PrefixLookup(self, request: pb.PrefixLookupRequest, context: Any) -> pb.PrefixLookupResponse:
        """Load the soft prompt (or adapter) into the engine's cache and answer its length.
        Loads run on a thread of their own: the worker thread keeps stepping meanwhile."""
        adapters = self.engine.adapters
        if adapters is None:  # an engine that takes no adapters: every id is unknown
            if request.adapter_id:
                await self._abort(context, PrefixNotFoundError(request.adapter_id, "adapter"))
            await self._abort(context, PrefixNotFoundError(request.prefix_id))
        assert adapters is not None
        load = functools.partial(adapters.lookup, request.prefix_id, request.adapter_id)
        return await self._loaded(context, adapters, load)

    async def _loaded(
        self, context: Any, adapters: AdapterSet, load: Callable[[], int]
    ) -> pb.PrefixLookupResponse:
        """Run `load` (an adapter's load, answering its virtual tokens) on a thread of its own;
        the length, with the caches as it left them."""
        try:
            length = await asyncio.get_running_loop().run_in_executor(None, load)
        except Exception as exc:  # every failure must become a status code
            await self._abort(context, exc)
        return pb.PrefixLookupResponse(
            prefix_length=length, adapters=convert.adapter_cache_to_pb(adapters.state())
        )

    async def AddAdapter(self, request: pb.AddAdapterRequest, context: Any) -> pb.PrefixLookupResponse:
        """Serve the adapter saved at `path` as `adapter_id`, loaded now on a thread of its own."""
        adapters = self.engine.adapters
        if adapters is None:
            await self._abort(context, AdapterError("this engine applies no adapters"))
        assert adapters is not None
        add = functools.partial(adapters.add, request.adapter_id, request.path, request.replace)
        return await self._loaded(context, adapters, add)

    async def RemoveAdapter(self, request: pb.RemoveAdapterRequest, context: Any) -> pb.RemoveAdapterResponse:
        adapters = self.engine.adapters
        if adapters is None or not adapters.remove(request.adapter_id):
            await self._abort(context, PrefixNotFoundError(request.adapter_id, "added adapter"))
        return pb.RemoveAdapterResponse()

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: Any) -> pb.ListAdaptersResponse:
        """The store's adapters this engine can apply, read on a thread of its own."""
        adapters = self.engine.adapters
        if adapters is None:
            return pb.ListAdaptersResponse()
        try:
            ids, truncated = await asyncio.get_running_loop().run_in_executor(None, adapters.listed)
        except Exception as exc:  # every failure must become a status code
            await self._abort(context, exc)
        return pb.ListAdaptersResponse(adapter_ids=ids, truncated=truncated)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


async def start_server(
    engine: ModelEngine, config: ServerConfig, executor: ThreadPoolExecutor | None = None
) -> tuple[grpc.aio.Server, ShardServicer]:
    """Bind the socket and start serving (the socket appearing is the readiness signal).
    `executor`: the engine's worker thread (see load_engine); a new one when None."""
    servicer = ShardServicer(engine, config, executor)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    path = config.socket_path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket of a previous run
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    logger.info("shard %d/%d serving on unix://%s", config.rank, config.world_size, path)
    return server, servicer


async def serve(
    engine: ModelEngine, config: ServerConfig, executor: ThreadPoolExecutor, grace_s: float = 5.0
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully and remove the socket."""
    server, servicer = await start_server(engine, config, executor)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("shard %d stopping", config.rank)
        await server.stop(grace_s)
    finally:
        servicer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket_path)
