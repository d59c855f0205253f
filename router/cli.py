"""`text-generation-router`: the router process (external gRPC API + HTTP health/metrics).

Normally started by text-generation-launcher; runnable alone against live shards:

    text-generation-router --tokenizer-path DIR --master-shard-uds-path /tmp/text-generation-server-0

Every option can also be set through the environment variable named in its help (TGIS names).
This module and router/config.py are the only readers of the environment in this package.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from router import cli_options as options
from router import config as defaults
from router.config import RouterConfig
from text_generation_common.logs import setup_logging

logger = logging.getLogger(__name__)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--tokenizer-path",
    envvar="TOKENIZER_PATH",
    required=True,
    help="Directory with tokenizer.json [env TOKENIZER_PATH].",
)
@click.option(
    "--model-name",
    envvar="MODEL_NAME",
    default="",
    help="The model's name in the HTTP APIs (TGI /info, OpenAI model) [env MODEL_NAME]; "
    "default: the tokenizer directory's name.",
)
@click.option(
    "--master-shard-uds-path",
    envvar="MASTER_SHARD_UDS_PATH",
    default="",
    help="Socket of shard 0 [env MASTER_SHARD_UDS_PATH]; "
    "default text-generation-server-0 in the temp directory.",
)
@options.max_concurrent_requests
@click.option(
    "--max-sequence-length",
    envvar="MAX_SEQUENCE_LENGTH",
    type=click.IntRange(min=2),
    default=defaults.DEFAULT_MAX_SEQUENCE_LENGTH,
    help="Input + generated tokens limit [env MAX_SEQUENCE_LENGTH].",
)
@options.max_new_tokens
@options.max_batch_size
@options.max_prefill_padding
@options.max_batch_prefill_tokens
@options.max_waiting_tokens
@options.max_best_of
@options.stream_interval
@options.max_stream_interval
@options.max_decode_steps
@options.max_decode_call_ms
@options.port
@options.grpc_port
@click.option(
    "--tokenization-workers",
    envvar="TOKENIZATION_WORKERS",
    type=click.IntRange(min=0),
    default=0,
    help="Tokenizer threads [env TOKENIZATION_WORKERS]; 0 = clamp(cpus - 1, 1, 8).",
)
@click.option(
    "--output-special-tokens/--no-output-special-tokens",
    envvar="OUTPUT_SPECIAL_TOKENS",
    default=False,
    help="Keep special tokens in output text [env OUTPUT_SPECIAL_TOKENS].",
)
@click.option(
    "--default-include-stop-seqs/--no-default-include-stop-seqs",
    envvar="DEFAULT_INCLUDE_STOP_SEQS",
    default=False,
    help="Keep a matched stop sequence in the output when the request does not say "
    "[env DEFAULT_INCLUDE_STOP_SEQS].",
)
@click.option(
    "--json-output/--no-json-output",
    envvar="JSON_OUTPUT",
    default=False,
    help="Log JSON lines [env JSON_OUTPUT].",
)
@options.tls_cert_path
@options.tls_key_path
@options.tls_client_ca_cert_path
@options.drain_timeout
@options.otlp_endpoint
@options.otlp_service_name
@options.tool_call_parser
@options.reasoning_parser
@options.scheduling_policy
@options.allow_runtime_adapter_loading
@options.responses_store_size
@options.auth_options
@click.option("--log-level", envvar="LOG_LEVEL", default="info", help="Log level [env LOG_LEVEL].")
def main(
    tokenizer_path: str,
    model_name: str,
    master_shard_uds_path: str,
    max_concurrent_requests: int,
    max_sequence_length: int,
    max_new_tokens: int,
    max_batch_size: int,
    max_prefill_padding: float,
    max_batch_prefill_tokens: int,
    max_waiting_tokens: int,
    max_best_of: int,
    stream_interval: int,
    max_stream_interval: int,
    max_decode_steps: int,
    max_decode_call_ms: float,
    port: int,
    grpc_port: int,
    tokenization_workers: int,
    output_special_tokens: bool,
    default_include_stop_seqs: bool,
    json_output: bool,
    tls_cert_path: str | None,
    tls_key_path: str | None,
    tls_client_ca_cert_path: str | None,
    drain_timeout_s: float,
    otlp_endpoint: str | None,
    otlp_service_name: str,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    scheduling_policy: str,
    allow_runtime_adapter_loading: bool,
    responses_store_size: int,
    log_level: str,
    **auth: Any,
) -> None:
    """Serve the TGIS gRPC API in front of running model shards."""
    setup_logging(log_level, json_output)
    if max_new_tokens >= max_sequence_length:
        logger.warning(
            "max_new_tokens (%d) must be < max_sequence_length (%d): lowering it to %d",
            max_new_tokens,
            max_sequence_length,
            max_sequence_length - 1,
        )
        max_new_tokens = max_sequence_length - 1
    try:
        config = RouterConfig(
            tokenizer_path=tokenizer_path,
            model_name=model_name,
            master_shard_uds_path=master_shard_uds_path,
            max_concurrent_requests=max_concurrent_requests,
            max_sequence_length=max_sequence_length,
            max_new_tokens=max_new_tokens,
            max_batch_size=max_batch_size,
            max_prefill_padding=max_prefill_padding,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_waiting_tokens=max_waiting_tokens,
            max_best_of=max_best_of,
            stream_interval=stream_interval,
            max_stream_interval=max_stream_interval,
            max_decode_steps=max_decode_steps,
            max_decode_call_ms=max_decode_call_ms,
            port=port,
            grpc_port=grpc_port,
            tokenization_workers=tokenization_workers,
            output_special_tokens=output_special_tokens,
            default_include_stop_seqs=default_include_stop_seqs,
            json_output=json_output,
            tls_cert_path=tls_cert_path,
            tls_key_path=tls_key_path,
            tls_client_ca_cert_path=tls_client_ca_cert_path,
            drain_timeout_s=drain_timeout_s,
            otlp_endpoint=otlp_endpoint,
            otlp_service_name=otlp_service_name,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            scheduling_policy=scheduling_policy,
            allow_runtime_adapter_loading=allow_runtime_adapter_loading,
            responses_store_size=responses_store_size,
            auth=options.auth_config(auth),
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    from router.server import run

    run(config)


if __name__ == "__main__":
    main()
