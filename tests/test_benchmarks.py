"""The benchmark harness (benchmarks/): a smoke run of the real entry point on the tiny Llama, and
the pieces whose definitions matter (exact prompt lengths, the metrics formulas).

The smoke run starts the real launcher through `python -m benchmarks`, measures two concurrency
points with a few short requests, runs both baselines, drives a fake OpenAI-compatible server
(the peer front-end) and checks the outputs, not the speed: every field, no errors, exact token
counts, TTFT <= end-to-end latency, table and plots.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from benchmarks.stats import POINT_FIELDS, RequestResult, summarize
from benchmarks.workload import WORKLOADS, PromptMaker, WorkloadSpec, build_workload
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
    assert build_workload(maker, spec, 12) == prompts  # deterministic


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
