"""The HTTP port (default 3000): one FastAPI application (http_app.py) served by uvicorn in the
router's event loop.

The server adds what uvicorn leaves to its host: the port is bound before anything starts (a
busy port is a start-up error, not an exit from inside uvicorn), the router's own signal
handling stays in charge (SIGTERM drains every door, then this server stops), and two limits:

  headers   a request's line and headers must arrive within HEADER_TIMEOUT_S of its first
            byte (or of the connection, for its first request); else the connection is closed
  body      at most MAX_BODY_BYTES (413), each part within BODY_TIMEOUT_S of the previous
            one (408), answered in TGI's error shape by BodyLimits

Idle keep-alive connections close after KEEP_ALIVE_S. Every connection has Nagle's algorithm
off (`listening_socket`), so each streamed event leaves when it is written.

The health routes (HealthCheck) live here with their semantics:

  /health        TGIS's: when the last shard step succeeded, every shard's Health RPC is asked;
                 when generation health is unknown or bad, a real one-token prefill of
                 "liveness" runs (batch and request id 2^64-1, never cached), through the
                 batcher, which owns every model call. 200 with an empty
                 body when healthy; 503 {"error":"unhealthy"}; 503 {"error":"Healthcheck
                 timed-out"} after 60 s.
  /health/live   liveness: the process answers and its batching loop runs (restart if not).
  /health/ready  readiness: not draining, and the shards answered within READY_WINDOW_S (else
                 a Health RPC decides).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.core.tokenizer import TokenizerPool
from router.scheduling.batcher import Batcher
from router.scheduling.shard_client import ShardCallError, ShardClient
from text_generation_common.messages import HEALTH_CHECK_BATCH_ID, GenerationRequest

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 60.0
READY_WINDOW_S = 10.0
LIVENESS_INPUT = "liveness"
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5
MAX_BODY_BYTES = 4 * 1024 * 1024  # as gRPC's default message limit
STOP_GRACE_S = 1


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"


class HealthCheck:
    def __init__(
        self, client: ShardClient, batcher: Batcher, tokenizer: TokenizerPool, draining: Callable[[], bool]
    ) -> None:
        self.client = client
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.draining = draining

    async def healthy(self) -> bool:
        if self.batcher.generation_healthy:
            try:
                await self.client.health()
            except ShardCallError as exc:
                logger.warning("health check: %s", exc)
                return False
            return True
        return await self._liveness_prefill()

    async def _liveness_prefill(self) -> bool:
        (ids,) = await self.tokenizer.encode_batch([LIVENESS_INPUT])
        request = GenerationRequest(id=HEALTH_CHECK_BATCH_ID, input_ids=tuple(ids), max_new_tokens=1)
        return await self.batcher.probe(request)

    async def respond(self) -> HttpResponse:
        try:
            ok = await asyncio.wait_for(self.healthy(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return HttpResponse(503, b'{"error":"Healthcheck timed-out"}')
        return HttpResponse(200) if ok else HttpResponse(503, b'{"error":"unhealthy"}')

    async def live(self) -> HttpResponse:
        return (
            HttpResponse(200)
            if self.batcher.running
            else HttpResponse(503, b'{"error":"batching loop stopped"}')
        )

    async def ready(self) -> HttpResponse:
        if self.draining():
            return HttpResponse(503, b'{"error":"draining"}')
        if time.monotonic() - self.batcher.last_shard_answer <= READY_WINDOW_S:
            return HttpResponse(200)
        try:
            await asyncio.wait_for(self.client.health(), READY_WINDOW_S)
        except (ShardCallError, TimeoutError):
            return HttpResponse(503, b'{"error":"shards not answering"}')
        self.batcher.last_shard_answer = time.monotonic()
        return HttpResponse(200)


def error_body(message: str, error_type: str) -> bytes:
    """An error answer in TGI's JSON shape ({"error", "error_type"}), which HTTP clients parse."""
    return json.dumps({"error": message, "error_type": error_type}).encode()


# ---- limits ---------------------------------------------------------------------------------


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's line and headers."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class BodyLimits:
    """ASGI wrapper: a request body over MAX_BODY_BYTES gets 413, one that stalls for
    BODY_TIMEOUT_S gets 408; the application then sees the client as gone. After the body,
    the application's receive() waits as long as it likes (a stream watches for disconnects)."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(
                send, 413, f"request body larger than {self.max_bytes} bytes", "payload_too_large"
            )
            return
        state = {"received": 0, "complete": False, "answered": False}

        async def limited_receive() -> dict[str, Any]:
            if state["complete"] or state["answered"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                return await refuse(
                    408, f"request body not received within {self.timeout_s:.0f} s", "timeout"
                )
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    return await refuse(
                        413, f"request body larger than {self.max_bytes} bytes", "payload_too_large"
                    )
                state["complete"] = not message.get("more_body", False)
            return message

        async def refuse(status: int, message: str, error_type: str) -> dict[str, Any]:
            state["answered"] = True
            await _send_error(send, status, message, error_type)
            return {"type": "http.disconnect"}

        async def guarded_send(message: dict[str, Any]) -> None:
            if not state["answered"]:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not state["answered"]:
                raise  # a real fault; once refused, the application's complaint is moot


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


async def _send_error(send: Any, status: int, message: str, error_type: str) -> None:
    body = error_body(message, error_type)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- the server -----------------------------------------------------------------------------


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the router's signal handlers stay: SIGTERM drains every door first


class HttpServer:
    """uvicorn serving `app` on the router's event loop."""

    def __init__(self, app: Any) -> None:
        self.app = BodyLimits(app)
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind and start serving; OSError when the port cannot be bound."""
        sock = listening_socket(host, port)
        config = uvicorn.Config(
            self.app,
            http=_HeaderTimeoutProtocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {host}:{port} stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def listening_socket(host: str, port: int) -> socket.socket:
    """The bound, listening TCP socket of the HTTP port. Its protocol is IPPROTO_TCP, not 0 as
    socket.create_server leaves it: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says TCP. With Nagle on, a streamed response's first event waited
    behind its headers for the client's delayed ACK (~40 ms on a kept-alive connection)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock
