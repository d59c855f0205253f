"""ServerConfig: the one configuration object of a shard process.

Built only by the `serve` command of cli.py (click reads the flags and their TGIS env vars);
everything else receives the object. Validation happens here, in __post_init__.
"""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_common.defaults import (
    DEFAULT_BATCH_SAFETY_MARGIN,
    DEFAULT_DEPLOYMENT_FRAMEWORK,
    DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DTYPES,
    default_uds_path,
    shard_socket_path,
)
from text_generation_common.quantize import refusal as quantize_refusal
from text_generation_common.speculate import DEFAULT_SPECULATOR_MAX_BATCH_SIZE, SPECULATOR_BATCH_GATES
from text_generation_common.speculate import refusal as speculate_refusal

LINEAR_LAYOUTS = ("auto", "plain", "column-major", "onednn", "panels")  # kernels/weight_layout.py
ESTIMATE_MEMORY_MODES = ("auto", "manual", "off")
CPU_ATTENTION_MODES = ("auto", "kernel", "sdpa")  # kernels/cpu_kernels.py
CPU_FORWARD_MODES = ("auto", "layers", "modules")  # engines/tgis_native/cpu_decoder.py
GPU_ATTENTION_MODES = ("auto", "triton", "sdpa")  # attention/__init__.py
DEFAULT_KV_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str  # local directory, or hub id resolved in the local HF cache
    deployment_framework: str = DEFAULT_DEPLOYMENT_FRAMEWORK  # engine name (see engines/__init__.py)
    revision: str | None = None
    dtype: str | None = None  # None: float16 on CUDA, float32 on CPU
    max_sequence_length: int | None = None  # None: from the model config, else 2048
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    uds_path: str = ""  # socket base path; "" = default_uds_path()
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"  # rendezvous of the ranks (world_size > 1)
    master_port: int = 29500
    collective_timeout_s: float = 60.0  # longest wait in one collective before the shard stops
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # transformers attn_implementation (eager, sdpa, ...)
    # CPU linear weights: auto (measured) | plain | column-major | onednn | panels
    linear_layout: str = "auto"
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE  # tokens per KV-cache block (tgis_native)
    cpu_attention: str = "auto"  # paged decode attention on CPU: auto | kernel (ours, C++) | sdpa
    quantize: str | None = None  # QUANTIZE: None, or a scheme of text_generation_common/quantize.py
    cpu_forward: str = "auto"  # tgis_native forward on CPU: auto | layers (one C++ call) | modules
    gpu_attention: str = "auto"  # paged decode attention on CUDA: auto | triton (ours) | sdpa
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before (tgis_native)
    cpu_kv_cache_space: float = 0.0  # GiB of host memory for the paged KV cache; 0 = sized by the batch
    kv_cache_blocks: int = 0  # blocks of the paged KV cache on any device; 0 = sized by memory
    run_ahead: bool = True  # step cached batches while the router handles the last answer
    # tgis_native, running ahead: queue the next step before reading the last back (None: on a
    # single CUDA shard, off on CPU where the forward holds the host)
    pipeline_steps: bool | None = None
    cuda_graphs: bool = True  # tgis_native on CUDA: steps replay captured graphs
    max_batch_prefill_tokens: int = DEFAULT_MAX_BATCH_PREFILL_TOKENS  # the router's; 0 = no limit
    cpu_affinity: str | None = None  # CPU list ("0-7") the process pins itself to; None = not pinned
    prefix_store_path: str | None = None  # soft prompts (prefix_id / adapter_id); None = none stored
    prompt_cache_size_mb: int = 512  # loaded soft prompts kept (LRU by bytes)
    max_prompt_prefix_length: int | None = None  # most virtual tokens; None = half the sequence
    max_loras: int = 8  # LoRA adapters resident at once (least recently used evicted)
    lora_cache_size_mb: int = 1024  # memory for resident LoRA adapters
    estimate_memory: str = "auto"  # batch-weight model: auto | manual | off (memory.py)
    batch_safety_margin: int = DEFAULT_BATCH_SAFETY_MARGIN  # % of free memory held back
    cuda_process_memory_fraction: float = 1.0  # share of the GPU this process may use
    speculate: int = 0  # most candidate tokens per row and step (speculative decoding); 0 = off
    speculator_name: str | None = None  # SPECULATOR_NAME: an MLP speculator (directory or cached hub id)
    speculator_revision: str | None = None
    speculator_max_batch_size: int = DEFAULT_SPECULATOR_MAX_BATCH_SIZE  # no speculation above this many rows
    speculator_batch_gate: str = "measured"  # measured | fixed (speculation/gate.py)
    # an MLP speculator's candidate tree (None: its config's)
    speculator_n_candidates: int | None = None
    speculator_top_k_tokens_per_head: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model name must not be empty")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2, got {self.max_sequence_length}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.cpu_kv_cache_space < 0:
            raise ValueError(f"cpu_kv_cache_space must be >= 0 GiB, got {self.cpu_kv_cache_space}")
        if self.kv_cache_blocks < 0:
            raise ValueError(f"kv_cache_blocks must be >= 0, got {self.kv_cache_blocks}")
        if self.kv_cache_blocks and self.cpu_kv_cache_space:
            raise ValueError("set KV_CACHE_BLOCKS or CPU_KV_CACHE_SPACE, not both")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.linear_layout not in LINEAR_LAYOUTS:
            choices = ", ".join(LINEAR_LAYOUTS)
            raise ValueError(f"unknown LINEAR_LAYOUT {self.linear_layout!r}; choose one of {choices}")
        if self.cpu_attention not in CPU_ATTENTION_MODES:
            choices = ", ".join(CPU_ATTENTION_MODES)
            raise ValueError(f"unknown CPU_ATTENTION {self.cpu_attention!r}; choose one of {choices}")
        refused = quantize_refusal(self.quantize, self.deployment_framework, self.world_size)
        if refused is not None:
            raise ValueError(refused)
        refused = speculate_refusal(
            self.speculate,
            self.speculator_max_batch_size,
            self.deployment_framework,
            self.speculator_name,
            self.world_size,
            self.speculator_n_candidates is not None or self.speculator_top_k_tokens_per_head is not None,
        )
        if refused is not None:
            raise ValueError(refused)
        if self.speculator_batch_gate not in SPECULATOR_BATCH_GATES:
            choices = ", ".join(SPECULATOR_BATCH_GATES)
            raise ValueError(
                f"unknown SPECULATOR_BATCH_GATE {self.speculator_batch_gate!r}; choose one of {choices}"
            )
        if self.cpu_forward not in CPU_FORWARD_MODES:
            choices = ", ".join(CPU_FORWARD_MODES)
            raise ValueError(f"unknown CPU_FORWARD {self.cpu_forward!r}; choose one of {choices}")
        if self.gpu_attention not in GPU_ATTENTION_MODES:
            choices = ", ".join(GPU_ATTENTION_MODES)
            raise ValueError(f"unknown GPU_ATTENTION {self.gpu_attention!r}; choose one of {choices}")
        if self.estimate_memory not in ESTIMATE_MEMORY_MODES:
            choices = ", ".join(ESTIMATE_MEMORY_MODES)
            raise ValueError(f"unknown ESTIMATE_MEMORY {self.estimate_memory!r}; choose one of {choices}")
        if not 0 <= self.batch_safety_margin < 100:
            raise ValueError(f"batch_safety_margin must be in [0, 100), got {self.batch_safety_margin}")
        if not 0.0 < self.cuda_process_memory_fraction <= 1.0:
            raise ValueError(
                f"cuda_process_memory_fraction must be in (0, 1], got {self.cuda_process_memory_fraction}"
            )
        if self.max_loras < 1 or self.lora_cache_size_mb < 1:
            raise ValueError(
                f"max_loras and lora_cache_size_mb must be >= 1, got {self.max_loras} and "
                f"{self.lora_cache_size_mb}"
            )
        if self.prompt_cache_size_mb < 1:
            raise ValueError(f"prompt_cache_size_mb must be >= 1, got {self.prompt_cache_size_mb}")
        if self.max_prompt_prefix_length is not None and self.max_prompt_prefix_length < 1:
            raise ValueError(f"max_prompt_prefix_length must be >= 1, got {self.max_prompt_prefix_length}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective timeout must be > 0 s, got {self.collective_timeout_s}")
        if self.world_size > 1 and self.linear_layout not in ("auto", "plain"):
            raise ValueError(
                f"LINEAR_LAYOUT={self.linear_layout} lays out whole linears of one shard; sharded "
                "models keep transformers' tensor-parallel linears: use auto or plain"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not self.uds_path:
            object.__setattr__(self, "uds_path", default_uds_path())

    @property
    def socket_path(self) -> str:
        """The Unix socket this shard listens on."""
        return shard_socket_path(self.uds_path, self.rank)

    def shard_urls(self) -> list[str]:
        return [f"unix://{shard_socket_path(self.uds_path, rank)}" for rank in range(self.world_size)]
