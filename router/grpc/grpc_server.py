"""The gRPC door: fmaas.GenerationService (Generate, GenerateStream, Tokenize, ModelInfo).

Protobuf stops here and in grpc_params.py: requests become RequestParams and texts for the
shared GenerationService (service.py: admission, validation, queueing, metrics, the log line),
its Outputs become GenerationResponses, and its RequestErrors status codes (README "Errors"
lists them all): validation -> INVALID_ARGUMENT with TGIS's message, the concurrency limit ->
RESOURCE_EXHAUSTED "Model is overloaded", a full tokenization lane -> RESOURCE_EXHAUSTED
"Server too busy: ...", draining -> UNAVAILABLE, generation failures -> "Request failed during
generation: ..." with the code of their Failure (UNAVAILABLE for a shard that is gone,
RESOURCE_EXHAUSTED for out of memory, INTERNAL for an engine fault); with authentication on
(auth.py), every call of the service needs a bearer token (UNAUTHENTICATED otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import grpc

from router.api.auth import Authenticator, AuthError
from router.api.service import Call, GenerationService, RequestError
from router.core.entry import Output
from router.core.metrics import Metrics
from router.core.tokenizer import TokenizedText, TokenizerPool
from router.core.validation import ValidatedRequest
from router.grpc.grpc_params import convert_params
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc
from text_generation_common.messages import TokenInfo

MAX_TOKENIZE_TEXTS = 4096  # texts in one Tokenize call (bytes are capped by gRPC's 4 MiB)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        service: GenerationService,
        tokenizer: TokenizerPool,
        metrics: Metrics,
        auth: Authenticator,
        *,
        seq2seq: bool,
        max_sequence_length: int,
        max_new_tokens: int,
        default_include_stop_seqs: bool,
    ) -> None:
        self.service = service
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.auth = auth
        self.seq2seq = seq2seq
        self.max_sequence_length = max_sequence_length
        self.max_new_tokens = max_new_tokens
        self.default_include_stop_seqs = default_include_stop_seqs

    # ---- Generate -------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: Any
    ) -> pb.BatchedGenerationResponse:
        tenant = await self._tenant(context)
        count = len(request.requests)
        kind = "single" if count == 1 else "batch"
        metadata = context.invocation_metadata()
        with self.service.open_call(kind, "Generate", metadata, count, tenant) as call:
            if count == 0:
                return pb.BatchedGenerationResponse()
            try:
                call.admit()
                validated = await self._validate(call, request, [r.text for r in request.requests])
                outputs = await self.service.generate(validated, call.info)
            except RequestError as exc:
                await _abort(context, exc)
            return pb.BatchedGenerationResponse(
                responses=[self._unary_response(v, o) for v, o in zip(validated, outputs, strict=True)]
            )

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
        tenant = await self._tenant(context)
        with self.service.open_call(
            "stream", "GenerateStream", context.invocation_metadata(), 1, tenant
        ) as call:
            try:
                call.admit()
                if not request.HasField("request"):
                    raise self.service.refuse("missing request")
                (validated,) = await self._validate(call, request, [request.request.text])
                yield pb.GenerationResponse(
                    input_token_count=validated.input_length,
                    text=validated.text if validated.response.input_text else "",
                    seed=validated.seed,
                )
                async with contextlib.aclosing(self.service.stream(validated, call.info)) as outputs:
                    async for output in outputs:
                        yield self._stream_message(validated, output)
            except RequestError as exc:
                await _abort(context, exc)

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

    async def _tenant(self, context: Any) -> str | None:
        """The caller's tenant (None with authentication off); UNAUTHENTICATED otherwise."""
        metadata = context.invocation_metadata() or ()
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        try:
            return self.auth.tenant(authorization if isinstance(authorization, str) else None)
        except AuthError as exc:
            await _abort(context, RequestError("UNAUTHENTICATED", str(exc), "unauthenticated"))

    async def _validate(self, call: Call, request: Any, texts: Sequence[str]) -> list[ValidatedRequest]:
        params = request.params if request.HasField("params") else None
        return await call.validate(
            texts,
            convert_params(params, self.default_include_stop_seqs),
            prefix_id=request.prefix_id if request.HasField("prefix_id") else "",
            adapter_id=request.adapter_id if request.HasField("adapter_id") else "",
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
        await self._tenant(context)
        texts = [r.text for r in request.requests]
        try:
            return await self.service.tokenize(
                self.tokenizer,
                texts,
                lambda: _tokenize_response(
                    self.tokenizer.tokenize_sync(
                        texts, tokens=request.return_tokens, offsets=request.return_offsets
                    ),
                    request,
                ),
                MAX_TOKENIZE_TEXTS,
            )
        except RequestError as exc:
            await _abort(context, exc)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any) -> pb.ModelInfoResponse:
        await self._tenant(context)
        return pb.ModelInfoResponse(
            model_kind=pb.ModelInfoResponse.ENCODER_DECODER
            if self.seq2seq
            else pb.ModelInfoResponse.DECODER_ONLY,
            max_sequence_length=self.max_sequence_length,
            max_new_tokens=self.max_new_tokens,
        )


async def _abort(context: Any, error: RequestError) -> NoReturn:
    await context.abort(grpc.StatusCode[error.code], error.message)
    raise AssertionError("unreachable: abort raises")


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
