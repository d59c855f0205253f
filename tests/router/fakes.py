"""Test doubles for the router: an in-process shard that keeps batches like the real one.

FakeShard implements router.scheduling.shard_client.ShardClient without torch: a "model" that
picks each request's next token with a script function, batches cached by id, pruning by
completed ids, merging on NextToken, and a log of every call so tests can assert the protocol
the batcher speaks; a resumed request (generated_ids) goes on counting from the ids it brings.
Failures and latency can be injected. With `chunked_prefill`, it computes at most the call's
token budget of prompt tokens per step and reports the requests whose prompts are not done as
pending; `forget` makes it answer a request with nothing at all (a broken shard). A NextToken
that asks for several steps runs them as the real shard does (a request leaves once it has
max_new_tokens), each reported as `forward_ns` of forward time; with `step_latency_s` each step
after the first takes that long, and `end_steps` naming the call ends it after the step under
way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.scheduling.shard_client import ShardCallError
from text_generation_common.messages import (
    HEALTH_CHECK_BATCH_ID,
    AdapterListing,
    CachedBatchRef,
    Generation,
    GenerationRequest,
    InputTokens,
    MemoryScalingModel,
    ModelInfo,
    NewBatch,
    RequestedDetails,
    RequestError,
    StepOutput,
    TokenInfo,
    TopToken,
    WeightBudget,
)

EOS = 2
UNLIMITED = MemoryScalingModel(0.0, 0.0, 0.0, 0.0, 0.0, 2**63 - 1)

Script = Callable[[GenerationRequest, int], int]  # (request, tokens generated so far) -> next id


def counting_script(first_id: int = 600) -> Script:
    """Token ids first_id, first_id + 1, ... (never EOS)."""
    return lambda request, step: first_id + step


@dataclass
class Call:
    method: str
    batch_id: int | None = None
    request_ids: list[int] = field(default_factory=list)
    refs: list[CachedBatchRef] = field(default_factory=list)
    steps: int = 1  # NextToken: the steps asked for
    name: int = 0  # NextToken: the call's name for end_steps
    ran: int = 0  # NextToken: the steps run


@dataclass
class FakeShard:
    script: Script = field(default_factory=counting_script)
    memory: MemoryScalingModel = UNLIMITED
    seq2seq: bool = False
    max_sequence_length: int = 512
    latency_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    batches: dict[int, list[GenerationRequest]] = field(default_factory=dict)
    generated: dict[int, int] = field(default_factory=dict)
    fail_prefill: ShardCallError | None = None  # raised by the next prefill
    fail_next_token: ShardCallError | None = None  # raised by the next next_token
    request_errors: dict[int, str] = field(default_factory=dict)  # request id -> error at its next step
    chunked_prefill: bool = False
    computed: dict[int, int] = field(default_factory=dict)  # request id -> prompt tokens computed
    forget: set[int] = field(default_factory=set)  # request ids answered with nothing (and dropped)
    budgets: list[int] = field(default_factory=list)  # token_budget of every call
    forward_ns: int = 1_000_000  # reported per step
    peak_live: int = 0  # most requests cached at once, over every call
    step_latency_s: float = 0.0  # each further step of a NextToken of several steps
    ended: list[int] = field(default_factory=list)  # the calls end_steps named, in order
    in_flight: int = 0  # model calls under way (the batcher must never overlap two)
    adapters: dict[str, int] = field(default_factory=dict)  # the store: adapter id -> virtual tokens
    sent: list[GenerationRequest] = field(default_factory=list)  # every request prefilled or joined
    cached_prompt: int = 0  # prompt tokens each request finds in the prefix cache (told with its first token)
    _called: asyncio.Event = field(default_factory=asyncio.Event)

    def _record(self, call: Call) -> None:
        assert self.in_flight == 0, f"{call.method} overlaps another model call"
        self.calls.append(call)
        self._called.set()

    async def next_call(self) -> None:
        """Until the next call reaches the shard."""
        self._called.clear()
        await self._called.wait()

    async def model_info(self) -> ModelInfo:
        return ModelInfo(
            self.seq2seq,
            EOS,
            2000,
            self.max_sequence_length,
            WeightBudget(self.memory, padded=True),
            chunked_prefill=self.chunked_prefill,
        )

    def _prune(self, refs: Sequence[CachedBatchRef]) -> list[list[GenerationRequest]]:
        kept = []
        for ref in refs:
            rows = self.batches.pop(ref.batch_id)  # KeyError = the batcher referenced an unknown batch
            rows = [r for r in rows if r.id not in ref.completed_ids]
            if rows:
                kept.append((ref.batch_id, rows))
        return kept

    async def _maybe_fail(self, method: str) -> None:
        await asyncio.sleep(self.latency_s)
        attribute = f"fail_{method}"
        error = getattr(self, attribute)
        if error is not None:
            setattr(self, attribute, None)
            raise error

    def _step(self, batch_id: int, rows: list[GenerationRequest], token_budget: int) -> StepOutput:
        self.budgets.append(token_budget)
        output = StepOutput(batch_id=batch_id, forward_ns=self.forward_ns, steps=1)
        live = []
        budget = token_budget or sum(len(r.input_ids) + len(r.generated_ids) for r in rows)
        for request in rows:
            if request.id in self.forget:
                continue
            if request.id in self.request_errors:
                output.errors.append(RequestError(request.id, self.request_errors.pop(request.id)))
                continue
            done = self.computed.get(request.id, 0)
            prompt = len(request.input_ids) + len(request.generated_ids)  # resumed: computed as prompt
            if done < prompt:
                chunk = min(prompt - done, budget)
                budget -= chunk
                self.computed[request.id] = done = done + chunk
                if done < prompt:
                    output.pending.append(request.id)
                    live.append(request)
                    continue
            step = self.generated.get(request.id, len(request.generated_ids))
            if request.id not in self.generated and self.cached_prompt:
                output.cached_prompts.append((request.id, self.cached_prompt))
            self.generated[request.id] = step + 1
            token = TokenInfo(self.script(request, step), logprob=-0.5 if request.details.logprobs else 0.0)
            output.generations.append(Generation(request.id, token))
            live.append(request)
        if live:
            self.batches[batch_id] = live
        else:
            output.batch_id = None
        self.peak_live = max(self.peak_live, sum(len(rows) for rows in self.batches.values()))
        return output

    async def prefill(
        self,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        to_prune: Sequence[CachedBatchRef],
        token_budget: int = 0,
    ) -> StepOutput:
        self._record(Call("prefill", batch_id, [r.id for r in requests], list(to_prune)))
        self.sent.extend(requests)
        for batch, rows in self._prune(to_prune):
            self.batches[batch] = rows
        self.in_flight += 1
        try:
            await self._maybe_fail("prefill")
        finally:
            self.in_flight -= 1
        if batch_id == HEALTH_CHECK_BATCH_ID:  # answered, never cached
            return StepOutput([Generation(r.id, TokenInfo(600)) for r in requests])
        output = self._step(batch_id, list(requests), token_budget)
        output.input_tokens = self._input_tokens(requests)
        return output

    @staticmethod
    def _input_tokens(requests: Sequence[GenerationRequest]) -> list[InputTokens]:
        """The details a shard gives of a prompt: the first token's logprob NaN; each later token
        k at logprob -k, rank 2, behind its id + 1 (logprob -0.5 k), then ids + 2, + 3, ..."""
        return [
            InputTokens(
                r.id, tuple(FakeShard._input_token(r.details, k, t) for k, t in enumerate(r.input_ids))
            )
            for r in requests
            if r.details.input_tokens
        ]

    @staticmethod
    def _input_token(details: RequestedDetails, k: int, token: int) -> TokenInfo:
        if k == 0:
            return TokenInfo(token, logprob=math.nan if details.logprobs else 0.0)
        tops = tuple(
            TopToken(token + 1 + i, -0.5 * k * (i + 1) if details.logprobs else 0.0)
            for i in range(details.top_n_tokens)
        )
        logprob = -float(k) if details.logprobs else 0.0
        return TokenInfo(token, logprob=logprob, rank=2 if details.ranks else 0, top_tokens=tops)

    async def next_token(
        self,
        batches: Sequence[CachedBatchRef],
        token_budget: int = 0,
        join: NewBatch | None = None,
        steps: int = 1,
        call: int = 0,
    ) -> StepOutput | None:
        """`join` (the batcher's join_in_step): new rows stepped with the others at once."""
        joined = list(join.requests) if join is not None else []
        record = Call(
            "next_token", join.batch_id if join else None, [r.id for r in joined], list(batches), steps, call
        )
        self._record(record)
        self.sent.extend(joined)
        kept = self._prune(batches)
        assert not self.batches, f"stale batches left in the shard: {sorted(self.batches)}"
        self.in_flight += 1
        try:
            await self._maybe_fail("next_token")
        finally:
            self.in_flight -= 1
        if not kept and join is None:
            return None
        batch_id = kept[0][0] if kept else join.batch_id  # type: ignore[union-attr]
        output = self._step(batch_id, [r for _, rows in kept for r in rows] + joined, token_budget)
        output.input_tokens = self._input_tokens(joined)
        outputs = [output]
        self.in_flight += 1
        try:
            for _ in range(steps - 1):
                if self.step_latency_s:
                    await asyncio.sleep(self.step_latency_s)
                if output.batch_id is None or (call and call in self.ended):
                    break
                rows = [
                    r
                    for r in self.batches.pop(batch_id)
                    if self.generated.get(r.id, len(r.generated_ids)) < r.max_new_tokens
                ]
                if not rows:
                    output.batch_id = None
                    break
                output = self._step(batch_id, rows, token_budget)
                outputs.append(output)
        finally:
            self.in_flight -= 1
        record.ran = len(outputs)
        merged = StepOutput.merged(outputs)
        merged.batch_id = output.batch_id
        return merged

    async def end_steps(self, call: int) -> None:
        self.ended.append(call)

    async def prefix_lookup(self, prefix_id: str, adapter: bool = False) -> int:
        if adapter and prefix_id in self.adapters:
            return self.adapters[prefix_id]
        what = "adapter" if adapter else "prefix"
        raise ShardCallError("error", f'{what} id "{prefix_id}" not found', "NOT_FOUND")

    async def list_adapters(self) -> AdapterListing:
        return AdapterListing(tuple(sorted(self.adapters)))

    async def add_adapter(self, adapter_id: str, path: str, replace: bool = False) -> int:
        if adapter_id in self.adapters and not replace:
            message = f"The lora adapter '{adapter_id}' has already been loaded."
            raise ShardCallError("error", message, "ALREADY_EXISTS")
        if not path.startswith("/adapters/"):  # the fake host's only adapters
            raise ShardCallError("error", f'adapter id "{adapter_id} at {path}" not found', "NOT_FOUND")
        self.adapters[adapter_id] = 0
        return 0

    async def remove_adapter(self, adapter_id: str) -> None:
        if self.adapters.pop(adapter_id, None) is None:
            raise ShardCallError("error", f'added adapter id "{adapter_id}" not found', "NOT_FOUND")

    async def health(self) -> None:
        self.calls.append(Call("health"))

    async def clear_cache(self) -> None:
        self.batches.clear()
