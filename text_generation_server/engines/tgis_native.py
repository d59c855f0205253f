"""The `tgis_native` engine: ragged batches over a paged KV cache, with chunked prefill.

transformers' own model classes run with our attention function (paged_attention.py) and no
dense mask, on one packed batch per step:

    input_ids / position_ids [1, T]: one token per decoding request (its last chosen token, at
    its next position), then each prompt chunk of this step (ragged.py plans them under the
    call's token budget)
    -> logits of the last token of every decoding request and of every prompt completed this
       step, in the chooser's row order -> the shared step post-processing (step.py)

Every request owns a block table (paged_kv.py) that grows as its tokens are written and goes
back to the pool when it leaves. The KV cache holds `num_blocks` blocks of KV_BLOCK_SIZE tokens,
sized by `_num_blocks` (KV_CACHE_BLOCKS, CPU_KV_CACHE_SPACE, or MAX_BATCH_SIZE sequences of the maximum length
within free memory; on CUDA the free memory). Every step reports the cache's state (`kv_state`:
blocks used, blocks the live requests may still take at their longest, reclaimable prefix-cache
blocks, prefix-cache totals); the router admits a request only when its longest length fits
beside that (router/capacity.py KVBlockCapacity), so a running request never runs out of blocks.

Decoder-only models of the families in SUPPORTED_MODEL_TYPES; others are refused at load with
one line naming the engine that serves them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from text_generation_common.engines import CapacityKind
from text_generation_common.messages import (
    GenerationRequest,
    InputTokens,
    KvCacheState,
    MemoryScalingModel,
    ModelInfo,
    RequestError,
    StepOutput,
)
from text_generation_server import distributed
from text_generation_server.adapters import adapters_for
from text_generation_server.batch import Batch
from text_generation_server.config import ServerConfig
from text_generation_server.engines import cpu_kernels, paged_attention
from text_generation_server.engines.base import ModelEngine
from text_generation_server.engines.hf_transformers import load_pretrained, model_context
from text_generation_server.engines.paged_attention import Piece, StepLayout
from text_generation_server.engines.paged_kv import BlockPool, PagedKVCache, SequenceKV, prefix_keys
from text_generation_server.engines.ragged import Chunk, Prefilling, RaggedBatch
from text_generation_server.engines.step import choose_tokens, drop_failed
from text_generation_server.engines.weight_layout import LinearLayout, choose_linear_layouts
from text_generation_server.memory import host_available_bytes
from text_generation_server.sampling.token_details import input_token_infos

logger = logging.getLogger(__name__)

Piece_ = tuple[SequenceKV, list[int], torch.Tensor | None]  # new tokens, soft-prompt embeddings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "gpt_neox", "gpt2", "gpt_bigcode", "granite", "qwen2")


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


class TgisNativeEngine(ModelEngine):
    def __init__(self, config: ServerConfig) -> None:
        paged_attention.register()
        loaded = load_pretrained(config, attn_implementation=paged_attention.NAME)
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
        self.kernel = cpu_kernels.use_kernel(config.cpu_attention, self.device)
        logger.info("decode attention: %s", "our CPU kernel" if self.kernel else "SDPA over gathered blocks")
        self.kv = self._allocate_cache(config)
        max_length = self.context.max_sequence_length
        self.adapters = adapters_for(config, self.model, self.device, False, max_length)
        # after the probe step above, which reads the loaded weights; sharded linears keep
        # transformers' tensor-parallel modules
        if self.device.type == "cpu" and config.world_size == 1:
            choose_linear_layouts(self.model, config.max_batch_size, LinearLayout(config.linear_layout))
        self.live: weakref.WeakSet[SequenceKV] = weakref.WeakSet()  # every request's blocks
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.info = ModelInfo(
            seq2seq=False,
            eos_token_id=self.context.eos_token_id,
            vocab_size=self.context.vocab_size,
            max_sequence_length=self.context.max_sequence_length,
            memory=MemoryScalingModel(1.0, 0.0, 0.0, 1.0, 1.0, self.kv.slots),
            capacity=CapacityKind.KV_BLOCKS,
            chunked_prefill=True,
            kv_block_size=self.block_size,
            kv_total_blocks=self.kv.pool.num_blocks,
            dtype=loaded.dtype_name,
            dtype_reason=loaded.dtype_reason,
        )

    # ---- the KV cache --------------------------------------------------------------------------

    def _allocate_cache(self, config: ServerConfig) -> PagedKVCache:
        """Measure the KV bytes per token with a one-token step, then size the pool."""
        probe = PagedKVCache(BlockPool(1, self.block_size), self.device, transposed_keys=self.kernel)
        sequence = SequenceKV(probe.pool)
        self._forward([(sequence, [self.context.pad_token_id or 0], None)], probe, [0])
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
        return PagedKVCache(BlockPool(num_blocks, self.block_size), self.device, transposed_keys=self.kernel)

    def _num_blocks(self, config: ServerConfig, per_block: int) -> tuple[int, str]:
        """How many blocks the cache gets, and why: KV_CACHE_BLOCKS where set (on any device,
        within the memory there is); on CUDA all the free memory the process may use less
        BATCH_SAFETY_MARGIN; on CPU CPU_KV_CACHE_SPACE GiB, or else room for MAX_BATCH_SIZE
        sequences of the longest length (+1 block held back for health checks) within free
        memory less the margin."""
        margin = (100 - config.batch_safety_margin) / 100
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            available = free - int(total * (1 - config.cuda_process_memory_fraction))  # this process's share
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
            reserved_blocks=sum(sequence.reserved_blocks for sequence in self.live),
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
        batch, errors = RaggedBatch.from_requests(batch_id, requests, (self.context, self.device), found)
        if batch is not None:
            for item in batch.prefilling:
                keys = self._prefix_keys(item)
                max_tokens = len(item.prompt) + item.request.max_new_tokens
                sequence = SequenceKV(self.kv.pool, keys, max_tokens)
                sequence.lora = found.loras.get(item.request.id)
                item.computed = sequence.length  # prefix-cache hit: those blocks are not prefilled
                batch.states[item.request.id] = sequence
                self.live.add(sequence)
                if keys:
                    self.prefix_query_tokens += len(keys) * self.block_size
                    self.prefix_hit_tokens += sequence.length
        return batch, errors

    def _prefix_keys(self, item: Prefilling) -> list[bytes]:
        """The keys of the prompt's full blocks that a later token attends to (the last prompt
        token is always computed: its logits choose the first token). None when prefix caching
        is off, or the request wants details of every prompt token (they need its logits)."""
        if not self.prefix_caching or item.request.details.input_tokens:
            return []
        # K/V behind a soft prompt or through a LoRA adapter are the adapter's: keyed by its id
        salt = item.request.adapter_id or item.request.prefix_id
        return prefix_keys(item.prompt[:-1], self.block_size, salt)

    def generate_token(
        self, batch: Batch, first: bool, token_budget: int = 0
    ) -> tuple[StepOutput, RaggedBatch | None]:
        assert isinstance(batch, RaggedBatch)
        with torch.inference_mode():
            output, cached = self._step(batch, token_budget)
        output.kv_cache = self.kv_state()
        return output, cached

    def _step(self, batch: RaggedBatch, token_budget: int) -> tuple[StepOutput, RaggedBatch | None]:
        chunks = batch.plan_prompts(token_budget)
        pieces: list[Piece_] = [
            (batch.states[r.id], [h[-1]], None) for r, h in zip(batch.requests, batch.histories, strict=True)
        ]
        pieces += [(batch.states[c.item.request.id], c.tokens, c.virtual) for c in chunks]
        ends: list[int] = []  # the packed index of each piece's last token
        for _, tokens, _ in pieces:
            ends.append((ends[-1] if ends else -1) + len(tokens))
        details = [c for c in chunks if c.item.request.details.input_tokens]
        start = time.perf_counter_ns()
        logits = self._forward(pieces, self.kv, None if details else self._wanted(batch, chunks, ends))
        for sequence, _, _ in pieces[len(batch.requests) :]:
            sequence.register_written()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        forward_ns = time.perf_counter_ns() - start
        rows = logits if not details else logits[self._wanted(batch, chunks, ends)]
        if details:
            self._keep_prompt_logits(batch, chunks, logits, ends)
        completed = batch.finish_prompts(chunks)
        input_tokens = [self._input_tokens(p) for p in completed if p.request.details.input_tokens]
        if batch.chooser is None:
            return StepOutput(pending=batch.pending_ids, forward_ns=forward_ns), batch
        _, output = choose_tokens(rows.float(), batch.requests, batch.chooser, forward_ns)
        output.input_tokens = input_tokens
        output.pending = batch.pending_ids
        return output, drop_failed(batch, output)

    @staticmethod
    def _wanted(batch: RaggedBatch, chunks: Sequence[Chunk], ends: list[int]) -> list[int]:
        """Packed indices whose logits choose tokens: every decoding row, then each completed
        prompt (the chooser's row order after finish_prompts)."""
        decoding = len(batch.requests)
        completed = [ends[decoding + i] for i, c in enumerate(chunks) if c.completes]
        return ends[:decoding] + completed

    def _forward(self, pieces: Sequence[Piece_], cache: PagedKVCache, keep: list[int] | None) -> torch.Tensor:
        """Write and attend `pieces` (a sequence's new tokens each, with the soft-prompt
        embeddings of its first ones, if any); logits [len(keep), vocab] (every packed token
        when keep is None)."""
        ids: list[int] = []
        positions: list[int] = []
        parts: list[Piece] = []
        virtual: list[tuple[int, torch.Tensor]] = []  # (packed index, embeddings from there)
        for sequence, tokens, embeddings in pieces:
            if embeddings is not None:
                virtual.append((len(ids), embeddings))
            begin = sequence.length
            sequence.reserve(len(tokens))
            ids += tokens
            positions += range(begin, begin + len(tokens))
            sequence.length = begin + len(tokens)
            parts.append(Piece(sequence.blocks, begin, len(tokens)))
        device = self.device
        layout = StepLayout.build(cache, parts, self.window, self.model.dtype, device, self.kernel)
        if keep is not None and len(keep) == len(ids) and keep[-1] == len(ids) - 1:
            keep = None  # every packed token, in order (a decode-only step)
        kwargs: dict[str, Any] = {}
        selected = keep is not None and self.context.accepts_logits_to_keep
        if selected:
            kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=device)
        applied = (
            self.adapters.applied(
                [s.lora for s, _, _ in pieces], device, False, [len(t) for _, t, _ in pieces]
            )
            if self.adapters is not None  # None only in the probe step of start-up
            else contextlib.nullcontext()
        )
        packed = torch.tensor([ids], device=device)
        if virtual:
            embeds = self.model.get_input_embeddings()(packed)
            for at, embeddings in virtual:
                embeds[0, at : at + embeddings.shape[0]] = embeddings
            kwargs["inputs_embeds"] = embeds
        else:
            kwargs["input_ids"] = packed
        with applied:
            out = self.model(
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                tgis_step=layout,
                **kwargs,
            )
        logits = out.logits[0]
        return logits[keep] if keep is not None and not selected else logits

    @staticmethod
    def _keep_prompt_logits(
        batch: RaggedBatch, chunks: Sequence[Chunk], logits: torch.Tensor, ends: list[int]
    ) -> None:
        decoding = len(batch.requests)
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
