"""`text-generation-server`: run a model shard and manage model weights.

    text-generation-server serve MODEL_NAME [DEPLOYMENT_FRAMEWORK] [options]
    text-generation-server download-weights MODEL_NAME [--revision] [--extension] [--auto-convert]
    text-generation-server convert-to-safetensors MODEL_NAME [--revision]
    text-generation-server convert-to-fast-tokenizer MODEL_NAME [--revision] [--output-path]
    text-generation-server build-cpu-kernels [--target NAME ...] [--output-dir DIR]

Every option can also be set through the environment variable named in its help (TGIS names).
This module and config.py are the only readers of the environment in this package.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import click

from text_generation_common.heap import freeze_loaded_heap
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
from text_generation_server.config import (
    CPU_ATTENTION_MODES,
    CPU_FORWARD_MODES,
    DEFAULT_BATCH_SAFETY_MARGIN,
    DEFAULT_DEPLOYMENT_FRAMEWORK,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DTYPES,
    ESTIMATE_MEMORY_MODES,
    GPU_ATTENTION_MODES,
    LINEAR_LAYOUTS,
    ServerConfig,
)
from text_generation_server.kernels import cpu_build

logger = logging.getLogger(__name__)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--log-level", envvar="LOG_LEVEL", default="info", help="Log level [env LOG_LEVEL].")
@click.option(
    "--json-output/--no-json-output",
    envvar="JSON_OUTPUT",
    default=False,
    help="Log JSON lines [env JSON_OUTPUT].",
)
def app(log_level: str, json_output: bool) -> None:
    """Model shard of the TGIS-compatible inference server."""
    setup_logging(log_level, json_output)


def pin_to(cpu_list: str) -> None:
    """Restrict this process (its threads, and every thread it starts later) to the CPUs of
    `cpu_list`; a list it cannot use raises PlacementError (a ValueError)."""
    from text_generation_common.cpu_placement import check_allowed, parse_cpu_list

    cpus = parse_cpu_list(cpu_list, "CPU_AFFINITY")
    check_allowed(cpus, "CPU_AFFINITY")
    # Threads that imports already started keep their own mask: pin each of them too.
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)
    logger.info("pinned to CPUs %s", cpu_list)


@app.command()
@click.argument("model_name", envvar="MODEL_NAME")
@click.argument("deployment_framework", envvar="DEPLOYMENT_FRAMEWORK", default=DEFAULT_DEPLOYMENT_FRAMEWORK)
@click.option(
    "--revision", envvar="REVISION", default=None, help="Model revision in the HF cache [env REVISION]."
)
@click.option(
    "--dtype",
    envvar=["DTYPE", "DTYPE_STR"],
    type=click.Choice(DTYPES),
    default=None,
    help="Weights and activations dtype; default float16 on CUDA, float32 on CPU [env DTYPE, DTYPE_STR].",
)
@click.option(
    "--max-sequence-length",
    envvar="MAX_SEQUENCE_LENGTH",
    type=click.IntRange(min=2),
    default=None,
    help="Input + generated tokens limit; default from the model config, else 2048 "
    "[env MAX_SEQUENCE_LENGTH].",
)
@click.option(
    "--max-new-tokens",
    envvar="MAX_NEW_TOKENS",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_NEW_TOKENS,
    help="Largest max_new_tokens a request may ask for [env MAX_NEW_TOKENS].",
)
@click.option(
    "--max-batch-size",
    envvar="MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BATCH_SIZE,
    help="Most requests in one batch [env MAX_BATCH_SIZE].",
)
@click.option(
    "--uds-path",
    envvar="SHARD_UDS_PATH",
    default="",
    help="Socket base path; shard RANK listens on {path}-{RANK} [env SHARD_UDS_PATH]; "
    "default text-generation-server in the temp directory.",
)
@click.option("--rank", envvar="RANK", type=click.IntRange(min=0), default=0, help="Shard rank [env RANK].")
@click.option(
    "--world-size",
    envvar="WORLD_SIZE",
    type=click.IntRange(min=1),
    default=1,
    help="Number of shards [env WORLD_SIZE].",
)
@click.option(
    "--prefix-store-path",
    envvar="PREFIX_STORE_PATH",
    default=None,
    help="Directory of tuned soft prompts, one per prefix id (decoder.pt / encoder.pt, or a PEFT "
    "prompt-tuning save) [env PREFIX_STORE_PATH].",
)
@click.option(
    "--prompt-cache-size-mb",
    envvar="PROMPT_CACHE_SIZE_MB",
    type=click.IntRange(min=1),
    default=512,
    help="Memory for loaded soft prompts, least recently used evicted first [env PROMPT_CACHE_SIZE_MB].",
)
@click.option(
    "--max-prompt-prefix-length",
    envvar="MAX_PROMPT_PREFIX_LENGTH",
    type=click.IntRange(min=1),
    default=None,
    help="Most virtual tokens of a soft prompt; default half the max sequence length "
    "[env MAX_PROMPT_PREFIX_LENGTH].",
)
@click.option(
    "--max-loras",
    envvar="MAX_LORAS",
    type=click.IntRange(min=1),
    default=8,
    help="LoRA adapters resident at once, least recently used evicted first [env MAX_LORAS].",
)
@click.option(
    "--lora-cache-size-mb",
    envvar="LORA_CACHE_SIZE_MB",
    type=click.IntRange(min=1),
    default=1024,
    help="Memory for resident LoRA adapters [env LORA_CACHE_SIZE_MB].",
)
@click.option(
    "--master-addr",
    envvar="MASTER_ADDR",
    default="127.0.0.1",
    help="Rendezvous address of the shards' process group [env MASTER_ADDR].",
)
@click.option(
    "--master-port",
    envvar="MASTER_PORT",
    type=click.IntRange(1, 65535),
    default=29500,
    help="Rendezvous port of the shards' process group [env MASTER_PORT].",
)
@click.option(
    "--collective-timeout",
    envvar="COLLECTIVE_TIMEOUT",
    type=click.FloatRange(0.0, min_open=True),
    default=60.0,
    help="Seconds a shard waits in one collective for its peers (a dead or hung rank) before it "
    "stops [env COLLECTIVE_TIMEOUT].",
)
@click.option(
    "--trust-remote-code/--no-trust-remote-code",
    envvar="TRUST_REMOTE_CODE",
    default=False,
    help="Allow model code from the model directory [env TRUST_REMOTE_CODE].",
)
@click.option(
    "--attn-implementation",
    envvar="TRANSFORMERS_ATTN_IMPL",
    default=None,
    help="transformers attention implementation, e.g. sdpa or eager [env TRANSFORMERS_ATTN_IMPL].",
)
@click.option(
    "--linear-layout",
    envvar="LINEAR_LAYOUT",
    type=click.Choice(LINEAR_LAYOUTS),
    default="auto",
    help="Layout of linear weights on CPU: auto measures each shape and picks the fastest "
    "[env LINEAR_LAYOUT].",
)
@click.option(
    "--cpu-affinity",
    envvar="CPU_AFFINITY",
    default=None,
    help="Pin this shard to these CPUs (e.g. 0-7) before anything loads; the launcher sets it "
    "from SHARD_CPUS [env CPU_AFFINITY].",
)
@click.option(
    "--kv-block-size",
    envvar="KV_BLOCK_SIZE",
    type=click.IntRange(min=1),
    default=DEFAULT_KV_BLOCK_SIZE,
    help="Tokens per block of the paged KV cache (tgis_native) [env KV_BLOCK_SIZE].",
)
@click.option(
    "--cpu-attention",
    envvar="CPU_ATTENTION",
    type=click.Choice(CPU_ATTENTION_MODES),
    default="auto",
    help="Paged decode attention on CPU (tgis_native): kernel = our C++ kernel, built at first use "
    "(fails if it cannot be built), sdpa = torch's SDPA over gathered blocks, auto = the kernel "
    "where it builds, else SDPA with a warning [env CPU_ATTENTION].",
)
@click.option(
    "--quantize",
    envvar="QUANTIZE",
    default=None,
    help="int8 = int8 weights and each token's activations in int8 on CPU (oneDNN where the CPU has VNNI "
    "or AMX-INT8, else our exact C++ kernel); the launcher's other schemes as it describes them, refused "
    "with the reason where they cannot serve [env QUANTIZE].",
)
@click.option(
    "--cpu-forward",
    envvar="CPU_FORWARD",
    type=click.Choice(CPU_FORWARD_MODES),
    default="auto",
    help="The forward of tgis_native on CPU: layers = the decoder stack of a Llama, Mistral, "
    "Qwen2 or Granite model in one C++ call (fails where it cannot serve the model), modules = "
    "transformers' forward, auto = layers where it can, else modules with the reason logged "
    "[env CPU_FORWARD].",
)
@click.option(
    "--gpu-attention",
    envvar="GPU_ATTENTION",
    type=click.Choice(GPU_ATTENTION_MODES),
    default="auto",
    help="Paged decode attention on CUDA (tgis_native): triton = our Triton kernel (read in place, "
    "CUDA graphs), sdpa = torch's SDPA over gathered blocks (no CUDA graphs), auto = Triton where "
    "it imports, else SDPA with a warning [env GPU_ATTENTION].",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    envvar="PREFIX_CACHING",
    default=True,
    help="Reuse the KV-cache blocks of prompts and answers seen before for prompts that start with "
    "them (tgis_native) [env PREFIX_CACHING].",
)
@speculate_option
@speculator_name_option
@speculator_revision_option
@speculator_max_batch_size_option
@speculator_batch_gate_option
@speculator_n_candidates_option
@speculator_top_k_tokens_per_head_option
@click.option(
    "--cpu-kv-cache-space",
    envvar="CPU_KV_CACHE_SPACE",
    type=click.FloatRange(min=0),
    default=0.0,
    help="GiB of host memory for the paged KV cache on CPU (tgis_native); 0 = enough for "
    "MAX_BATCH_SIZE sequences of MAX_SEQUENCE_LENGTH, within free memory [env CPU_KV_CACHE_SPACE].",
)
@click.option(
    "--kv-cache-blocks",
    envvar="KV_CACHE_BLOCKS",
    type=click.IntRange(min=0),
    default=0,
    help="Blocks of KV_BLOCK_SIZE tokens in the paged KV cache, on any device (tgis_native; like "
    "vLLM's --num-gpu-blocks-override); 0 = sized by memory (CPU_KV_CACHE_SPACE, MAX_BATCH_SIZE "
    "sequences on CPU, the free GPU memory on CUDA) [env KV_CACHE_BLOCKS].",
)
@click.option(
    "--run-ahead/--no-run-ahead",
    envvar="RUN_AHEAD",
    default=True,
    help="Run the next decode step of the cached batches while the router handles the last "
    "answer, so that the round trip is not between two forwards [env RUN_AHEAD].",
)
@click.option(
    "--pipeline-steps/--no-pipeline-steps",
    envvar="PIPELINE_STEPS",
    default=None,
    help="tgis_native, running ahead: queue the next step on the device before the last one is "
    "read back, so that the host's work per step (reading the ids, the answer, the next inputs) "
    "overlaps the forward instead of following it. Default: on for a single CUDA shard, off on "
    "CPU (where the forward itself holds the host) [env PIPELINE_STEPS].",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    envvar="CUDA_GRAPHS",
    default=True,
    help="tgis_native on a GPU: capture the step as CUDA graphs at start-up (one per token-count "
    "bucket, up to MAX_BATCH_SIZE + MAX_BATCH_PREFILL_TOKENS) and replay them [env CUDA_GRAPHS].",
)
@click.option(
    "--max-batch-prefill-tokens",
    envvar="MAX_BATCH_PREFILL_TOKENS",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    help="The router's prompt tokens per step (passed by the launcher): tgis_native's largest CUDA "
    f"graph holds MAX_BATCH_SIZE + this many tokens (0: the default, {DEFAULT_MAX_BATCH_PREFILL_TOKENS}) "
    "[env MAX_BATCH_PREFILL_TOKENS].",
)
@click.option(
    "--estimate-memory",
    envvar="ESTIMATE_MEMORY",
    type=click.Choice(ESTIMATE_MEMORY_MODES),
    default="auto",
    help="Batch-weight model reported to the router: auto (measured, bytes), manual (TGIS units), "
    "off [env ESTIMATE_MEMORY].",
)
@click.option(
    "--batch-safety-margin",
    envvar="BATCH_SAFETY_MARGIN",
    type=click.IntRange(0, 99),
    default=DEFAULT_BATCH_SAFETY_MARGIN,
    help="Percent of free memory held back from batches [env BATCH_SAFETY_MARGIN].",
)
@click.option(
    "--cuda-process-memory-fraction",
    envvar="CUDA_PROCESS_MEMORY_FRACTION",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    help="Share of the GPU's memory this shard may use [env CUDA_PROCESS_MEMORY_FRACTION].",
)
def serve(
    model_name: str,
    deployment_framework: str,
    revision: str | None,
    dtype: str | None,
    max_sequence_length: int | None,
    max_new_tokens: int,
    max_batch_size: int,
    uds_path: str,
    rank: int,
    world_size: int,
    prefix_store_path: str | None,
    prompt_cache_size_mb: int,
    max_prompt_prefix_length: int | None,
    max_loras: int,
    lora_cache_size_mb: int,
    master_addr: str,
    master_port: int,
    collective_timeout: float,
    trust_remote_code: bool,
    attn_implementation: str | None,
    linear_layout: str,
    cpu_affinity: str | None,
    kv_block_size: int,
    cpu_attention: str,
    quantize: str | None,
    cpu_forward: str,
    prefix_caching: bool,
    speculate: int,
    speculator_name: str | None,
    speculator_revision: str | None,
    speculator_max_batch_size: int,
    speculator_batch_gate: str,
    speculator_n_candidates: int | None,
    speculator_top_k_tokens_per_head: tuple[int, ...] | None,
    cpu_kv_cache_space: float,
    kv_cache_blocks: int,
    gpu_attention: str,
    cuda_graphs: bool,
    max_batch_prefill_tokens: int,
    run_ahead: bool,
    pipeline_steps: bool | None,
    estimate_memory: str,
    batch_safety_margin: int,
    cuda_process_memory_fraction: float,
) -> None:
    """Load MODEL_NAME with DEPLOYMENT_FRAMEWORK and serve it over a Unix socket."""
    from text_generation_server import distributed
    from text_generation_server.server import load_engine
    from text_generation_server.server import serve as serve_forever

    try:
        config = ServerConfig(
            model_name=model_name,
            deployment_framework=deployment_framework,
            revision=revision,
            dtype=dtype,
            max_sequence_length=max_sequence_length,
            max_new_tokens=max_new_tokens,
            max_batch_size=max_batch_size,
            uds_path=uds_path,
            rank=rank,
            world_size=world_size,
            prefix_store_path=prefix_store_path,
            prompt_cache_size_mb=prompt_cache_size_mb,
            max_prompt_prefix_length=max_prompt_prefix_length,
            max_loras=max_loras,
            lora_cache_size_mb=lora_cache_size_mb,
            master_addr=master_addr,
            master_port=master_port,
            collective_timeout_s=collective_timeout,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            linear_layout=linear_layout,
            run_ahead=run_ahead,
            pipeline_steps=pipeline_steps,
            kv_block_size=kv_block_size,
            cpu_attention=cpu_attention,
            quantize=quantize,
            cpu_forward=cpu_forward,
            prefix_caching=prefix_caching,
            speculate=speculate,
            speculator_name=speculator_name,
            speculator_revision=speculator_revision,
            speculator_max_batch_size=speculator_max_batch_size,
            speculator_batch_gate=speculator_batch_gate,
            speculator_n_candidates=speculator_n_candidates,
            speculator_top_k_tokens_per_head=speculator_top_k_tokens_per_head,
            cpu_kv_cache_space=cpu_kv_cache_space,
            kv_cache_blocks=kv_cache_blocks,
            gpu_attention=gpu_attention,
            cuda_graphs=cuda_graphs,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            cpu_affinity=cpu_affinity,
            estimate_memory=estimate_memory,
            batch_safety_margin=batch_safety_margin,
            cuda_process_memory_fraction=cuda_process_memory_fraction,
        )
        if config.cpu_affinity:
            pin_to(config.cpu_affinity)  # before anything loads
        distributed.join(config)
        engine, worker = load_engine(config)
        freeze_loaded_heap(f"shard {config.rank} loaded")
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        asyncio.run(serve_forever(engine, config, worker))
    finally:
        distributed.leave()


@app.command("download-weights")
@click.argument("model_name")
@click.option("--revision", envvar="REVISION", default=None, help="Revision to download [env REVISION].")
@click.option("--token", envvar="HF_TOKEN", default=None, help="Hub access token [env HF_TOKEN].")
@click.option(
    "--extension",
    "extensions",
    default=".safetensors",
    help="Comma-separated weight file extensions to download, e.g. .safetensors,.bin.",
)
@click.option(
    "--auto-convert/--no-auto-convert",
    default=True,
    help="Download .bin weights and convert them when no .safetensors weights exist.",
)
def download_weights(
    model_name: str, revision: str | None, token: str | None, extensions: str, auto_convert: bool
) -> None:
    """Download MODEL_NAME from the hub into the local HF cache (HF_HUB_CACHE)."""
    from text_generation_server.utils import hub

    wanted = [e.strip() for e in extensions.split(",") if e.strip()]
    try:
        path = hub.download_weights(
            model_name, revision=revision, extensions=wanted, auto_convert=auto_convert, token=token
        )
    except (hub.WeightsNotFoundError, FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@app.command("convert-to-safetensors")
@click.argument("model_name")
@click.option("--revision", envvar="REVISION", default=None, help="Revision in the HF cache [env REVISION].")
def convert_to_safetensors(model_name: str, revision: str | None) -> None:
    """Convert the .bin weights of MODEL_NAME (local dir or HF cache) to .safetensors beside them."""
    from text_generation_server.utils import hub, weights

    try:
        written = weights.convert_to_safetensors(hub.resolve_model_dir(model_name, revision))
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in written:
        click.echo(str(path))


@app.command("convert-to-fast-tokenizer")
@click.argument("model_name")
@click.option("--revision", envvar="REVISION", default=None, help="Revision in the HF cache [env REVISION].")
@click.option(
    "--output-path", default=None, help="Directory for tokenizer.json; default: the model directory."
)
def convert_to_fast_tokenizer(model_name: str, revision: str | None, output_path: str | None) -> None:
    """Write a fast tokenizer (tokenizer.json) for MODEL_NAME."""
    from text_generation_server.utils import hub, weights

    try:
        path = weights.convert_to_fast_tokenizer(hub.resolve_model_dir(model_name, revision), output_path)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@app.command("convert-to-onnx")
@click.argument("model_name")
@click.argument("target", required=False)
@click.option("--revision", envvar="REVISION", default=None, help="Revision in the HF cache [env REVISION].")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    help="Weights and activations of the export: float32 for CPUs, float16 for the CUDA provider.",
)
@click.option(
    "--optimize/--no-optimize",
    envvar="OPTIMIZE_ONNX_MODEL",
    default=False,
    help="Save the graph with ONNX Runtime's extended optimizations applied [env OPTIMIZE_ONNX_MODEL].",
)
@click.option(
    "--merge-graphs/--no-merge-graphs",
    envvar="MERGE_ONNX_GRAPHS",
    default=True,
    help="Accepted for TGIS compatibility: the export is always one graph for prefill and decode.",
)
def convert_to_onnx(
    model_name: str, target: str | None, revision: str | None, dtype: str, optimize: bool, merge_graphs: bool
) -> None:
    """Export MODEL_NAME (local dir or HF cache) to an ONNX decoder in optimum's layout, in TARGET
    (default: the model directory), with the model's config and tokenizer beside it."""
    from text_generation_server.onnx import onnx_export
    from text_generation_server.utils import hub

    try:
        model_dir = hub.resolve_model_dir(model_name, revision)
        out = Path(target) if target else Path(model_dir)
        written = onnx_export.export(Path(model_dir), out, dtype=dtype, optimize=optimize)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(written))


@app.command("build-cpu-kernels")
@click.option(
    "--target",
    "targets",
    multiple=True,
    type=click.Choice([t.name for t in cpu_build.TARGETS]),
    help="An instruction-set target to build (repeatable; default: every one).",
)
@click.option(
    "--output-dir",
    default=None,
    help="Where to put the libraries (default: lib/tgis-cpu-kernels in this Python environment, "
    "where the shard looks for them).",
)
def build_cpu_kernels(targets: tuple[str, ...], output_dir: str | None) -> None:
    """Build our C++ CPU kernels ahead of time for CPU families (kernels/cpu_build.py), so that a
    shard on a CPU of one loads them without a compiler: the container image's way."""
    import platform

    known = {t.name: t for t in cpu_build.TARGETS}
    if platform.machine() not in ("x86_64", "AMD64"):  # the targets are x86-64 families
        if targets:
            raise click.ClickException(f"x86-64 targets cannot be built on {platform.machine()}")
        logger.warning("no targets for %s: a shard builds its kernels at first start", platform.machine())
        return
    directory = Path(output_dir) if output_dir else cpu_build.prebuilt_dir()
    for name in targets or tuple(known):
        target = known[name]
        try:
            path = cpu_build.build(target.march, cpu_build.prebuilt_path(target, directory))
        except cpu_build.KernelBuildError as exc:
            raise click.ClickException(f"{name}: {exc}") from exc
        click.echo(str(path))


if __name__ == "__main__":
    app()
