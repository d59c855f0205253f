"""What the engine conformance suite runs on, and the helpers its tests share.

Pointing the suite at a new engine: register it (text_generation_common/engines.py); it is
then run on ENGINE_ARCHS[name] (default: DEFAULT_ARCHS, plus SEQ2SEQ_ARCHS when its
capabilities say seq2seq), with `transformers` `generate` as the greedy oracle. An engine that
cannot be compared with transformers names its own oracle in ORACLES.

`Runner` plays the router against a BatchManager over the engine (joins, prunes, merges,
run-ahead), without gRPC; `LocalShard` is the router's ShardClient over a BatchManager, so the
real batcher, detokenizer and stop rules run on the engine's tokens.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from router.core.capacity import Capacity
from router.core.detokenizer import Detokenizer
from router.core.entry import Entry, Output
from router.core.metrics import Metrics
from router.core.validation import ResponseSpec, StoppingSpec, ValidatedRequest
from router.scheduling.batcher import Batcher
from router.scheduling.request_queue import RequestQueue
from router.scheduling.shard_client import ShardCallError
from text_generation_common.engines import ENGINES
from text_generation_common.messages import (
    AdapterListing,
    CachedBatchRef,
    GenerationRequest,
    ModelInfo,
    NewBatch,
    SamplingParams,
    StepOutput,
    TokenInfo,
)
from text_generation_server import distributed
from text_generation_server.batch_manager import BatchManager
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class
from text_generation_server.engines.base import ModelEngine
from text_generation_server.testing.fake_engine import FakeEngine

DEFAULT_ARCHS = ("llama", "gpt2")
SEQ2SEQ_ARCHS = ("t5",)
ENGINE_ARCHS: dict[str, tuple[str, ...]] = {
    "fake": ("llama",),
    "hf_accelerate": ("llama", "t5"),  # hf_transformers' steps: the loading differs
    "tgis_native": ("llama", "gpt2", "gpt_neox", "mistral", "gpt_bigcode", "granite", "qwen2"),
    "hf_optimum_ort": ("llama", "gpt_neox", "gpt_bigcode"),
}
# engine -> (label, ServerConfig overrides, archs): the engine again on another code path
ENGINE_VARIANTS: dict[str, tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...]] = {
    # decode attention on SDPA over gathered blocks instead of our CPU kernel (GQA, window, MQA)
    # and decode steps through transformers' modules instead of the C++ decoder stack
    "tgis_native": (
        ("sdpa", {"cpu_attention": "sdpa"}, ("llama", "mistral", "gpt_bigcode")),
        ("modules", {"cpu_forward": "modules"}, ("llama", "granite")),
        # steps launched before the one before is read back (a GPU's default), here on the CPU
        ("pipelined", {"pipeline_steps": True}, ("llama", "gpt2")),
    ),
}
TEST_ENGINES: dict[str, Callable[[ServerConfig], ModelEngine]] = {"fake": FakeEngine}


def without_onnx(model_dir: Path) -> Path:
    """A copy of a tiny model with no ONNX file (once per model): hf_optimum_ort exports it on
    first load, as it does for a user's model, and the copy keeps the export for the next case."""
    copy = model_dir.with_name(model_dir.name + "-onnx")
    if not (copy / "config.json").exists():
        shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    return copy


# engine -> the model directory it serves, made from a tiny model's (default: that directory)
ENGINE_MODEL_DIRS: dict[str, Callable[[Path], Path]] = {"hf_optimum_ort": without_onnx}
MAX_BATCH = 16


@dataclass(frozen=True)
class EngineCase:
    engine: str  # a registry name, or a key of TEST_ENGINES
    arch: str  # a tiny model (text_generation_server/testing/tiny_models.py)
    variant: str = ""  # a label of ENGINE_VARIANTS
    options: tuple[tuple[str, Any], ...] = ()  # its ServerConfig overrides

    @property
    def id(self) -> str:
        return f"{self.engine}[{self.variant}]-{self.arch}" if self.variant else f"{self.engine}-{self.arch}"

    def model_dir(self, tiny: Path) -> Path:
        """The directory this case serves, given the tiny model's."""
        prepare = ENGINE_MODEL_DIRS.get(self.engine)
        return prepare(tiny) if prepare else tiny

    def build(self, model_dir: Path) -> ModelEngine:
        config = ServerConfig(
            model_name=str(model_dir),
            deployment_framework=self.engine if self.engine in ENGINES else "hf_transformers",
            max_batch_size=MAX_BATCH,
            max_sequence_length=512,
            max_new_tokens=64,
            dtype="float32",  # the oracles' exactness
            kv_cache_blocks=MAX_BATCH * 512 // 16 + 1,  # tgis_native: the CPU's default size, also on a GPU
            **sharding(),
            **dict(self.options),
        )
        joined(config)
        engine_class = TEST_ENGINES.get(self.engine) or get_engine_class(self.engine)
        return engine_class(config)


# The suite runs sharded when the environment names this process's rank (tests/engines/
# test_sharded.py starts one pytest per rank over the same cases: every rank makes the same
# engine calls in the same order, as the router makes them).
SHARD_ENV = ("CONFORMANCE_RANK", "CONFORMANCE_WORLD_SIZE", "MASTER_PORT")


def joined(config: ServerConfig) -> ServerConfig:
    """`config`, with this process in its rank's group first when it is sharded."""
    if config.world_size > 1 and not torch.distributed.is_initialized():
        distributed.join(config)
    return config


def sharding() -> dict[str, Any]:
    """ServerConfig fields of this process's rank; empty when the suite runs on one shard."""
    rank, world_size, port = (os.environ.get(name) for name in SHARD_ENV)
    if not world_size:
        return {}
    return {"rank": int(rank or 0), "world_size": int(world_size), "master_port": int(port or 29500)}


def engine_cases() -> list[EngineCase]:
    cases = []
    for name, spec in ENGINES.items():
        archs = ENGINE_ARCHS.get(name, DEFAULT_ARCHS + (SEQ2SEQ_ARCHS if spec.capabilities.seq2seq else ()))
        cases += [EngineCase(name, arch) for arch in archs]
        for label, options, variant_archs in ENGINE_VARIANTS.get(name, ()):
            cases += [EngineCase(name, arch, label, tuple(options.items())) for arch in variant_archs]
    cases += [EngineCase(name, arch) for name in TEST_ENGINES for arch in ENGINE_ARCHS[name]]
    return cases


# ---- oracles ---------------------------------------------------------------------------------

Oracle = Callable[..., list[int]]  # (input ids, max new tokens, **generate kwargs) -> new ids


def transformers_oracle(model_dir: Path, device: str | None = None, dtype: str = "float32") -> Oracle:
    """Greedy `generate` of transformers on one prompt, new tokens up to and including EOS; on
    `device`, by default the one engines pick (a GPU where one is visible)."""
    import torch
    import transformers

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id

    def generate(input_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
        ids = torch.tensor([list(input_ids)], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                **kwargs,
            )
        return (out[0, 1:] if seq2seq else out[0, ids.shape[1] :]).tolist()

    return generate


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties the slow way, as a logits processor for
    transformers' `generate` (transformers has none): a token's score less `frequency` per time
    and `presence` once it appears after the first `start` ids of a row (the prompt, or a
    decoder's start token)."""

    def __init__(self, start: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            generated = input_ids[row, self.start :].tolist()
            for token in set(generated):
                scores[row, token] -= self.frequency * generated.count(token) + self.presence
        return scores


class TGIFrequencyPenalty:
    """TGI's frequency penalty the slow way, as a logits processor for transformers' `generate`:
    a token's score less `penalty` times its share of the row's ids so far (its count over
    their number, the prompt's included; the scale rounded to float32 as the server holds it)."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            ids = input_ids[row].tolist()
            scale = torch.tensor(self.penalty, dtype=torch.float32) / len(ids)
            for token in set(ids):
                scores[row, token] -= scale * ids.count(token)
        return scores


class LogitBias:
    """OpenAI's logit_bias the slow way, as a logits processor for transformers' `generate`:
    each (token, bias) pair's bias added to the token's score in every row."""

    def __init__(self, biases: Sequence[tuple[int, float]]) -> None:
        self.biases = list(biases)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token, bias in self.biases:
            scores[:, token] += bias
        return scores


def own_reference(engine: ModelEngine) -> Oracle:
    assert isinstance(engine, FakeEngine)

    def generate(input_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
        assert not kwargs, "the fake engine's reference is greedy only"
        return engine.reference(input_ids, max_new_tokens)

    return generate


# engine name -> (engine, model dir) -> oracle; transformers_oracle for every other engine
ORACLES: dict[str, Callable[[ModelEngine, Path], Oracle]] = {"fake": lambda engine, _: own_reference(engine)}


def oracle_for(case: EngineCase, engine: ModelEngine, model_dir: Path) -> Oracle:
    make = ORACLES.get(case.engine)
    if make:
        return make(engine, model_dir)
    device = getattr(engine, "device", None)  # generate on the engine's device (a GPU's own rounding)
    return transformers_oracle(model_dir, str(device) if device is not None else None)


# ---- driving the engine as the router does -----------------------------------------------------


@dataclass
class Runner:
    """Runs requests on an engine through a BatchManager like the router: batches join at given
    calls (pruning the finished requests in the same call), finished requests are pruned at the
    next call, batches merge, tokens past a request's end are dropped; optionally the shard runs
    ahead after every call, and decode calls run `steps` steps."""

    engine: ModelEngine
    run_ahead: bool | None = None  # None: where the engine pipelines steps (they need it), as the server does
    token_budget: int = 0  # prompt tokens per call (engines with chunked prefill)
    steps: int = 1  # decode steps per NextToken call
    pending_steps: int = 0  # answers that were "pending"
    tokens: dict[int, list[TokenInfo]] = field(default_factory=dict)
    input_tokens: dict[int, tuple[TokenInfo, ...]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.run_ahead is None:
            self.run_ahead = self.engine.pipelined
        self.manager = BatchManager(self.engine, MAX_BATCH)
        self.limits: dict[int, int] = {}
        self.cached: dict[int, list[int]] = {}  # batch id -> live request ids
        self.next_batch_id = 1

    def _finished(self, request_id: int) -> bool:
        got = self.tokens[request_id]
        eos = got and got[-1].token_id == self.engine.info.eos_token_id
        return len(got) >= self.limits[request_id] or bool(eos)

    def _refs(self) -> list[CachedBatchRef]:
        refs = []
        for batch_id, live in self.cached.items():
            done = tuple(r for r in live if self._finished(r))
            refs.append(CachedBatchRef(batch_id, done))
            self.cached[batch_id] = [r for r in live if r not in done]
        self.cached = {b: live for b, live in self.cached.items() if live}
        return refs

    def _absorb(self, output: StepOutput | None) -> None:
        if self.run_ahead:
            self.manager.run_ahead()
        if output is None:
            return
        for g in output.generations:
            if not self._finished(g.request_id):  # else past its end: a step run ahead of the prune
                self.tokens[g.request_id].append(g.token)
        for e in output.errors:
            self.errors[e.request_id] = e.message
        self.pending_steps += len(output.pending)
        for item in output.input_tokens:
            self.input_tokens[item.request_id] = item.tokens
        if output.batch_id is not None:
            self.cached[output.batch_id] = sorted(output.running_ids, key=list(self.tokens).index)

    def join(self, requests: Sequence[GenerationRequest]) -> None:
        for r in requests:
            self.tokens[r.id] = []
            self.limits[r.id] = r.max_new_tokens - len(r.generated_ids)
        batch_id, self.next_batch_id = self.next_batch_id, self.next_batch_id + 1
        self._absorb(self.manager.prefill(batch_id, requests, self._refs(), self.token_budget))

    def step(self) -> None:
        refs = self._refs()
        self.cached = {}
        self._absorb(self.manager.next_token(refs, self.token_budget, steps=self.steps))

    def run(self, schedule: dict[int, list[GenerationRequest]]) -> dict[int, list[int]]:
        """`schedule`: step index -> requests that join at that step. Returns each request's ids."""
        step = 0
        while step <= max(schedule) or self.cached:
            if step in schedule:
                self.join(schedule[step])
            elif self.cached:
                self.step()
            step += 1
        assert len(self.manager) == 0, "the shard must hold nothing once every request finished"
        return {rid: [t.token_id for t in got] for rid, got in self.tokens.items()}


def alone(engine: ModelEngine, request: GenerationRequest) -> list[int]:
    return Runner(engine).run({0: [request]})[request.id]


class LocalShard:
    """router.scheduling.shard_client.ShardClient over a BatchManager in this process (no gRPC);
    it runs ahead after each call where the engine pipelines steps, as the server does."""

    def __init__(self, engine: ModelEngine) -> None:
        self.manager = BatchManager(engine, MAX_BATCH)
        self.info = engine.info
        self.run_ahead = engine.pipelined
        self.steps_asked: list[int] = []  # by every NextToken

    def _answered(self, output: Any) -> Any:
        if self.run_ahead:
            self.manager.run_ahead()
        return output

    async def model_info(self) -> ModelInfo:
        return self.info

    async def prefill(
        self,
        batch_id: int,
        requests: Sequence[GenerationRequest],
        to_prune: Sequence[CachedBatchRef],
        token_budget: int = 0,
    ) -> StepOutput:
        return self._answered(self.manager.prefill(batch_id, requests, to_prune, token_budget))

    def next_token(
        self,
        batches: Sequence[CachedBatchRef],
        token_budget: int = 0,
        join: NewBatch | None = None,
        steps: int = 1,
        call: int = 0,
    ) -> Awaitable[StepOutput | None]:
        self.steps_asked.append(steps)
        future = asyncio.get_running_loop().create_future()
        future.set_result(self._answered(self.manager.next_token(batches, token_budget, join, steps, call)))
        return future

    async def end_steps(self, call: int) -> None:
        self.manager.end_steps(call)  # the call has ended: its answer was ready at once

    async def prefix_lookup(self, prefix_id: str, adapter: bool = False) -> int:
        raise ShardCallError("error", f'prefix id "{prefix_id}" not found', "NOT_FOUND")

    async def list_adapters(self) -> AdapterListing:
        return AdapterListing()

    async def add_adapter(self, adapter_id: str, path: str, replace: bool = False) -> int:
        raise ShardCallError("error", "this engine applies no adapters")

    async def remove_adapter(self, adapter_id: str) -> None:
        raise ShardCallError("error", f'added adapter id "{adapter_id}" not found', "NOT_FOUND")

    async def health(self) -> None:
        return None

    async def clear_cache(self) -> None:
        self.manager.clear()


def validated_request(
    ids: tuple[int, ...],
    max_new: int,
    min_new: int = 0,
    stop: tuple[str, ...] = (),
    sampling: SamplingParams | None = None,
    input_tokens: bool = False,
) -> ValidatedRequest:
    """A request of `ids` as validation leaves it (greedy unless `sampling`), asking for the
    generated tokens (and the input tokens with `input_tokens`)."""
    return ValidatedRequest(
        text="",
        input_ids=ids,
        input_length=len(ids),
        truncate_input_tokens=0,
        prefix_id="",
        prefix_length=0,
        sampling=sampling or SamplingParams(),
        stopping=StoppingSpec(max_new, min_new, stop),
        response=ResponseSpec(generated_tokens=True, input_tokens=input_tokens),
        received_at=time.monotonic(),
    )


async def through_batcher(
    shard: LocalShard,
    tokenizer: Any,
    requests: Sequence[tuple[ValidatedRequest, bool]],
    capacity: Capacity,
    metrics: Metrics,
    decode_steps: int = 1,
    **queue_options: Any,
) -> list[list[Output]]:
    """Every output of `requests` (request, stream) run through the router's batcher and queue
    over `shard`, in request order; decode calls ask for up to `decode_steps` steps."""
    info = await shard.model_info()
    queue = RequestQueue(capacity, 8, metrics, **queue_options)
    detokenizer = Detokenizer(tokenizer, seq2seq=info.seq2seq)
    batcher = Batcher(
        shard,
        queue,
        detokenizer,
        metrics,
        eos_token_id=info.eos_token_id,
        extra_eos_token_ids=info.extra_eos_token_ids,
        max_waiting_tokens=2,
        join_in_step=info.chunked_prefill,
        max_decode_steps=decode_steps,
        max_decode_call_s=60.0,
    )
    task = asyncio.create_task(batcher.run())
    entries = [Entry(request, stream) for request, stream in requests]
    queue.append(entries)
    results = []
    try:
        for entry in entries:
            outs: list[Output] = []
            while not outs or not outs[-1].final:
                outs.append(await asyncio.wait_for(entry.outputs.get(), 60))
            results.append(outs)
    finally:
        task.cancel()
    return results
