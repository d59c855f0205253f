"""The benchmark harness (benchmarks/): a smoke run of the real entry point on the tiny Llama, and
the pieces whose definitions matter (exact prompt lengths, the metrics formulas).

The smoke run starts the real launcher through `python -m benchmarks`, measures two concurrency
points with a few short requests, runs both baselines, drives a fake OpenAI-compatible server
(the peer front-end) and checks the outputs, not the speed: every field, no errors, exact token
counts, TTFT <= end-to-end latency, table and plots.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from benchmarks import baselines, longmix, report
from benchmarks.__main__ import build_parser, config_from_args
from benchmarks.reference_model import SHAPES
from benchmarks.reference_training import (
    TrainingRecipe,
    held_out_files,
    held_out_mean_loss,
    train,
)
from benchmarks.server import DTYPE_LOG
from benchmarks.stats import METRICS, POINT_FIELDS, RequestResult, summarize
from benchmarks.suite import BenchConfig, fit_context, gpu_names
from benchmarks.variants import baseline_key, plan_variants
from benchmarks.workload import WORKLOADS, Prompt, PromptMaker, WorkloadSpec, build_long_mix, build_workload
from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK
from text_generation_server.testing.tiny_models import stdlib_sources
from text_generation_server.utils.cpu import cpu_flags, default_cpu_dtype

REPO_ROOT = Path(__file__).resolve().parent.parent
INPUT_LEN, OUTPUT_LEN, PROMPTS = 16, 8, 4
CONCURRENCY = (1, 4)


@pytest.fixture(scope="module")
def fake_openai(tiny_model: Callable[..., Path]) -> Iterator[str]:
    """A streaming /v1/completions server that counts prompt tokens with the tiny tokenizer."""
    tokenizer = Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send_json({"object": "list", "data": [{"id": "fake-model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] and body["ignore_eos"] and body["model"] == "fake-model"
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt).ids)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["max_tokens"]):
                time.sleep(0.002)
                self._event({"choices": [{"index": 0, "text": "x"}]})
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
            self._event({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, data: dict[str, object]) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        def _send_json(self, data: dict[str, object]) -> None:
            payload = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def smoke_run(
    tiny_model: Callable[..., Path], fake_openai: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    command = [
        sys.executable, "-m", "benchmarks",
        "--model", str(tiny_model("llama")),
        "--input-len", str(INPUT_LEN),
        "--output-len", str(OUTPUT_LEN),
        "--concurrency", ",".join(map(str, CONCURRENCY)),
        "--num-prompts", str(PROMPTS),
        "--systems", "ours,engine,generate,vllm",
        "--vllm-script", str(out.parent / "no-such-peer.sh"),
        "--openai-url", fake_openai,
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"results: {out}" in done.stdout
    return out


def test_smoke_json_has_every_field_and_sane_numbers(smoke_run: Path) -> None:
    results = json.loads((smoke_run / "results.json").read_text())
    meta = results["metadata"]
    for key in ("date", "git", "model", "dtype", "threads", "pinning", "workload", "host", "options"):
        assert key in meta, key
    # The server's CPU default (by this CPU's instructions), read back from its log.
    assert meta["dtype"] == str(default_cpu_dtype(cpu_flags())[0]).removeprefix("torch.")
    assert meta["model"]["vocab_size"] == 2000 and meta["model"]["parameters"] > 0

    ours = results["systems"]["ours"]
    assert ours["info"]["managed"] and ours["info"]["pid"] > 0
    assert [p["max_concurrency"] for p in ours["points"]] == list(CONCURRENCY)
    peer = results["systems"]["openai"]
    assert [p["max_concurrency"] for p in peer["points"]] == list(CONCURRENCY)
    for point in ours["points"] + peer["points"]:
        missing = [f for f in POINT_FIELDS if f not in point]
        assert not missing, missing
        assert len(point["loadavg_before"]) == 3 and point["client_cpu_s"] >= 0
        assert set(point["host_cpu"]) == {"busy", "idle", "steal"}
        assert point["failed"] == 0 and point["completed"] == PROMPTS, point["errors"]
        assert point["errors"] == [""] * PROMPTS
        assert point["input_lens"] == [INPUT_LEN] * PROMPTS
        assert point["output_lens"] == [OUTPUT_LEN] * PROMPTS
        assert point["total_input_tokens"] == INPUT_LEN * PROMPTS
        assert point["total_output_tokens"] == OUTPUT_LEN * PROMPTS
        assert point["length_mismatches"] == 0
        assert all(0 < t <= e for t, e in zip(point["ttfts"], point["e2els"], strict=True))
        assert 0 < point["median_ttft_ms"] <= point["median_e2el_ms"]
        assert point["mean_tpot_ms"] > 0 and point["mean_itl_ms"] > 0
        assert point["output_throughput"] > 0 and point["duration"] > 0
        assert 1 <= point["max_concurrent_requests"] <= point["max_concurrency"]
    for point in ours["points"]:
        breakdown = point["server_breakdown"]
        assert breakdown["next_token"]["calls"] > 0 and breakdown["prefill"]["calls"] > 0
        assert breakdown["prefill"]["steps_per_call"] == 1 and breakdown["next_token"]["steps_per_call"] >= 1
        # the router's CPU seconds come in clock ticks (10 ms): a short run on a fast CPU may use none
        assert breakdown["router_cpu_s"] >= 0 and 0 <= breakdown["router_cpu_share"] < 2

    for key in ("engine_only", "hf_generate"):
        baseline = results["baselines"][key]
        assert baseline["dtype"] == meta["dtype"]  # the baselines run in the dtype the server resolved
        assert [p["batch_size"] for p in baseline["points"]] == list(CONCURRENCY)
        for point in baseline["points"]:
            assert point["output_tokens"] == point["batch_size"] * OUTPUT_LEN
            assert point["output_throughput"] > 0

    assert "not installed" in results["skipped"]["vllm"] or "not there" in results["skipped"]["vllm"]
    ratios = results["ratios"]
    assert set(ratios["by_concurrency"]) == {str(c) for c in CONCURRENCY}
    assert ratios["by_concurrency"]["4"]["vs_engine_only_output_throughput"] > 0
    errors_target = next(t for t in ratios["targets"] if t["target"].startswith("failed requests"))
    assert errors_target["status"] == "met"


def test_smoke_table_and_plots(smoke_run: Path) -> None:
    table = (smoke_run / "results.md").read_text()
    for c in CONCURRENCY:
        assert f"| ours (gRPC) | {c} | {PROMPTS} / 0 |" in table
        assert f"| OpenAI endpoint | {c} | {PROMPTS} / 0 |" in table
    assert "## Baselines" in table and "## Targets (issue 6)" in table
    assert "vLLM-CPU skipped" in table
    for name in ("throughput.png", "latency.png"):
        data = (smoke_run / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    assert (smoke_run / "server-ours.log").stat().st_size > 0


@pytest.mark.parametrize("kind", WORKLOADS)
def test_prompts_have_exact_token_counts(tiny_model: Callable[..., Path], kind: str) -> None:
    maker = PromptMaker(tiny_model("llama"))
    spec = WorkloadSpec(kind=kind, input_len=40, output_len=10, num_prefixes=2)
    prompts = build_workload(maker, spec, 12)
    for prompt in prompts:
        assert maker.encode(prompt.text) == list(prompt.ids)
        assert prompt.ids[0] == 1  # the Llama tokenizer's BOS
    if kind == "mixed":
        assert len({p.input_len for p in prompts}) > 1 and len({p.output_len for p in prompts}) > 1
        assert all(20 <= p.input_len <= 60 and 5 <= p.output_len <= 15 for p in prompts)
    else:
        assert {(p.input_len, p.output_len) for p in prompts} == {(40, 10)}
    if kind == "shared-prefix":
        assert prompts[0].ids[:20] == prompts[2].ids[:20] != prompts[1].ids[:20]
    if kind == "code":  # cut from the sources training holds out, at a line start
        sources = [Path(f).read_text(encoding="utf-8", errors="replace") for f in held_out_files()]
        for prompt in prompts:
            assert any(("\n" + prompt.text) in "\n" + source for source in sources)
        assert len({p.text for p in prompts}) == len(prompts)
    assert build_workload(maker, spec, 12) == prompts  # deterministic


def test_training_a_reference_model_lowers_its_held_out_loss(tiny_model: Callable[..., Path]) -> None:
    import torch
    import transformers

    model_dir = tiny_model("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    recipe = TrainingRecipe(steps=40, batch=4, seq_len=64, lr=1e-2, warmup=4)
    assert recipe.lr_at(0) == pytest.approx(1e-2 / 4) and recipe.lr_at(3) == pytest.approx(1e-2)
    assert recipe.lr_at(39) == pytest.approx(1e-3, rel=0.1)  # cosine down to a tenth
    held_out = set(held_out_files(recipe))
    assert held_out and held_out < set(stdlib_sources())
    uniform = math.log(model.config.vocab_size)  # the loss of a uniform guess
    ids = [4 + i % (model.config.vocab_size - 4) for i in range(64 * 32)]
    assert held_out_mean_loss(model, ids, 32) > uniform  # random weights: worse than a uniform guess
    stamp = train(model, model_dir / "tokenizer.json", 2, recipe)
    assert stamp["held_out_loss"] < uniform - 0.5, stamp  # on text it never saw
    assert stamp["recipe"]["steps"] == 40 and stamp["held_out_tokens"] > 10_000


def test_summarize_uses_vllm_definitions() -> None:
    # Two requests: 5 tokens in 4 messages (one bundles 2 tokens), and a failure.
    ok = RequestResult(expected_input_len=3, expected_output_len=5, start=10.0, end=10.5, ttft=0.1)
    ok.itl, ok.input_len, ok.output_len, ok.messages = [0.1, 0.1, 0.2], 3, 5, 4
    failed = RequestResult(expected_input_len=3, expected_output_len=5, start=10.0, error="UNAVAILABLE: x")
    point = summarize([ok, failed], duration=2.0)
    assert point["completed"] == 1 and point["failed"] == 1
    assert point["errors"] == ["", "UNAVAILABLE: x"]
    assert point["output_throughput"] == pytest.approx(2.5)
    assert point["total_token_throughput"] == pytest.approx(4.0)
    assert point["mean_ttft_ms"] == pytest.approx(100.0)
    assert point["mean_tpot_ms"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1)
    assert point["median_itl_ms"] == pytest.approx(100.0)
    assert point["mean_e2el_ms"] == pytest.approx(500.0)
    assert point["mean_tokens_per_message"] == pytest.approx(1.25)
    assert point["length_mismatches"] == 0


# ---- engines, prefix-cache and prefill-budget variants; the long-prompt mix (no server) -------


def _config(*args: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(["--out", "/tmp/unused", *args]))


def test_engine_prefix_cache_and_budget_options() -> None:
    cfg = _config()
    assert cfg.engines == (DEFAULT_DEPLOYMENT_FRAMEWORK,) and cfg.prefix_cache == "default"
    assert cfg.prefill_budgets == () and cfg.workload.output_len == 128
    cfg = _config(
        "--engine", "hf_transformers, tgis_native", "--prefix-cache", "both", "--prefill-budget", "256,100000"
    )  # fmt: skip
    assert cfg.engines == ("hf_transformers", "tgis_native")
    assert cfg.prefix_cache == "both" and cfg.prefill_budgets == (256, 100000)
    for bad in (["--engine", "no_such_engine"], ["--prefill-budget", "-1"], ["--prefix-cache", "maybe"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    with pytest.raises(ValueError, match="one running server"):
        _config("--engine", "hf_transformers,tgis_native", "--grpc-address", "127.0.0.1:1")


def test_reference_option_names_the_model_to_build() -> None:
    assert _config().reference == "tiny-llama-512x8"
    assert _config("--reference", "llama-1b").reference == "llama-1b"
    assert _config("--reference", "tiny-llama-512x8-stdlib").reference == "tiny-llama-512x8-stdlib"
    assert SHAPES["tiny-llama-512x8-stdlib"] == SHAPES["tiny-llama-512x8"]  # same step, trained weights
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reference", "llama-70b"])
    shape = SHAPES["llama-1b"]
    per_layer = 2 * shape["hidden_size"] * (shape["hidden_size"] + shape["num_key_value_heads"] * 64)
    per_layer += 3 * shape["hidden_size"] * shape["intermediate_size"] + 2 * shape["hidden_size"]
    embeddings = 2 * shape["vocab_size"] * shape["hidden_size"]
    parameters = shape["num_hidden_layers"] * per_layer + embeddings + shape["hidden_size"]
    assert 0.95e9 < parameters < 1.05e9  # the 1 B Llama of the GPU measurements


def test_the_host_info_names_the_visible_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\necho 'NVIDIA H200'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_names() == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_names() == ["NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_names() == []
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_names() == []


def test_long_prompt_mix_options_and_defaults() -> None:
    spec = _config("--workload", "long-prompt-mix").workload
    assert (spec.streams, spec.input_len, spec.output_len) == (16, 128, 256)
    assert (spec.long_len, spec.long_count, spec.long_output_len) == (2048, 4, 16)
    assert spec.max_total_len() == 2048 + 16
    assert "16 streams of 128 in / 256 out, 4 long prompts of 2048 in" in spec.describe()
    spec = _config(
        "--workload", "long-prompt-mix", "--streams", "3", "--long-len", "100", "--long-count", "2",
        "--long-output-len", "4", "--long-interval", "0.1", "--output-len", "50",
    ).workload  # fmt: skip
    assert (spec.streams, spec.long_len, spec.long_count, spec.long_output_len) == (3, 100, 2, 4)
    assert spec.long_interval_s == 0.1 and spec.output_len == 50 and spec.max_total_len() == 178
    with pytest.raises(ValueError, match="at least one stream"):
        WorkloadSpec(kind="long-prompt-mix", streams=0)
    with pytest.raises(ValueError, match="drives its own arrivals"):
        _config("--workload", "long-prompt-mix", "--request-rate", "2")


def test_variants_name_only_what_varies() -> None:
    (only,) = plan_variants(("tgis_native",))
    assert (
        only.key == "ours"
        and only.env() == {}
        and only.launcher_args() == ("--deployment-framework", "tgis_native")
    )
    variants = plan_variants(("hf_transformers", "tgis_native"), "both", (256,))
    assert [v.key for v in variants] == [
        "ours[hf_transformers]",  # no prefix cache to switch: runs once
        "ours[tgis_native,prefix-cache]",
        "ours[tgis_native,no-prefix-cache]",
    ]
    off = variants[2]
    assert off.env() == {"PREFIX_CACHING": "false"} and variants[1].env() == {"PREFIX_CACHING": "true"}
    assert off.launcher_args() == (
        "--deployment-framework",
        "tgis_native",
        "--max-batch-prefill-tokens",
        "256",
    )
    assert off.describe() == {
        "engine": "tgis_native",
        "prefix_cache": False,
        "prefill_budget": 256,
        "adapters": 0,
        "speculate": 0,
        "speculator": "",
    }
    budgets = plan_variants(("tgis_native",), "default", (256, 100000))
    assert [v.key for v in budgets] == ["ours[budget=256]", "ours[budget=100000]"]
    speculating = plan_variants(("hf_transformers", "tgis_native"), speculate=(0, 4))
    assert [v.key for v in speculating] == [
        "ours[hf_transformers,speculate=0]",  # no speculation to switch: runs once
        "ours[tgis_native,speculate=0]",
        "ours[tgis_native,speculate=4]",
    ]
    assert speculating[2].launcher_args()[-2:] == ("--speculate", "4")
    assert "--speculate" not in speculating[1].launcher_args()
    off, mlp = plan_variants(("tgis_native",), speculate=(0, 3), speculator="/s")
    assert mlp.launcher_args()[-4:] == ("--speculate", "3", "--speculator-name", "/s")
    assert "--speculator-name" not in off.launcher_args() and off.describe()["speculator"] == ""
    assert _config("--speculate", "0,3", "--speculator", "/s").speculator == "/s"
    with pytest.raises(ValueError, match="--speculator needs a --speculate value above 0"):
        _config("--speculator", "/s")
    assert baseline_key("engine_only", "tgis_native", ("tgis_native",)) == "engine_only"
    assert (
        baseline_key("engine_only", "tgis_native", ("hf_transformers", "tgis_native"))
        == "engine_only[tgis_native]"
    )


def test_long_mix_prompts_have_exact_token_counts(tiny_model: Callable[..., Path]) -> None:
    maker = PromptMaker(tiny_model("llama"))
    spec = WorkloadSpec(
        kind="long-prompt-mix", input_len=12, output_len=6, streams=3, long_len=90, long_count=2
    )
    streams, longs = build_long_mix(maker, spec, "point-0")
    assert [(p.input_len, p.output_len) for p in streams] == [(12, 6)] * 3
    assert [(p.input_len, p.output_len) for p in longs] == [(90, 16)] * 2
    assert all(maker.encode(p.text) == list(p.ids) for p in streams + longs)
    assert build_long_mix(maker, spec, "point-0") == (streams, longs)  # deterministic
    assert build_long_mix(maker, spec, "point-1")[1] != longs  # a new run, new prompts


def test_fit_context_extends_only_the_reference_model(tmp_path: Path) -> None:
    reference = tmp_path / "ref"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "vocab_size": 10}))
    (reference / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (reference / "model.safetensors").write_bytes(b"weights")
    short = BenchConfig(out_dir=tmp_path, workload=WorkloadSpec(input_len=32, output_len=32))
    assert fit_context(reference, short) == reference
    long = BenchConfig(out_dir=tmp_path, workload=WorkloadSpec(input_len=1000, output_len=100))
    extended = fit_context(reference, long)
    assert extended == tmp_path / "ref-ctx2048"
    assert json.loads((extended / "config.json").read_text())["max_position_embeddings"] == 2048
    assert json.loads((extended / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    assert (extended / "model.safetensors").is_symlink() and (
        extended / "model.safetensors"
    ).read_bytes() == b"weights"
    assert fit_context(reference, long) == extended  # made once
    user = BenchConfig(out_dir=tmp_path, model_dir=reference, workload=long.workload)
    with pytest.raises(ValueError, match="needs 1100 positions"):
        fit_context(reference, user)


def _stream(start: float, ttft: float, gaps: list[float], tokens: int | None = None) -> RequestResult:
    result = RequestResult(
        expected_input_len=8, expected_output_len=tokens or len(gaps) + 1, start=start, ttft=ttft
    )
    result.itl, result.input_len, result.output_len = gaps, 8, tokens or len(gaps) + 1
    result.messages, result.end = len(gaps) + 1, start + ttft + sum(gaps)
    return result


def test_long_mix_statistics_count_stream_gaps_only() -> None:
    # Two streams decoding every 10 ms, with one 100 ms stall at t = 1.05..1.15 s, during the
    # long prompt's prefill (sent at 1.0 s, first token at 1.205 s).
    gaps = [0.01] * 100
    gaps[4] = 0.1
    streams = [_stream(1.0, 0.01, list(gaps)), _stream(1.0, 0.01, list(gaps))]
    long = _stream(1.0, 0.205, [0.01] * 3)
    point = longmix.summarize_mix(streams, [long], duration=2.0)
    assert point["completed"] == 2 and point["long"]["completed"] == 1
    assert point["p50_itl_ms"] == pytest.approx(10.0)
    assert point["long"]["median_ttft_ms"] == pytest.approx(205.0)  # the long prompt's, not the streams'
    during = point["during_long_itl"]
    # per stream: 4 x 10 ms, the 100 ms stall, 5 x 10 ms and the gap across 1.205 s
    assert during["count"] == 2 * 11 and during["max"] == pytest.approx(100.0)
    assert point["overlapped_long"] == 1
    assert point["stream_itl_p99_over_p50"] == pytest.approx(point["p99_itl_ms"] / 10.0)
    combined = longmix.combine_mix([point, point])
    assert combined["completed"] == 4 and combined["long"]["completed"] == 2
    assert combined["during_long_itl"]["count"] == during["count"]


def test_long_mix_sends_long_prompts_once_every_stream_decodes() -> None:
    events: list[str] = []

    class FakeClient:
        name = "fake"

        async def generate(self, prompt: Prompt, first_token: asyncio.Event | None = None) -> RequestResult:
            kind = "long" if prompt.input_len > 10 else "stream"
            events.append(f"send {kind}")
            await asyncio.sleep(0.01)
            events.append(f"first {kind}")
            if first_token is not None:
                first_token.set()
            await asyncio.sleep(0.01)
            return _stream(0.0, 0.01, [0.01])

        async def close(self) -> None:
            pass

    streams = [Prompt("s", (1, 2, 3), 2)] * 3
    longs = [Prompt("l", tuple(range(20)), 2)] * 2
    stream_results, long_results, duration = asyncio.run(longmix.drive(FakeClient(), streams, longs, 0.0))
    assert len(stream_results) == 3 and len(long_results) == 2 and duration > 0
    first_long = events.index("send long")
    assert events[:first_long].count("first stream") == 3


def _serving_point(c: int, tok_s: float, ttft: float, mode: str = "concurrency") -> dict[str, Any]:
    return {
        "mode": mode, "max_concurrency": c, "request_rate": "inf", "completed": 4, "failed": 0,
        "request_throughput": 1.0, "output_throughput": tok_s, "total_token_throughput": tok_s,
        **{f"{s}_{m}_ms": ttft if m == "ttft" else 5.0 for s in ("mean", "median", "p99") for m in METRICS},
        "median_e2el_ms": 100.0, "p99_e2el_ms": 120.0, "duration": 1.0, "client_cpu_s": 0.1,
        "loadavg_before": [0.5, 0.5, 0.5],
    }  # fmt: skip


def _system(variant: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    return {"info": {"variant": variant}, "points": points}


def _baseline(engine: str, tok_s: dict[int, float]) -> dict[str, Any]:
    shape = {"input_len": 128, "output_len": 128, "prefill_ms": 50.0, "decode_step_ms": 8.0}
    return {
        "engine": engine,
        "points": [{"batch_size": b, "output_throughput": t, **shape} for b, t in tok_s.items()],
    }


def test_report_sets_engines_and_prefix_cache_side_by_side() -> None:
    hf = {"engine": "hf_transformers", "prefix_cache": "default", "prefill_budget": "default"}
    native_on = {"engine": "tgis_native", "prefix_cache": True, "prefill_budget": "default"}
    native_off = {**native_on, "prefix_cache": False}
    results: dict[str, Any] = {
        "metadata": {"mode": "concurrency", "engines": ["hf_transformers", "tgis_native"], "date": "now"},
        "systems": {
            "ours[hf_transformers]": _system(
                hf, [_serving_point(1, 100.0, 40.0), _serving_point(8, 400.0, 80.0)]
            ),
            "ours[tgis_native,prefix-cache]": _system(
                native_on, [_serving_point(1, 150.0, 10.0), _serving_point(8, 600.0, 20.0)]
            ),
            "ours[tgis_native,no-prefix-cache]": _system(
                native_off, [_serving_point(1, 140.0, 40.0), _serving_point(8, 500.0, 40.0)]
            ),
        },
        "baselines": {
            "engine_only[hf_transformers]": _baseline("hf_transformers", {1: 110.0, 8: 440.0}),
            "engine_only[tgis_native]": _baseline("tgis_native", {1: 165.0, 8: 660.0}),
        },
        "skipped": {},
    }  # fmt: skip
    ratios = report.compute_ratios(results)
    by_variant = ratios["by_variant"]
    assert by_variant["ours[hf_transformers]"]["8"]["vs_engine_only_output_throughput"] == pytest.approx(
        400 / 440
    )
    assert by_variant["ours[tgis_native,prefix-cache]"]["1"][
        "vs_engine_only_output_throughput"
    ] == pytest.approx(150 / 165)
    (with_cache,) = [r for r in ratios["engines"] if r["numerator"] == "ours[tgis_native,prefix-cache]"]
    assert with_cache["denominator"] == "ours[hf_transformers]"
    assert with_cache["by_point"]["8"]["output_throughput"] == pytest.approx(1.5)
    assert with_cache["by_point"]["8"]["median_ttft"] == pytest.approx(0.25)
    assert with_cache["by_point"]["8"]["engine_only_output_throughput"] == pytest.approx(1.5)
    prefix = {r["point"]: r for r in ratios["prefix_cache"]}
    assert prefix["1"]["ratio"] == pytest.approx(0.25) and prefix["1"]["status"] == "met"
    assert prefix["8"]["ratio"] == pytest.approx(0.5) and prefix["8"]["status"] == "missed"
    results["ratios"] = ratios
    text = report.markdown(results)
    assert (
        "## Engines side by side" in text
        and "### ours[tgis_native,prefix-cache] / ours[hf_transformers]" in text
    )
    assert "| 8 | 400.0 | 600.0 | 1.50 | 80.0 | 20.0 | 0.25 |" in text
    assert "## Prefix cache on / off" in text
    assert (
        "| ours[tgis_native,prefix-cache] / ours[tgis_native,no-prefix-cache] | 1 | 10.0 | 40.0 | 0.25 |"
        in text
    )
    assert "engine-only loop [tgis_native] out tok/s" in text


def test_report_long_mix_table() -> None:
    def mix_point(p50: float, p99: float, long_ttft: float) -> dict[str, Any]:
        point = _serving_point(16, 500.0, 30.0, mode="long-prompt-mix")
        point.update(p50_itl_ms=p50, p99_itl_ms=p99, stream_itl_p99_over_p50=p99 / p50, itls=[[p99 / 1000.0]])
        point["during_long_itl"] = {"count": 40, "mean": p99, "p50": p99, "p99": p99, "max": p99}
        point["long"] = {
            "completed": 4,
            "failed": 0,
            "median_ttft_ms": long_ttft,
            "ttfts": [long_ttft / 1000.0],
        }
        point["overlapped_long"] = 4
        return point

    chunked = {"engine": "tgis_native", "prefix_cache": "default", "prefill_budget": 256}
    whole = {**chunked, "prefill_budget": 100000}
    results: dict[str, Any] = {
        "metadata": {"mode": "long-prompt-mix", "engines": ["tgis_native"]},
        "systems": {
            "ours[budget=256]": _system(chunked, [mix_point(20.0, 36.0, 900.0)]),
            "ours[budget=100000]": _system(whole, [mix_point(18.0, 400.0, 700.0)]),
        },
        "baselines": {},
        "skipped": {},
    }
    ratios = report.compute_ratios(results)
    rows = {r["system"]: r for r in ratios["long_mix"]}
    assert rows["ours[budget=256]"]["status"] == "met" and rows["ours[budget=256]"]["prefill_budget"] == 256
    assert rows["ours[budget=100000]"]["status"] == "missed"
    assert rows["ours[budget=100000]"]["itl_p99_over_p50"] == pytest.approx(400 / 18)
    # no sweep, no issue-6 targets: only the errors one
    assert [t["target"] for t in ratios["targets"]] == ["failed requests, all systems and points"]
    results["ratios"] = ratios
    text = report.markdown(results)
    assert "## Long-prompt mix" in text
    assert "| ours[budget=256] | 256 | 4 / 4 / 0 | 20.0 / 36.0 / 36.0 | 1.80 |" in text
    assert report.plots(results, Path("/nonexistent")) == []  # one point per system: no plots


def test_baseline_prompts_are_new_for_every_run(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("llama")
    first = baselines.prompt_ids(model, 2, 10, seed=0, salt="8:0")
    assert first == baselines.prompt_ids(model, 2, 10, seed=0, salt="8:0")
    assert first != baselines.prompt_ids(model, 2, 10, seed=0, salt="8:1")
    assert all(len(p) == 10 and p[0] == 1 for p in first)


@pytest.mark.parametrize(
    ("line", "dtype"),
    [
        (
            "Shard 0: INFO x: loading /m/tiny (float32: the CPU has no AMX-BF16, AVX512-BF16; cpu) from /m",
            "float32",
        ),
        ("INFO x: loading /m/tiny (torch.bfloat16, cpu)", "bfloat16"),
    ],
)
def test_the_server_dtype_is_read_from_its_log(line: str, dtype: str) -> None:
    match = DTYPE_LOG.search(line)
    assert match is not None and match.group(1) == dtype


def test_adapter_variants_and_round_robin_requests() -> None:
    from benchmarks.clients import GrpcClient
    from benchmarks.workload import Prompt

    cfg = _config("--engine", "tgis_native", "--adapters", "0,4")
    assert cfg.adapters == (0, 4)
    base, mixed = plan_variants(("tgis_native",), "default", (), (0, 4))
    assert (base.key, mixed.key) == ("ours[adapters=0]", "ours[adapters=4]")
    assert base.adapter_ids == [] and mixed.adapter_ids == ["lora-0", "lora-1", "lora-2", "lora-3"]
    client = GrpcClient.__new__(GrpcClient)
    client.adapter_ids, client._sent, client.decoding = mixed.adapter_ids, 0, None
    prompt = Prompt("x", (1,), 4)
    assert [client.request(prompt).adapter_id for _ in range(5)] == [
        "lora-0",
        "lora-1",
        "lora-2",
        "lora-3",
        "lora-0",
    ]


def test_long_adapters_name_a_new_adapter_per_measured_long_prompt(tiny_model) -> None:
    from benchmarks.clients import GrpcClient
    from benchmarks.suite import plan_mix
    from benchmarks.workload import PromptMaker

    cfg = _config("--workload", "long-prompt-mix", "--long-adapters", "--long-len", "16", "--repeats", "2")
    assert cfg.workload.long_adapters and "each naming an adapter not loaded yet" in cfg.workload.describe()
    (plan,) = plan_mix(cfg, PromptMaker(tiny_model("llama")))
    assert all(not p.adapter_id for streams, longs in plan.mix_warmup for p in streams + longs)
    named = [[p.adapter_id for p in longs] for _, longs in plan.mix_repeats]
    assert named == [[f"lora-{i}" for i in range(4)], [f"lora-{i}" for i in range(4, 8)]]
    assert all(not p.adapter_id for streams, _ in plan.mix_repeats for p in streams)
    client = GrpcClient.__new__(GrpcClient)
    client.adapter_ids, client._sent, client.decoding = [], 0, None
    assert client.request(plan.mix_repeats[0][1][2]).adapter_id == "lora-2"


async def test_guided_json_requests_carry_the_schema() -> None:
    import json

    from benchmarks.clients import GUIDED_SCHEMA, GrpcClient
    from benchmarks.workload import Prompt

    assert _config("--guided-json").guided_json and not _config().guided_json
    guided, free = GrpcClient("127.0.0.1:1", 1.0, guided_json=True), GrpcClient("127.0.0.1:1", 1.0)
    try:
        request = guided.request(Prompt("x", (1,), 4))
        assert json.loads(request.params.decoding.json_schema) == GUIDED_SCHEMA
        assert not free.request(Prompt("x", (1,), 4)).params.HasField("decoding")
    finally:
        await guided.close()
        await free.close()


def test_targets_of_a_run_through_the_openai_door_alone() -> None:
    """`--systems ours-openai,vllm` (vLLM's client for both): issue 6's targets are the OpenAI
    door's, not 'not measured'."""
    native = {"engine": "tgis_native", "prefix_cache": "default", "prefill_budget": "default"}
    results: dict[str, Any] = {
        "metadata": {"mode": "concurrency", "engines": ["tgis_native"]},
        "systems": {
            "ours-openai": _system(
                native, [_serving_point(1, 200.0, 25.0), _serving_point(32, 2000.0, 280.0)]
            ),
            "vllm": _system({}, [_serving_point(1, 150.0, 20.0), _serving_point(32, 1600.0, 260.0)]),
        },
        "baselines": {},
        "skipped": {},
    }
    targets = {t["target"]: t for t in report.compute_ratios(results)["targets"]}
    throughput = targets["ours-openai: ours / vLLM-CPU output tok/s at c = 32 (stretch 1.5)"]
    assert throughput["value"] == pytest.approx(2000 / 1600) and throughput["status"] == "met"
    assert targets["ours-openai: ours / vLLM-CPU median TTFT at c = 32"]["status"] == "missed"


def test_quantize_reaches_our_server_and_the_baselines(
    tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from text_generation_server import quantization

    assert _config("--quantize", "int8").quantize == "int8" and _config().quantize is None
    quantized = []
    quantize_model = quantization.quantize_model

    def recording(model, scheme):
        quantize_model(model, scheme)
        quantized.append(sum(isinstance(m, quantization.Int8Linear) for m in model.modules()))

    monkeypatch.setattr(quantization, "quantize_model", recording)
    for kind in ("engine", "generate"):
        result = baselines.measure(kind, tiny_model("llama"), "float32", [2], 6, 3, quantize="int8")
        assert result["quantize"] == "int8" and result["points"][0]["output_throughput"] > 0
    assert len(quantized) == 2 and min(quantized) > 0  # both models ran in int8


def test_logit_error_reports_cosines_of_the_final_logits(tiny_model) -> None:
    from benchmarks.logit_error import measure

    llama = tiny_model("llama")
    close = measure(llama, None, "int8", "float32", prompts=4, length=8)
    assert close["prompts"] == 4 and 0.99 <= close["min_cosine"] <= close["mean_cosine"] <= 1.0
    assert close["greedy_agreement"] >= 0.75
    other = measure(llama, tiny_model("gpt_neox"), None, "float32", prompts=4, length=8)  # other weights
    assert other["mean_cosine"] < 0.9


def test_router_load_streams_every_token_through_the_real_router(capsys) -> None:
    """benchmarks.router_load: the router process over a shard serving the fake engine, then
    (--bare) the bare gRPC server; every token of every answer arrives from both, one row per
    server and concurrency, the bare server's without a shard."""
    from benchmarks import router_load

    argv = [
        "--concurrency",
        "1,3",
        "--requests-per-stream",
        "2",
        "--output-len",
        "6",
        "--step-ms",
        "1",
        "--bare",
    ]
    points = router_load.main(argv)
    assert [(p.server, p.concurrency, p.tokens, p.errors) for p in points] == [
        ("router", 1, 12, 0),
        ("router", 3, 36, 0),
        ("bare gRPC", 1, 12, 0),
        ("bare gRPC", 3, 36, 0),
    ]
    assert all(0 < p.messages <= p.tokens for p in points)
    assert [p.shard_cpu_s is None for p in points] == [False, False, True, True]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert [row.split(" | ")[1] for row in rows] == ["router", "bare gRPC"]
    assert all(row.endswith("| 0 |") for row in rows)
