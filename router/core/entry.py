"""Entry: one input's life in the router, from queue to final answer.

The servicer (grpc_server.py) creates an Entry and reads Outputs from it; the batcher is the
only writer of its generation state: it feeds every token the shard returns through
`on_token`, which decodes, applies the stopping rules and emits what the client may see.

Text handling: streamed requests and requests with stop sequences decode incrementally (the
stop sequences are matched on decoded text, even in the middle of a token); other unary
requests decode all their ids once at the end (TGIS). Streams hold back text that a later
stop-sequence cut could remove: with the stop sequence omitted from the output, the longest
stop sequence's length in bytes. output_text.py owns that text.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from router.core.detokenizer import REPLACEMENT_CHAR, Detokenizer
from router.core.output_text import OutputText
from router.core.pacing import ONE_PER_TOKEN, StreamPacing
from router.core.stopping import StopReason, check_stop
from router.core.thinking import ThinkingWatch
from router.core.validation import ValidatedRequest
from text_generation_common.messages import GenerationRequest, TokenInfo


class Failure(enum.Enum):
    """Why a request failed after it was accepted; the value names its gRPC status code, one a
    client can act on: retry elsewhere (UNAVAILABLE), later (RESOURCE_EXHAUSTED), or report a
    bug (INTERNAL)."""

    SHARD_UNAVAILABLE = "UNAVAILABLE"  # a shard is gone or stopped answering
    OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"  # the shard ran out of memory for the batch
    ENGINE_FAULT = "INTERNAL"  # the engine failed the call or this request, or decoding failed


@dataclass(slots=True)
class Output:
    """What the client gets: a stream message, or (unary) the whole answer."""

    generated_tokens: int = 0
    text: str = ""  # stream: the new delta; unary: the whole generated text
    tokens: list[TokenInfo] = field(default_factory=list)  # stream: since the last message; unary: all
    input_tokens: list[TokenInfo] | None = None
    stop_reason: StopReason = StopReason.NOT_FINISHED
    stop_sequence: str = ""
    stop_token: int | None = None  # the request's own stop token id that ended it (not the model's EOS)
    error: str | None = None  # the request failed: "Request failed during generation: ..."
    cached_tokens: int = 0  # final: prompt tokens the shard found in its prefix cache
    reasoning_tokens: int = 0  # final: tokens of a reasoning model's thinking, its markers included
    failure: Failure = Failure.ENGINE_FAULT  # what kind of failure, when `error` is set

    @property
    def final(self) -> bool:
        return self.stop_reason.finished or self.error is not None


@dataclass(eq=False, slots=True)
class Entry:
    request: ValidatedRequest
    stream: bool
    # streams: after the first token, one message per `pacing.interval` tokens (pacing.py)
    pacing: StreamPacing = ONE_PER_TOKEN
    queued_at: float = field(default_factory=time.monotonic)
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    # Set by the servicer when its client went away; the batcher drops the entry.
    cancelled: bool = False
    # ---- owned by the batcher -------------------------------------------------------------
    id: int = 0  # shard request id, assigned when scheduled
    started_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated ids, EOS excluded
    tokens: list[TokenInfo] = field(default_factory=list)  # unary token details
    input_tokens: list[TokenInfo] | None = None
    stop_reason: StopReason = StopReason.NOT_FINISHED
    _text: OutputText | None = None  # decoded as tokens come: streams and stop sequences
    _due: int = 0  # streams: the generated count from which the next message may go
    _held_tokens: list[TokenInfo] = field(default_factory=list)  # streams: token details not sent yet
    _ends: Collection[int] | None = None  # the model's EOS ids and the request's stop ids, once joined
    preemptions: int = 0  # times it left the running batch for a request of a lower priority value
    thinking: ThinkingWatch | None = None  # its thinking, where the request limits it
    cached_tokens: int | None = None  # prompt tokens found in the shard's prefix cache, once known

    @property
    def finished(self) -> bool:
        return self.stop_reason.finished

    @property
    def in_tokens(self) -> int:
        """Tokens resident for this request now (input + soft prompt + generated)."""
        return self.request.input_length + self.request.prefix_length + self.generated

    @property
    def out_tokens(self) -> int:
        """Tokens this request may still generate."""
        return self.request.stopping.max_new_tokens - self.generated

    def start(self, request_id: int, detokenizer: Detokenizer, now: float) -> None:
        """Scheduled under shard request id `request_id`: first, or resumed after a preemption
        (its text, tokens and stop state go on)."""
        self.id = request_id
        if self.started_at is not None:
            return
        self.started_at = now
        if self.request.thinking is not None:
            self.thinking = ThinkingWatch(self.request.thinking)
        st = self.request.stopping
        if self.stream or st.stop_sequences:
            decoding = detokenizer.variant(self.request.response.skip_special_tokens)
            self._text = OutputText(decoding.incremental(), st, streamed=self.stream)

    @property
    def preemptible(self) -> bool:
        """It may leave the running batch and resume later from its generated ids: running, past
        its first token (its prompt's details, if asked, are out), every generated id known."""
        return (
            self.last_token_at is not None
            and not self.finished
            and not self.cancelled
            and len(self.token_ids) == self.generated < self.request.stopping.max_new_tokens
        )

    def preempt(self) -> None:
        """It leaves the running batch (the shard drops it) to wait in the queue again."""
        assert self.preemptible
        self.preemptions += 1

    def end_thinking(self, detokenizer: Detokenizer, now: float) -> bool:
        """Its thinking reached its budget: the format's closing ids are its next tokens (given
        here, as if generated); it then goes on from them (resumed). True when that finished it
        (max_new_tokens)."""
        assert self.thinking is not None and self.thinking.over
        for token_id in self.thinking.closing:
            if self.on_token(TokenInfo(token_id), (), detokenizer, now):
                return True
        return False

    def shard_request(self) -> GenerationRequest:
        """What the shard is sent to run it: the request, or (resumed: preempted, or its thinking
        ended) the request with the ids generated so far, computed after the prompt, and no
        prompt details again."""
        request = self.request.shard_request(self.id)
        if not self.generated:
            return request
        details = replace(request.details, input_tokens=False)
        return replace(request, generated_ids=tuple(self.token_ids), details=details)

    def on_cached_prompt(self, tokens: int) -> None:
        """The shard found `tokens` of the prompt (its soft prompt's first) in its prefix cache;
        the first report counts (a resumed request's own is of its generated ids too)."""
        if self.cached_tokens is None:
            r = self.request
            self.cached_tokens = max(0, min(tokens - r.prefix_length, r.input_length))

    def on_input_tokens(self, tokens: list[TokenInfo]) -> None:
        if self.stream:
            self.outputs.put_nowait(Output(input_tokens=tokens))
        else:
            self.input_tokens = tokens

    def on_token(
        self, token: TokenInfo, eos_token_ids: Collection[int], detokenizer: Detokenizer, now: float
    ) -> bool:
        """Account one generated token (`eos_token_ids`: the model's, each an EOS); returns True
        when the request is finished."""
        self.generated += 1
        want_details = self.request.response.generated_tokens
        if want_details and not self.stream:
            self.tokens.append(token)
        if self._ends is None:  # the request's own stop_token_ids end it as EOS does
            stops = self.request.sampling.stop_token_ids
            self._ends = frozenset((*eos_token_ids, *stops)) if stops else eos_token_ids
        # the model's EOS is left out of the text; a stop token id's text stays, as vLLM keeps
        # it (a special one decodes to nothing unless the request keeps special tokens)
        in_text = token.token_id not in eos_token_ids
        eos_token_ids = self._ends
        new_chars = 0
        if in_text:
            self.token_ids.append(token.token_id)
            if self._text is not None:
                new_chars = self._text.push(token.token_id)
            if self.thinking is not None:
                self.thinking.feed(self.token_ids)
        st = self.request.stopping
        reason = check_stop(
            generated=self.generated,
            token_id=token.token_id,
            eos_token_ids=eos_token_ids,
            min_new_tokens=st.min_new_tokens,
            max_new_tokens=st.max_new_tokens,
            capped=st.capped,
            deadline=self.request.deadline,
            now=now,
        )
        match = None
        if (
            not reason.finished
            and st.stop_sequences
            and self.generated >= st.min_new_tokens
            and new_chars
            and self._text is not None
        ):
            match = self._text.cut_at_stop(new_chars)
            if match is not None:
                reason = StopReason.STOP_SEQUENCE
        if want_details and self.stream:
            self._held_tokens.append(token)
        if reason.finished:
            tokens, self._held_tokens = self._held_tokens, []
            stop_token = token.token_id if reason is StopReason.EOS_TOKEN and in_text else None
            self._finish(reason, match.sequence if match else "", tokens, detokenizer, stop_token)
        elif self.stream and self.generated >= self._due and self._text is not None:
            delta = self._text.take_delta()
            if delta or self._held_tokens:
                tokens, self._held_tokens = self._held_tokens, []
                self.outputs.put_nowait(Output(self.generated, delta, tokens))
                self._due = self.generated + self.pacing.interval
        return reason.finished

    def _finish(
        self,
        reason: StopReason,
        stop_sequence: str,
        tokens: list[TokenInfo],
        detokenizer: Detokenizer,
        stop_token: int | None = None,
    ) -> None:
        self.stop_reason = reason
        if self._text is not None:
            if reason is not StopReason.STOP_SEQUENCE:
                self._text.flush()
            text = self._text.final_unsent() if self.stream else self._text.final()
        else:
            decoding = detokenizer.variant(self.request.response.skip_special_tokens)
            text = decoding.decode(self.token_ids).rstrip(REPLACEMENT_CHAR)
        # a stream's last message carries its own tokens; a unary answer all of them
        details, inputs = (tokens, None) if self.stream else (self.tokens, self.input_tokens)
        self.outputs.put_nowait(
            Output(
                self.generated,
                text,
                details,
                inputs,
                reason,
                stop_sequence,
                stop_token=stop_token,
                cached_tokens=self.cached_tokens or 0,
                reasoning_tokens=self.thinking.thought if self.thinking is not None else 0,
            )
        )

    def fail_detokenization(self, message: str) -> None:
        """Decoding this request's output failed (the batch goes on)."""
        self.stop_reason = StopReason.ERROR
        error = f"Request failed during detokenization: {message}"
        self.outputs.put_nowait(Output(self.generated, error=error, failure=Failure.ENGINE_FAULT))

    def fail(self, message: str, failure: Failure, *, request_error: bool = False) -> None:
        """Generation failed: the whole shard call (`message` = the call's error), or this
        request alone (`request_error`, the shard's message, prefixed once tokens exist)."""
        self.stop_reason = StopReason.ERROR
        if request_error and self.generated:
            message = f"Error after generating {self.generated} tokens: {message}"
        error = f"Request failed during generation: {message}"
        self.outputs.put_nowait(Output(self.generated, error=error, failure=failure))

    def time_out(self, detokenizer: Detokenizer) -> None:
        """The deadline passed while no token was due (its prompt still being computed)."""
        self._finish(StopReason.TIME_LIMIT, "", [], detokenizer)

    def cancel(self) -> None:
        """The client is gone (seen by the batcher)."""
        self.stop_reason = StopReason.CANCELLED

    def expire_in_queue(self) -> None:
        """The deadline passed before the request was scheduled: TIME_LIMIT, 0 tokens."""
        self.stop_reason = StopReason.TIME_LIMIT
        self.outputs.put_nowait(Output(stop_reason=StopReason.TIME_LIMIT))
