"""Options that text-generation-launcher and text-generation-router both take.

Each is defined once, so a flag's env var, range, default and help cannot drift between the
launcher (which users call) and the router (which the launcher calls with the resolved values).
A click option decorator builds a fresh Option every time it is applied, so one serves both.
Options whose defaults differ between the two (sequence length, the boolean switches the launcher
passes on explicitly) stay in their own command.
"""

from __future__ import annotations

import click

from router import config as defaults

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
max_waiting_tokens = click.option(
    "--max-waiting-tokens",
    envvar="MAX_WAITING_TOKENS",
    type=click.IntRange(min=1),
    default=defaults.DEFAULT_MAX_WAITING_TOKENS,
    help="Decode steps after which waiting requests always get to join [env MAX_WAITING_TOKENS].",
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
otlp_service_name = click.option(
    "--otlp-service-name",
    envvar="OTEL_SERVICE_NAME",
    default=defaults.DEFAULT_OTLP_SERVICE_NAME,
    help="Service name of the traces [env OTEL_SERVICE_NAME].",
)
