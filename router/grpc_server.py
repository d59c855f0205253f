"""The external API: fmaas.GenerationService (Generate, GenerateStream, Tokenize, ModelInfo).

Protobuf stops here: requests are validated into ValidatedRequests, queued as Entries, and the
Entries' Outputs are turned into GenerationResponses. Errors become status codes in this module
only (README "Errors" lists them all): validation -> INVALID_ARGUMENT with TGIS's message, the
concurrency limit -> RESOURCE_EXHAUSTED "Model is overloaded", a full tokenization lane ->
RESOURCE_EXHAUSTED "Server too busy: ...", draining -> UNAVAILABLE, generation failures ->
"Request failed during generation: ..." with the code of their Failure (UNAVAILABLE for a
shard that is gone, RESOURCE_EXHAUSTED for out of memory, INTERNAL for an engine fault).
Admission takes one permit per input without waiting. Request-level metrics and the one log
line per finished request (TGIS's) are emitted here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from router.entry import Entry, Output
from router.metrics import Metrics
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc
from router.request_queue import RequestQueue
from router.stopping import StopReason
from router.tokenizer import TokenizedText, TokenizerBusy, TokenizerError, TokenizerPool
from router.tracing import Span, Tracing, correlation_id
from router.validation import ValidatedRequest, ValidationError, Validator, tokenizer_error_message
from text_generation_common.logs import clip
from text_generation_common.messages import TokenInfo

logger = logging.getLogger(__name__)

OVERLOADED = "Model is overloaded"
DRAINING = "The server is shutting down"
LOGGED_TEXT_CHARS = 32
QUEUE_DEADLINE_POLL_S = 0.01  # how often an expired but still queued entry checks again
MAX_TOKENIZE_TEXTS = 4096  # texts in one Tokenize call (bytes are capped by gRPC's 4 MiB)


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

    kind: str  # single | batch | stream
    correlation_id: str | None
    span: Span


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        validator: Validator,
        queue: RequestQueue,
        tokenizer: TokenizerPool,
        limiter: ConcurrencyLimiter,
        metrics: Metrics,
        tracing: Tracing,
        *,
        seq2seq: bool,
        max_sequence_length: int,
        max_new_tokens: int,
    ) -> None:
        self.validator = validator
        self.queue = queue
        self.tokenizer = tokenizer
        self.limiter = limiter
        self.metrics = metrics
        self.tracing = tracing
        self.seq2seq = seq2seq
        self.max_sequence_length = max_sequence_length
        self.max_new_tokens = max_new_tokens
        self.draining = False  # set on SIGTERM: new requests are refused

    # ---- Generate -------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: Any
    ) -> pb.BatchedGenerationResponse:
        received_at = time.monotonic()
        count = len(request.requests)
        kind = "single" if count == 1 else "batch"
        self.metrics.inc("tgi_request_count", kind=kind)
        if count == 0:
            return pb.BatchedGenerationResponse()
        self.metrics.inc("tgi_request_input_count", count)
        metadata = context.invocation_metadata()
        with self.tracing.request_span("Generate", metadata) as span:
            span.set_attribute("inputs", count)
            await self._admit(context, count)
            call = CallInfo(kind, correlation_id(metadata), span)
            entries: list[Entry] = []
            try:
                validated = await self._validate(
                    request, [r.text for r in request.requests], received_at, context
                )
                entries = [Entry(v, stream=False) for v in validated]
                self.queue.append(entries)
                outputs, failed = await self._final_outputs(entries, call)
            finally:
                self.limiter.release(count)
                self._abandon(entries, call)
            if failed is not None:
                await self._fail_call(context, span, failed)
            return pb.BatchedGenerationResponse(
                responses=[self._unary_response(e.request, o) for e, o in zip(entries, outputs, strict=True)]
            )

    async def _final_outputs(
        self, entries: Sequence[Entry], call: CallInfo
    ) -> tuple[list[Output], Output | None]:
        """Every entry's final output, or (as TGIS) the first failure as soon as one happens; the
        other entries are then abandoned by the caller."""
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
                        return [], output
            return [t.result() for t in tasks], None
        finally:
            for task in tasks:
                task.cancel()

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

    def _unary_response(self, request: ValidatedRequest, output: Output) -> pb.GenerationResponse:
        text = output.text
        if request.response.input_text:
            text = request.text + ("\n\n" if self.seq2seq else "") + text
        response = pb.GenerationResponse(
            input_token_count=request.input_length,
            generated_token_count=output.generated_tokens,
            text=text,
            stop_reason=pb.StopReason.Value(output.stop_reason.name),
            stop_sequence=output.stop_sequence,
            seed=request.seed,
        )
        if request.response.generated_tokens:
            response.tokens.extend(self._token_infos(output.tokens, request))
        if request.response.input_tokens and output.input_tokens is not None:
            response.input_tokens.extend(self._token_infos(output.input_tokens, request))
        return response

    # ---- GenerateStream -------------------------------------------------------------------

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: Any
    ) -> AsyncIterator[pb.GenerationResponse]:
        received_at = time.monotonic()
        self.metrics.inc("tgi_request_count", kind="stream")
        self.metrics.inc("tgi_request_input_count")
        metadata = context.invocation_metadata()
        with self.tracing.request_span("GenerateStream", metadata) as span:
            await self._admit(context, 1)
            call = CallInfo("stream", correlation_id(metadata), span)
            entries: list[Entry] = []
            try:
                if not request.HasField("request"):
                    await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "missing request")
                (validated,) = await self._validate(request, [request.request.text], received_at, context)
                yield pb.GenerationResponse(
                    input_token_count=validated.input_length,
                    text=validated.text if validated.response.input_text else "",
                    seed=validated.seed,
                )
                entry = Entry(validated, stream=True)
                entries.append(entry)
                self.queue.append(entries)
                text_bytes, head = 0, ""
                while True:
                    output = await self._next_output(entry)
                    if output.error is not None:
                        self._finished(entry, output, call)
                        await self._fail_call(context, span, output)
                    text_bytes += len(output.text.encode())
                    head = (head + output.text)[:LOGGED_TEXT_CHARS]
                    yield self._stream_message(validated, output)
                    if output.final:
                        self._finished(entry, output, call, text=head, output_bytes=text_bytes)
                        return
            finally:
                self.limiter.release(1)
                self._abandon(entries, call)

    def _stream_message(self, request: ValidatedRequest, output: Output) -> pb.GenerationResponse:
        if output.input_tokens is not None:
            return pb.GenerationResponse(
                input_token_count=len(output.input_tokens),
                input_tokens=self._token_infos(output.input_tokens, request),
            )
        message = pb.GenerationResponse(generated_token_count=output.generated_tokens, text=output.text)
        if request.response.generated_tokens:
            message.tokens.extend(self._token_infos(output.tokens, request))
        if output.final:
            message.stop_reason = pb.StopReason.Value(output.stop_reason.name)
            message.stop_sequence = output.stop_sequence
            message.seed = request.seed
        return message

    # ---- shared ---------------------------------------------------------------------------

    async def _admit(self, context: Any, count: int) -> None:
        """Refuse the call when draining or over the concurrency limit; else take its permits."""
        if self.draining:
            self.metrics.inc("tgi_queue_rejected", reason="draining")
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, DRAINING)
        if not self.limiter.try_acquire(count):
            self.metrics.inc("tgi_queue_rejected", reason="conc_limit")
            self.metrics.inc("tgi_request_failure", err="conc_limit")
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED)

    async def _fail_call(self, context: Any, span: Span, failed: Output) -> NoReturn:
        """End the call with a request's generation failure, under its Failure's status code."""
        assert failed.error is not None
        self.metrics.inc("tgi_request_failure", err="generate")
        span.set_error(failed.error)
        await self._abort(context, grpc.StatusCode[failed.failure.value], failed.error)

    async def _validate(
        self, request: Any, texts: Sequence[str], received_at: float, context: Any
    ) -> list[ValidatedRequest]:
        prefix_id = request.prefix_id if request.HasField("prefix_id") else ""
        adapter_id = request.adapter_id if request.HasField("adapter_id") else ""
        params = request.params if request.HasField("params") else None
        try:
            return await self.validator.validate(texts, params, prefix_id, received_at, adapter_id)
        except ValidationError as exc:
            self.metrics.inc("tgi_request_failure", err="validation")
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TokenizerBusy as exc:
            self.metrics.inc("tgi_queue_rejected", reason="tokenizer_busy")
            self.metrics.inc("tgi_request_failure", err="queue_full")
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    @staticmethod
    async def _abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

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
        prefix = {"single": "Request", "stream": "Streaming response"}.get(
            call.kind, f"Sub-request {index} from batch of {count}"
        )
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
            "%s %s %s input_toks=%d request_id=%d correlation_id=%s",
            prefix,
            summary,
            fields,
            r.input_length,
            entry.id,
            clip(call.correlation_id or "-"),
        )

    def _token_infos(self, tokens: Sequence[TokenInfo], request: ValidatedRequest) -> list[pb.TokenInfo]:
        r = request.response
        infos = []
        for t in tokens:
            info = pb.TokenInfo(text=self.tokenizer.piece(t.token_id))
            if r.token_logprobs:
                info.logprob = t.logprob
            if r.token_ranks:
                info.rank = t.rank
            for top in t.top_tokens:
                info.top_tokens.add(text=self.tokenizer.piece(top.token_id), logprob=top.logprob)
            infos.append(info)
        return infos

    # ---- Tokenize and ModelInfo -----------------------------------------------------------

    async def Tokenize(self, request: pb.BatchedTokenizeRequest, context: Any) -> pb.BatchedTokenizeResponse:
        started = time.monotonic()
        self.metrics.inc("tgi_tokenize_request_count")
        self.metrics.inc("tgi_tokenize_request_input_count", len(request.requests))
        if self.draining:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, DRAINING)
        texts = [r.text for r in request.requests]
        if len(texts) > MAX_TOKENIZE_TEXTS:
            message = f"a Tokenize call may carry at most {MAX_TOKENIZE_TEXTS} texts, got {len(texts)}"
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            # The answer is built on the worker thread too: for a long text it is millions of
            # pieces and offsets, which would otherwise stall the event loop.
            response, total = await self.tokenizer.run_tokenize_job(
                texts,
                lambda: _tokenize_response(
                    self.tokenizer.tokenize_sync(
                        texts, tokens=request.return_tokens, offsets=request.return_offsets
                    ),
                    request,
                ),
            )
        except TokenizerBusy as exc:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TokenizerError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, tokenizer_error_message(exc))
        self.metrics.observe("tgi_tokenize_request_tokens", total)
        self.metrics.observe("tgi_tokenize_request_duration", time.monotonic() - started)
        return response

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(
            model_kind=pb.ModelInfoResponse.ENCODER_DECODER
            if self.seq2seq
            else pb.ModelInfoResponse.DECODER_ONLY,
            max_sequence_length=self.max_sequence_length,
            max_new_tokens=self.max_new_tokens,
        )


def _tokenize_response(
    results: Sequence[TokenizedText], request: pb.BatchedTokenizeRequest
) -> tuple[pb.BatchedTokenizeResponse, int]:
    """The Tokenize answer (left truncation to `truncate_input_tokens`) and its token total."""
    response = pb.BatchedTokenizeResponse()
    truncate = request.truncate_input_tokens
    total = 0
    for result in results:
        count = min(len(result.ids), truncate) if truncate else len(result.ids)
        total += count
        item = response.responses.add(token_count=count)
        if request.return_tokens:
            item.tokens.extend(result.tokens[len(result.tokens) - count :])
        if request.return_offsets:
            for start, end in result.offsets[len(result.offsets) - count :]:
                item.offsets.add(start=start, end=end)
    return response, total
