"""Router startup and shutdown: wires the components and runs them until SIGTERM/SIGINT.

Startup (TGIS order): load the tokenizer, connect to shard 0 and discover the others, clear
their caches, read ModelInfo, check that one maximal request fits the shard's memory model,
then start the batching loop, the gRPC server (TLS when configured; grpc.health.v1 and
reflection v1 + v1alpha beside fmaas.GenerationService) and the HTTP server. A failure at any
step ends the process with a one-line reason.

Shutdown (drain): health turns NOT_SERVING, new requests get UNAVAILABLE, requests in flight
get up to DRAIN_TIMEOUT_SECS to finish, then the servers close and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.api.auth import Authenticator
from router.api.service import ConcurrencyLimiter, GenerationService
from router.api.tls import TlsConfigError, server_credentials
from router.api.tracing import Tracing, TracingError
from router.config import RouterConfig
from router.core.call_ends import CallEnds
from router.core.capacity import CapacityError, capacity_for
from router.core.detokenizer import Detokenizer
from router.core.metrics import CONTENT_TYPE, Metrics
from router.core.pacing import CPU_HIGH, IdleTimingSelector, StreamPacing, shares_cpus
from router.core.thinking import ThinkingMarkers
from router.core.tokenizer import TokenizerPool, load_tokenizer
from router.core.validation import PrefixLengths, Validator
from router.grpc.grpc_server import GenerationServicer
from router.grpc.reflection import enable_server_reflection
from router.grpc.rpc_handlers import add_servicer
from router.http.adapter_admin import AdapterAdmin
from router.http.anthropic_messages import MessagesApi
from router.http.chat_template import load_chat_template
from router.http.http_app import build_app
from router.http.http_server import HealthCheck, HttpServer
from router.http.openai_api import OpenAIApi
from router.http.openai_responses import ResponsesApi
from router.http.reasoning import reasoning_format
from router.http.responses_store import ResponseStore
from router.http.tgi_rest import TgiRest, info_fields
from router.http.tool_parsers import parser_named
from router.pb import generation_pb2
from router.scheduling.batcher import Batcher
from router.scheduling.request_queue import RequestQueue
from router.scheduling.shard_client import GrpcShardClient, ShardCallError
from text_generation_common.guided import grammars_of
from text_generation_common.heap import freeze_loaded_heap
from text_generation_common.messages import KvBlocks, ModelInfo

logger = logging.getLogger(__name__)

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
SERVICE_NAME = SERVICE.full_name
PUBLISHED_API_FILE = "generation.proto"  # the API's file name as TGIS clients know it
DRAIN_POLL_S = 0.05
SERVER_STOP_GRACE_S = 1.0


class StartupError(Exception):
    """The router cannot start; the message is the one-line reason."""


def _thinking_markers(parser: str | None, pool: TokenizerPool, seq2seq: bool) -> ThinkingMarkers | None:
    """The served reasoning format's markers as token ids, where a thinking budget can be held:
    a REASONING_PARSER, and a decoder-only model (the request goes on from the closing ids)."""
    fmt = reasoning_format(parser)
    if fmt is None or seq2seq:
        return None
    return ThinkingMarkers.of(
        fmt.opened_by_prompt, fmt.starts, fmt.ends, lambda texts: pool.encode_batch_sync(texts, special=False)
    )


def package_version() -> str:
    try:
        return importlib.metadata.version("text-generation-server")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def model_name(config: RouterConfig) -> str:
    """The model's name in the HTTP APIs: MODEL_NAME, else the tokenizer directory's name."""
    return config.model_name or os.path.basename(os.path.normpath(config.tokenizer_path))


def check_model(info: ModelInfo, config: RouterConfig) -> None:
    if config.max_sequence_length > info.max_sequence_length:
        raise StartupError(
            f"max_sequence_length {config.max_sequence_length} is above the shard's "
            f"{info.max_sequence_length}: start both with the same value"
        )


async def _connect(config: RouterConfig) -> tuple[GrpcShardClient, ModelInfo]:
    try:
        client = await GrpcShardClient.connect(config.master_shard_uds_path)
        await client.clear_cache()
        return client, await client.model_info()
    except ShardCallError as exc:
        raise StartupError(f"cannot reach the shards at {config.master_shard_uds_path}: {exc}") from exc
    except ValueError as exc:  # a ModelInfo this router cannot read (convert.capacity_from_pb)
        raise StartupError(str(exc)) from exc


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status)


async def _drain(service: GenerationService, limiter: ConcurrencyLimiter, timeout_s: float) -> None:
    """Refuse new requests on every door and wait for the ones in flight (at most `timeout_s`)."""
    service.draining = True
    started = time.monotonic()
    logger.info("draining: %d request(s) in flight, up to %.0f s", limiter.in_use, timeout_s)
    while limiter.in_use and time.monotonic() - started < timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    if limiter.in_use:
        logger.warning("drain timeout: %d request(s) still in flight are cut off", limiter.in_use)
    else:
        logger.info("drained in %.2f s", time.monotonic() - started)


@dataclass(slots=True)
class Router:
    """The router's components, wired and not yet serving (built by `build`)."""

    config: RouterConfig
    info: ModelInfo
    client: GrpcShardClient
    pool: TokenizerPool
    tracing: Tracing
    batcher: Batcher
    service: GenerationService
    limiter: ConcurrencyLimiter
    grpc_server: grpc.aio.Server
    grpc_address: str
    secure: bool
    health_servicer: health.aio.HealthServicer
    http_server: HttpServer

    async def close(self) -> None:
        self.pool.close()
        await self.client.close()
        self.tracing.shutdown()


async def build(config: RouterConfig, loop_idle_s: Callable[[], float] | None = None) -> Router:
    """Load the tokenizer, connect to the shards, check the model and wire every component;
    binds the gRPC port (not started). StartupError at the first problem. `loop_idle_s`: the
    event loop's idle seconds so far (IdleTimingSelector), which adaptive stream pacing reads."""
    try:
        tokenizer = load_tokenizer(config.tokenizer_path)
        credentials = server_credentials(
            config.tls_cert_path, config.tls_key_path, config.tls_client_ca_cert_path
        )
        tracing = Tracing.setup(config.otlp_endpoint, config.otlp_service_name)
        auth = Authenticator(config.auth)
    except (TlsConfigError, TracingError, ValueError) as exc:
        raise StartupError(str(exc)) from exc
    except Exception as exc:
        raise StartupError(f"cannot load the tokenizer from {config.tokenizer_path}: {exc}") from exc
    client, info = await _connect(config)
    check_model(info, config)
    try:  # one request of max_sequence_length tokens must fit (TGIS refuses to start otherwise)
        capacity = capacity_for(info, config.max_prefill_padding)
        capacity.check_fits_alone(config.max_sequence_length)
    except CapacityError as exc:
        raise StartupError(str(exc)) from exc

    metrics = Metrics(
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        max_batch_size=config.max_batch_size,
    )
    pool = TokenizerPool(tokenizer, config.tokenization_workers)
    detokenizer = Detokenizer(
        tokenizer, skip_special_tokens=not config.output_special_tokens, seq2seq=info.seq2seq
    )
    detokenizer.variant(config.output_special_tokens)  # the OpenAI door's other rule, built now
    queue = RequestQueue(
        capacity,
        config.max_batch_size,
        metrics,
        max_prefill_tokens=config.max_batch_prefill_tokens,
        chunked_prefill=info.chunked_prefill,
        by_priority=config.by_priority,
    )
    cpu_s = time.process_time if shares_cpus(info.compute_cpus) else None  # the forward's CPUs are ours
    pacing = StreamPacing(config.stream_interval, config.max_stream_interval, loop_idle_s, cpu_s=cpu_s)
    batcher = Batcher(
        client,
        queue,
        detokenizer,
        metrics,
        eos_token_id=info.eos_token_id,
        extra_eos_token_ids=info.extra_eos_token_ids,
        max_waiting_tokens=config.max_waiting_tokens,
        join_in_step=info.chunked_prefill,
        eager_joins=info.eager_joins,
        pacing=pacing,
        max_decode_steps=config.max_decode_steps,
        max_decode_call_s=config.max_decode_call_ms / 1000,
        # an encoder-decoder model cannot go on from generated ids: nothing is preempted
        preemption=config.by_priority and not info.seq2seq,
    )
    client.on_adapter_state = metrics.adapter_cache
    metrics.adapters_in_use, metrics.max_loras = batcher.adapters_in_use, info.max_loras
    if isinstance(info.capacity, KvBlocks):
        metrics.cache_config(info.capacity.block_size, info.capacity.total_blocks)
    prefixes = PrefixLengths(client.prefix_lookup, metrics)
    validator = Validator(
        pool,
        prefixes,
        metrics,
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        vocab_size=info.vocab_size,
        capacity=capacity,
        grammars=grammars_of(tokenizer.to_str(), info.vocab_size, info.eos_token_id),
        call_ends=_call_ends(detokenizer, config.max_decode_steps),
        by_priority=config.by_priority,
        thinking=_thinking_markers(config.reasoning_parser, pool, info.seq2seq),
    )
    limiter = ConcurrencyLimiter(config.max_concurrent_requests)
    service = GenerationService(
        validator,
        queue,
        limiter,
        metrics,
        config.auth.tenant_max_concurrent_requests,
        tracing,
        pacing,
    )
    servicer = GenerationServicer(
        service,
        pool,
        metrics,
        auth,
        seq2seq=info.seq2seq,
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        default_include_stop_seqs=config.default_include_stop_seqs,
    )
    grpc_server = grpc.aio.server()
    add_servicer(servicer, SERVICE, grpc_server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    enable_server_reflection(
        (
            (generation_pb2.DESCRIPTOR, PUBLISHED_API_FILE),
            (health_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR.name),
        ),
        grpc_server,
    )
    address = f"{config.host}:{config.grpc_port}"
    bound = (
        grpc_server.add_secure_port(address, credentials)
        if credentials is not None
        else grpc_server.add_insecure_port(address)
    )
    if bound == 0:
        raise StartupError(f"cannot listen for gRPC on {address}")
    health_check = HealthCheck(client, batcher, pool, lambda: service.draining)  # probes via batcher
    version = package_version()
    tgi = TgiRest(
        service,
        pool,
        info=info_fields(
            model_id=model_name(config),
            dtype=info.dtype,
            max_concurrent_requests=config.max_concurrent_requests,
            max_sequence_length=config.max_sequence_length,
            max_new_tokens=config.max_new_tokens,
            max_batch_size=config.max_batch_size,
            max_waiting_tokens=config.max_waiting_tokens,
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            version=version,
            max_best_of=config.max_best_of,
        ),
        max_new_tokens=config.max_new_tokens,
    )
    empty = pool.encode_batch_sync([""])[0]  # what the tokenizer adds before any text
    openai = OpenAIApi(
        service,
        pool,
        model_name=model_name(config),
        max_sequence_length=config.max_sequence_length,
        max_new_tokens=config.max_new_tokens,
        chat_template=load_chat_template(config.tokenizer_path, pool.piece(empty[0]) if empty else ""),
        tool_parser=parser_named(config.tool_call_parser),
        reasoning=reasoning_format(config.reasoning_parser),
        sampling_defaults=dict(info.sampling_defaults),
        list_adapters=client.list_adapters,
        bos_token_id=info.bos_token_id,
    )
    # POST /v1/responses on the OpenAI door's routes; with a store, its answers kept
    store = ResponseStore(config.responses_store_size) if config.responses_store_size else None
    ResponsesApi(openai, store)
    MessagesApi(openai)  # Anthropic's POST /v1/messages, over the same chat calls
    if config.allow_runtime_adapter_loading:
        AdapterAdmin(openai, client, prefixes)
        logger.warning("adapters may be added from any directory the shards read (/v1/load_lora_adapter)")
    if info.sampling_defaults:
        logger.info(
            "OpenAI door: requests that leave them unset sample with the model's generation_config.json: %s",
            ", ".join(f"{name} {value:.6g}" for name, value in info.sampling_defaults),
        )
    app = build_app(health_check, metrics.exposition, CONTENT_TYPE, tgi, openai, auth, version=version)
    http_server = HttpServer(app)
    return Router(
        config,
        info,
        client,
        pool,
        tracing,
        batcher,
        service,
        limiter,
        grpc_server,
        address,
        credentials is not None,
        health_servicer,
        http_server,
    )


async def serve(router: Router) -> None:
    """Start the batching loop and both servers; serve until SIGTERM/SIGINT, then drain."""
    config = router.config
    await _set_health(router.health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await router.http_server.start(config.host, config.port)
    except OSError as exc:
        raise StartupError(f"cannot listen for HTTP on {config.host}:{config.port}: {exc}") from exc
    batching = asyncio.create_task(router.batcher.run(), name="batcher")
    await router.grpc_server.start()
    await _set_health(router.health_servicer, health_pb2.HealthCheckResponse.SERVING)
    _log_serving(router)
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
        await router.health_servicer.enter_graceful_shutdown()
        await _drain(router.service, router.limiter, config.drain_timeout_s)
        await router.grpc_server.stop(SERVER_STOP_GRACE_S)
        await router.http_server.stop()
    finally:
        batching.cancel()
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await batching


def _log_serving(router: Router) -> None:
    config, info = router.config, router.info
    logger.info(
        "serving %s model in %s (%s): gRPC on %s%s, HTTP on %s:%d "
        "(max batch %d, max sequence %d, max new tokens %d)",
        "encoder-decoder" if info.seq2seq else "decoder-only",
        info.dtype or "?",
        info.dtype_reason or "?",
        router.grpc_address,
        " (mTLS)" if config.tls_client_ca_cert_path else " (TLS)" if router.secure else "",
        config.host,
        config.port,
        config.max_batch_size,
        config.max_sequence_length,
        config.max_new_tokens,
    )
    pacing = router.batcher.pacing
    if pacing.adaptive:
        logger.info(
            "gRPC and OpenAI streams: one message per %d token(s), up to %d while the event loop is "
            "saturated%s (MAX_STREAM_INTERVAL)",
            pacing.least,
            pacing.most,
            f" or the router takes more than {CPU_HIGH:.0%} of a core from the CPUs the shard computes on"
            if pacing.shares_cpus
            else "",
        )
    elif pacing.least > 1:
        logger.info("gRPC and OpenAI streams: one message per %d tokens (STREAM_INTERVAL)", pacing.least)
    if pacing.shares_cpus:
        logger.info(
            "the shard computes on CPUs this router also runs on: the router's CPU time slows the forward%s",
            "" if pacing.adaptive else " (MAX_STREAM_INTERVAL would pace streams by it)",
        )
    auth = config.auth
    if auth.enabled:
        ways = [f"{len(auth.api_keys)} API key(s)"] if auth.api_keys else []
        ways += ["JWT (HS256)"] if auth.jwt_secret else []
        ways += [f"JWT ({auth.jwt_public_key_path})"] if auth.jwt_public_key_path else []
        logger.info(
            "authentication on every API call: %s; tenant claim %s, per-tenant limit %s; health, metrics %s",
            ", ".join(ways),
            auth.tenant_claim,
            auth.tenant_max_concurrent_requests or "none",
            "need a token" if auth.protect_health else "open",
        )


def _call_ends(detokenizer: Detokenizer, max_decode_steps: int) -> CallEnds | None:
    """The tokens on which a decode call of several steps ends for a request with stop sequences
    (call_ends.py); None where calls run one step, or where a token's text depends on the next."""
    if max_decode_steps <= 1:
        return None
    texts = detokenizer.token_texts()
    if texts is None:
        logger.info(
            "decode calls of several steps end on stop sequences only when they return: "
            "this tokenizer's token texts depend on the token after them"
        )
        return None
    return CallEnds(texts)


async def _build_and_serve(config: RouterConfig, loop_idle_s: Callable[[], float]) -> None:
    router = await build(config, loop_idle_s)
    freeze_loaded_heap("router built")
    try:
        await serve(router)
    finally:
        await router.close()


def run(config: RouterConfig) -> None:
    # The tokenizer's own thread pool would let one long prompt hold the threads every other
    # request's tokenization needs; the router parallelizes by request instead (tokenizer.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    selector = IdleTimingSelector()  # how busy the loop is: adaptive stream pacing reads it
    try:
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
            runner.run(_build_and_serve(config, lambda: selector.idle_s))
    except StartupError as exc:
        logger.error("%s", exc)
        sys.exit(1)
