"""The `tgis_native` engine: ragged batches over a paged KV cache, with chunked prefill.

transformers' own model classes run with our attention function (attention/paged.py) and no
dense mask, on one packed batch per step, through the model runner (runner.py):

    input_ids / position_ids [1, T]: one token per decoding request (its last chosen token, at
    its next position), then each prompt chunk of this step (ragged.py plans them under the
    call's token budget); a step without prompt chunks is a decode-only step (persistent
    buffers: runner.decode); on a GPU either kind replays a CUDA graph of its token count
    (graphs.py) where its rows allow
    -> logits of the last token of every decoding request and of every prompt completed this
       step, in the chooser's row order -> the shared step post-processing (step.py)

Each request has a typed record (RequestState: its KV blocks and LoRA adapter). Its block table
(paged_kv.py) grows as its tokens are written; KVAllocations owns every table by request id
and frees it when the BatchManager reports the request gone (`release`). The decode attention
backend (attention/) is picked once, by CPU_ATTENTION and the device, and decides the cache's
layout. The KV cache holds `num_blocks` blocks of KV_BLOCK_SIZE tokens,
sized by `_num_blocks` (KV_CACHE_BLOCKS, CPU_KV_CACHE_SPACE, or MAX_BATCH_SIZE sequences of the maximum length
within free memory; on CUDA the free memory). Every call reports the cache's state (`kv_state`:
blocks used, blocks the live requests may still take at their longest, reclaimable prefix-cache
blocks, prefix-cache totals); the router admits a request only when its longest length fits
beside that (router/core/capacity.py KVBlockCapacity), so a running request never runs out of blocks.

Speculative decoding (SPECULATE, speculation/): while at most SPECULATOR_MAX_BATCH_SIZE rows
decode and the gate allows it (speculation/gate.py: a speculating step's cost, measured at
start-up by speculation_costs.py, against the tokens taken lately), each decoding request may
carry k candidate tokens after its last token and becomes 1 + k decode rows of its sequence,
one position apart (the same decode step, so the same numbers as a step without speculation:
C++ decoder stack, CUDA graphs); the chooser takes the candidates the model would have chosen
plus the token after them (step.py `choose_speculated`), and the
sequence's block table is cut back to the tokens taken (the rejected candidates' K/V are never
read: lengths bound the attention; their blocks go back to the pool). A greedy request with
several candidate chains (an MLP speculator's candidate tree) verifies the others in forks of its
sequence (shared full blocks, a copy of the partial one); it follows the chain that took the most,
whose fork, when it is not the first, the sequence adopts.

A step is launched (`_launch`: forward and choice queued on the device, the chooser's device
state moved on) then finished (`_finish`: the ids read back, recorded, answered);
`generate_token` does both. With PIPELINE_STEPS (`launch` / `finish`, driven by the
BatchManager when running ahead) the next step is launched before the last one is finished:
a decoding row whose last token is not read back yet takes it on the device
(RequestState.pending), so no host work stands between two forwards.

Decoder-only models of the families in SUPPORTED_MODEL_TYPES; others are refused at load with
one line naming the engine that serves them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from text_generation_common.defaults import DEFAULT_MAX_BATCH_PREFILL_TOKENS
from text_generation_common.logs import first_line
from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    KvBlocks,
    KvCacheState,
    ModelInfo,
    RequestError,
    StepOutput,
)
from text_generation_server import distributed
from text_generation_server.adapters import adapters_for
from text_generation_server.attention import paged, pick_backend
from text_generation_server.batches.batch import Batch
from text_generation_server.batches.ragged import Chunk, Prefilling, RaggedBatch, cached_prompts
from text_generation_server.config import ServerConfig
from text_generation_server.engines.base import Launched, ModelEngine
from text_generation_server.engines.loading import load_pretrained, model_context
from text_generation_server.engines.step import (
    Chosen,
    Verified,
    choice_scores,
    choose_speculated,
    drop_failed,
    end_choice,
    start_choice,
)
from text_generation_server.engines.tgis_native import speculation_costs
from text_generation_server.engines.tgis_native.cpu_decoder import decoder_for
from text_generation_server.engines.tgis_native.graphs import (
    Capture,
    Step,
    StepGraphs,
    buckets_up_to,
    cuda_capture,
)
from text_generation_server.engines.tgis_native.runner import ModelRunner, StepPiece
from text_generation_server.kernels.weight_layout import LinearLayout, PanelLinear, choose_linear_layouts
from text_generation_server.kv.paged_kv import (
    BlockPool,
    KVAllocations,
    PagedKVCache,
    SequenceKV,
    prefix_keys,
)
from text_generation_server.memory import cuda_available_bytes, host_available_bytes
from text_generation_server.sampling.token_details import input_token_infos
from text_generation_server.speculation import Lookahead, Speculator, Target, speculator_for
from text_generation_server.speculation.gate import SpeculationGate
from text_generation_server.utils.cpu import compute_cpus
from text_generation_server.utils.hub import resolve_model_dir
from text_generation_server.utils.transfer import to_device

if TYPE_CHECKING:
    from text_generation_server.lora import LoraWeights

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "gpt_neox", "gpt2", "gpt_bigcode", "granite", "qwen2")
# positions past MAX_SEQUENCE_LENGTH whose rotary embedding the C++ decoder stack tables too (a
# speculating step's candidates); a step past them runs the model's rotary module
ROTARY_SPARE_POSITIONS = 16


def sliding_window(hf_config: Any) -> int | None:
    """The sliding window of every attention layer (None: full attention). The paged attention
    applies one window to all layers, so a model whose `layer_types` mix windowed and full layers
    (Qwen2 with use_sliding_window below max_window_layers) is refused."""
    window: int | None = getattr(hf_config, "sliding_window", None)
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if window is None or not kinds:
        return window
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise ValueError(
        f"the tgis_native engine applies one attention window to every layer; this model's layers "
        f"are {', '.join(sorted(kinds))}: run it on hf_transformers (DEPLOYMENT_FRAMEWORK=hf_transformers)"
    )


@dataclass(slots=True, eq=False)
class RequestState:
    """What the engine keeps for a request beside its batch row (RaggedBatch.states)."""

    kv: SequenceKV  # its block table (owned by the engine's KVAllocations)
    lora: LoraWeights | None = None  # its LoRA adapter, if it has one
    lookahead: Lookahead | None = None  # candidates it asks for (speculative decoding)
    hidden: torch.Tensor | None = None  # the model's last hidden state, for a speculator that reads it
    # its last token, where a step launched ahead chose it and it is not read back yet: (the
    # step's next ids on the device, its row there)
    pending: tuple[torch.Tensor, int] | None = None


@dataclass(eq=False)
class LaunchedStep(Launched):
    """A tgis_native step queued on the device: what `finish` needs to answer it."""

    batch: RaggedBatch
    forward_ns: Callable[[], int]  # its forward's time, read once the ids are back
    pending: list[int]  # requests still prefilling after it
    completed: list[Prefilling]  # prompts it completed (their input-token details)
    requests: list[GenerationRequest] = field(default_factory=list)  # the chooser's rows
    chosen: Chosen | None = None  # None: no row chose a token (every prompt still partial)


class TgisNativeEngine(ModelEngine):
    def __init__(self, config: ServerConfig) -> None:
        paged.register()
        loaded = load_pretrained(config, attn_implementation=paged.NAME)
        model_type = getattr(loaded.hf_config, "model_type", "?")
        if loaded.seq2seq or model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the tgis_native engine serves {', '.join(SUPPORTED_MODEL_TYPES)} models; "
                f"{model_type} models run on hf_transformers (DEPLOYMENT_FRAMEWORK=hf_transformers)"
            )
        self.model = loaded.model
        self.device = loaded.device
        self.context = model_context(loaded, config)
        self.block_size = config.kv_block_size
        self.prefix_caching = config.prefix_caching
        self.window = sliding_window(loaded.hf_config)
        self.backend = pick_backend(config.cpu_attention, config.gpu_attention, self.device)
        logger.info("decode attention: %s", self.backend.name)
        self.kv = self._allocate_cache(config)
        self.allocations = KVAllocations(self.kv.pool)
        max_length = self.context.max_sequence_length
        self.runner = self._runner(self.kv, config.max_batch_size)
        self.adapters = adapters_for(config, self.model, self.device, False, max_length)
        self.runner.adapters = self.adapters
        # after the probe step above, which reads the loaded weights; sharded linears keep
        # transformers' tensor-parallel modules
        lay_out = self.device.type == "cpu" and config.world_size == 1
        if lay_out:
            choose_linear_layouts(self.model, config.max_batch_size, LinearLayout(config.linear_layout))
        # after the layouts: the C++ step takes the weights as they are laid out now
        self.runner.decoder = decoder_for(
            config.cpu_forward, self.model, self.kv, self.backend.name, config.world_size, self.window
        )
        if self.runner.decoder is not None:
            self.runner.decoder.table_rotary(max_length + ROTARY_SPARE_POSITIONS)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.gate = SpeculationGate(config.speculator_max_batch_size)  # measured below, where asked
        tokenizer = resolve_model_dir(config.model_name, config.revision) / "tokenizer.json"
        target = Target(
            vocab_size=self.context.vocab_size,
            hidden_size=int(loaded.hf_config.hidden_size),
            dtype=self.runner.dtype,
            dtype_name=loaded.dtype_name,
            device=self.device,
            max_sequence_length=self.context.max_sequence_length,
            tokenizer=tokenizer if tokenizer.is_file() else None,
        )
        found = speculator_for(config, target)
        self.speculator: Speculator | None = found[0] if found is not None else None
        self.speculate = found[1] if found is not None else 0
        if self.speculator is not None:
            if self.speculator.needs_hidden:
                self.runner.capture_hidden()
            if lay_out and self.speculator.network is not None:
                layout = LinearLayout(config.linear_layout)
                choose_linear_layouts(self.speculator.network, config.speculator_max_batch_size, layout)
            lm_head = self.model.get_output_embeddings()
            if isinstance(lm_head, PanelLinear) and lm_head.bias is None:
                self.speculator.share_lm_head(lm_head.packed_weight)
            logger.info(
                "speculative decoding: %s, up to %d candidate tokens per row, while at most %d rows decode",
                self.speculator.name,
                self.speculate,
                config.speculator_max_batch_size,
            )
        # PIPELINE_STEPS: by default where the forward runs on its own (a CUDA device) and one shard steps
        self.pipelined = (
            config.pipeline_steps
            if config.pipeline_steps is not None
            else self.device.type == "cuda" and config.world_size == 1
        )
        self.info = ModelInfo(
            seq2seq=False,
            eos_token_id=self.context.eos_token_id,
            extra_eos_token_ids=self.context.extra_eos_token_ids,
            sampling_defaults=self.context.sampling_defaults,
            bos_token_id=self.context.bos_token_id,
            max_loras=self.adapters.max_loras,
            vocab_size=self.context.vocab_size,
            max_sequence_length=self.context.max_sequence_length,
            capacity=KvBlocks(self.block_size, self.kv.pool.num_blocks),  # each step reports their use
            chunked_prefill=True,
            dtype=loaded.dtype_name,
            dtype_reason=loaded.dtype_reason,
            compute_cpus=compute_cpus(self.device),
        )
        if self.device.type == "cuda" and config.cuda_graphs:
            if config.world_size > 1:  # NOTE: collectives inside a capture are not tried yet
                logger.warning(
                    "CUDA graphs are off: %d shards run their decode steps eagerly", config.world_size
                )
            else:
                budget = config.max_batch_prefill_tokens or DEFAULT_MAX_BATCH_PREFILL_TOKENS
                self.capture_graphs(
                    config.max_batch_size, cuda_capture(self.device), config.max_batch_size + budget
                )
        if self.speculator is not None and config.speculator_batch_gate == "measured":
            self.measure_speculation(config.speculator_max_batch_size, config.max_batch_size)

    def measure_speculation(self, most_rows: int, max_batch_size: int) -> None:
        """SPECULATOR_BATCH_GATE=measured: time speculating against plain steps up to `most_rows`
        decoding rows (no more than a batch holds; speculation_costs.py) and gate speculation by it."""
        try:
            costs = speculation_costs.measure(self, min(most_rows, max_batch_size))
        except Exception as exc:  # the model or kernel says why in its first line
            raise RuntimeError(
                f"measuring what a speculating step costs failed ({first_line(exc)}); "
                "SPECULATOR_BATCH_GATE=fixed skips it"
            ) from exc
        if costs is None:
            logger.warning(
                "speculation's cost is not measured (MAX_NEW_TOKENS=%d and sequences of %d tokens "
                "leave too few steps): steps speculate while at most %d rows decode, as "
                "SPECULATOR_BATCH_GATE=fixed",
                self.context.max_new_tokens,
                self.context.max_sequence_length,
                most_rows,
            )
            return
        self.gate = SpeculationGate(most_rows, costs)
        logger.info(
            "speculating step / plain step, measured: %s; a step speculates while its rows take "
            "more tokens per step than that (SPECULATOR_BATCH_GATE=measured)",
            costs.describe(),
        )

    def _runner(self, cache: PagedKVCache, max_rows: int) -> ModelRunner:
        return ModelRunner(
            self.model,
            cache,
            self.backend,
            self.window,
            self.context.accepts_logits_to_keep,
            max_rows,
            self.context.max_sequence_length,
        )

    def capture_graphs(self, max_rows: int, capture: Capture, max_tokens: int | None = None) -> None:
        """Graphs of the steps of up to `max_tokens` tokens (default `max_rows`) of which up to
        `max_rows` sequences choose tokens (graphs.py), where the backend allows them; `capture`
        records one (CUDA, or a stand-in in tests)."""
        if not self.backend.graphable:
            logger.warning(
                "CUDA graphs are off: the %s attention backend cannot be captured", self.backend.name
            )
            return
        graphs = StepGraphs(buckets_up_to(max_rows, max_tokens), self._most_kept_rows(max_rows))
        runner = self.runner
        runner.hold(graphs.buckets[-1])

        def make_step(bucket: int) -> Step:
            runner.buffers.pad(0, bucket)
            runner.buffers.upload(bucket)
            return runner.decode_step(bucket, 0, 0, kept=graphs.kept(bucket))

        try:
            with torch.inference_mode():
                graphs.capture_all(make_step, capture)
        except Exception as exc:  # the untried model or kernel says why in its first line
            raise RuntimeError(
                f"capturing the decode steps as CUDA graphs failed ({first_line(exc)}); "
                "CUDA_GRAPHS=false runs them eagerly"
            ) from exc
        runner.graphs = graphs
        # a speculator that reads hidden states keeps steps with prompt chunks eager (runner.py)
        self.info = dataclasses.replace(self.info, eager_joins=runner.capturing)

    def _most_kept_rows(self, max_rows: int) -> int:
        """The most rows a step takes logits from: one per decoding or completed request, and
        with speculation (at most SPECULATOR_MAX_BATCH_SIZE decoding rows) each chain's
        candidates too."""
        if self.speculator is None:
            return max_rows
        speculating = min(max_rows, self.gate.most_rows)
        return max_rows + speculating * ((1 + self.speculate) * self.speculator.chains - 1)

    # ---- the KV cache --------------------------------------------------------------------------

    def _allocate_cache(self, config: ServerConfig) -> PagedKVCache:
        """Measure the KV bytes per token with a one-token step, then size and allocate the pool."""
        probe = PagedKVCache(BlockPool(1, self.block_size), self.device, self.backend.transposed_keys)
        sequence = SequenceKV(probe.pool)
        with torch.inference_mode():
            self._runner(probe, 1).forward([StepPiece(sequence, [self.context.pad_token_id or 0])], [0])
        per_token = probe.bytes() // probe.slots
        num_blocks, why = self._num_blocks(config, per_token * self.block_size)
        agreed = distributed.agree_min(num_blocks, self.device)  # every rank runs the same tables
        if agreed < num_blocks:
            num_blocks, why = agreed, f"{why}; fewer on another shard"
        logger.info(
            "KV cache: %d bytes per token, %d blocks of %d tokens (%.1f MiB, %d tokens): %s",
            per_token,
            num_blocks,
            self.block_size,
            num_blocks * per_token * self.block_size / 2**20,
            num_blocks * self.block_size,
            why,
        )
        cache = PagedKVCache(
            BlockPool(num_blocks, self.block_size), self.device, self.backend.transposed_keys
        )
        cache.allocate(like=probe)
        return cache

    def _num_blocks(self, config: ServerConfig, per_block: int) -> tuple[int, str]:
        """How many blocks the cache gets, and why: KV_CACHE_BLOCKS where set (on any device,
        within the memory there is); on CUDA all the free memory the process may use less
        BATCH_SAFETY_MARGIN; on CPU CPU_KV_CACHE_SPACE GiB, or else room for MAX_BATCH_SIZE
        sequences of the longest length (+1 block held back for health checks) within free
        memory less the margin."""
        margin = (100 - config.batch_safety_margin) / 100
        if self.device.type == "cuda":
            available = cuda_available_bytes(self.device, config.cuda_process_memory_fraction)
            where = "free GPU memory this process may use"
        else:
            available, where = host_available_bytes(), "memory available"
        if config.kv_cache_blocks:
            num_blocks, why = config.kv_cache_blocks, f"KV_CACHE_BLOCKS={config.kv_cache_blocks}"
            if num_blocks * per_block > available:
                raise ValueError(
                    f"KV_CACHE_BLOCKS={num_blocks} needs {num_blocks * per_block / 2**30:.2f} GiB, more than "
                    f"the {available / 2**30:.2f} GiB of {where}"
                )
        elif self.device.type == "cuda":
            num_blocks = int(available * margin) // per_block
            why = f"{config.batch_safety_margin}% of the free GPU memory held back"
        elif config.cpu_kv_cache_space:
            wanted = int(config.cpu_kv_cache_space * 2**30)
            if wanted > available:
                raise ValueError(
                    f"CPU_KV_CACHE_SPACE={config.cpu_kv_cache_space:g} GiB is more than the "
                    f"{available / 2**30:.1f} GiB of memory available"
                )
            num_blocks, why = wanted // per_block, f"CPU_KV_CACHE_SPACE={config.cpu_kv_cache_space:g} GiB"
        else:
            longest = self.context.max_sequence_length
            wanted = config.max_batch_size * -(-longest // self.block_size) + 1
            affordable = int(available * margin) // per_block
            num_blocks = min(wanted, affordable)
            why = (
                f"MAX_BATCH_SIZE={config.max_batch_size} sequences of {longest} tokens"
                if num_blocks == wanted
                else f"limited by free memory (wanted {wanted} blocks)"
            )
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache gets {num_blocks} blocks of {self.block_size} tokens ({why}): at least 2 "
                "are needed (one is held back for health checks); give it more memory"
            )
        return num_blocks, why

    def kv_state(self) -> KvCacheState:
        """The cache over every live request (reported with each step)."""
        pool = self.kv.pool
        return KvCacheState(
            total_blocks=pool.num_blocks,
            used_blocks=pool.used,
            reserved_blocks=self.allocations.reserved_blocks,
            cached_blocks=pool.reclaimable,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    # ---- batches and steps -----------------------------------------------------------------------

    def new_batch(
        self, batch_id: int, requests: Sequence[GenerationRequest]
    ) -> tuple[RaggedBatch | None, list[RequestError]]:
        assert self.adapters is not None
        found = self.adapters.for_requests(requests)
        batch, errors = RaggedBatch.from_requests(batch_id, requests, self.context, self.device, found)
        if batch is not None:
            for item in batch.prefilling:
                request = item.request
                keys = self._prefix_keys(item)
                longest = len(item.prompt) + request.max_new_tokens - len(request.generated_ids)
                sequence = self.allocations.open(request.id, keys, longest)
                item.computed = item.cached = sequence.length  # prefix-cache hit: not prefilled
                lookahead = None
                if self.speculator is not None:
                    costs = self.gate.costs.lookahead if self.gate.costs is not None else ()
                    lookahead = Lookahead(self.speculate, costs)
                batch.states[request.id] = RequestState(sequence, found.loras.get(request.id), lookahead)
                if keys:
                    self.prefix_query_tokens += len(keys) * self.block_size
                    self.prefix_hit_tokens += sequence.length
        return batch, errors

    def release(self, request_ids: Iterable[int]) -> None:
        request_ids = list(request_ids)
        self.allocations.release(request_ids)
        if self.speculator is not None:
            self.speculator.release(request_ids)

    def _caches(self, request: GenerationRequest) -> bool:
        """Prefix caching applies to `request`: it is on, and the request does not want details
        of every prompt token (they need every prompt token's logits)."""
        return self.prefix_caching and not request.details.input_tokens

    def _prefix_keys(self, item: Prefilling) -> list[bytes]:
        """The keys of the prompt's full blocks that a later token attends to (the last prompt
        token is always computed: its logits choose the first token); none where prefix caching
        does not apply to the request (`_caches`)."""
        if not self._caches(item.request):
            return []
        return prefix_keys(item.prompt[:-1], self.block_size, _salt(item.request))

    def _offer_when_gone(self, batch: RaggedBatch, completed: Sequence[Prefilling]) -> None:
        """The requests whose prompts were just completed offer their written blocks to the
        prefix cache when they leave (their generated tokens' too: SequenceKV.offer), where
        prefix caching applies to them. Their history lists are the chooser's last rows, which
        grow as they generate."""
        if not completed or batch.chooser is None:
            return
        histories = batch.chooser.histories[len(batch.chooser.histories) - len(completed) :]
        for item, history in zip(completed, histories, strict=True):
            if self._caches(item.request):
                kv = batch.states[item.request.id].kv
                kv.source = (item.virtual_length, history, _salt(item.request))

    def generate_token(self, batch: Batch, token_budget: int = 0) -> tuple[StepOutput, RaggedBatch | None]:
        assert isinstance(batch, RaggedBatch)
        with torch.inference_mode():
            chains = self._candidates(batch, [batch.states[r.id] for r in batch.requests])
            if chains is not None:
                return self._speculative_step(batch, token_budget, chains)
            launched = self._launch(batch, token_budget, ahead=False)
            output = self._finish(launched)
            return output, drop_failed(launched.batch, output)

    def launch(self, batch: Batch, token_budget: int = 0) -> LaunchedStep | None:
        """A step queued without waiting for it (PIPELINE_STEPS): not with speculative decoding
        (candidates are read from the host ids) nor guided rows (a grammar takes each id on the
        host before the next mask). Rows that have had max_new_tokens launched leave the batch
        first: a step past them would write K/V beyond the blocks their request reserved."""
        assert isinstance(batch, RaggedBatch)
        if not self.pipelined or self.speculator is not None or self._guided(batch):
            return None
        live = batch.without_done()
        assert live is not None, "launch needs a batch with tokens still to generate"
        with torch.inference_mode():
            return self._launch(live, token_budget, ahead=True)

    def finish(self, launched: Launched) -> StepOutput:
        assert isinstance(launched, LaunchedStep)
        with torch.inference_mode():
            return self._finish(launched)

    @staticmethod
    def _guided(batch: RaggedBatch) -> bool:
        return (batch.chooser is not None and batch.chooser.any_guided) or any(
            p.request.params.guided is not None for p in batch.prefilling
        )

    def _launch(self, batch: RaggedBatch, token_budget: int, ahead: bool) -> LaunchedStep:
        """Run the step's forward and choice on the device (nothing read back). A decoding row's
        last token is read on the device where a step launched before this one chose it and
        is not read back yet (RequestState.pending). `ahead`: the next step may replay the
        same graph before this one is read, so the scores are copied out of its output."""
        chunks = batch.plan_prompts(token_budget)
        decoding: list[RequestState] = [batch.states[r.id] for r in batch.requests]
        ids = [history[-1] for history in batch.histories]
        plain: list[list[list[int]]] = [[[]] for _ in decoding]
        rows, wanted = self._forward(batch, chunks, ids, plain, [[s.kv] for s in decoding])
        completed = batch.finish_prompts(chunks)
        self._offer_when_gone(batch, completed)
        forward_ns = self.runner.timer.lap()
        step = LaunchedStep(batch, list(batch.request_ids), forward_ns, batch.pending_ids, completed)
        if batch.chooser is None:
            return step
        # `ahead`: a graph's output is rewritten by its next replay, which may come before this
        # step is read back
        scores = choice_scores(rows, batch.chooser, batch.requests, keep=ahead)
        step.requests = list(batch.requests)
        step.chosen = start_choice(scores, batch.chooser)
        if self.runner.capturing:  # an MLP speculator reads each row's hidden state next step
            self._keep_hidden(batch, list(range(len(batch.requests))), wanted)
        for row, request in enumerate(batch.requests):
            batch.states[request.id].pending = (step.chosen.next_ids, row)
        return step

    def _finish(self, step: LaunchedStep) -> StepOutput:
        if step.chosen is None:
            output = StepOutput()
        else:
            output = end_choice(step.chosen, step.requests)
            for request in step.requests:
                state = step.batch.states.get(request.id)
                if (
                    state is not None
                    and state.pending is not None
                    and state.pending[0] is step.chosen.next_ids
                ):
                    state.pending = None
        output.forward_ns = step.forward_ns()  # after the ids' copy: no sync of its own
        output.input_tokens = [
            self._input_tokens(p) for p in step.completed if p.request.details.input_tokens
        ]
        output.cached_prompts = cached_prompts(step.completed)
        output.pending = step.pending
        return output

    def _forward(
        self,
        batch: RaggedBatch,
        chunks: Sequence[Chunk],
        ids: Sequence[int],
        chains: Sequence[Sequence[Sequence[int]]],
        sequences: Sequence[Sequence[SequenceKV]],
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The step's forward: for each decoding request and each of its candidate chains
        `chains[i]` (one empty chain without speculation), a row with its last token `ids[i]`,
        then a row per candidate, each one position further, written to the chain's sequence
        `sequences[i][c]` (the request's own, or a fork of it); then the prompt chunks. Returns
        the logits of every decode row then of each completed prompt (the chooser's rows after
        finish_prompts), and, where the forward computed every token's logits (prompt-token
        details), the packed index of each of those rows."""
        kvs: list[SequenceKV] = []
        row_ids: list[int] = []
        loras: list[LoraWeights | None] = []
        from_device: list[tuple[int, torch.Tensor, int]] = []
        decoding = [batch.states[r.id] for r in batch.requests]
        for state, token, row_chains, row_kvs in zip(decoding, ids, chains, sequences, strict=True):
            for chain, kv in zip(row_chains, row_kvs, strict=True):
                if state.pending is not None:
                    from_device.append((len(row_ids), *state.pending))
                kvs += [kv] * (1 + len(chain))
                row_ids += [token, *chain]
                loras += [state.lora] * (1 + len(chain))
        if not chunks:
            return self.runner.decode(kvs, row_ids, loras, from_device), None
        details = any(c.item.request.details.input_tokens for c in chunks)
        pieces = [StepPiece(kv, [i], None, lora) for kv, i, lora in zip(kvs, row_ids, loras, strict=True)]
        prompts = [batch.states[c.item.request.id] for c in chunks]
        pieces += [StepPiece(s.kv, c.tokens, c.virtual, s.lora) for s, c in zip(prompts, chunks, strict=True)]
        ends: list[int] = []  # the packed index of each piece's last token
        for piece in pieces:
            ends.append((ends[-1] if ends else -1) + len(piece.tokens))
        wanted = self._wanted(len(row_ids), chunks, ends)
        logits = self.runner.forward(pieces, None if details else wanted, from_device)
        for state in prompts:
            state.kv.register_written()
        if not details:
            return logits, None
        self._keep_prompt_logits(len(row_ids), chunks, logits, ends)
        return logits[wanted], wanted

    def _speculative_step(
        self, batch: RaggedBatch, token_budget: int, chains: list[list[list[int]]]
    ) -> tuple[StepOutput, RaggedBatch | None]:
        chunks = batch.plan_prompts(token_budget)
        decoding: list[RequestState] = [batch.states[r.id] for r in batch.requests]
        begins = [s.kv.length for s in decoding]
        ids = [history[-1] for history in batch.histories]
        sequences = self._fork(decoding, chains)
        try:
            rows, wanted = self._forward(batch, chunks, ids, chains, sequences)
            completed = batch.finish_prompts(chunks)
            self._offer_when_gone(batch, completed)
            input_tokens = [self._input_tokens(p) for p in completed if p.request.details.input_tokens]
            assert batch.chooser is not None  # candidates come from decoding rows
            no_chains: list[list[list[int]]] = [[[]] for _ in completed]
            rows_chains = [*chains, *no_chains]  # the chooser's rows: decoding, completed
            scores = choice_scores(rows, batch.chooser, batch.requests, keep=False)
            verified = choose_speculated(scores, batch.requests, batch.chooser, rows_chains)
            for row, state in enumerate(decoding):
                if verified.chain[row] and verified.taken[row]:  # the chain that won was written to its fork
                    state.kv.adopt(sequences[row][verified.chain[row]])
        finally:  # the forks that lost (or all, when the step failed) go back to the pool
            for row_kvs in sequences:
                for fork in row_kvs[1:]:
                    fork.free()
        self.gate.record(len(decoding), sum(len(taken) for taken in verified.taken[: len(decoding)]))
        for row, (state, row_chains) in enumerate(zip(decoding, chains, strict=True)):
            if any(row_chains) and verified.taken[row]:
                state.kv.truncate(begins[row] + len(verified.taken[row]))  # rejected candidates forgotten
                assert state.lookahead is not None
                state.lookahead.taken(len(row_chains[verified.chain[row]]), verified.accepted[row])
        if self.runner.capturing:
            self._keep_hidden(batch, self._chosen_rows(rows_chains, verified), wanted)
        output = verified.output
        output.forward_ns = self.runner.timer.elapsed_ns()  # after the ids' copy: no sync of its own
        output.input_tokens = input_tokens
        output.cached_prompts = cached_prompts(completed)
        output.pending = batch.pending_ids
        return output, drop_failed(batch, output)

    def _fork(
        self, decoding: Sequence[RequestState], chains: list[list[list[int]]]
    ) -> list[list[SequenceKV]]:
        """Each row's sequence per candidate chain: its own for the first, a fork for each other
        (blocks past the shared ones taken now, the partial block copied on the device). Chains
        that the free blocks cannot hold beside every request's reserve are dropped (in
        `chains` too)."""
        room = self.kv.pool.free - self.allocations.reserved_blocks
        sequences: list[list[SequenceKV]] = []
        copies: list[tuple[int, int]] = []
        for state, row_chains in zip(decoding, chains, strict=True):
            kvs = [state.kv]
            for chain in row_chains[1:]:
                need = state.kv.fork_blocks(1 + len(chain))
                if need > room:
                    break
                room -= need
                fork, copy = state.kv.fork()
                kvs.append(fork)
                if copy is not None:
                    copies.append(copy)
            del row_chains[len(kvs) :]
            sequences.append(kvs)
        self.kv.copy_blocks(copies)
        return sequences

    @staticmethod
    def _chosen_rows(chains: Sequence[Sequence[Sequence[int]]], verified: Verified) -> list[int]:
        """Each chooser row's logits row whose position chose its last token taken: in the
        chain it followed (the first row for a row that took none)."""
        rows, start = [], 0
        for row, row_chains in enumerate(chains):
            winner = verified.chain[row]
            first = start + sum(len(c) + 1 for c in row_chains[:winner])
            rows.append(first + max(len(verified.taken[row]), 1) - 1)
            start += sum(len(c) + 1 for c in row_chains)
        return rows

    def _keep_hidden(self, batch: RaggedBatch, rows: list[int], wanted: list[int] | None) -> None:
        """Keep each chooser row's final hidden state at logits row `rows[i]` (the runner kept
        the LM head's input: one row per logits row, `wanted` of them where the step computed
        every token's logits)."""
        hidden = self.runner.hidden
        assert hidden is not None
        packed = [wanted[i] for i in rows] if wanted is not None else rows
        kept = hidden.index_select(0, to_device(packed, hidden.device))
        for request, row in zip(batch.requests, kept, strict=True):
            batch.states[request.id].hidden = row

    def _candidates(
        self, batch: RaggedBatch, decoding: Sequence[RequestState]
    ) -> list[list[list[int]]] | None:
        """Each decoding row's candidate chains for this step, the likeliest first (None: no
        row has any, or speculation is off or the batch too large for it); a row without
        candidates has one empty chain. A row is offered at most its lookahead and never more
        than would take it past max_new_tokens; several chains only to greedy rows (a sampling
        row's draws follow one chain)."""
        if self.speculator is None or not decoding or not self.gate.allows(len(decoding)):
            return None
        chooser = batch.chooser
        assert chooser is not None
        limits = []
        for state, request, generated in zip(decoding, batch.requests, chooser.generated, strict=True):
            assert state.lookahead is not None
            limit = min(state.lookahead.ask(), request.max_new_tokens - generated - 1)
            limits.append(0 if self.runner.capturing and state.hidden is None else max(0, limit))
        hidden = None
        if self.runner.capturing:
            like = next((s.hidden for s in decoding if s.hidden is not None), None)
            if like is None:
                return None
            hidden = torch.stack(
                [s.hidden if s.hidden is not None else torch.zeros_like(like) for s in decoding]
            )
        requests = [r.id for r in batch.requests]
        greedy = [g is None for g in chooser.generators]
        proposed = self.speculator.propose_chains(requests, chooser.histories, limits, hidden, greedy)
        chains: list[list[list[int]]] = []
        for row, (row_chains, limit) in enumerate(zip(proposed, limits, strict=True)):
            cut = [c[:limit] for c in (row_chains if greedy[row] else row_chains[:1])]
            trimmed = chooser.trim_drafts(cut, [row] * len(cut))
            kept: list[list[int]] = []
            for chain in trimmed:
                if chain and chain not in kept:
                    kept.append(chain)
            chains.append(kept or [[]])
        return chains if any(any(c) for c in chains) else None

    @staticmethod
    def _wanted(decoding: int, chunks: Sequence[Chunk], ends: list[int]) -> list[int]:
        """Packed indices whose logits choose tokens: every decode row (`decoding` pieces of one
        token), then each completed prompt (the chooser's row order after finish_prompts)."""
        completed = [ends[decoding + i] for i, c in enumerate(chunks) if c.completes]
        return ends[:decoding] + completed

    @staticmethod
    def _keep_prompt_logits(
        decoding: int, chunks: Sequence[Chunk], logits: torch.Tensor, ends: list[int]
    ) -> None:
        for i, chunk in enumerate(chunks):
            if not chunk.item.request.details.input_tokens:
                continue
            last = ends[decoding + i]
            first = last - (chunk.end - chunk.start) + 1 + max(0, chunk.item.virtual_length - chunk.start)
            rows = logits[first : last + 1].float()  # the request's own tokens, not its soft prompt
            chunk.item.prompt_logits = [*(chunk.item.prompt_logits or []), rows]

    @staticmethod
    def _input_tokens(item: Prefilling) -> InputTokens:
        logits = torch.cat(item.prompt_logits) if item.prompt_logits else None
        return InputTokens(item.request.id, input_token_infos(logits, item.ids, item.request.details))


def _salt(request: GenerationRequest) -> str:
    """The prefix keys' salt of a request: K/V behind a soft prompt or through a LoRA adapter
    are the adapter's (keyed by its id), and a request's cache_salt keeps its blocks from every
    other salt's requests."""
    salt = request.adapter_id or request.prefix_id
    return f"{salt}\x00{request.cache_salt}" if request.cache_salt else salt
