"""`python -m benchmarks`: the benchmark suite in one command (see benchmarks/README.md).

Starts our server on the reference model (built offline when missing), warms up, measures every
point, stops it; runs the engine-only and HF generate baselines at the same batch sizes; runs the
vLLM-CPU peer when installed; writes results.json, results.md and PNG plots into
benchmarks/results/<timestamp>/ and prints the table and where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import signal
import sys
from pathlib import Path

from benchmarks import compare
from benchmarks.arguments import concurrency_list, env_pair
from benchmarks.reference_model import NAME as REFERENCE_NAME
from benchmarks.reference_model import SHAPES as REFERENCE_SHAPES
from benchmarks.server import DEFAULT_VLLM_SCRIPT, parse_cpus
from benchmarks.suite import DEFAULT_CONCURRENCY, SWEEP, SYSTEMS, BenchConfig, run
from benchmarks.variants import PREFIX_CACHE_MODES, parse_budgets, parse_engines, plan_variants
from benchmarks.workload import DEFAULT_OUTPUT_LEN, WORKLOADS, WorkloadSpec
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK

RESULTS_DIR = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("benchmarks")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive rates, got {text!r}")
    return values


def _systems(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    return values


def _engines(text: str) -> tuple[str, ...]:
    try:
        return parse_engines(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _budgets(text: str) -> tuple[int, ...]:
    try:
        return parse_budgets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cpus(text: str) -> set[int]:
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when it says something (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is argparse.SUPPRESS or default in (None, False, (), []) or "default" in text:
            return text
        if isinstance(default, tuple):
            return f"{text} (default: {','.join(map(str, default))})"
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (config.json, safetensors, tokenizer.json); default: the reference "
        "model (--reference), built offline into .cache/bench-models/ when missing",
    )
    g.add_argument(
        "--reference",
        choices=sorted(REFERENCE_SHAPES),
        default=REFERENCE_NAME,
        help="the reference model to build and serve without --model: tiny-llama-512x8 (30 M "
        "parameters, for CPUs) or llama-1b (1.0 B parameters: hidden 2048, 16 layers, 32/8 heads, "
        "FFN 8192, for GPUs); tiny-llama-512x8-stdlib is the 30 M model trained on the standard "
        "library's sources (built once, about 20 minutes on 2 cores), for speculation's acceptance",
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "best"],
        default=None,
        help="dtype for our server and the baselines; default: the server's own default "
        "(by the CPU: bfloat16 with AMX-BF16 or AVX512-BF16, else float32); the dtype actually used "
        "is recorded. best: run everything in float32 and in bfloat16 (OUT/float32/, "
        "OUT/bfloat16/) and write OUT/best.md with each system at its fastest dtype",
    )
    g.add_argument(
        "--quantize",
        default=None,
        help="QUANTIZE for our server and the baselines (int8 on CPU; recorded in the metadata); "
        "vLLM-CPU runs unquantized",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="fixed",
        help="fixed lengths, mixed lengths (uniform ±range-ratio), shared-prefix prompts, code "
        "(standard-library source: code completion), or long-prompt-mix (decode streams while long "
        "prompts arrive)",
    )
    g.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (exact, special tokens included)"
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="generated tokens (exact: min = max new tokens); default 128, "
        f"{DEFAULT_OUTPUT_LEN['long-prompt-mix']} for the long-prompt-mix streams",
    )
    g.add_argument("--range-ratio", type=float, default=0.5, help="mixed: lengths in [len·(1−r), len·(1+r)]")
    g.add_argument(
        "--prefix-len", type=int, default=0, help="shared-prefix: prefix tokens (0 = input-len / 2)"
    )
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and Poisson arrivals")
    g.add_argument(
        "--streams", type=int, default=16, help="long-prompt-mix: decode streams (input-len / output-len)"
    )
    g.add_argument("--long-len", type=int, default=2048, help="long-prompt-mix: tokens of each long prompt")
    g.add_argument("--long-count", type=int, default=4, help="long-prompt-mix: long prompts per run")
    g.add_argument(
        "--long-output-len", type=int, default=16, help="long-prompt-mix: tokens each long prompt generates"
    )
    g.add_argument(
        "--long-interval",
        type=float,
        default=0.5,
        help="long-prompt-mix: seconds between long prompts (the first once every stream decodes)",
    )
    g.add_argument(
        "--long-adapters",
        action="store_true",
        help="long-prompt-mix: long prompt i names LoRA adapter lora-i, not loaded before (the "
        "streams stay on the base model): how a first use stalls the streams",
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=DEFAULT_CONCURRENCY,
        metavar="C[,C...]|sweep",
        help=f"closed-loop concurrency points; 'sweep' = {','.join(map(str, SWEEP))}",
    )
    g.add_argument(
        "--request-rate",
        type=_floats,
        default=(),
        metavar="R[,R...]",
        help="Poisson mode instead: request rates in req/s (baselines are skipped)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Poisson mode: most requests in flight (default: unbounded)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="measured requests per point (default: max(16, 4·c); 32 in Poisson mode)",
    )
    g.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="warm-up rounds per point, each c full requests at concurrency c (0 = none)",
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    g = p.add_argument_group("systems")
    g.add_argument(
        "--systems",
        type=_systems,
        default=SYSTEMS,
        metavar="LIST",
        help="what to run: ours (our server over gRPC), ours-openai (the same server through its OpenAI "
        "door, with the client that measures vLLM-CPU), engine (engine-only loop), generate "
        "(HF generate), vllm (vLLM-CPU peer; skipped with a message when not installed)",
    )
    g.add_argument(
        "--engine",
        type=_engines,
        default=(DEFAULT_DEPLOYMENT_FRAMEWORK,),
        metavar="NAME[,NAME...]",
        help="engine(s) of our server (DEPLOYMENT_FRAMEWORK): our server is started once per engine "
        "and the engine-only baseline runs each",
    )
    g.add_argument(
        "--prefix-cache",
        choices=PREFIX_CACHE_MODES,
        default="default",
        help="prefix caching of engines that have it (tgis_native): the server's default, on, off "
        "(PREFIX_CACHING=false), or both (one server each, compared in the report)",
    )
    g.add_argument(
        "--prefill-budget",
        type=_budgets,
        default=(),
        metavar="TOKENS[,TOKENS...]",
        help="our server's --max-batch-prefill-tokens, one server per value (e.g. 256,100000 to "
        "compare chunked prefill with whole prompts); default: the router's",
    )
    g.add_argument(
        "--adapters",
        type=_budgets,
        default=(),
        metavar="COUNT[,COUNT...]",
        help="LoRA adapters (rank 8, on --adapter-targets) in our server's store, one server per count; "
        "requests name them in turn (0 = the base model; e.g. 0,4 for the 4-adapter mixed workload "
        "against the base model)",
    )
    g.add_argument(
        "--speculate",
        type=_budgets,
        default=(),
        metavar="N[,N...]",
        help="our server's --speculate (speculative decoding, engines that offer it), one server per "
        "value (e.g. 0,4 to compare with and without)",
    )
    g.add_argument(
        "--speculator",
        type=Path,
        default=None,
        metavar="DIR",
        help="the speculator model (--speculator-name: an MLP speculator or a draft model) of the "
        "servers whose --speculate is above 0; without it they look up n-grams",
    )
    g.add_argument(
        "--adapter-targets",
        type=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
        default=("q_proj", "v_proj"),
        metavar="MODULE[,MODULE...]",
        help="the modules the --adapters adapt (default PEFT's for Llama: q_proj,v_proj; e.g. "
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj for every projection)",
    )
    g.add_argument(
        "--guided-json",
        action="store_true",
        help="our gRPC requests carry a JSON schema (guided decoding; benchmarks/clients.py "
        "GUIDED_SCHEMA); the breakdown reports the shard's mask time per decode call",
    )
    g.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="our server's --max-batch-size (default: the largest concurrency; in Poisson mode "
        "without --max-concurrency, 32)",
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra launcher argument, repeatable (e.g. --server-arg=--max-waiting-tokens=10)",
    )
    g.add_argument(
        "--server-env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for our server and the baselines, repeatable (e.g. OMP_NUM_THREADS=1)",
    )
    g.add_argument(
        "--server-cpus",
        type=_cpus,
        default=None,
        metavar="LIST",
        help="pin servers and baselines to these CPUs (e.g. 0-1); default: all",
    )
    g.add_argument(
        "--client-cpus",
        type=_cpus,
        default=None,
        metavar="LIST",
        help="pin the load generator to these CPUs (e.g. 1); default: none",
    )
    g.add_argument(
        "--grpc-address",
        default=None,
        metavar="HOST:PORT",
        help="measure an already running server of ours instead of starting one",
    )
    g.add_argument(
        "--openai-url",
        default=None,
        metavar="URL",
        help="also measure an already running OpenAI-compatible server (e.g. http://127.0.0.1:8080)",
    )
    g.add_argument("--openai-model", default=None, help="model name for --openai-url (default: its first)")
    g.add_argument(
        "--openai-prompt",
        choices=["text", "ids"],
        default="text",
        help="send OpenAI prompts as text or as token-id lists",
    )
    g.add_argument(
        "--vllm-script",
        type=Path,
        default=DEFAULT_VLLM_SCRIPT,
        help="the peer script (install | serve | bench)",
    )
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `vllm serve` argument, repeatable (e.g. --vllm-arg=--enforce-eager)",
    )
    g.add_argument("--vllm-dtype", default=None, help="vLLM's --dtype (default: the dtype our server used)")
    g.add_argument(
        "--client",
        choices=["own", "vllm-bench"],
        default="own",
        help="load generator of the OpenAI doors (ours-openai, vllm, --openai-url): own, or the peer's "
        "`vllm bench serve` (random prompts of its own, --ignore-eos; closed-loop fixed workload)",
    )
    g.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for a server to become healthy"
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per point and per baseline batch size (perf.md asks for 3); statistics "
        "are the medians over runs, counts the sums",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: benchmarks/results/<UTC timestamp>)",
    )
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    workload = WorkloadSpec(
        kind=args.workload,
        input_len=args.input_len,
        output_len=args.output_len or DEFAULT_OUTPUT_LEN.get(args.workload, 128),
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.seed,
        streams=args.streams,
        long_len=args.long_len,
        long_count=args.long_count,
        long_output_len=args.long_output_len,
        long_interval_s=args.long_interval,
        long_adapters=args.long_adapters,
    )
    if args.speculator is not None and not any(args.speculate):
        raise ValueError("--speculator needs a --speculate value above 0 (e.g. --speculate 0,3)")
    speculator = str(args.speculator.resolve()) if args.speculator is not None else ""
    variants = plan_variants(
        args.engine, args.prefix_cache, args.prefill_budget, args.adapters, args.speculate, speculator
    )
    if args.grpc_address and len(variants) > 1:
        raise ValueError(
            "--grpc-address measures one running server: give one engine, prefix-cache "
            "setting and prefill budget"
        )
    if args.workload == "long-prompt-mix" and args.request_rate:
        raise ValueError("long-prompt-mix drives its own arrivals: drop --request-rate")
    out = args.out or RESULTS_DIR / datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return BenchConfig(
        out_dir=out,
        model_dir=args.model.resolve() if args.model else None,
        reference=args.reference,
        workload=workload,
        concurrency=args.concurrency,
        request_rates=args.request_rate,
        max_concurrency=args.max_concurrency,
        num_prompts=args.num_prompts,
        warmup_rounds=args.warmup_rounds,
        systems=args.systems,
        dtype=args.dtype,
        quantize=args.quantize,
        max_batch_size=args.max_batch_size,
        server_args=tuple(args.server_arg),
        server_env=dict(args.server_env),
        server_cpus=args.server_cpus,
        client_cpus=args.client_cpus,
        grpc_address=args.grpc_address,
        openai_url=args.openai_url,
        openai_model=args.openai_model,
        openai_prompt=args.openai_prompt,
        vllm_script=args.vllm_script,
        vllm_args=tuple(args.vllm_arg),
        vllm_dtype=args.vllm_dtype,
        client=args.client,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        repeats=args.repeats,
        progress=not args.no_progress,
        plots=not args.no_plots,
        engines=args.engine,
        prefix_cache=args.prefix_cache,
        prefill_budgets=args.prefill_budget,
        adapters=args.adapters,
        speculate=args.speculate,
        speculator=speculator,
        adapter_targets=args.adapter_targets,
        guided_json=args.guided_json,
    )


def run_best(cfg: BenchConfig, vllm_dtype: str | None) -> dict[str, Path]:
    """The suite once per dtype, then the best-against-best report (compare.py)."""
    paths: dict[str, Path] = {}
    for dtype in compare.DTYPES:
        one = dataclasses.replace(
            cfg, out_dir=cfg.out_dir / dtype, dtype=dtype, vllm_dtype=vllm_dtype or dtype
        )
        paths.update({f"{dtype}_{kind}": path for kind, path in run(one).items()})
    best = compare.write(cfg.out_dir, compare.load(cfg.out_dir))
    return {"markdown": best["best_markdown"], **best, **paths}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds, so the servers the run started are stopped on the way


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.log_level != "DEBUG":
        logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        paths = run_best(cfg, args.vllm_dtype) if cfg.dtype == "best" else run(cfg)
    except (RuntimeError, OSError) as exc:
        logger.error("benchmark failed: %s", exc)
        return 1
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    sys.stdout.write(paths["markdown"].read_text())
    sys.stdout.write(f"\nresults: {cfg.out_dir}\n")
    for kind, path in paths.items():
        sys.stdout.write(f"  {kind}: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
