"""What every API door shares: admission, validation, queueing, answers, request metrics and the
per-request log line.

The doors (grpc_server.py for fmaas.GenerationService, tgi_rest.py for HF TGI's REST routes,
openai_api.py for OpenAI's) translate their wire format into RequestParams and texts, and the
Outputs they get back into their answers. Every generation call of every door takes one path,
`open_call`: counted (tgi_request_count) -> one trace span -> the door's own checks (`refuse`)
-> admitted -> validated -> generated or streamed -> closed with its answer. Everything a door
can be refused with is a RequestError carrying a door-neutral code, named after the gRPC status
code it maps to: each door maps it to its own status (gRPC code, HTTP status). One
ConcurrencyLimiter bounds the inputs in flight across all doors (MAX_CONCURRENT_REQUESTS), and,
with authentication on, a per-tenant limit (TENANT_MAX_CONCURRENT_REQUESTS) keeps one tenant from
holding them all; draining refuses new requests on every door.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from router.api.tracing import PRIORITY_KEY, Metadata, Span, Tracing, correlation_id, priority_text
from router.core.entry import Entry, Output
from router.core.metrics import Metrics
from router.core.pacing import ONE_PER_TOKEN, StreamPacing
from router.core.stopping import StopReason
from router.core.tokenizer import TokenizerBusy, TokenizerError, TokenizerPool
from router.core.validation import (
    Input,
    RequestParams,
    UnknownAdapterError,
    ValidatedRequest,
    ValidationError,
    Validator,
    tokenizer_error_message,
)
from router.scheduling.request_queue import RequestQueue
from text_generation_common.logs import clip

logger = logging.getLogger(__name__)
R = TypeVar("R")

# call kinds whose stream messages may carry several tokens (STREAM_INTERVAL)
MULTI_TOKEN_STREAMS = frozenset({"stream", "openai_stream", "anthropic_stream"})

OVERLOADED = "Model is overloaded"
DRAINING = "The server is shutting down"
LOGGED_TEXT_CHARS = 32
QUEUE_DEADLINE_POLL_S = 0.01  # how often an expired but still queued entry checks again


class RequestError(Exception):
    """A refused or failed request. `code` names the gRPC status code (INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL, ...); `cause` says which step refused it
    (validation, overloaded, tokenizer_busy, draining, generation), for HTTP error types; `param`
    the request field at fault, where a door's error shape names it (OpenAI's)."""

    def __init__(self, code: str, message: str, cause: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.cause = cause
        self.param = param


class UnknownAdapter(RequestError):
    """A validation refusal because the request's adapter_id names no stored adapter."""


class ConcurrencyLimiter:
    """Permits for inputs in flight; taking them never waits (TGIS's try_acquire)."""

    def __init__(self, permits: int) -> None:
        self.permits = permits
        self.available = permits

    @property
    def in_use(self) -> int:
        return self.permits - self.available

    def try_acquire(self, count: int) -> bool:
        if count > self.available:
            return False
        self.available -= count
        return True

    def release(self, count: int) -> None:
        self.available += count


@dataclass(frozen=True, slots=True)
class CallInfo:
    """Who asked: for metrics labels and the per-request log line."""

    # metrics.KINDS: single | batch | stream (gRPC), rest | rest_stream, openai | openai_stream,
    # anthropic | anthropic_stream
    kind: str
    correlation_id: str | None
    span: Span
    tenant: str | None = None  # who, when authentication is on (auth.py)

    @property
    def streaming(self) -> bool:
        return self.kind.endswith("stream")


class Call:
    """One generation call of a door, from its arrival to its answer (GenerationService.open_call):
    counted and traced when opened, admitted once for all its inputs, validated as of its
    arrival. Close it (or leave its `with` block) once the answer is sent; a stream's answer
    ends with its last event (http_calls.EventStream closes it then)."""

    def __init__(
        self,
        service: GenerationService,
        kind: str,
        name: str,
        headers: Metadata | None,
        inputs: int,
        tenant: str | None,
    ) -> None:
        self.service = service
        self.received_at = time.monotonic()
        self.inputs = inputs
        service.metrics.inc("tgi_request_count", kind=kind)
        service.metrics.inc("tgi_request_input_count", inputs)
        self._held = contextlib.ExitStack()
        span = self._held.enter_context(service.tracing.request_span(name, headers))
        span.set_attribute("inputs", inputs)
        self.info = CallInfo(kind, correlation_id(headers), span, tenant)
        self.priority = priority_text(headers)  # x-request-priority, for requests that set none

    def admit(self) -> None:
        """Take the permits of the call's inputs until it closes (RequestError when refused)."""
        self._held.enter_context(self.service.admission(self.inputs, self.info.tenant))

    async def validate(
        self, texts: Sequence[Input], params: RequestParams | None, prefix_id: str = "", adapter_id: str = ""
    ) -> list[ValidatedRequest]:
        if self.priority is not None and (params is None or params.priority is None):
            try:
                priority = int(self.priority)
            except ValueError:
                message = f"{PRIORITY_KEY} must be an integer, not {self.priority!r}"
                raise self.service.refuse(message) from None
            params = replace(params or RequestParams(), priority=priority)
        return await self.service.validate(texts, params, self.received_at, prefix_id, adapter_id)

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._held.__exit__(*exc_info)  # the span records an exception that escapes


class GenerationService:
    def __init__(
        self,
        validator: Validator,
        queue: RequestQueue,
        limiter: ConcurrencyLimiter,
        metrics: Metrics,
        tenant_limit: int = 0,
        tracing: Tracing | None = None,
        pacing: StreamPacing = ONE_PER_TOKEN,
    ) -> None:
        self.validator = validator
        self.queue = queue
        self.limiter = limiter
        self.metrics = metrics
        self.tracing = tracing or Tracing()  # disabled unless given
        self.tenant_limit = tenant_limit  # inputs in flight per tenant; 0 = no limit
        # tokens per message (STREAM_INTERVAL, MAX_STREAM_INTERVAL) of the streams whose
        # messages may carry several (the TGI door's events carry one token each)
        self.pacing = pacing
        self.tenant_in_flight: dict[str, int] = {}
        self.draining = False  # set on SIGTERM: new requests are refused

    # ---- admission and validation ---------------------------------------------------------

    def open_call(
        self, kind: str, name: str, headers: Metadata | None, inputs: int, tenant: str | None = None
    ) -> Call:
        """A door's generation call of `inputs` requests: `kind` labels its metrics (KINDS),
        `name` its span; `headers` (gRPC metadata or HTTP headers) carry the trace context and
        the correlation id."""
        return Call(self, kind, name, headers, inputs, tenant)

    def refuse(self, message: str, code: str = "INVALID_ARGUMENT", param: str | None = None) -> RequestError:
        """A door's own refusal of a request (its wire format's rules, checked before the shared
        validation): counted as a validation failure like the shared validation's refusals."""
        self.metrics.inc("tgi_request_failure", err="validation")
        return RequestError(code, message, "validation", param)

    @contextlib.contextmanager
    def admission(self, count: int, tenant: str | None = None) -> Iterator[None]:
        """Hold `count` permits for the block; RequestError when draining or over a limit."""
        if self.draining:
            self.metrics.inc("tgi_queue_rejected", reason="draining")
            raise RequestError("UNAVAILABLE", DRAINING, "draining")
        held = self.tenant_in_flight.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and self.tenant_limit and held + count > self.tenant_limit:
            self.metrics.inc("tgi_queue_rejected", reason="tenant_limit")
            self.metrics.inc("tgi_request_failure", err="conc_limit")
            message = f"Tenant {tenant} is over its limit of {self.tenant_limit} requests in flight"
            raise RequestError("RESOURCE_EXHAUSTED", message, "overloaded")
        if not self.limiter.try_acquire(count):
            self.metrics.inc("tgi_queue_rejected", reason="conc_limit")
            self.metrics.inc("tgi_request_failure", err="conc_limit")
            raise RequestError("RESOURCE_EXHAUSTED", OVERLOADED, "overloaded")
        if tenant is not None:
            self.tenant_in_flight[tenant] = held + count
        try:
            yield
        finally:
            self.limiter.release(count)
            if tenant is not None:
                left = self.tenant_in_flight[tenant] - count
                if left:
                    self.tenant_in_flight[tenant] = left
                else:
                    del self.tenant_in_flight[tenant]

    async def validate(
        self,
        texts: Sequence[Input],
        params: RequestParams | None,
        received_at: float,
        prefix_id: str = "",
        adapter_id: str = "",
    ) -> list[ValidatedRequest]:
        try:
            return await self.validator.validate(texts, params, prefix_id, received_at, adapter_id)
        except UnknownAdapterError as exc:
            self.metrics.inc("tgi_request_failure", err="validation")
            raise UnknownAdapter("INVALID_ARGUMENT", str(exc), "validation") from exc
        except ValidationError as exc:
            raise self.refuse(str(exc)) from exc
        except TokenizerBusy as exc:
            self.metrics.inc("tgi_queue_rejected", reason="tokenizer_busy")
            self.metrics.inc("tgi_request_failure", err="queue_full")
            raise RequestError("RESOURCE_EXHAUSTED", str(exc), "tokenizer_busy") from exc

    # ---- tokenization ---------------------------------------------------------------------

    async def tokenize(
        self,
        tokenizer: TokenizerPool,
        texts: Sequence[str],
        job: Callable[[], tuple[R, int]],
        max_texts: int | None = None,
    ) -> R:
        """A tokenize call of any door (gRPC Tokenize, TGI's and vLLM's /tokenize): `job`
        tokenizes `texts` and builds the answer, returning it with its token count, on the
        tokenizer's Tokenize lane (a long text's answer is millions of objects: not built on the
        event loop). Counted in the tgi_tokenize_* metrics; RequestError when draining, when
        there are more than `max_texts`, when the lane holds too much (RESOURCE_EXHAUSTED) or
        the tokenizer fails on a text."""
        started = time.monotonic()
        self.metrics.inc("tgi_tokenize_request_count")
        self.metrics.inc("tgi_tokenize_request_input_count", len(texts))
        if self.draining:
            raise RequestError("UNAVAILABLE", DRAINING, "draining")
        if max_texts is not None and len(texts) > max_texts:
            message = f"a Tokenize call may carry at most {max_texts} texts, got {len(texts)}"
            raise RequestError("INVALID_ARGUMENT", message, "validation")
        try:
            answer, tokens = await tokenizer.run_tokenize_job(texts, job)
        except TokenizerBusy as exc:
            raise RequestError("RESOURCE_EXHAUSTED", str(exc), "tokenizer_busy") from exc
        except TokenizerError as exc:
            raise RequestError("INVALID_ARGUMENT", tokenizer_error_message(exc), "validation") from exc
        self.metrics.observe("tgi_tokenize_request_tokens", tokens)
        self.metrics.observe("tgi_tokenize_request_duration", time.monotonic() - started)
        return answer

    # ---- generation -----------------------------------------------------------------------

    async def generate(self, requests: Sequence[ValidatedRequest], call: CallInfo) -> list[Output]:
        """Every request's final output, or (as TGIS) a RequestError for the first failure as
        soon as one happens; unfinished requests are abandoned when this returns or raises."""
        entries = [Entry(v, stream=False) for v in requests]
        self.queue.append(entries)
        tasks: list[asyncio.Future[Output]] = [asyncio.ensure_future(self._final_output(e)) for e in entries]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = tasks.index(task)
                    output = task.result()
                    self._finished(entries[index], output, call, index + 1, len(entries))
                    if output.error is not None:
                        self._fail(call, output)
            return [t.result() for t in tasks]
        finally:
            for task in tasks:
                task.cancel()
            self._abandon(entries, call)

    async def stream(self, request: ValidatedRequest, call: CallInfo) -> AsyncGenerator[Output, None]:
        """The request's outputs as they come (input-token details first when asked for, then
        one per token delta, the last one final); RequestError when it fails. Close it (doors
        use contextlib.aclosing) when the client goes away: the request is then abandoned."""
        pacing = self.pacing if call.kind in MULTI_TOKEN_STREAMS else ONE_PER_TOKEN
        entry = Entry(request, stream=True, pacing=pacing)
        self.queue.append([entry])
        text_bytes, head = 0, ""
        try:
            while True:
                output = await self._next_output(entry)
                if output.error is not None:
                    self._finished(entry, output, call)
                    self._fail(call, output)
                text_bytes += len(output.text.encode())
                head = (head + output.text)[:LOGGED_TEXT_CHARS]
                if output.final:
                    self._finished(entry, output, call, text=head, output_bytes=text_bytes)
                yield output
                if output.final:
                    return
        finally:
            self._abandon([entry], call)

    def _fail(self, call: CallInfo, failed: Output) -> None:
        """Raise a request's generation failure, under its Failure's status code."""
        assert failed.error is not None
        self.metrics.inc("tgi_request_failure", err="generate")
        call.span.set_error(failed.error)
        raise RequestError(failed.failure.value, failed.error, "generation")

    async def _final_output(self, entry: Entry) -> Output:
        output = await self._next_output(entry)
        while not output.final:
            output = await self._next_output(entry)
        return output

    async def _next_output(self, entry: Entry) -> Output:
        """The entry's next output. When its deadline passes while it still waits in the queue
        behind running requests, it is answered TIME_LIMIT with 0 tokens (TGIS services its
        queue only while a step is in flight; an idle server runs the request, which then stops
        with TIME_LIMIT after one token)."""
        deadline = entry.request.deadline
        while deadline is not None and entry.started_at is None:
            wait_s = max(deadline - time.monotonic(), 0.0) or QUEUE_DEADLINE_POLL_S
            try:
                return await asyncio.wait_for(entry.outputs.get(), wait_s)
            except TimeoutError:
                if self.queue.busy and self.queue.remove(entry):
                    entry.expire_in_queue()
        return await entry.outputs.get()

    def _abandon(self, entries: Sequence[Entry], call: CallInfo) -> None:
        """The call ended (answered, failed or cancelled): unfinished entries are dropped."""
        for index, entry in enumerate(entries, 1):
            if entry.finished:
                continue
            entry.cancelled = True
            queued = self.queue.remove(entry)
            self.metrics.inc("tgi_request_cancellation", phase="queued" if queued else "running")
            self.metrics.inc("tgi_request_failure", err="cancelled")
            self._log(entry, call, StopReason.CANCELLED, entry.generated, "", index, len(entries))

    # ---- metrics and the log line ---------------------------------------------------------

    def _finished(
        self,
        entry: Entry,
        output: Output,
        call: CallInfo,
        index: int = 1,
        count: int = 1,
        *,
        text: str | None = None,
        output_bytes: int = -1,
    ) -> None:
        """Metrics and the log line of a request that got its answer (or its error). Streams pass
        the head of their text and its total size (their last output holds only a delta)."""
        now = time.monotonic()
        request = entry.request
        generated = output.generated_tokens
        if output.error is not None:
            self._log(entry, call, StopReason.ERROR, generated, output.error, index, count)
            return
        if entry.started_at is None:  # the deadline passed in the queue
            self.metrics.inc("tgi_request_failure", err="timeout")
        else:
            inference_s = now - entry.started_at
            self.metrics.inc("tgi_request_success", stop_reason=output.stop_reason.name, kind=call.kind)
            self.metrics.observe("tgi_request_generated_tokens", generated)
            adapter = request.adapter
            if adapter:
                self.metrics.inc("tgi_adapter_request_count", adapter_id=adapter)
                self.metrics.inc("tgi_adapter_generated_tokens", generated, adapter_id=adapter)
            self.metrics.observe("tgi_request_total_tokens", request.input_length + generated)
            self.metrics.observe("tgi_request_duration", now - request.received_at)
            self.metrics.observe("tgi_request_inference_duration", inference_s)
            if generated:
                self.metrics.observe("tgi_request_mean_time_per_token_duration", inference_s / generated)
        call.span.set_attribute("generated_tokens", generated)
        call.span.set_attribute("stop_reason", output.stop_reason.name)
        shown = output.text if text is None else text
        self._log(entry, call, output.stop_reason, generated, shown, index, count, output_bytes)

    def _log(
        self,
        entry: Entry,
        call: CallInfo,
        reason: StopReason,
        generated: int,
        text: str,
        index: int = 1,
        count: int = 1,
        output_bytes: int = -1,
    ) -> None:
        """TGIS's per-request line: what happened, and where the time went."""
        now = time.monotonic()
        r = entry.request
        started = entry.started_at
        times = {
            "validation_time": entry.queued_at - r.received_at,
            "queue_time": (started or now) - entry.queued_at,
            "inference_time": now - started if started else 0.0,
            "time_per_token": (now - started) / generated if started and generated else 0.0,
            "total_time": now - r.received_at,
        }
        fields = " ".join(f"{k}={v:.4f}s" for k, v in times.items())
        if count > 1:
            prefix = f"Sub-request {index} from batch of {count}"
        else:
            prefix = "Streaming response" if call.streaming else "Request"
        if reason is StopReason.ERROR:
            summary = f"failed after {generated} tokens: {text}"
        else:
            size = output_bytes if output_bytes >= 0 else len(text.encode())
            shown = text[:LOGGED_TEXT_CHARS]
            summary = f"generated {generated} tokens before {reason.name}, output {size} bytes: {shown!r}"
        level = {
            StopReason.ERROR: logging.ERROR,
            StopReason.CANCELLED: logging.WARNING,
            StopReason.TOKEN_LIMIT: logging.WARNING,
        }
        logger.log(
            level.get(reason, logging.INFO),
            "%s %s %s input_toks=%d request_id=%d correlation_id=%s%s",
            prefix,
            summary,
            fields,
            r.input_length,
            entry.id,
            clip(call.correlation_id or "-"),
            f" tenant={call.tenant}" if call.tenant is not None else "",
        )
