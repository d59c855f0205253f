"""The HTTP port (default 3000): health probes and /metrics.

A deliberately small asyncio HTTP/1.1 server: probes and Prometheus send simple GETs, each
answered and closed.

  /health        TGIS's: when the last shard step succeeded, every shard's Health RPC is asked;
                 when generation health is unknown or bad, a real one-token prefill of
                 "liveness" runs (batch and request id 2^64-1, never cached), through the
                 batcher, which owns every model call. 200 with an empty
                 body when healthy; 503 {"error":"unhealthy"}; 503 {"error":"Healthcheck
                 timed-out"} after 60 s.
  /health/live   liveness: the process answers and its batching loop runs (restart if not).
  /health/ready  readiness: not draining, and the shards answered within READY_WINDOW_S (else
                 a Health RPC decides).
  /metrics       Prometheus text format (router/metrics.py).

Anything else gets a JSON error body, {"error": ..., "error_type": ...} as TGI's REST API
answers: 404 for an unknown path, 405 for a method other than GET, 400 for a malformed line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.batcher import Batcher
from router.shard_client import ShardCallError, ShardClient
from router.tokenizer import TokenizerPool
from text_generation_common.logs import clip
from text_generation_common.messages import HEALTH_CHECK_BATCH_ID, GenerationRequest

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 60.0
READY_WINDOW_S = 10.0
LIVENESS_INPUT = "liveness"
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"


Handler = Callable[[], Awaitable[HttpResponse]]
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
MAX_ECHOED_PATH = 64


def metrics_route(exposition: Callable[[], bytes], content_type: str) -> Handler:
    async def handler() -> HttpResponse:
        return HttpResponse(200, exposition(), content_type)

    return handler


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


class HttpServer:
    def __init__(self, routes: dict[str, Handler]) -> None:
        self.routes = routes
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            response = await self._route(parts)
            head = (
                f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}\r\n"
                f"Content-Type: {response.content_type}\r\n"
                f"Content-Length: {len(response.body)}\r\n"
                + ("Allow: GET\r\n" if response.status == 405 else "")
                + "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + response.body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _route(self, parts: list[str]) -> HttpResponse:
        if len(parts) < 2:
            return _error(400, "malformed request line", "bad_request")
        method, target = parts[0], parts[1].split("?", 1)[0]
        handler = self.routes.get(target)
        if handler is None:
            return _error(404, f"no route {clip(target, MAX_ECHOED_PATH)}", "not_found")
        if method != "GET":
            message = f"{clip(method, MAX_ECHOED_PATH)} is not allowed, use GET"
            return _error(405, message, "method_not_allowed")
        return await handler()


def _error(status: int, message: str, error_type: str) -> HttpResponse:
    """An error answer in TGI's JSON shape ({"error", "error_type"}), which HTTP clients parse."""
    return HttpResponse(status, json.dumps({"error": message, "error_type": error_type}).encode())
