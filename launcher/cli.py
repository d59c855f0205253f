"""`text-generation-launcher`: start N model shards and the router, supervise them, stop them.

    text-generation-launcher --model-name bigscience/bloom-560m --num-shard 1

Every option can also be set through the TGIS environment variable named in its help. This click
CLI is the launcher's only reader of the environment: it resolves a LaunchConfig
(launcher/config.py), checks that the ports are free, finds or writes a fast tokenizer, and
hands the shard and router commands to the Supervisor (launcher/supervisor.py).

Bad configuration fails before anything starts, with one log line on stderr (no traceback), the
same line in the termination log, and exit code 1 (2 for a malformed flag).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import click

from launcher.config import (
    DEFAULT_BATCH_SAFETY_MARGIN,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MODEL_NAME,
    LaunchConfig,
    LaunchError,
    LaunchFlags,
    resolve_config,
    router_command,
    router_env,
    server_command,
    shard_command,
    shard_env,
)
from launcher.supervisor import ChildSpec, Supervisor, write_termination_log
from router import cli_options as options
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK
from text_generation_common.logs import setup_logging
from text_generation_common.speculate import (
    speculate_option,
    speculator_batch_gate_option,
    speculator_max_batch_size_option,
    speculator_n_candidates_option,
    speculator_name_option,
    speculator_revision_option,
    speculator_top_k_tokens_per_head_option,
)

# What the router gets beyond its drain timeout to close its servers and exit.
ROUTER_STOP_MARGIN_S = 10.0

logger = logging.getLogger(__name__)

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_TIMEOUT_S = 300


def termination_log_path(env: Mapping[str, str]) -> str | None:
    """TERMINATION_LOG_PATH when set (created if missing), else /dev/termination-log if writable."""
    if env.get("TERMINATION_LOG_PATH"):
        return env["TERMINATION_LOG_PATH"]
    return DEFAULT_TERMINATION_LOG if os.access(DEFAULT_TERMINATION_LOG, os.W_OK) else None


def exit_with_error(message: str, exit_code: int = 1) -> NoReturn:
    """Fatal error before the supervisor runs: one log line, the termination log, exit."""
    if not logging.getLogger().handlers:  # a flag error comes before setup_logging
        setup_logging("info")
    logger.error("%s", message)
    write_termination_log(termination_log_path(os.environ), message)
    sys.exit(exit_code)


class OneLineErrorCommand(click.Command):
    """click's own errors (bad flag values) as one line too, instead of usage text + error."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.ClickException as exc:
            exit_with_error(exc.format_message(), exc.exit_code)
        except click.Abort:
            exit_with_error("aborted")


def check_ports_free(ports: Mapping[str, int]) -> None:
    """Bind each port on every interface, as the router will; 0 (any free port) is not checked."""
    used = [port for port in ports.values() if port]
    if len(set(used)) < len(used):
        raise LaunchError(f"{' and '.join(ports)} must differ, got {', '.join(map(str, used))}")
    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as exc:
                raise LaunchError(f"{flag} {port} is not available: {exc.strerror or exc}") from None


def tokenizer_dir(config: LaunchConfig, env: Mapping[str, str], scratch: str) -> Path:
    """The model directory when it has tokenizer.json, else a fast tokenizer written into `scratch`."""
    if (config.model_dir / TOKENIZER_FILE).is_file():
        return config.model_dir
    logger.info("%s has no %s: converting its tokenizer", config.model_dir, TOKENIZER_FILE)
    argv = [*server_command(), "convert-to-fast-tokenizer", str(config.model_dir), "--output-path", scratch]
    child_env = {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": config.cache_dir}
    try:
        result = subprocess.run(
            argv, env=child_env, capture_output=True, text=True, timeout=TOKENIZER_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = str(exc)
    else:
        if result.returncode == 0 and (Path(scratch) / TOKENIZER_FILE).is_file():
            return Path(scratch)
        detail = _error_line(result.stderr) or f"exit code {result.returncode}"
    raise LaunchError(
        f"No existing fast tokenizer (tokenizer.json) found in {config.model_dir} "
        f"and converting one failed: {detail}"
    )


def _error_line(stderr: str) -> str:
    """The `Error: ...` line of a failed click command, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def child_specs(
    config: LaunchConfig, env: Mapping[str, str], tokenizer: Path
) -> tuple[list[ChildSpec], ChildSpec]:
    shard_argv = shard_command(config)
    shards = [
        ChildSpec(f"Shard {rank}", shard_argv, shard_env(config, rank, env), log_prefix=f"Shard {rank}: ")
        for rank in range(config.num_shard)
    ]
    router = ChildSpec("Router", router_command(config, tokenizer), router_env(config, env))
    return shards, router


def launch(config: LaunchConfig, env: Mapping[str, str]) -> int:
    """Run the shards and the router until a signal or a failure; returns the exit code."""
    # The router gets its drain timeout to finish in-flight requests, plus time to shut down.
    supervisor = Supervisor(
        sys.stderr.buffer,
        termination_log_path(env),
        router_grace_s=config.drain_timeout_s + ROUTER_STOP_MARGIN_S,
    )
    scratch = tempfile.mkdtemp(prefix="tgis-tokenizer-")
    try:
        with supervisor.signals_handled():
            try:
                shards, router = child_specs(config, env, tokenizer_dir(config, env, scratch))
                sockets = [config.socket_path(rank) for rank in range(config.num_shard)]
                return supervisor.run(shards, sockets, router)
            except LaunchError as exc:
                supervisor.fail(str(exc))
                return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@click.command(
    cls=OneLineErrorCommand,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.option(
    "--model-name",
    envvar="MODEL_NAME",
    default=DEFAULT_MODEL_NAME,
    help="Hub id in the local cache, or a model directory [env MODEL_NAME].",
)
@click.option(
    "--revision",
    envvar="REVISION",
    default=None,
    help="Revision of a hub model; default main [env REVISION].",
)
@click.option(
    "--deployment-framework",
    envvar="DEPLOYMENT_FRAMEWORK",
    default=DEFAULT_DEPLOYMENT_FRAMEWORK,
    help="Engine [env DEPLOYMENT_FRAMEWORK].",
)
@click.option(
    "--dtype",
    envvar="DTYPE",
    default=None,
    help="float16, bfloat16 or float32; default: the engine's [env DTYPE].",
)
@click.option(
    "--dtype-str", envvar="DTYPE_STR", default=None, help="Same as --dtype; both must agree [env DTYPE_STR]."
)
@click.option(
    "--quantize",
    envvar="QUANTIZE",
    default=None,
    help="int8 = int8 weights and each token's activations in int8 on CPU (tgis_native, hf_transformers); "
    "gptq, awq, compressed-tensors (pre-quantized "
    "checkpoints), bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4 (CPU), fp8 (GPUs with fp8 tensor cores); "
    "refused with the reason where they cannot serve [env QUANTIZE].",
)
@speculate_option
@speculator_name_option
@speculator_revision_option
@speculator_max_batch_size_option
@speculator_batch_gate_option
@speculator_n_candidates_option
@speculator_top_k_tokens_per_head_option
@click.option(
    "--num-shard",
    envvar="NUM_SHARD",
    type=click.IntRange(min=1),
    default=None,
    help="Shard processes; must match NUM_GPUS if both are set; default: visible CUDA devices, "
    "else 1 [env NUM_SHARD].",
)
@options.max_concurrent_requests
@click.option(
    "--max-sequence-length",
    envvar="MAX_SEQUENCE_LENGTH",
    type=click.IntRange(min=2),
    default=None,
    help="Input + generated tokens; default from the model's config.json, else 2048 "
    "[env MAX_SEQUENCE_LENGTH].",
)
@options.max_new_tokens
@options.max_batch_size
@options.max_prefill_padding
@options.max_batch_prefill_tokens
@click.option(
    "--batch-safety-margin",
    envvar="BATCH_SAFETY_MARGIN",
    type=click.IntRange(0, 99),
    default=DEFAULT_BATCH_SAFETY_MARGIN,
    help="Percent of free memory the shards hold back [env BATCH_SAFETY_MARGIN].",
)
@options.max_waiting_tokens
@options.max_best_of
@options.stream_interval
@options.max_stream_interval
@options.max_decode_steps
@options.max_decode_call_ms
@options.port
@options.grpc_port
@click.option(
    "--shard-uds-path",
    envvar="SHARD_UDS_PATH",
    default=None,
    help="Socket base path, shard i listens on {path}-{i}; default text-generation-server in the "
    "temp directory [env SHARD_UDS_PATH].",
)
@click.option(
    "--master-addr",
    envvar="MASTER_ADDR",
    default=DEFAULT_MASTER_ADDR,
    help="torch.distributed rendezvous host [env MASTER_ADDR].",
)
@click.option(
    "--master-port",
    envvar="MASTER_PORT",
    type=click.IntRange(1, 65535),
    default=DEFAULT_MASTER_PORT,
    help="torch.distributed rendezvous port [env MASTER_PORT].",
)
@click.option(
    "--collective-timeout",
    "collective_timeout_s",
    envvar="COLLECTIVE_TIMEOUT",
    type=click.FloatRange(0.0, min_open=True),
    default=DEFAULT_COLLECTIVE_TIMEOUT_S,
    show_default=True,
    help="Seconds a shard waits for its peers in one collective (NUM_SHARD > 1): a rank that "
    "died or hangs stops the server after at most this long [env COLLECTIVE_TIMEOUT].",
)
@click.option(
    "--json-output",
    envvar="JSON_OUTPUT",
    is_flag=True,
    default=False,
    help="Log JSON lines [env JSON_OUTPUT].",
)
@click.option(
    "--output-special-tokens",
    envvar="OUTPUT_SPECIAL_TOKENS",
    is_flag=True,
    default=False,
    help="Keep special tokens in output text [env OUTPUT_SPECIAL_TOKENS].",
)
@click.option(
    "--default-include-stop-seqs",
    envvar="DEFAULT_INCLUDE_STOP_SEQS",
    type=click.BOOL,
    default=True,
    help="Keep a matched stop sequence when the request does not say [env DEFAULT_INCLUDE_STOP_SEQS].",
)
@click.option(
    "--cuda-process-memory-fraction",
    "-c",
    envvar="CUDA_PROCESS_MEMORY_FRACTION",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    help="Share of each GPU a shard may use, in (0, 1] [env CUDA_PROCESS_MEMORY_FRACTION].",
)
@click.option(
    "--shard-threads",
    envvar="SHARD_THREADS",
    type=click.IntRange(min=1),
    default=None,
    help="Intra-op (OpenMP) threads of each shard; default: OMP_NUM_THREADS if set, else the "
    "shard's CPUs (SHARD_CPUS slice, else usable CPUs within the CPU quota / NUM_SHARD) "
    "[env SHARD_THREADS].",
)
@click.option(
    "--shard-cpus",
    envvar="SHARD_CPUS",
    default=None,
    help="Pin the shards to these CPUs (e.g. 0-7,16-23), split evenly in order, one slice per "
    "rank; default: not pinned [env SHARD_CPUS].",
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
@click.option(
    "--log-level", envvar="LOG_LEVEL", default="info", help="Log level of every process [env LOG_LEVEL]."
)
def main(**flags: Any) -> None:
    """Start the model shards and the router, and keep them running."""
    setup_logging(flags["log_level"], flags["json_output"])
    env = dict(os.environ)
    try:
        config = resolve_config(LaunchFlags(**flags), env)
        ports = {"--port": config.port, "--grpc-port": config.grpc_port}
        if config.num_shard > 1:  # rank 0 listens there for its peers
            ports["--master-port"] = config.master_port
        check_ports_free(ports)
    except LaunchError as exc:
        exit_with_error(str(exc))
    logger.info(
        "model %s (%s), engine %s, %d shard(s), max sequence length %d, max new tokens %d",
        config.model_name,
        config.model_dir,
        config.deployment_framework,
        config.num_shard,
        config.max_sequence_length,
        config.max_new_tokens,
    )
    for rank, placement in enumerate(config.placements):
        pinned = f", pinned to CPUs {sorted(placement.cpus)}" if placement.cpus is not None else ""
        logger.info("shard %d: %d intra-op threads (%s)%s", rank, placement.threads, placement.reason, pinned)
    sys.exit(launch(config, env))


if __name__ == "__main__":
    main()
