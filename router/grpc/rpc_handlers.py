"""Registering a servicer so that a request body that does not parse is the client's error.

The generated `add_*Servicer_to_server` hands grpc.aio the message class's parser; when it
raises (a truncated or corrupted body, invalid UTF-8 in a string field) grpc.aio answers
UNKNOWN and logs a traceback. Here every method takes the raw bytes and parses them itself:
a body that does not parse gets INVALID_ARGUMENT "cannot parse <message>: <reason>" and one
log line at WARNING, before the servicer sees anything (so no metric counts it, as in TGIS).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

logger = logging.getLogger(__name__)


async def _parse(raw: bytes, cls: type[Message], method: str, context: Any) -> Message:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        peer = context.peer() if hasattr(context, "peer") else "?"
        logger.warning("%s: undecodable request of %d bytes from %s: %s", method, len(raw), peer, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse {cls.DESCRIPTOR.name}: {exc}")
        raise AssertionError("unreachable: abort raises") from exc


def _unary(impl: Callable[..., Any], cls: type[Message], method: str) -> Callable[..., Any]:
    async def handle(raw: bytes, context: Any) -> Any:
        return await impl(await _parse(raw, cls, method, context), context)

    return handle


def _server_streaming(impl: Callable[..., Any], cls: type[Message], method: str) -> Callable[..., Any]:
    async def handle(raw: bytes, context: Any) -> AsyncIterator[Any]:
        request = await _parse(raw, cls, method, context)
        # Closed with this handler (a client that leaves), so its cleanup runs at once.
        async with contextlib.aclosing(impl(request, context)) as messages:
            async for message in messages:
                yield message

    return handle


def add_servicer(servicer: object, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Serve `service`'s unary-request methods from `servicer`, parsing each body as above."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client-streaming methods are not supported here")
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        path = f"/{service.full_name}/{method.name}"
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_streaming(impl, request_cls, path),
                response_serializer=response_cls.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_cls, path),
                response_serializer=response_cls.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
