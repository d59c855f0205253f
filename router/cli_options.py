"""Options that text-generation-launcher and text-generation-router both take.

Each is defined once, so a flag's env var, range, default and help cannot drift between the
launcher (which users call) and the router (which the launcher calls with the resolved values).
A click option decorator builds a fresh Option every time it is applied, so one serves both.
Options whose defaults differ between the two (sequence length, the boolean switches the launcher
passes on explicitly) stay in their own command.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import click

from router import config as defaults
from router.api.auth import AuthConfig, parse_api_keys
from router.core.pacing import CPU_HIGH
from router.http.reasoning import FORMATS
from router.http.tool_parsers import PARSERS

max_concurrent_requests = click.option(
    "--max-concurrent-requests",
    envvar="MAX_CONCURRENT_REQUESTS",
    type=click.IntRange(min=1),
    default=defaults.DEFAULT_MAX_CONCURRENT_REQUESTS,
    help="Inputs in flight before 'Model is overloaded' [env MAX_CONCURRENT_REQUESTS].",
)
max_new_tokens = click.option(
    "--max-new-tokens",
    envvar="MAX_NEW_TOKENS",
    type=click.IntRange(min=1),
    default=defaults.DEFAULT_MAX_NEW_TOKENS,
    help="Largest max_new_tokens [env MAX_NEW_TOKENS].",
)
max_batch_size = click.option(
    "--max-batch-size",
    envvar="MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=defaults.DEFAULT_MAX_BATCH_SIZE,
    help="Most requests in the running batch [env MAX_BATCH_SIZE].",
)
max_prefill_padding = click.option(
    "--max-prefill-padding",
    envvar="MAX_PREFILL_PADDING",
    type=click.FloatRange(0.0, 1.0),
    default=defaults.DEFAULT_MAX_PREFILL_PADDING,
    help="Largest padding fraction of a prefill batch [env MAX_PREFILL_PADDING].",
)
max_batch_prefill_tokens = click.option(
    "--max-batch-prefill-tokens",
    envvar="MAX_BATCH_PREFILL_TOKENS",
    type=click.IntRange(min=0),
    default=defaults.DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    help=(
        "Most prompt tokens one prefill computes (padded: batch size x longest prompt); the rest "
        "joins at later steps; one request always fits; 0 = no limit [env MAX_BATCH_PREFILL_TOKENS]."
    ),
)


def _count_option(flag: str, env: str, default: int, help_text: str) -> Any:
    """A flag of a count of at least 1."""
    return click.option(
        flag, envvar=env, type=click.IntRange(min=1), default=default, help=f"{help_text} [env {env}]."
    )


max_waiting_tokens = _count_option(
    "--max-waiting-tokens",
    "MAX_WAITING_TOKENS",
    defaults.DEFAULT_MAX_WAITING_TOKENS,
    "Decode steps after which waiting requests always get to join",
)
max_best_of = _count_option(
    "--max-best-of",
    "MAX_BEST_OF",
    defaults.DEFAULT_MAX_BEST_OF,
    "The largest best_of the TGI REST door takes: so many sampled answers of one request, the "
    "likeliest returned",
)
stream_interval = click.option(
    "--stream-interval",
    envvar="STREAM_INTERVAL",
    type=click.IntRange(min=1),
    default=1,
    help="Streamed requests of the gRPC and OpenAI doors get their first token at once, then one "
    "message per this many tokens (their text and token details together), so that fewer "
    "messages carry the same tokens at high concurrency; 1 = one message per token (TGIS) "
    "[env STREAM_INTERVAL].",
)
max_stream_interval = click.option(
    "--max-stream-interval",
    envvar="MAX_STREAM_INTERVAL",
    type=click.IntRange(min=0),
    default=0,
    help="Above --stream-interval: while the router's event loop is saturated (the engine waits "
    "for it), or, where the shard computes on the router's CPUs, while the router takes more "
    f"than {CPU_HIGH:.0%} of a core from its forward, those streams' messages carry up to this many tokens, "
    "one more per 0.1 s of it and one fewer once the load falls; 0 = --stream-interval, fixed "
    "[env MAX_STREAM_INTERVAL].",
)
max_decode_steps = _count_option(
    "--max-decode-steps",
    "MAX_DECODE_STEPS",
    defaults.DEFAULT_MAX_DECODE_STEPS,
    "While no request waits and every running one has its first token, one shard call runs "
    "up to this many decode steps and answers their tokens together (one round trip for "
    "several tokens per request), as many as fit in --max-decode-call-ms; 1 = one step per "
    "call (TGIS)",
)
max_decode_call_ms = click.option(
    "--max-decode-call-ms",
    envvar="MAX_DECODE_CALL_MS",
    type=click.FloatRange(min=0),
    default=defaults.DEFAULT_MAX_DECODE_CALL_MS,
    help="The longest the forwards of one several-step decode call may take, by the last calls' "
    "forward time per step: a request that arrives meanwhile waits at most this long more to "
    "join, and streams get their tokens at least this often [env MAX_DECODE_CALL_MS].",
)
port = click.option(
    "--port",
    "-p",
    envvar="PORT",
    type=click.IntRange(0, 65535),
    default=defaults.DEFAULT_PORT,
    help="HTTP port for /health and /metrics [env PORT].",
)
grpc_port = click.option(
    "--grpc-port",
    "-g",
    envvar="GRPC_PORT",
    type=click.IntRange(0, 65535),
    default=defaults.DEFAULT_GRPC_PORT,
    help="gRPC port of the external API [env GRPC_PORT].",
)
tls_cert_path = click.option(
    "--tls-cert-path",
    envvar="TLS_CERT_PATH",
    default=None,
    help="gRPC TLS certificate (PEM) [env TLS_CERT_PATH].",
)
tls_key_path = click.option(
    "--tls-key-path",
    envvar="TLS_KEY_PATH",
    default=None,
    help="gRPC TLS private key (PEM) [env TLS_KEY_PATH].",
)
tls_client_ca_cert_path = click.option(
    "--tls-client-ca-cert-path",
    envvar="TLS_CLIENT_CA_CERT_PATH",
    default=None,
    help="Require client certificates signed by this CA (mTLS) [env TLS_CLIENT_CA_CERT_PATH].",
)
drain_timeout = click.option(
    "--drain-timeout-secs",
    "drain_timeout_s",
    envvar="DRAIN_TIMEOUT_SECS",
    type=click.FloatRange(min=0.0),
    default=defaults.DEFAULT_DRAIN_TIMEOUT_S,
    help="On SIGTERM, how long in-flight requests get to finish [env DRAIN_TIMEOUT_SECS].",
)
otlp_endpoint = click.option(
    "--otlp-endpoint",
    envvar=["OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"],
    default=None,
    help="Send OpenTelemetry traces to this OTLP/gRPC endpoint "
    "[env OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT].",
)


def _format_option(flag: str, env: str, names: Iterable[str], help_text: str) -> Any:
    """A flag naming one of the model-format parsers of the OpenAI chat door (unset: none)."""
    return click.option(
        flag, envvar=env, type=click.Choice(sorted(names)), default=None, help=f"{help_text} [env {env}]."
    )


tool_call_parser = _format_option(
    "--tool-call-parser",
    "TOOL_CALL_PARSER",
    PARSERS,
    "The served model's tool call format, read from its answers: turns on the OpenAI chat door's "
    'tool_choice "auto" (OpenAI\'s default when tools are given); unset, "auto" is refused',
)
reasoning_parser = _format_option(
    "--reasoning-parser",
    "REASONING_PARSER",
    FORMATS,
    "How the served reasoning model writes its thinking: the OpenAI chat door answers it apart, "
    "as reasoning_content; unset, thinking stays in the text",
)
scheduling_policy = click.option(
    "--scheduling-policy",
    envvar="SCHEDULING_POLICY",
    type=click.Choice(defaults.SCHEDULING_POLICIES),
    default="fcfs",
    help="The order waiting requests are taken in: fcfs (first come, first served), or priority "
    "(a request's priority: the OpenAI door's `priority` field or the x-request-priority header "
    "of any door; lower values first, arrival order within one; a waiting request that does not "
    "fit preempts running ones of higher values, which resume later from the tokens they "
    "generated; decoder-only models) [env SCHEDULING_POLICY].",
)
allow_runtime_adapter_loading = click.option(
    "--allow-runtime-adapter-loading/--no-allow-runtime-adapter-loading",
    envvar=["ALLOW_RUNTIME_ADAPTER_LOADING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"],
    default=False,
    help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters added "
    "by name from any directory the shards can read, and removed [env ALLOW_RUNTIME_ADAPTER_LOADING, "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING].",
)
responses_store_size = click.option(
    "--responses-store-size",
    envvar="RESPONSES_STORE_SIZE",
    type=click.IntRange(min=0),
    default=0,
    help="Keep the last N Responses API answers in this router's memory (store, the default in "
    "requests), for previous_response_id and GET / DELETE /v1/responses/{id}; 0: none kept "
    "[env RESPONSES_STORE_SIZE].",
)
otlp_service_name = click.option(
    "--otlp-service-name",
    envvar="OTEL_SERVICE_NAME",
    default=defaults.DEFAULT_OTLP_SERVICE_NAME,
    help="Service name of the traces [env OTEL_SERVICE_NAME].",
)

# ---- authentication (router/api/auth.py): off unless a key, a secret or a public key is given ----

_AUTH_OPTIONS = (
    click.option(
        "--api-key",
        envvar="API_KEY",
        default=None,
        help="Accept these bearer tokens (one key, or several separated by commas) on every API "
        "call, gRPC and HTTP [env API_KEY]. Prefer the env var: flags show in process lists.",
    ),
    click.option(
        "--jwt-secret",
        envvar="JWT_SECRET",
        default=None,
        help="Accept JWTs signed with this HS256 secret [env JWT_SECRET].",
    ),
    click.option(
        "--jwt-public-key-path",
        envvar="JWT_PUBLIC_KEY_PATH",
        default=None,
        help="Accept JWTs signed by this PEM public key's private key (RSA, EC or Ed25519) "
        "[env JWT_PUBLIC_KEY_PATH].",
    ),
    click.option(
        "--jwt-audience", envvar="JWT_AUDIENCE", default=None, help="Required `aud` [env JWT_AUDIENCE]."
    ),
    click.option("--jwt-issuer", envvar="JWT_ISSUER", default=None, help="Required `iss` [env JWT_ISSUER]."),
    click.option(
        "--jwt-tenant-claim",
        envvar="JWT_TENANT_CLAIM",
        default="sub",
        help="The claim naming the caller's tenant, in logs and the per-tenant limit [env JWT_TENANT_CLAIM].",
    ),
    click.option(
        "--auth-health/--no-auth-health",
        envvar="AUTH_HEALTH",
        default=False,
        help="Also require a token for /health*, /ping, /version and /metrics [env AUTH_HEALTH].",
    ),
    click.option(
        "--tenant-max-concurrent-requests",
        envvar="TENANT_MAX_CONCURRENT_REQUESTS",
        type=click.IntRange(min=0),
        default=0,
        help="Inputs in flight per tenant before 429 / RESOURCE_EXHAUSTED; 0 = no per-tenant limit "
        "[env TENANT_MAX_CONCURRENT_REQUESTS].",
    ),
)
AUTH_PARAMS = (
    "api_key",
    "jwt_secret",
    "jwt_public_key_path",
    "jwt_audience",
    "jwt_issuer",
    "jwt_tenant_claim",
    "auth_health",
    "tenant_max_concurrent_requests",
)


def auth_options(command: Any) -> Any:
    """Apply the authentication options (their values: AUTH_PARAMS)."""
    for option in reversed(_AUTH_OPTIONS):
        command = option(command)
    return command


def auth_config(values: Mapping[str, Any]) -> AuthConfig:
    """The AuthConfig of the authentication options' values; ValueError when inconsistent."""
    return AuthConfig(
        api_keys=parse_api_keys(values["api_key"]),
        jwt_secret=values["jwt_secret"],
        jwt_public_key_path=values["jwt_public_key_path"],
        jwt_audience=values["jwt_audience"],
        jwt_issuer=values["jwt_issuer"],
        tenant_claim=values["jwt_tenant_claim"],
        protect_health=values["auth_health"],
        tenant_max_concurrent_requests=values["tenant_max_concurrent_requests"],
    )
