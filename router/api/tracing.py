"""OpenTelemetry tracing of the router's external requests (optional, the `tracing` extra).

Owns the router's TracerProvider: one SERVER span per external RPC, exported in batches over
OTLP/gRPC to `--otlp-endpoint`, parented on the W3C trace context (`traceparent`/`tracestate`)
that the client sent as gRPC metadata. `router/server.py` calls `Tracing.setup()` at startup and
`shutdown()` at exit; `router/grpc/grpc_server.py` wraps each RPC in `request_span()` and reads
`correlation_id()` for its log line.

Without an endpoint nothing of opentelemetry is imported and `request_span()` costs one attribute
lookup and a shared no-op context manager yielding a shared no-op `Span`.

NOTE(tracing): spans are not made the current OpenTelemetry context. A request block may cover an
async generator's yields (GenerateStream), and a contextvars token cannot be reset from another
context when the generator is closed elsewhere; callers hold the `Span` object instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

from text_generation_common.logs import clip

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

Metadata = Iterable[tuple[str, str | bytes]]
AttributeValue = str | bool | int | float

CORRELATION_ID_KEY = "x-correlation-id"
PRIORITY_KEY = "x-request-priority"  # any door: the requests' priority (SCHEDULING_POLICY=priority)
TRACE_CONTEXT_KEYS = ("traceparent", "tracestate")


class TracingError(Exception):
    """Tracing cannot start (a one-line message, shown at startup)."""


class Span(Protocol):
    """What request handlers may do with their request's span."""

    def set_attribute(self, key: str, value: AttributeValue) -> None: ...

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None: ...

    def set_error(self, message: str) -> None: ...


class _NoopSpan:
    __slots__ = ()

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        pass

    def set_error(self, message: str) -> None:
        pass


NOOP_SPAN: Span = _NoopSpan()
# NOTE(tracing): nullcontext is stateless, so one instance serves every disabled request.
_NOOP_CONTEXT: AbstractContextManager[Span] = contextlib.nullcontext(NOOP_SPAN)


class _OtelSpan:
    """A recording span; `set_error` wins over the exception text when both happen."""

    __slots__ = ("_span", "error_set")

    def __init__(self, span: OtelSpan) -> None:
        self._span = span
        self.error_set = False

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self._span.add_event(name, attributes=attributes)

    def set_error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))
        self.error_set = True


def _text_values(metadata: Metadata | None, keys: Iterable[str]) -> dict[str, str]:
    """The first value of each wanted metadata key, as text (gRPC keys are lower-case), clipped."""
    wanted = set(keys)
    found: dict[str, str] = {}
    for key, value in metadata or ():
        key = key.lower()
        if key in wanted and key not in found:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            found[key] = clip(text)  # they end up in log lines and span attributes
    return found


def correlation_id(metadata: Metadata | None) -> str | None:
    """The request's `x-correlation-id` metadata value, if the client sent one."""
    return _text_values(metadata, (CORRELATION_ID_KEY,)).get(CORRELATION_ID_KEY)


def priority_text(metadata: Metadata | None) -> str | None:
    """The request's `x-request-priority` metadata value (or HTTP header), if sent."""
    return _text_values(metadata, (PRIORITY_KEY,)).get(PRIORITY_KEY)


class Tracing:
    """The router's tracer, or nothing: build it with `Tracing.setup()`."""

    def __init__(
        self,
        provider: TracerProvider | None = None,
        tracer: Tracer | None = None,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        self._provider = provider
        self._tracer = tracer
        self._propagator = propagator

    @classmethod
    def setup(cls, endpoint: str | None, service_name: str) -> Tracing:
        """Disabled without an endpoint; else OTLP/gRPC export to `endpoint` (http:// plain, https:// TLS)."""
        if not endpoint:
            return cls()
        scheme = urlparse(endpoint).scheme
        if scheme not in ("http", "https"):
            raise TracingError(
                f"OTLP endpoint must be http://host:port or https://host:port, got {endpoint!r}"
            )
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise TracingError(
                f"OTLP endpoint {endpoint} is set but OpenTelemetry is not installed ({exc}); "
                "install text-generation-server[tracing]"
            ) from None
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=scheme == "http")
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, provider.get_tracer(__name__), TraceContextTextMapPropagator())

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request_span(self, name: str, metadata: Metadata | None) -> AbstractContextManager[Span]:
        """A SERVER span `name`, child of the metadata's W3C trace context; errors escaping are recorded."""
        if self._tracer is None:
            return _NOOP_CONTEXT
        return self._recording_span(self._tracer, name, metadata)

    @contextlib.contextmanager
    def _recording_span(self, tracer: Tracer, name: str, metadata: Metadata | None) -> Iterator[Span]:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        assert self._propagator is not None
        values = _text_values(metadata, (*TRACE_CONTEXT_KEYS, CORRELATION_ID_KEY))
        parent = self._propagator.extract(values)
        span = tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, record_exception=False, set_status_on_exception=False
        )
        if CORRELATION_ID_KEY in values:
            span.set_attribute("correlation_id", values[CORRELATION_ID_KEY])
        wrapper = _OtelSpan(span)
        try:
            yield wrapper
        except Exception as exc:
            span.record_exception(exc)
            if not wrapper.error_set:
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        except BaseException as exc:
            # NOTE(tracing): cancellation / generator close is the client leaving, not a server error.
            span.add_event("cancelled", {"exception.type": type(exc).__name__})
            raise
        finally:
            span.end()

    def shutdown(self) -> None:
        """Flush the queued spans and stop the exporter (blocks, at most ~30 s if the collector is down)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
