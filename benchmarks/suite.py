"""One benchmark run, all in one command: model -> servers and points -> baselines -> report.

Order: our server once per variant (variants.py: engine x prefix caching x prefill budget;
each started, healthy, warmed up, measured at every point, stopped), the engine-only baseline
once per engine and the HF generate baseline (each in its own process, same dtype as the server
resolved), then the vLLM-CPU peer when asked for and installed (same dtype), then an external
OpenAI-compatible endpoint when one is given. Nothing runs at the same time as anything else.
Results are rewritten after every stage, so an interrupted run keeps what it measured.

The long-prompt-mix workload has one point per system instead of a concurrency sweep
(longmix.py: decode streams with long prompts arriving while they decode) and no baselines.
A workload longer than the model's context (config.json) runs the reference model with a
longer context (reference_model.with_context: same weights, RoPE positions); another model is
refused.

Each point: `warmup_rounds` closed-loop rounds of c requests at concurrency c (separate prompts),
then `repeats` runs of the measured prompts (num_prompts each, default max(16, 4c); new prompts
for every run, so that no prefix cache sees a prompt twice), each with loadavg before and after
and, for our server, the /metrics deltas (stats.server_breakdown); several runs are combined by
stats.combine_repeats. All systems get the same prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import logging
import os
import platform
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import baselines, loadgen, longmix, report, vllm_bench
from benchmarks.clients import Client, GrpcClient, OpenAIClient, served_model_name
from benchmarks.reference_model import NAME as REFERENCE_NAME
from benchmarks.reference_model import STAMP_FILE, ensure_reference_model, with_context
from benchmarks.server import (
    DEFAULT_VLLM_SCRIPT,
    OurServer,
    http_get,
    our_server,
    vllm_installed,
    vllm_peer,
)
from benchmarks.stats import (
    Scrape,
    combine_repeats,
    cpu_shares,
    cpu_times,
    parse_metrics,
    server_breakdown,
    summarize,
)
from benchmarks.variants import OURS_OPENAI, ServerVariant, adapter_id, baseline_key, plan_variants
from benchmarks.workload import LONG_MIX, Prompt, PromptMaker, WorkloadSpec, build_long_mix, build_workload
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK
from text_generation_common.model_config import context_length

logger = logging.getLogger(__name__)

SYSTEMS = ("ours", "ours-openai", "engine", "generate", "vllm")
DEFAULT_CONCURRENCY = (1, 8, 32)
SWEEP = (1, 2, 4, 8, 16, 32, 64)
RATE_WARMUP_CONCURRENCY = 8
RATE_MAX_BATCH_SIZE = 32
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS", "KMP_AFFINITY", "OMP_PROC_BIND")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchConfig:
    out_dir: Path
    model_dir: Path | None = None  # None: the reference model, built when missing
    reference: str = REFERENCE_NAME  # which reference model (reference_model.SHAPES) without model_dir
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    request_rates: tuple[float, ...] = ()  # non-empty: Poisson mode
    max_concurrency: int | None = None  # Poisson mode cap
    num_prompts: int | None = None  # None: max(16, 4c), or 4 x 8 in Poisson mode
    warmup_rounds: int = 1
    systems: tuple[str, ...] = SYSTEMS
    dtype: str | None = None
    quantize: str | None = None  # QUANTIZE of our server and of the baselines
    max_batch_size: int | None = None  # None: the largest concurrency
    server_args: tuple[str, ...] = ()
    server_env: dict[str, str] = field(default_factory=dict)
    server_cpus: set[int] | None = None
    client_cpus: set[int] | None = None
    grpc_address: str | None = None  # benchmark a running server instead of starting ours
    openai_url: str | None = None  # an extra, already running OpenAI-compatible server
    openai_model: str | None = None
    openai_prompt: str = "text"
    vllm_script: Path = DEFAULT_VLLM_SCRIPT
    vllm_args: tuple[str, ...] = ()
    engines: tuple[str, ...] = (DEFAULT_DEPLOYMENT_FRAMEWORK,)  # our server once per engine
    prefix_cache: str = "default"  # default | on | off | both (variants.plan_variants)
    prefill_budgets: tuple[int, ...] = ()  # --max-batch-prefill-tokens per variant; () = default
    adapters: tuple[int, ...] = ()  # LoRA adapters per variant, named by requests in turn; () = none
    speculate: tuple[int, ...] = ()  # --speculate per variant; () = off
    speculator: str = ""  # --speculator-name of the variants that speculate; "" = n-gram lookup
    adapter_targets: tuple[str, ...] = ("q_proj", "v_proj")  # the modules they adapt (PEFT's Llama default)
    guided_json: bool = False  # our gRPC requests carry a JSON schema (clients.GUIDED_SCHEMA)
    vllm_dtype: str | None = None  # None: the dtype our server resolved
    client: str = "own"  # the OpenAI doors' load generator: own (clients.OpenAIClient) or vllm-bench
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    repeats: int = 1  # runs per point (statistics: medians over runs) and per baseline batch size
    progress: bool = True
    plots: bool = True


@dataclass(frozen=True, slots=True)
class PointPlan:
    label: str
    concurrency: int  # closed loop: c; Poisson: the cap (0 = none)
    rate: float | None  # Poisson rate, None in closed loop
    warmup: list[Prompt]
    warmup_concurrency: int
    repeats: list[list[Prompt]]  # the measured prompts of each repeat (all different)
    # long-prompt-mix: (stream prompts, long prompts) of each warm-up round and of each repeat
    mix_warmup: list[tuple[list[Prompt], list[Prompt]]] = field(default_factory=list)
    mix_repeats: list[tuple[list[Prompt], list[Prompt]]] = field(default_factory=list)

    @property
    def is_mix(self) -> bool:
        return bool(self.mix_repeats)


def plan_mix(cfg: BenchConfig, maker: PromptMaker) -> list[PointPlan]:
    """The one point of the long-prompt mix: its warm-up runs and measured runs (new prompts each)."""
    spec = cfg.workload
    return [
        PointPlan(
            label=f"{spec.streams} streams + {spec.long_count} long",
            concurrency=spec.streams,
            rate=None,
            warmup=[],
            warmup_concurrency=spec.streams + spec.long_count,
            repeats=[],
            mix_warmup=[build_long_mix(maker, spec, f"warmup-{r}") for r in range(cfg.warmup_rounds)],
            mix_repeats=[  # warm-ups name no adapter: every measured one is loaded on first use
                build_long_mix(
                    maker,
                    spec,
                    f"point-0-{r}" if r else "point-0",
                    r * spec.long_count if spec.long_adapters else None,
                )
                for r in range(max(1, cfg.repeats))
            ],
        )
    ]


def plan_points(cfg: BenchConfig, maker: PromptMaker) -> list[PointPlan]:
    spec = cfg.workload
    if spec.kind == LONG_MIX:
        return plan_mix(cfg, maker)
    shapes: list[tuple[str, int, float | None, int, int]] = []  # label, cap, rate, warm-up c, count
    if cfg.request_rates:
        warm_c = cfg.max_concurrency or RATE_WARMUP_CONCURRENCY
        for rate in cfg.request_rates:
            shapes.append((f"rate {rate:g}/s", cfg.max_concurrency or 0, rate, warm_c, cfg.num_prompts or 32))
    else:
        for c in cfg.concurrency:
            shapes.append((f"c={c}", c, None, c, cfg.num_prompts or max(16, 4 * c)))
    return [
        PointPlan(
            label=label,
            concurrency=cap,
            rate=rate,
            warmup=build_workload(maker, spec, warm_c * cfg.warmup_rounds, salt=f"warmup-{k}"),
            warmup_concurrency=warm_c,
            repeats=[
                build_workload(maker, spec, count, salt=f"point-{k}-{r}" if r else f"point-{k}")
                for r in range(max(1, cfg.repeats))
            ],
        )
        for k, (label, cap, rate, warm_c, count) in enumerate(shapes)
    ]


async def measure(
    client: Client, plans: list[PointPlan], system: str, cfg: BenchConfig, metrics_url: str | None = None
) -> list[dict[str, Any]]:
    points = []
    for plan in plans:
        if plan.is_mix:
            points.append(await _measure_mix(client, plan, system, cfg, metrics_url))
            continue
        if plan.warmup:
            await loadgen.closed_loop(
                client, plan.warmup, plan.warmup_concurrency, f"{system} warm-up {plan.label}", cfg.progress
            )
        runs = []
        for r, prompts in enumerate(plan.repeats):
            label = f"{system} {plan.label}" + (f" #{r + 1}" if len(plan.repeats) > 1 else "")
            runs.append(await _measure_once(client, plan, prompts, label, cfg, metrics_url))
        point = combine_repeats(runs)
        point["warmup_requests"] = len(plan.warmup)
        if point["failed"]:
            first = next(e for e in point["errors"] if e)
            logger.warning("%s %s: %d request(s) failed, e.g. %s", system, plan.label, point["failed"], first)
        points.append(point)
    return points


async def _measure_mix(
    client: Client, plan: PointPlan, system: str, cfg: BenchConfig, metrics_url: str | None
) -> dict[str, Any]:
    """The long-prompt mix: warm-up runs, then the measured runs, combined (longmix.combine_mix)."""
    interval = cfg.workload.long_interval_s
    for k, (streams, longs) in enumerate(plan.mix_warmup):
        logger.info("%s warm-up %s #%d", system, plan.label, k + 1)
        await longmix.drive(client, streams, longs, interval, cfg.request_timeout_s)
    runs = []
    for r, (streams, longs) in enumerate(plan.mix_repeats):
        label = f"{system} {plan.label}" + (f" #{r + 1}" if len(plan.mix_repeats) > 1 else "")

        async def drive(streams: list[Prompt] = streams, longs: list[Prompt] = longs) -> dict[str, Any]:
            stream_results, long_results, duration = await longmix.drive(
                client, streams, longs, interval, cfg.request_timeout_s
            )
            return longmix.summarize_mix(stream_results, long_results, duration)

        point = await _instrumented(drive, metrics_url)
        point.update(
            mode=LONG_MIX, max_concurrency=plan.concurrency, request_rate="inf", num_prompts=len(streams)
        )
        logger.info(
            "%s: streams ITL p50 %.1f / p99 %.1f ms (during long prefills p99 %.1f ms), "
            "long TTFT p50 %.0f ms; %d + %d ok, %d failed (load %.2f)",
            label, point["p50_itl_ms"], point["p99_itl_ms"], point["during_long_itl"]["p99"],
            point["long"]["median_ttft_ms"], point["completed"], point["long"]["completed"],
            point["failed"] + point["long"]["failed"], point["loadavg_before"][0],
        )  # fmt: skip
        runs.append(point)
    point = longmix.combine_mix(runs)
    point["warmup_requests"] = sum(len(s) + len(lg) for s, lg in plan.mix_warmup)
    failed = point["failed"] + point["long"]["failed"]
    if failed:
        errors = [e for e in point["errors"] + point["long"]["errors"] if e]
        logger.warning("%s %s: %d request(s) failed, e.g. %s", system, plan.label, failed, errors[0])
    return point


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the servers are reaped after the run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _instrumented(
    drive: Callable[[], Awaitable[dict[str, Any]]], metrics_url: str | None
) -> dict[str, Any]:
    """Run `drive` (it returns the point's statistics, with `duration`) with what every point
    records around it: loadavg, the client's CPU time (this process's, and a client run as a
    child process: the peer's, its warm-up included), the machine's CPU shares, /metrics deltas."""
    before: Scrape | None = _scrape(metrics_url)
    load_before = list(os.getloadavg())
    cpu_before = time.process_time() + _children_cpu_s()
    host_before = cpu_times()
    stats = await drive()
    point: dict[str, Any] = {
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "client_cpu_s": time.process_time() + _children_cpu_s() - cpu_before,  # the load generator's
        "host_cpu": cpu_shares(host_before, cpu_times()),  # the whole machine over the point
    }
    point.update(stats)
    after = _scrape(metrics_url)
    if before is not None and after is not None:
        point["server_breakdown"] = server_breakdown(before, after, stats["duration"])
    return point


async def _measure_once(
    client: Client,
    plan: PointPlan,
    prompts: list[Prompt],
    label: str,
    cfg: BenchConfig,
    metrics_url: str | None,
) -> dict[str, Any]:
    async def drive() -> dict[str, Any]:
        if plan.rate is None:
            results, duration = await loadgen.closed_loop(
                client, prompts, plan.concurrency, label, cfg.progress
            )
        else:
            cap = plan.concurrency or None
            results, duration = await loadgen.poisson(
                client, prompts, plan.rate, cap, cfg.workload.seed, label, cfg.progress
            )
        return summarize(results, duration)

    point: dict[str, Any] = {
        "mode": "concurrency" if plan.rate is None else "rate",
        "max_concurrency": plan.concurrency if plan.concurrency else None,
        "request_rate": plan.rate if plan.rate is not None else "inf",
        "num_prompts": len(prompts),
    }
    point.update(await _instrumented(drive, metrics_url))
    logger.info(
        "%s: %d ok, %d failed, %.1f out tok/s, TTFT p50 %.1f ms, TPOT mean %.2f ms (load %.2f)",
        label, point["completed"], point["failed"], point["output_throughput"],
        point["median_ttft_ms"], point["mean_tpot_ms"], point["loadavg_before"][0],
    )  # fmt: skip
    return point


def _scrape(url: str | None) -> Scrape | None:
    if url is None:
        return None
    status, body = http_get(url)
    return parse_metrics(body) if status == 200 else None


# ---- metadata -----------------------------------------------------------------------------


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "sha": git("rev-parse", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def gpu_names() -> list[str]:
    """The NVIDIA GPUs this process sees (nvidia-smi's names, in CUDA_VISIBLE_DEVICES order when
    it lists indices); [] without nvidia-smi. The harness itself never imports torch."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    names = [line.strip() for line in listed if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return names
    picked = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in picked):
        return names
    return [names[int(v)] for v in picked if int(v) < len(names)]


def host_info() -> dict[str, Any]:
    cpu_model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not cpu_model:
                cpu_model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    memory_gib = None
    with contextlib.suppress(ValueError, OSError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu_model": cpu_model,
        "gpus": gpu_names(),
        "cpus": os.cpu_count(),
        "isa": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def safetensors_parameters(model_dir: Path) -> int | None:
    """Parameter count from the safetensors headers (no torch needed)."""
    total = 0
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= int(dim)
                total += count
    return total


def model_info(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    keys = (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    )  # fmt: skip
    info: dict[str, Any] = {"dir": str(model_dir), **{k: config[k] for k in keys if k in config}}
    stamp = model_dir / STAMP_FILE
    if stamp.exists():
        info["name"] = json.loads(stamp.read_text()).get("name")
    info["parameters"] = safetensors_parameters(model_dir)
    return info


def _cpus(cpus: set[int] | None) -> list[int] | None:
    return sorted(cpus) if cpus else None


def fit_context(model_dir: Path, cfg: BenchConfig) -> Path:
    """The model directory to serve: `model_dir`, or, when the workload needs more positions than
    the reference model's config.json allows, the reference model with a longer context (the
    next multiple of 1024). Another model that is too short is refused (ValueError)."""
    config = json.loads((model_dir / "config.json").read_text())
    allowed = context_length(config)
    needed = cfg.workload.max_total_len()
    if allowed is None or needed <= allowed:
        return model_dir
    if cfg.model_dir is not None:
        raise ValueError(
            f"the {cfg.workload.kind} workload needs {needed} positions (input + output) and "
            f"{model_dir} allows {allowed}: shorten the workload or use a model with a longer context"
        )
    positions = -(-needed // 1024) * 1024
    logger.info("the workload needs %d positions: the reference model with %d positions", needed, positions)
    return with_context(model_dir, positions)


# ---- the run ------------------------------------------------------------------------------


class Run:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.out = cfg.out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.all_cpus = os.sched_getaffinity(0)
        self.server_cpus = cfg.server_cpus or self.all_cpus
        if cfg.client_cpus:
            os.sched_setaffinity(0, cfg.client_cpus)  # before any client thread exists
        self.results: dict[str, Any] = {"metadata": {}, "systems": {}, "baselines": {}, "skipped": {}}
        self.paths: dict[str, Path] = {}
        self.model_dir: Path | None = None  # the served model, once execute() resolved it

    def save(self) -> None:
        self.paths = report.write(self.results, self.out, with_plots=self.cfg.plots)

    def execute(self) -> dict[str, Path]:
        cfg = self.cfg
        model_dir = fit_context(cfg.model_dir or ensure_reference_model(name=cfg.reference), cfg)
        self.model_dir = model_dir
        maker = PromptMaker(model_dir)
        plans = plan_points(cfg, maker)
        variants = plan_variants(
            cfg.engines, cfg.prefix_cache, cfg.prefill_budgets, cfg.adapters, cfg.speculate, cfg.speculator
        )
        mix = cfg.workload.kind == LONG_MIX
        meta = self.results["metadata"]
        meta.update(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=sys.argv,
            git=git_info(),
            host=host_info(),
            model=model_info(model_dir),
            workload=asdict(cfg.workload),
            workload_description=cfg.workload.describe(),
            mode=LONG_MIX if mix else "rate" if cfg.request_rates else "concurrency",
            points=[p.label for p in plans],
            engine=cfg.engines[0] if len(cfg.engines) == 1 else None,
            engines=list(cfg.engines),
            variants={v.key: v.describe() for v in variants},
            dtype_requested=cfg.dtype,
            dtype=cfg.dtype,
            quantize=cfg.quantize,
            threads={
                "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
                "server_env": cfg.server_env,
            },
            pinning={"client": _cpus(cfg.client_cpus), "servers": _cpus(cfg.server_cpus)},
            options={k: (str(v) if isinstance(v, Path | set) else v) for k, v in asdict(cfg).items()},
        )
        if "ours" in cfg.systems or OURS_OPENAI in cfg.systems:
            for variant in variants:
                stage = functools.partial(self._ours, variant, model_dir, plans)
                if len(variants) == 1:
                    stage()  # the only server of ours: its failure fails the run
                else:
                    self._guarded(variant.key, stage)
        closed_loop = not cfg.request_rates and not mix
        sizes = sorted({p.concurrency for p in plans if p.concurrency}) if closed_loop else []
        why_not = f"baselines run at the concurrencies of a closed-loop sweep, not {meta['mode']}"
        if "engine" in cfg.systems:
            for engine in cfg.engines:
                key = baseline_key("engine_only", engine, cfg.engines)
                if sizes:
                    stage = functools.partial(self._baseline, "engine", key, model_dir, sizes, engine)
                    self._guarded(key, stage)
                else:
                    self.results["skipped"][key] = why_not
        if "generate" in cfg.systems and sizes:
            self._guarded(
                "hf_generate", functools.partial(self._baseline, "generate", "hf_generate", model_dir, sizes)
            )
        elif "generate" in cfg.systems:
            self.results["skipped"]["hf_generate"] = why_not
        if "vllm" in cfg.systems:
            self._guarded("vllm", functools.partial(self._vllm, model_dir, plans))
        if cfg.openai_url:
            self._guarded("openai", functools.partial(self._openai, plans))
        self.save()
        return self.paths

    def _guarded(self, key: str, stage: Callable[[], None]) -> None:
        """Run a stage whose failure must not lose the rest of the run; record why it failed."""
        try:
            stage()
        except (RuntimeError, OSError) as exc:
            logger.error("%s failed: %s", key, exc)
            self.results["skipped"][key] = f"failed: {str(exc).splitlines()[0]}"
            self.save()

    def _ours(self, variant: ServerVariant, model_dir: Path, plans: list[PointPlan]) -> None:
        """Our server over gRPC ("ours"), and/or through its OpenAI door ("ours-openai", driven by
        the client that measures vLLM-CPU), each on a server of its own."""
        cfg = self.cfg
        doors = [door for door in ("ours", OURS_OPENAI) if door in cfg.systems]
        entries: dict[str, dict[str, Any]] = {}
        for door in doors:
            key = variant.key if door == "ours" else variant.key.replace("ours", OURS_OPENAI, 1)
            client = "grpc" if door == "ours" else "openai"
            entries[door] = {"info": {"client": client, "variant": variant.describe()}, "points": []}
            self.results["systems"][key] = entries[door]
        if cfg.grpc_address:
            entry = entries.get("ours")
            if entry is None:
                raise RuntimeError("ours-openai needs a server we start (no --grpc-address)")
            entry["info"].update(address=cfg.grpc_address, managed=False)
            entry["points"] = asyncio.run(self._drive_grpc(cfg.grpc_address, plans, None, variant.key))
            self.save()
            return
        largest = max([p.concurrency for p in plans] + [p.warmup_concurrency for p in plans])
        if cfg.request_rates and not cfg.max_concurrency:
            largest = max(largest, RATE_MAX_BATCH_SIZE)  # unbounded arrivals: room to batch them
        suffix = variant.key.removeprefix("ours").strip("[]").replace(",", "-").replace("=", "")
        for door, entry in entries.items():
            # A fresh server per door, as vLLM-CPU gets: the prompts repeat across systems, and a
            # warm prefix cache would flatter the second door.
            name = f"ours-{suffix}" if suffix else "ours"
            long_adapters = cfg.workload.long_adapters
            cold = cfg.workload.long_count * max(1, cfg.repeats)  # one new adapter per measured long prompt
            store = self._adapter_store(model_dir, cold if long_adapters else variant.adapters)
            server: OurServer = our_server(
                model_dir,
                self.out,
                dtype=cfg.dtype,
                max_batch_size=cfg.max_batch_size or largest,
                extra_args=(
                    *variant.launcher_args(),
                    *(("--quantize", cfg.quantize) if cfg.quantize else ()),
                    *cfg.server_args,
                ),
                env={**variant.env(), **store, **cfg.server_env},
                cpus=self.server_cpus,
                name=name if door == "ours" else name.replace("ours", OURS_OPENAI, 1),
            )
            with server:
                server.start(cfg.startup_timeout_s)
                resolved = server.resolved_dtype()
                if resolved:
                    self.results["metadata"]["dtype"] = resolved
                entry["info"].update(server.info, dtype=resolved, managed=True)
                if door == "ours":
                    points = self._drive_grpc(
                        server.grpc_address,
                        plans,
                        server.metrics_url,
                        variant.key,
                        () if long_adapters else variant.adapter_ids,  # prompts name their own
                    )
                    entry["points"] = asyncio.run(points)
                else:
                    url = server.openai_url
                    entry["points"] = self._openai_points(OURS_OPENAI, url, None, plans, model_dir)
            self.save()

    def _adapter_store(self, model_dir: Path, count: int) -> dict[str, str]:
        """The environment of a server whose store holds `count` LoRA adapters of the model
        (rank 8 on `--adapter-targets`, built once per run), or {} for none."""
        if not count:
            return {}
        from text_generation_server.testing.tiny_prompts import build_lora

        targets = list(self.cfg.adapter_targets)
        root = self.out / f"adapters-{'-'.join(targets)}"
        for index in range(count):
            if not (root / adapter_id(index) / "adapter_config.json").exists():
                build_lora(model_dir, root / adapter_id(index), seed=100 + index, rank=8, targets=targets)
        return {"PREFIX_STORE_PATH": str(root)}

    async def _drive_grpc(
        self,
        address: str,
        plans: list[PointPlan],
        metrics_url: str | None,
        system: str = "ours",
        adapter_ids: Sequence[str] = (),
    ) -> list[dict[str, Any]]:
        client = GrpcClient(address, self.cfg.request_timeout_s, adapter_ids, self.cfg.guided_json)
        try:
            return await measure(client, plans, system, self.cfg, metrics_url)
        finally:
            await client.close()

    def _openai_points(
        self, system: str, base_url: str, model: str | None, plans: list[PointPlan], model_dir: Path | None
    ) -> list[dict[str, Any]]:
        """The points of an OpenAI door, measured by the run's client (--client)."""
        if self.cfg.client != vllm_bench.CLIENT:
            return asyncio.run(self._drive_openai(system, base_url, model, plans))
        if model_dir is None:
            raise RuntimeError("--client vllm-bench needs the model directory for its tokenizer (--model)")
        return self._vllm_bench(system, base_url, plans, model_dir)

    def _vllm_bench(
        self, system: str, base_url: str, plans: list[PointPlan], model_dir: Path
    ) -> list[dict[str, Any]]:
        cfg = self.cfg
        missing = vllm_installed(cfg.vllm_script)
        if missing:
            raise RuntimeError(f"--client vllm-bench: {missing}")
        if cfg.request_rates or cfg.workload.kind != "fixed":
            raise RuntimeError("--client vllm-bench measures closed-loop points of the fixed workload only")
        points = []
        for plan in plans:
            name = f"vllm-bench-{system.replace('[', '-').rstrip(']')}-c{plan.concurrency}"
            result = self.out / f"{name}.json"
            num_prompts = sum(len(prompts) for prompts in plan.repeats)
            cmd = vllm_bench.command(
                cfg.vllm_script,
                base_url,
                model_dir,
                input_len=cfg.workload.input_len,
                output_len=cfg.workload.output_len,
                concurrency=plan.concurrency,
                num_prompts=num_prompts,
                num_warmups=len(plan.warmup),
                seed=cfg.workload.seed,
                result=result,
            )
            logger.info("%s %s: %s", system, plan.label, " ".join(cmd))
            log = self.out / f"{name}.log"

            async def drive(cmd: list[str] = cmd, result: Path = result, log: Path = log) -> dict[str, Any]:
                raw = vllm_bench.run_point(cmd, result, log, cfg.request_timeout_s)
                return vllm_bench.point_from_result(raw, cfg.workload.input_len, cfg.workload.output_len)

            point = asyncio.run(_instrumented(drive, None))
            point.update(
                mode="concurrency",
                max_concurrency=plan.concurrency,
                request_rate="inf",
                num_prompts=num_prompts,
                warmup_requests=len(plan.warmup),
                client=vllm_bench.CLIENT,
            )
            logger.info(
                "%s c=%d (vllm bench serve): %d ok, %d failed, %.1f out tok/s, TTFT p50 %.1f ms, "
                "TPOT mean %.2f ms",
                system, plan.concurrency, point["completed"], point["failed"], point["output_throughput"],
                point["median_ttft_ms"], point["mean_tpot_ms"],
            )  # fmt: skip
            points.append(point)
        return points

    async def _drive_openai(
        self, system: str, base_url: str, model: str | None, plans: list[PointPlan]
    ) -> list[dict[str, Any]]:
        name = model or await served_model_name(base_url)
        largest = max([p.concurrency for p in plans] + [p.warmup_concurrency for p in plans])
        client = OpenAIClient(base_url, name, self.cfg.request_timeout_s, self.cfg.openai_prompt, largest + 8)
        try:
            return await measure(client, plans, system, self.cfg)
        finally:
            await client.close()

    def _baseline(
        self, kind: str, key: str, model_dir: Path, sizes: list[int], engine: str | None = None
    ) -> None:
        cfg = self.cfg
        name = key.replace("engine_only", "engine").replace("hf_generate", "generate").replace("[", "-")
        result = baselines.run_in_child(
            kind,
            model_dir,
            self.out / f"baseline-{name.rstrip(']')}.json",
            dtype=self.results["metadata"]["dtype"] or cfg.dtype,
            batch_sizes=sizes,
            input_len=cfg.workload.input_len,
            output_len=cfg.workload.output_len,
            seed=cfg.workload.seed,
            repeats=cfg.repeats,
            env=cfg.server_env,
            cpus=self.server_cpus,
            engine=engine,
            token_budget=cfg.prefill_budgets[0] if len(cfg.prefill_budgets) == 1 else None,
            quantize=cfg.quantize,
        )
        self.results["baselines"][key] = result
        meta = self.results["metadata"]
        meta["threads"]["torch_threads"] = result.get("torch_threads")
        meta["dtype"] = meta["dtype"] or result.get("dtype")
        self.save()

    def _vllm(self, model_dir: Path, plans: list[PointPlan]) -> None:
        cfg = self.cfg
        missing = vllm_installed(cfg.vllm_script)
        if missing:
            logger.warning("vLLM-CPU peer skipped: %s", missing)
            self.results["skipped"]["vllm"] = missing
            return
        dtype = cfg.vllm_dtype or self.results["metadata"]["dtype"] or cfg.dtype or "float32"
        server = vllm_peer(
            model_dir, self.out, cfg.vllm_script, dtype=dtype, extra_args=cfg.vllm_args, cpus=self.server_cpus
        )
        entry: dict[str, Any] = {"info": {"client": "openai", "dtype": dtype}, "points": []}
        self.results["systems"]["vllm"] = entry
        with server:
            server.start(cfg.startup_timeout_s)
            entry["info"].update(server.info)
            entry["points"] = self._openai_points("vllm", server.base_url, None, plans, model_dir)
        self.save()

    def _openai(self, plans: list[PointPlan]) -> None:
        cfg = self.cfg
        assert cfg.openai_url is not None
        entry: dict[str, Any] = {"info": {"client": "openai", "url": cfg.openai_url, "managed": False}}
        self.results["systems"]["openai"] = entry
        url, model = cfg.openai_url, cfg.openai_model
        entry["points"] = self._openai_points("openai", url, model, plans, self.model_dir)
        self.save()


def run(cfg: BenchConfig) -> dict[str, Path]:
    """Run the suite; the paths of what it wrote (json, markdown, plots)."""
    return Run(cfg).execute()
