"""Router startup and shutdown: wires the components and runs them until SIGTERM/SIGINT.

Startup (TGIS order): load the tokenizer, connect to shard 0 and discover the others, clear
their caches, read ModelInfo, check that one maximal request fits the shard's memory model,
then start the batching loop, the gRPC server and the HTTP server. A failure at any step ends
the process with a one-line reason. Shutdown: stop accepting, let in-flight calls finish
(grace period), cancel the batcher, close the shard connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import grpc

from router.batch_weights import BatchWeights
from router.batcher import Batcher
from router.config import RouterConfig
from router.detokenizer import Detokenizer
from router.grpc_server import ConcurrencyLimiter, GenerationServicer
from router.http_server import HealthCheck, HttpServer
from router.pb import generation_pb2_grpc
from router.request_queue import RequestQueue
from router.shard_client import GrpcShardClient, ShardCallError
from router.tokenizer import TokenizerPool, load_tokenizer
from router.validation import PrefixLengths, Validator
from text_generation_server.outputs import ModelInfo

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 30.0


class StartupError(Exception):
    """The router cannot start; the message is the one-line reason."""


def check_capacity(weights: BatchWeights, max_sequence_length: int) -> None:
    """One request of max_sequence_length tokens must fit (TGIS refuses to start otherwise)."""
    longest = [(max_sequence_length, 1)]
    prefill = weights.prefill_weight(longest)
    if prefill > weights.limit or weights.initial_weight(longest) > weights.limit:
        raise StartupError(
            f"The provided max_sequence length ({max_sequence_length}) results in a prefill batch weight "
            f"that exceeds the estimated capacity ({prefill} > {weights.limit})"
        )


def check_model(info: ModelInfo, config: RouterConfig) -> None:
    if config.max_sequence_length > info.max_sequence_length:
        raise StartupError(
            f"max_sequence_length {config.max_sequence_length} is above the shard's "
            f"{info.max_sequence_length}: start both with the same value"
        )


async def _serve(config: RouterConfig) -> None:
    try:
        tokenizer = load_tokenizer(config.tokenizer_path)
    except Exception as exc:
        raise StartupError(f"cannot load the tokenizer from {config.tokenizer_path}: {exc}") from exc
    try:
        client = await GrpcShardClient.connect(config.master_shard_uds_path)
        await client.clear_cache()
        info = await client.model_info()
    except ShardCallError as exc:
        raise StartupError(f"cannot reach the shards at {config.master_shard_uds_path}: {exc}") from exc
    check_model(info, config)
    weights = BatchWeights.from_model(info.memory, info.batch_padding)
    check_capacity(weights, config.max_sequence_length)

    pool = TokenizerPool(tokenizer, config.tokenization_workers)
    detokenizer = Detokenizer(
        tokenizer, skip_special_tokens=not config.output_special_tokens, seq2seq=info.seq2seq
    )
    queue = RequestQueue(weights, config.max_batch_size, config.max_prefill_padding)
    batcher = Batcher(
        client,
        queue,
        detokenizer,
        eos_token_id=info.eos_token_id,
        max_waiting_tokens=config.max_waiting_tokens,
    )
    validator = Validator(
        pool,
        PrefixLengths(client.prefix_lookup),
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        default_include_stop_seqs=config.default_include_stop_seqs,
    )
    servicer = GenerationServicer(
        validator,
        queue,
        pool,
        ConcurrencyLimiter(config.max_concurrent_requests),
        seq2seq=info.seq2seq,
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
    )
    grpc_server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, grpc_server)
    address = f"{config.host}:{config.grpc_port}"
    if grpc_server.add_insecure_port(address) == 0:
        raise StartupError(f"cannot listen for gRPC on {address}")
    health = HealthCheck(client, batcher, pool)
    http_server = HttpServer({"/health": health.respond})
    try:
        await http_server.start(config.host, config.port)
    except OSError as exc:
        raise StartupError(f"cannot listen for HTTP on {config.host}:{config.port}: {exc}") from exc

    batching = asyncio.create_task(batcher.run(), name="batcher")
    await grpc_server.start()
    logger.info(
        "serving %s model: gRPC on %s, HTTP on %s:%d (max batch %d, max sequence %d, max new tokens %d)",
        "encoder-decoder" if info.seq2seq else "decoder-only",
        address,
        config.host,
        config.port,
        config.max_batch_size,
        config.max_sequence_length,
        config.max_new_tokens,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({batching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if batching in done:
            batching.result()  # re-raise: the batching loop must never end
            raise StartupError("the batching loop ended")
        logger.info("shutting down")
        await http_server.stop()
        await grpc_server.stop(SHUTDOWN_GRACE_S)
    finally:
        batching.cancel()
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await batching
        pool.close()
        await client.close()


def run(config: RouterConfig) -> None:
    try:
        asyncio.run(_serve(config))
    except StartupError as exc:
        logger.error("%s", exc)
        sys.exit(1)
