"""LaunchConfig: what text-generation-launcher resolved from its flags, the environment and the
model's files, and the command lines it derives from that.

Owns the pure part of the launcher: the Hugging Face cache directory, the model directory, the
engine name, dtype, number of shards and sequence limits, then the argv and environment of each
shard process and of the router process. launcher/cli.py (the click CLI, the only reader of the
environment) passes the environment in as a mapping; launcher/supervisor.py runs the commands.

    LaunchFlags (flags as given) + env --resolve_config--> LaunchConfig --> shard_command / shard_env
                                                                        --> router_command

Every failure is a LaunchError carrying one line for the operator. No torch, no transformers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from router import config as router_defaults
from router.api.auth import AuthConfig
from router.cli_options import AUTH_PARAMS, auth_config
from text_generation_common.cpu_placement import PlacementError, ShardPlacement, shard_placements
from text_generation_common.defaults import (
    DEFAULT_BATCH_SAFETY_MARGIN,
    DEFAULT_DEPLOYMENT_FRAMEWORK,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_SEQUENCE_LENGTH,
    DTYPES,
    default_uds_path,
    shard_socket_path,
)
from text_generation_common.engines import ENGINES, EngineSpec
from text_generation_common.model_config import context_length
from text_generation_common.quantize import refusal as quantize_refusal
from text_generation_common.speculate import DEFAULT_SPECULATOR_MAX_BATCH_SIZE
from text_generation_common.speculate import refusal as speculate_refusal
from text_generation_server.utils import hub

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "bigscience/bloom-560m"
DEFAULT_MASTER_ADDR = "localhost"
DEFAULT_MASTER_PORT = 29500
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
# Cache variables in order of preference; all that are set must name the same directory.
CACHE_ENV_VARS = ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE")
# TGIS's deprecated engine names -> the engine they stand for (used only when that engine exists).
ENGINE_ALIASES = {"hf_custom_tp": "tgis_native"}
# NVIDIA_VISIBLE_DEVICES values that are not a device list.
NON_LIST_DEVICE_VALUES = frozenset({"all", "none", "void", "nodevfiles"})


class LaunchError(Exception):
    """A fatal launch problem; str() is the one line shown to the operator."""


@dataclass(frozen=True, slots=True)
class LaunchFlags:
    """The launcher's flags exactly as click parsed them (flag or env var)."""

    model_name: str = DEFAULT_MODEL_NAME
    revision: str | None = None
    deployment_framework: str = DEFAULT_DEPLOYMENT_FRAMEWORK
    dtype: str | None = None
    dtype_str: str | None = None
    quantize: str | None = None
    speculate: int = 0
    speculator_name: str | None = None
    speculator_revision: str | None = None
    speculator_max_batch_size: int = DEFAULT_SPECULATOR_MAX_BATCH_SIZE
    speculator_batch_gate: str = "measured"
    speculator_n_candidates: int | None = None
    speculator_top_k_tokens_per_head: tuple[int, ...] | None = None
    num_shard: int | None = None
    max_concurrent_requests: int = router_defaults.DEFAULT_MAX_CONCURRENT_REQUESTS
    max_sequence_length: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_prefill_padding: float = router_defaults.DEFAULT_MAX_PREFILL_PADDING
    max_batch_prefill_tokens: int = router_defaults.DEFAULT_MAX_BATCH_PREFILL_TOKENS
    batch_safety_margin: int = DEFAULT_BATCH_SAFETY_MARGIN
    max_waiting_tokens: int = router_defaults.DEFAULT_MAX_WAITING_TOKENS
    max_best_of: int = router_defaults.DEFAULT_MAX_BEST_OF
    stream_interval: int = 1
    max_stream_interval: int = 0
    max_decode_steps: int = router_defaults.DEFAULT_MAX_DECODE_STEPS
    max_decode_call_ms: float = router_defaults.DEFAULT_MAX_DECODE_CALL_MS
    port: int = router_defaults.DEFAULT_PORT
    grpc_port: int = router_defaults.DEFAULT_GRPC_PORT
    shard_uds_path: str | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    json_output: bool = False
    output_special_tokens: bool = False
    default_include_stop_seqs: bool = True
    cuda_process_memory_fraction: float = 1.0
    shard_threads: int | None = None
    shard_cpus: str | None = None
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_cert_path: str | None = None
    drain_timeout_s: float = router_defaults.DEFAULT_DRAIN_TIMEOUT_S
    otlp_endpoint: str | None = None
    otlp_service_name: str = router_defaults.DEFAULT_OTLP_SERVICE_NAME
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    scheduling_policy: str = "fcfs"
    allow_runtime_adapter_loading: bool = False
    responses_store_size: int = 0
    log_level: str = "info"
    # authentication (router/cli_options.AUTH_PARAMS): passed on to the router
    api_key: str | None = None
    jwt_secret: str | None = None
    jwt_public_key_path: str | None = None
    jwt_audience: str | None = None
    jwt_issuer: str | None = None
    jwt_tenant_claim: str = "sub"
    auth_health: bool = False
    tenant_max_concurrent_requests: int = 0


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Everything needed to start the shards and the router; built by resolve_config()."""

    model_name: str  # as given: hub id or directory (the shards resolve it the same way)
    model_dir: Path  # the directory holding config.json
    revision: str | None
    cache_dir: str  # Hugging Face hub cache, passed to the shards as HF_HUB_CACHE
    deployment_framework: str  # a key of the engine registry (aliases resolved)
    dtype: str | None  # None: the engine's default
    num_shard: int
    max_concurrent_requests: int
    max_sequence_length: int
    max_new_tokens: int  # < max_sequence_length
    max_batch_size: int
    max_prefill_padding: float
    max_batch_prefill_tokens: int  # 0 = no limit
    batch_safety_margin: int  # percent of free memory the shards hold back
    max_waiting_tokens: int
    max_best_of: int  # the router's MAX_BEST_OF (the TGI door)
    stream_interval: int  # the router's STREAM_INTERVAL
    max_stream_interval: int  # and MAX_STREAM_INTERVAL (0 = fixed)
    max_decode_steps: int  # the router's MAX_DECODE_STEPS
    max_decode_call_ms: float  # and MAX_DECODE_CALL_MS
    port: int  # HTTP /health and /metrics
    grpc_port: int  # external gRPC API
    shard_uds_path: str  # shard i listens on f"{shard_uds_path}-{i}"
    master_addr: str
    master_port: int
    collective_timeout_s: float  # a shard waits this long in one collective for its peers
    json_output: bool
    output_special_tokens: bool
    default_include_stop_seqs: bool
    cuda_process_memory_fraction: float
    log_level: str
    tls_cert_path: str | None = None  # passed to the router (checked readable here)
    tls_key_path: str | None = None
    tls_client_ca_cert_path: str | None = None
    drain_timeout_s: float = router_defaults.DEFAULT_DRAIN_TIMEOUT_S
    otlp_endpoint: str | None = None
    otlp_service_name: str = router_defaults.DEFAULT_OTLP_SERVICE_NAME
    tool_call_parser: str | None = None  # passed to the router
    reasoning_parser: str | None = None  # passed to the router
    scheduling_policy: str = "fcfs"  # passed to the router
    allow_runtime_adapter_loading: bool = False  # passed to the router
    responses_store_size: int = 0  # passed to the router
    placements: tuple[ShardPlacement, ...] = ()  # per rank: intra-op threads and pinning
    quantize: str | None = None  # QUANTIZE, passed to the shards (checked here, and there for the device)
    speculate: int = 0  # SPECULATE, SPECULATOR_NAME and SPECULATOR_MAX_BATCH_SIZE, passed to the shards
    speculator_dir: Path | None = None  # SPECULATOR_NAME resolved (a directory with config.json)
    speculator_max_batch_size: int = DEFAULT_SPECULATOR_MAX_BATCH_SIZE
    speculator_batch_gate: str = "measured"
    speculator_n_candidates: int | None = None  # an MLP speculator's candidate tree (None: its config's)
    speculator_top_k_tokens_per_head: tuple[int, ...] | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)  # the router's; secrets go in its environment

    def socket_path(self, rank: int) -> str:
        return shard_socket_path(self.shard_uds_path, rank)


# --- resolution ---------------------------------------------------------------------------------


def resolve_cache_dir(env: Mapping[str, str]) -> str:
    """HF_HUB_CACHE / TRANSFORMERS_CACHE / HUGGINGFACE_HUB_CACHE (must agree), else
    $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    named = [(var, env[var]) for var in CACHE_ENV_VARS if env.get(var)]
    if named:
        if len({os.path.normpath(os.path.expanduser(value)) for _, value in named}) > 1:
            listed = ", ".join(f"{var}={value}" for var, value in named)
            raise LaunchError(f"cache directories disagree ({listed}): set only HF_HUB_CACHE")
        var, value = named[0]
        if var != "HF_HUB_CACHE":
            logger.warning("%s is deprecated: use HF_HUB_CACHE", var)
        return os.path.expanduser(value)
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".cache", "huggingface", "hub")


def resolve_model_dir(model_name: str, revision: str | None, cache_dir: str, what: str = "model") -> Path:
    """A local directory with config.json, or the snapshot of a hub id in the local cache
    (`what`: how errors name it, the model or its speculator)."""
    path = Path(model_name)
    if path.is_absolute() and not path.is_dir():
        raise LaunchError(f"{what} directory {model_name} does not exist")
    try:
        model_dir = hub.resolve_model_dir(model_name, revision, cache_dir=cache_dir)
    except hub.ModelNotFoundError:
        raise LaunchError(
            f"{what} {model_name!r} (revision {revision or 'main'}) not found: it is not a local directory "
            f"and not in the Hugging Face cache at {cache_dir} "
            f"(run `text-generation-server download-weights {model_name}`)"
        ) from None
    if not (model_dir / "config.json").is_file():
        raise LaunchError(f"{what} directory {model_dir} has no config.json")
    return model_dir


def resolve_engine(name: str, engines: Mapping[str, EngineSpec] = ENGINES) -> str:
    """The registry name for `name`; TGIS's alias hf_custom_tp counts only if tgis_native exists."""
    target = ENGINE_ALIASES.get(name)
    if target is not None and target in engines:
        logger.warning("deployment framework %r is deprecated: use %r", name, target)
        return target
    if name not in engines:
        raise LaunchError(
            f"unknown deployment framework {name!r}; choose one of: {', '.join(sorted(engines))}"
        )
    return name


def resolve_dtype(dtype: str | None, dtype_str: str | None) -> str | None:
    """--dtype and --dtype-str name the same setting: they must agree when both are set."""
    if dtype and dtype_str and dtype != dtype_str:
        raise LaunchError(f"--dtype ({dtype}) and --dtype-str ({dtype_str}) disagree: set only one")
    value = dtype or dtype_str or None
    if value is not None and value not in DTYPES:
        raise LaunchError(f"unsupported dtype {value!r}; choose one of: {', '.join(DTYPES)}")
    return value


def resolve_num_shard(num_shard: int | None, env: Mapping[str, str]) -> int:
    """--num-shard / NUM_SHARD and NUM_GPUS must match if both are set; default: the number of
    visible devices (CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES), else 1."""
    num_gpus = _positive_int_env(env, "NUM_GPUS")
    if num_shard is not None and num_gpus is not None and num_shard != num_gpus:
        raise LaunchError(f"--num-shard/NUM_SHARD ({num_shard}) and NUM_GPUS ({num_gpus}) disagree")
    visible = _visible_devices(env)
    wanted = num_shard if num_shard is not None else num_gpus
    if wanted is None:
        return max(1, visible[1]) if visible else 1
    if wanted > 1 and visible and 0 < visible[1] < wanted:
        raise LaunchError(
            f"{wanted} shards need {wanted} GPUs, but {visible[0]} lists {visible[1]}: "
            "set NUM_SHARD (or NUM_GPUS) to the number of visible GPUs"
        )
    return wanted


def _visible_devices(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, count) of the first of CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES that is
    set; count 0 where it is not a list ("all", "none", ...); None when neither is set."""
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(var)
        if value is None:
            continue
        if value.strip().lower() in NON_LIST_DEVICE_VALUES:
            return var, 0
        return var, len([d for d in value.split(",") if d.strip()])
    return None


def _positive_int_env(env: Mapping[str, str], var: str) -> int | None:
    value = env.get(var, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"{var} must be a positive integer, got {value!r}")
    return int(value)


def check_num_shard(num_shard: int, engine: str, engines: Mapping[str, EngineSpec] = ENGINES) -> None:
    """More than one shard needs an engine whose registry entry says it shards (tensor parallel)."""
    if num_shard > 1 and not engines[engine].capabilities.tensor_parallel:
        raise LaunchError(
            f"{num_shard} shards need tensor parallelism, which engine {engine!r} does not support: "
            "run one shard (--num-shard 1) or choose an engine that supports tensor parallelism"
        )


def check_engine_installed(engine: str, engines: Mapping[str, EngineSpec] = ENGINES) -> None:
    """An engine that needs an optional extra (onnxruntime) fails here, before any process starts."""
    spec = engines[engine].capabilities
    missing = [module for module in spec.requires if importlib.util.find_spec(module) is None]
    if missing:
        raise LaunchError(
            f"engine {engine!r} needs {', '.join(missing)}, which is not installed: {spec.install_hint}"
        )


def check_quantize(quantize: str | None, engine: str, num_shard: int) -> None:
    refuse(quantize_refusal(quantize, engine, num_shard))


def check_speculate(
    speculate: int,
    max_batch_size: int,
    engine: str,
    speculator_name: str | None = None,
    num_shard: int = 1,
    tree: bool = False,
) -> None:
    refuse(speculate_refusal(speculate, max_batch_size, engine, speculator_name, num_shard, tree))


def refuse(reason: str | None) -> None:
    """Stop the launch with `reason` (None: nothing to refuse)."""
    if reason is not None:
        raise LaunchError(reason)


# TGIS switches that change how the shard runs the model, each read as TGIS reads it (on unless
# false/0/no/off). FLASH_ATTENTION and PAGED_ATTENTION both mean the paged engine: accepted with
# DEPLOYMENT_FRAMEWORK=tgis_native, refused with any other engine (never a silent engine swap).
# The others are not implemented: asking for one fails instead of starting without it.
PAGED_ENGINE = "tgis_native"
PAGED_SWITCHES = ("FLASH_ATTENTION", "PAGED_ATTENTION")
UNSUPPORTED_SWITCHES = {
    "PT2_COMPILE": "torch.compile of the model, which this server does not support yet",
}
OFF_VALUES = ("", "false", "0", "no", "off")


def check_switches(env: Mapping[str, str], engine: str) -> None:
    for var in PAGED_SWITCHES:
        value = env.get(var, "")
        if value.strip().lower() not in OFF_VALUES and engine != PAGED_ENGINE:
            raise LaunchError(
                f"{var}={value} asks for the {PAGED_ENGINE} engine's paged attention: set "
                f"DEPLOYMENT_FRAMEWORK={PAGED_ENGINE} (engine {engine!r} is selected) or unset {var}"
            )
    for var, what in UNSUPPORTED_SWITCHES.items():
        value = env.get(var, "")
        if value.strip().lower() not in OFF_VALUES:
            raise LaunchError(f"{var}={value} asks for {what}: unset {var}")


def read_model_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LaunchError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"{model_dir / 'config.json'} does not hold a JSON object")
    return config


def model_sequence_length(model_dir: Path) -> int | None:
    """The context length recorded in the model's config.json, if any."""
    return context_length(read_model_config(model_dir))


def check_model_kind(model_dir: Path, engine: str, engines: Mapping[str, EngineSpec] = ENGINES) -> None:
    """An encoder-decoder model needs an engine whose registry entry says seq2seq."""
    if read_model_config(model_dir).get("is_encoder_decoder") and not engines[engine].capabilities.seq2seq:
        serving = sorted(name for name, spec in engines.items() if spec.capabilities.seq2seq)
        raise LaunchError(
            f"engine {engine!r} serves decoder-only models and {model_dir.name} is an encoder-decoder "
            f"model: choose one of {', '.join(serving) or 'no engine yet'}"
        )


def resolve_max_sequence_length(flag: int | None, model_max: int | None) -> int:
    if flag is None:
        return model_max or DEFAULT_MAX_SEQUENCE_LENGTH
    if model_max is not None and flag > model_max:
        logger.warning("--max-sequence-length %d is above the model's own limit of %d", flag, model_max)
    return flag


def resolve_max_new_tokens(max_new_tokens: int, max_sequence_length: int) -> int:
    if max_new_tokens < max_sequence_length:
        return max_new_tokens
    logger.warning(
        "--max-new-tokens (%d) must be < max sequence length (%d): lowering it to %d",
        max_new_tokens,
        max_sequence_length,
        max_sequence_length - 1,
    )
    return max_sequence_length - 1


def resolve_max_stream_interval(flags: LaunchFlags) -> int:
    if flags.max_stream_interval and flags.max_stream_interval < flags.stream_interval:
        raise LaunchError(
            f"--max-stream-interval ({flags.max_stream_interval}) must be 0 or at least "
            f"--stream-interval ({flags.stream_interval})"
        )
    return flags.max_stream_interval


def resolve_auth(flags: LaunchFlags) -> AuthConfig:
    try:
        auth = auth_config({name: getattr(flags, name) for name in AUTH_PARAMS})
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    if auth.jwt_public_key_path and not os.access(auth.jwt_public_key_path, os.R_OK):
        raise LaunchError(f"jwt_public_key_path {auth.jwt_public_key_path} is not a readable file")
    return auth


def resolve_config(flags: LaunchFlags, env: Mapping[str, str]) -> LaunchConfig:
    """Check and complete `flags`; raises LaunchError at the first problem."""
    engine = resolve_engine(flags.deployment_framework)
    check_switches(env, engine)
    dtype = resolve_dtype(flags.dtype, flags.dtype_str)
    num_shard = resolve_num_shard(flags.num_shard, env)
    check_num_shard(num_shard, engine)
    check_quantize(flags.quantize, engine, num_shard)
    tree = flags.speculator_n_candidates is not None or flags.speculator_top_k_tokens_per_head is not None
    check_speculate(
        flags.speculate, flags.speculator_max_batch_size, engine, flags.speculator_name, num_shard, tree
    )
    check_engine_installed(engine)
    check_tls_files(flags.tls_cert_path, flags.tls_key_path, flags.tls_client_ca_cert_path)
    auth = resolve_auth(flags)
    cache_dir = resolve_cache_dir(env)
    model_dir = resolve_model_dir(flags.model_name, flags.revision, cache_dir)
    check_model_kind(model_dir, engine)
    speculator_dir = None
    if flags.speculator_name:
        speculator_dir = resolve_model_dir(
            flags.speculator_name, flags.speculator_revision, cache_dir, "speculator"
        )
    max_sequence_length = resolve_max_sequence_length(
        flags.max_sequence_length, model_sequence_length(model_dir)
    )
    try:
        placements = shard_placements(
            num_shard, flags.shard_threads, flags.shard_cpus, env.get("OMP_NUM_THREADS")
        )
    except PlacementError as exc:
        raise LaunchError(str(exc)) from None
    for var in ("MAX_BATCH_WEIGHT", "MAX_PREFILL_WEIGHT"):
        if env.get(var):
            logger.warning("%s is ignored: batch weights come from the shards' memory model", var)
    return LaunchConfig(
        model_name=flags.model_name,
        model_dir=model_dir,
        revision=flags.revision,
        cache_dir=cache_dir,
        deployment_framework=engine,
        dtype=dtype,
        num_shard=num_shard,
        max_concurrent_requests=flags.max_concurrent_requests,
        max_sequence_length=max_sequence_length,
        max_new_tokens=resolve_max_new_tokens(flags.max_new_tokens, max_sequence_length),
        max_batch_size=flags.max_batch_size,
        max_prefill_padding=flags.max_prefill_padding,
        max_batch_prefill_tokens=flags.max_batch_prefill_tokens,
        batch_safety_margin=flags.batch_safety_margin,
        max_waiting_tokens=flags.max_waiting_tokens,
        max_best_of=flags.max_best_of,
        stream_interval=flags.stream_interval,
        max_stream_interval=resolve_max_stream_interval(flags),
        max_decode_steps=flags.max_decode_steps,
        max_decode_call_ms=flags.max_decode_call_ms,
        port=flags.port,
        grpc_port=flags.grpc_port,
        shard_uds_path=flags.shard_uds_path or default_uds_path(),
        master_addr=flags.master_addr,
        master_port=flags.master_port,
        collective_timeout_s=flags.collective_timeout_s,
        json_output=flags.json_output,
        output_special_tokens=flags.output_special_tokens,
        default_include_stop_seqs=flags.default_include_stop_seqs,
        cuda_process_memory_fraction=flags.cuda_process_memory_fraction,
        log_level=flags.log_level,
        tls_cert_path=flags.tls_cert_path,
        tls_key_path=flags.tls_key_path,
        tls_client_ca_cert_path=flags.tls_client_ca_cert_path,
        drain_timeout_s=flags.drain_timeout_s,
        otlp_endpoint=flags.otlp_endpoint,
        otlp_service_name=flags.otlp_service_name,
        tool_call_parser=flags.tool_call_parser,
        reasoning_parser=flags.reasoning_parser,
        scheduling_policy=flags.scheduling_policy,
        allow_runtime_adapter_loading=flags.allow_runtime_adapter_loading,
        responses_store_size=flags.responses_store_size,
        placements=tuple(placements),
        quantize=flags.quantize,
        speculate=flags.speculate,
        speculator_dir=speculator_dir,
        speculator_max_batch_size=flags.speculator_max_batch_size,
        speculator_batch_gate=flags.speculator_batch_gate,
        speculator_n_candidates=flags.speculator_n_candidates,
        speculator_top_k_tokens_per_head=flags.speculator_top_k_tokens_per_head,
        auth=auth,
    )


# --- child processes ----------------------------------------------------------------------------


def script_command(script: str, module: str) -> list[str]:
    """How to run a console script: the one beside this interpreter (same virtualenv), else the
    one on PATH, else `python -m module`."""
    beside = Path(sys.executable).parent / script
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    on_path = shutil.which(script)
    return [on_path] if on_path else [sys.executable, "-m", module]


def server_command() -> list[str]:
    return script_command("text-generation-server", "text_generation_server.cli")


def shard_command(config: LaunchConfig) -> list[str]:
    argv = [
        *server_command(),
        "serve",
        config.model_name,
        config.deployment_framework,
        "--uds-path",
        config.shard_uds_path,
        "--max-sequence-length",
        str(config.max_sequence_length),
        "--max-new-tokens",
        str(config.max_new_tokens),
        "--max-batch-size",
        str(config.max_batch_size),
        "--max-batch-prefill-tokens",
        str(config.max_batch_prefill_tokens),
    ]
    if config.dtype:
        argv += ["--dtype", config.dtype]
    if config.quantize:
        argv += ["--quantize", config.quantize]
    if config.speculate:
        argv += ["--speculate", str(config.speculate)]
    if config.speculator_dir is not None:
        argv += ["--speculator-name", str(config.speculator_dir)]
    if config.speculate or config.speculator_dir is not None:
        argv += ["--speculator-max-batch-size", str(config.speculator_max_batch_size)]
        argv += ["--speculator-batch-gate", config.speculator_batch_gate]
    if config.speculator_n_candidates is not None:
        argv += ["--speculator-n-candidates", str(config.speculator_n_candidates)]
    if config.speculator_top_k_tokens_per_head is not None:
        per_head = ",".join(map(str, config.speculator_top_k_tokens_per_head))
        argv += ["--speculator-top-k-tokens-per-head", per_head]
    if config.revision:
        argv += ["--revision", config.revision]
    return argv


def shard_env(config: LaunchConfig, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The inherited environment plus the rank, rendezvous, cache and memory settings of shard `rank`."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(config.num_shard),
        LOCAL_SIZE=str(config.num_shard),
        CROSS_SIZE="1",
        CROSS_RANK="0",
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(config.master_port),
        COLLECTIVE_TIMEOUT=str(config.collective_timeout_s),
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=config.cache_dir,
        PYTHONUNBUFFERED="1",
        JSON_OUTPUT="true" if config.json_output else "false",
        LOG_LEVEL=config.log_level,
        BATCH_SAFETY_MARGIN=str(config.batch_safety_margin),
        CUDA_PROCESS_MEMORY_FRACTION=str(config.cuda_process_memory_fraction),
        NCCL_ASYNC_ERROR_HANDLING="1",
        TORCH_NCCL_AVOID_RECORD_STREAMS="1",
        SAFETENSORS_FAST_GPU="1",
    )
    if rank < len(config.placements):
        placement = config.placements[rank]
        env["OMP_NUM_THREADS"] = str(placement.threads)
        if placement.cpus is not None:
            env["CPU_AFFINITY"] = ",".join(str(c) for c in sorted(placement.cpus))
    # TGIS: expandable segments unless configured; set-but-empty means "use torch's default".
    alloc_conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if alloc_conf is None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif not alloc_conf:
        del env["PYTORCH_CUDA_ALLOC_CONF"]
    return env


def router_command(config: LaunchConfig, tokenizer_dir: str | os.PathLike[str]) -> list[str]:
    def switch(name: str, on: bool) -> str:
        return f"--{name}" if on else f"--no-{name}"

    return [
        *script_command("text-generation-router", "router.cli"),
        "--tokenizer-path",
        str(tokenizer_dir),
        "--model-name",
        config.model_name,
        "--master-shard-uds-path",
        config.socket_path(0),
        "--max-concurrent-requests",
        str(config.max_concurrent_requests),
        "--max-sequence-length",
        str(config.max_sequence_length),
        "--max-new-tokens",
        str(config.max_new_tokens),
        "--max-batch-size",
        str(config.max_batch_size),
        "--max-prefill-padding",
        str(config.max_prefill_padding),
        "--max-batch-prefill-tokens",
        str(config.max_batch_prefill_tokens),
        "--max-waiting-tokens",
        str(config.max_waiting_tokens),
        "--max-best-of",
        str(config.max_best_of),
        "--stream-interval",
        str(config.stream_interval),
        "--max-stream-interval",
        str(config.max_stream_interval),
        "--max-decode-steps",
        str(config.max_decode_steps),
        "--max-decode-call-ms",
        str(config.max_decode_call_ms),
        "--port",
        str(config.port),
        "--grpc-port",
        str(config.grpc_port),
        switch("output-special-tokens", config.output_special_tokens),
        switch("default-include-stop-seqs", config.default_include_stop_seqs),
        switch("json-output", config.json_output),
        "--drain-timeout-secs",
        str(config.drain_timeout_s),
        "--otlp-service-name",
        config.otlp_service_name,
        *_optional("--otlp-endpoint", config.otlp_endpoint),
        *_optional("--tool-call-parser", config.tool_call_parser),
        *_optional("--reasoning-parser", config.reasoning_parser),
        "--scheduling-policy",
        config.scheduling_policy,
        switch("allow-runtime-adapter-loading", config.allow_runtime_adapter_loading),
        "--responses-store-size",
        str(config.responses_store_size),
        *_optional("--tls-cert-path", config.tls_cert_path),
        *_optional("--tls-key-path", config.tls_key_path),
        *_optional("--tls-client-ca-cert-path", config.tls_client_ca_cert_path),
        *_auth_args(config.auth),
    ]


def _auth_args(auth: AuthConfig) -> list[str]:
    """The router's authentication flags, but the secrets (router_env passes those)."""
    return [
        *_optional("--jwt-public-key-path", auth.jwt_public_key_path),
        *_optional("--jwt-audience", auth.jwt_audience),
        *_optional("--jwt-issuer", auth.jwt_issuer),
        "--jwt-tenant-claim",
        auth.tenant_claim,
        "--auth-health" if auth.protect_health else "--no-auth-health",
        "--tenant-max-concurrent-requests",
        str(auth.tenant_max_concurrent_requests),
    ]


def _optional(flag: str, value: str | None) -> list[str]:
    return [flag, value] if value else []


def check_tls_files(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """TGIS's startup checks: both cert and key, every file readable."""
    if bool(cert) != bool(key):
        raise LaunchError("tls: must provide both cert and key")
    if client_ca and not cert:
        raise LaunchError("tls: a client CA needs a server cert and key")
    for what, path in (("cert", cert), ("key", key), ("client ca cert", client_ca)):
        if path:
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as exc:
                raise LaunchError(f"couldn't load {what} from {path}: {exc.strerror or exc}") from None


def router_env(config: LaunchConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment, plus the router's secrets (never on a command line)."""
    env = {**base, "PYTHONUNBUFFERED": "1", "LOG_LEVEL": config.log_level}
    env.pop("API_KEY", None)
    env.pop("JWT_SECRET", None)
    if config.auth.api_keys:
        env["API_KEY"] = ",".join(config.auth.api_keys)
    if config.auth.jwt_secret:
        env["JWT_SECRET"] = config.auth.jwt_secret
    return env
