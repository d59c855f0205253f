"""The external API: fmaas.GenerationService (Generate, GenerateStream, Tokenize, ModelInfo).

Protobuf stops here: requests are validated into ValidatedRequests, queued as Entries, and the
Entries' Outputs are turned into GenerationResponses. Errors become status codes in this module
only: validation -> INVALID_ARGUMENT with TGIS's message, the concurrency limit ->
RESOURCE_EXHAUSTED "Model is overloaded", generation failures -> UNKNOWN
"Request failed during generation: ...". Admission takes one permit per input without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import grpc

from router.entry import Entry, Output
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc
from router.request_queue import RequestQueue
from router.tokenizer import TokenizerPool
from router.validation import ValidatedRequest, ValidationError, Validator
from text_generation_server.outputs import TokenInfo

logger = logging.getLogger(__name__)

OVERLOADED = "Model is overloaded"


class ConcurrencyLimiter:
    """Permits for inputs in flight; taking them never waits (TGIS's try_acquire)."""

    def __init__(self, permits: int) -> None:
        self.available = permits

    def try_acquire(self, count: int) -> bool:
        if count > self.available:
            return False
        self.available -= count
        return True

    def release(self, count: int) -> None:
        self.available += count


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        validator: Validator,
        queue: RequestQueue,
        tokenizer: TokenizerPool,
        limiter: ConcurrencyLimiter,
        *,
        seq2seq: bool,
        max_sequence_length: int,
        max_new_tokens: int,
    ) -> None:
        self.validator = validator
        self.queue = queue
        self.tokenizer = tokenizer
        self.limiter = limiter
        self.seq2seq = seq2seq
        self.max_sequence_length = max_sequence_length
        self.max_new_tokens = max_new_tokens

    # ---- Generate -------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: Any
    ) -> pb.BatchedGenerationResponse:
        received_at = time.monotonic()
        count = len(request.requests)
        if count == 0:
            return pb.BatchedGenerationResponse()
        if not self.limiter.try_acquire(count):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED)
        entries: list[Entry] = []
        try:
            validated = await self._validate(
                request, [r.text for r in request.requests], received_at, context
            )
            entries = [Entry(v, stream=False) for v in validated]
            self.queue.append(entries)
            outputs = await asyncio.gather(*(self._final_output(e) for e in entries))
        finally:
            self.limiter.release(count)
            self._abandon(entries)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            await context.abort(grpc.StatusCode.UNKNOWN, failed.error)
        return pb.BatchedGenerationResponse(
            responses=[self._unary_response(e.request, o) for e, o in zip(entries, outputs, strict=True)]
        )

    async def _final_output(self, entry: Entry) -> Output:
        output = await self._next_output(entry)
        while not output.final:
            output = await self._next_output(entry)
        return output

    async def _next_output(self, entry: Entry) -> Output:
        """The entry's next output; answers TIME_LIMIT itself when the deadline passes while the
        entry still waits in the queue."""
        deadline = entry.request.deadline
        if deadline is None or entry.started_at is not None:
            return await entry.outputs.get()
        try:
            return await asyncio.wait_for(entry.outputs.get(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if self.queue.remove(entry):
                entry.expire_in_queue()
            return await entry.outputs.get()

    def _abandon(self, entries: Sequence[Entry]) -> None:
        """The call ended (answered, failed or cancelled): unfinished entries are dropped."""
        for entry in entries:
            if not entry.finished:
                entry.cancelled = True
                self.queue.remove(entry)

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
        if not self.limiter.try_acquire(1):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED)
        entries: list[Entry] = []
        try:
            if not request.HasField("request"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing request")
            (validated,) = await self._validate(request, [request.request.text], received_at, context)
            yield pb.GenerationResponse(
                input_token_count=validated.input_length,
                text=validated.text if validated.response.input_text else "",
                seed=validated.seed,
            )
            entry = Entry(validated, stream=True)
            entries.append(entry)
            self.queue.append(entries)
            while True:
                output = await self._next_output(entry)
                if output.error is not None:
                    await context.abort(grpc.StatusCode.UNKNOWN, output.error)
                yield self._stream_message(validated, output)
                if output.final:
                    return
        finally:
            self.limiter.release(1)
            self._abandon(entries)

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

    async def _validate(
        self, request: Any, texts: Sequence[str], received_at: float, context: Any
    ) -> list[ValidatedRequest]:
        prefix_id = request.prefix_id if request.HasField("prefix_id") else ""
        if not prefix_id and request.HasField("adapter_id"):
            prefix_id = request.adapter_id
        params = request.params if request.HasField("params") else None
        try:
            return await self.validator.validate(texts, params, prefix_id, received_at)
        except ValidationError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @staticmethod
    async def _abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

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
        try:
            results = await self.tokenizer.tokenize([r.text for r in request.requests])
        except Exception as exc:
            await self._abort(context, grpc.StatusCode.UNKNOWN, str(exc))
        response = pb.BatchedTokenizeResponse()
        truncate = request.truncate_input_tokens
        for result in results:
            count = min(len(result.ids), truncate) if truncate else len(result.ids)
            item = response.responses.add(token_count=count)
            if request.return_tokens:
                item.tokens.extend(result.tokens[len(result.tokens) - count :])
            if request.return_offsets:
                for start, end in result.offsets[len(result.offsets) - count :]:
                    item.offsets.add(start=start, end=end)
        return response

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(
            model_kind=pb.ModelInfoResponse.ENCODER_DECODER
            if self.seq2seq
            else pb.ModelInfoResponse.DECODER_ONLY,
            max_sequence_length=self.max_sequence_length,
            max_new_tokens=self.max_new_tokens,
        )
