"""RouterConfig: the one configuration object of the router process.

Built only by router/cli.py (click flags + their TGIS env vars); every other module receives the
object. Validation happens in __post_init__ and raises ValueError with a one-line reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from router.api.auth import AuthConfig
from text_generation_common.defaults import (
    DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_SEQUENCE_LENGTH,
    default_uds_path,
    shard_socket_path,
)

DEFAULT_MAX_CONCURRENT_REQUESTS = 512
DEFAULT_MAX_PREFILL_PADDING = 0.2
DEFAULT_MAX_WAITING_TOKENS = 24
SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_MAX_BEST_OF = 2  # TGI's
DEFAULT_MAX_DECODE_STEPS = 16
DEFAULT_MAX_DECODE_CALL_MS = 25.0
DEFAULT_PORT = 3000
DEFAULT_GRPC_PORT = 8033
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_OTLP_SERVICE_NAME = "text-generation-inference.router"


def default_master_shard_uds_path() -> str:
    return shard_socket_path(default_uds_path(), 0)


def default_tokenization_workers(num_shards: int = 1) -> int:
    """TGIS: clamp(cpus - shards, 1, 8)."""
    return max(1, min(8, (os.cpu_count() or 1) - num_shards))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    tokenizer_path: str  # directory holding tokenizer.json (or the file itself)
    model_name: str = ""  # in the HTTP APIs (/info, /v1/models); "" = the tokenizer dir's name

    master_shard_uds_path: str = ""  # "" = default_master_shard_uds_path()
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_prefill_padding: float = DEFAULT_MAX_PREFILL_PADDING
    max_batch_prefill_tokens: int = DEFAULT_MAX_BATCH_PREFILL_TOKENS  # 0 = no limit
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS
    max_best_of: int = DEFAULT_MAX_BEST_OF  # the TGI door's largest best_of
    # a streamed request's messages after its first: one per this many tokens (gRPC, OpenAI doors)
    stream_interval: int = 1
    # above stream_interval: messages carry up to this many tokens while the event loop is
    # saturated or the router's CPU slows a forward on its CPUs (router/core/pacing.py);
    # 0 = stream_interval, fixed
    max_stream_interval: int = 0
    # while nothing waits: decode steps one shard call may run (their tokens answered together),
    # and the longest their forwards may take (router/scheduling/batcher.py); 1 = one per call
    max_decode_steps: int = DEFAULT_MAX_DECODE_STEPS
    max_decode_call_ms: float = DEFAULT_MAX_DECODE_CALL_MS
    port: int = DEFAULT_PORT  # HTTP: /health (and /metrics)
    grpc_port: int = DEFAULT_GRPC_PORT
    host: str = "0.0.0.0"  # a server in a container listens on every interface
    tokenization_workers: int = 0  # 0 = default_tokenization_workers()
    output_special_tokens: bool = False
    default_include_stop_seqs: bool = False  # the launcher passes true (TGIS's default)
    json_output: bool = False
    tls_cert_path: str | None = None  # gRPC TLS: server certificate (PEM)
    tls_key_path: str | None = None  # and its private key
    tls_client_ca_cert_path: str | None = None  # mTLS: clients must present a cert signed by this CA
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: time in-flight requests get to finish
    otlp_endpoint: str | None = None  # OpenTelemetry collector (OTLP/gRPC); None = no tracing
    otlp_service_name: str = DEFAULT_OTLP_SERVICE_NAME
    # the model's tool call format (router/http/tool_parsers.py), for the OpenAI door's
    # tool_choice "auto"; None = "auto" refused
    tool_call_parser: str | None = None
    # how the model writes its thinking (router/http/reasoning.py): answered apart by the chat
    # door; None = thinking stays in the text
    reasoning_parser: str | None = None
    # the order waiting requests are taken in: fcfs (arrival), or priority (lower values first,
    # arrival within a value: router/scheduling/request_queue.py)
    scheduling_policy: str = "fcfs"
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (router/http/adapter_admin.py)
    allow_runtime_adapter_loading: bool = False
    # Responses API answers kept for previous_response_id (router/http/responses_store.py); 0: none
    responses_store_size: int = 0
    # API keys / JWT (router/api/auth.py); off by default
    auth: AuthConfig = field(default_factory=AuthConfig)

    @property
    def by_priority(self) -> bool:
        """Waiting requests are taken by priority (SCHEDULING_POLICY=priority)."""
        return self.scheduling_policy == "priority"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if not self.tokenizer_path:
            raise ValueError("a tokenizer path is required")
        if self.max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2, got {self.max_sequence_length}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens >= self.max_sequence_length:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be < max_sequence_length "
                f"({self.max_sequence_length})"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if not 0.0 <= self.max_prefill_padding <= 1.0:
            raise ValueError(f"max_prefill_padding must be in [0, 1], got {self.max_prefill_padding}")
        if self.max_batch_prefill_tokens < 0:
            raise ValueError(f"max_batch_prefill_tokens must be >= 0, got {self.max_batch_prefill_tokens}")
        if self.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {self.max_waiting_tokens}")
        if self.max_best_of < 1:
            raise ValueError(f"max_best_of must be >= 1, got {self.max_best_of}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_stream_interval and self.max_stream_interval < self.stream_interval:
            raise ValueError(
                f"max_stream_interval ({self.max_stream_interval}) must be 0 or at least "
                f"stream_interval ({self.stream_interval})"
            )
        if self.max_decode_steps < 1:
            raise ValueError(f"max_decode_steps must be >= 1, got {self.max_decode_steps}")
        if self.max_decode_call_ms < 0:
            raise ValueError(f"max_decode_call_ms must be >= 0, got {self.max_decode_call_ms}")
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            raise ValueError("tls: must provide both cert and key")
        if self.tls_client_ca_cert_path and not self.tls_cert_path:
            raise ValueError("tls: a client CA needs a server cert and key")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.master_shard_uds_path:
            object.__setattr__(self, "master_shard_uds_path", default_master_shard_uds_path())
        if self.tokenization_workers <= 0:
            object.__setattr__(self, "tokenization_workers", default_tokenization_workers())
