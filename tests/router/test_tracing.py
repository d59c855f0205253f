"""router.api.tracing: the disabled path imports nothing; the enabled path exports real OTLP/gRPC.

The enabled tests run an in-process fake collector (a grpc server implementing the OTLP
TraceService) and check what the exporter actually sent over the wire.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from router.api.tracing import NOOP_SPAN, Tracing, TracingError, correlation_id

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE = "text-generation-inference.router"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )


# --- disabled --------------------------------------------------------------------------------------


def test_disabled_setup_gives_shared_noop_span() -> None:
    for endpoint in (None, ""):
        tracing = Tracing.setup(endpoint, "x")
        assert not tracing.enabled
        with tracing.request_span("Generate", [("traceparent", "garbage")]) as span:
            span.set_attribute("k", 1)
            span.add_event("e", {"a": "b"})
            span.set_error("boom")
        assert span is NOOP_SPAN
        with pytest.raises(ValueError), tracing.request_span("Generate", None):
            raise ValueError("passes through")
        tracing.shutdown()


def test_disabled_path_imports_no_opentelemetry() -> None:
    code = (
        "import sys, router.api.tracing as t\n"
        "s = t.Tracing.setup(None, 'x')\n"
        "with s.request_span('Generate', [('x-correlation-id', 'a')]) as span:\n"
        "    span.set_attribute('k', 'v')\n"
        "assert t.correlation_id([('x-correlation-id', b'a')]) == 'a'\n"
        "s.shutdown()\n"
        "bad = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not bad, bad\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_missing_extra_raises_tracing_error() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None\n"
        "import router.api.tracing as t\n"
        "try:\n"
        "    t.Tracing.setup('http://127.0.0.1:4317', 'x')\n"
        "except t.TracingError as exc:\n"
        "    sys.stdout.write(str(exc))\n"
        "else:\n"
        "    raise SystemExit('no TracingError')\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "text-generation-server[tracing]" in result.stdout
    assert "\n" not in result.stdout


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://collector:4317"])
def test_endpoint_needs_http_or_https(endpoint: str) -> None:
    with pytest.raises(TracingError, match="http://host:port"):
        Tracing.setup(endpoint, "x")


# --- correlation id ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ([("user-agent", "grpc"), ("x-correlation-id", "abc")], "abc"),
        ([("x-correlation-id", b"abc")], "abc"),
        ([("x-correlation-id", "first"), ("x-correlation-id", "second")], "first"),
        ([("user-agent", "grpc")], None),
        ([], None),
        (None, None),
    ],
)
def test_correlation_id(metadata: Any, expected: str | None) -> None:
    assert correlation_id(metadata) == expected


# --- enabled, over a real OTLP/gRPC connection ---------------------------------------------------------


class FakeCollector:
    """An OTLP TraceService on 127.0.0.1 that keeps every ExportTraceServiceRequest it receives."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with collector.lock:
                    collector.requests.append(request)
                    collector.metadata.append(dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.lock = threading.Lock()
        self.requests: list[Any] = []
        self.metadata: list[dict[str, Any]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def spans(self) -> list[tuple[Any, Any]]:
        """(resource, span) for every exported span."""
        with self.lock:
            return [
                (rs.resource, span)
                for request in self.requests
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]


def attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in key_values}


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    pytest.importorskip("opentelemetry.sdk")
    fake = FakeCollector()
    yield fake
    fake.server.stop(grace=None)


@pytest.fixture
def tracing(collector: FakeCollector) -> Iterator[Tracing]:
    tracing = Tracing.setup(f"http://127.0.0.1:{collector.port}", SERVICE)
    yield tracing
    tracing.shutdown()


def test_span_is_exported_with_remote_parent(collector: FakeCollector, tracing: Tracing) -> None:
    from opentelemetry.proto.trace.v1 import trace_pb2

    assert tracing.enabled
    metadata = [
        ("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),
        ("x-correlation-id", "abc"),
        ("user-agent", "grpc-python"),
    ]
    with tracing.request_span("Generate", metadata) as span:
        span.set_attribute("input_tokens", 7)
        span.set_attribute("model", "tiny")
        span.add_event("queued", {"queue_size": 1})
    tracing.shutdown()
    assert not tracing.enabled

    [(resource, exported)] = collector.spans()
    assert attributes(resource.attributes)["service.name"] == SERVICE
    assert exported.name == "Generate"
    assert exported.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert exported.trace_id.hex() == TRACE_ID
    assert exported.parent_span_id.hex() == PARENT_SPAN_ID
    assert len(exported.span_id) == 8 and exported.span_id.hex() != PARENT_SPAN_ID
    assert attributes(exported.attributes) == {"correlation_id": "abc", "input_tokens": 7, "model": "tiny"}
    assert [(e.name, attributes(e.attributes)) for e in exported.events] == [("queued", {"queue_size": 1})]
    assert exported.status.code == trace_pb2.Status.STATUS_CODE_UNSET
    # The request really came from the OTLP/gRPC exporter over the wire.
    assert "OTel-OTLP-Exporter-Python" in collector.metadata[0]["user-agent"]


def test_span_without_traceparent_starts_a_new_trace(collector: FakeCollector, tracing: Tracing) -> None:
    with tracing.request_span("Tokenize", [("tracestate", "k=v")]):
        pass
    with tracing.request_span("Tokenize", None):
        pass
    tracing.shutdown()

    spans = [span for _, span in collector.spans()]
    assert len(spans) == 2
    for span in spans:
        assert span.parent_span_id == b""
        assert len(span.trace_id) == 16 and span.trace_id.hex() != TRACE_ID
    assert spans[0].trace_id != spans[1].trace_id


def test_exception_is_recorded_and_reraised(collector: FakeCollector, tracing: Tracing) -> None:
    from opentelemetry.proto.trace.v1 import trace_pb2

    with pytest.raises(RuntimeError, match="shard died"), tracing.request_span("GenerateStream", None):
        raise RuntimeError("shard died")
    with pytest.raises(KeyError), tracing.request_span("Generate", None) as span:
        span.set_error("Request failed during generation: oom")
        raise KeyError("abort")
    tracing.shutdown()

    by_name = {span.name: span for _, span in collector.spans()}
    failed = by_name["GenerateStream"]
    assert failed.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert failed.status.message == "RuntimeError: shard died"
    [event] = failed.events
    assert event.name == "exception"
    assert attributes(event.attributes)["exception.type"] == "RuntimeError"
    assert attributes(event.attributes)["exception.message"] == "shard died"
    # An explicit set_error keeps its message over the exception's.
    assert by_name["Generate"].status.message == "Request failed during generation: oom"
    assert by_name["Generate"].status.code == trace_pb2.Status.STATUS_CODE_ERROR


def test_cancellation_is_not_an_error(collector: FakeCollector, tracing: Tracing) -> None:
    from opentelemetry.proto.trace.v1 import trace_pb2

    async def handler() -> None:
        with tracing.request_span("GenerateStream", None):
            await asyncio.sleep(10)

    async def cancel_it() -> None:
        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    tracing.shutdown()

    [(_, span)] = collector.spans()
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET
    assert [(e.name, attributes(e.attributes)) for e in span.events] == [
        ("cancelled", {"exception.type": "CancelledError"})
    ]


def test_unsampled_parent_is_not_exported(collector: FakeCollector, tracing: Tracing) -> None:
    with tracing.request_span("Generate", [("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-00")]) as span:
        span.set_attribute("k", "v")
    with tracing.request_span("Generate", [("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")]):
        pass
    tracing.shutdown()

    [(_, exported)] = collector.spans()
    assert exported.trace_id.hex() == TRACE_ID
