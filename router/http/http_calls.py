"""What the HTTP doors (tgi_rest.py, openai_api.py, openai_responses.py) share: a call that ends
when its client leaves, server-sent-event answers that release what they hold however they end,
and pydantic's refusals of a body as one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from router.api.service import Call, GenerationService, RequestError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


def tenant_of(request: Request) -> str | None:
    """Who is calling, as the authentication dependency found (http_app.py); None when off."""
    return getattr(request.state, "tenant", None)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it when the HTTP client goes away first (RequestError then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise RequestError("CANCELLED", "the client disconnected", "cancelled")
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict[str, Any], *, space: bool = False) -> str:
    """One server-sent event of compact JSON: `data:{...}` (TGI's), or `data: {...}` with `space`
    (OpenAI's)."""
    return f"data:{' ' if space else ''}{json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """An SSE answer that, however it ends (finished, client gone, cancelled), closes its event
    generator (which abandons the request) and then `call` (its admission and its span)."""

    def __init__(self, events: AsyncGenerator[str, None], call: Call) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._call.close()


def refuse_body(service: GenerationService, request: Request, kind: str, name: str, message: str) -> None:
    """A generate call of `kind` (its span `name`) whose body was refused before any door could
    open it: counted and traced as one call refused at validation, as every door's refusals are."""
    with service.open_call(kind, name, list(request.headers.items()), 1, tenant_of(request)):
        service.refuse(message)


def describe_validation(exc: RequestValidationError | ValidationError) -> str:
    """pydantic's complaints about a request body, one line: `field: problem; ...`."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)
