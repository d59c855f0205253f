"""Speculative decoding through the real launcher: `--speculate 4` (n-gram) and `--speculator-name`
(an MLP speculator made by the training command, or a draft model: here the model itself) on
tgis_native give the same text as the same server without them (greedy, seeded sampling, stop
sequences, a busy batch and a stream), count what they verified in /metrics, say what runs in the
log; an engine without speculation and a speculator that is not there are refused with one line.
The model is the benchmarks' reference Llama, whose random-weight greedy output falls into short
loops that the speculators predict."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.reference_model import build, is_built
from integration_tests.servers import Server, launch
from integration_tests.test_ops import scrape
from router.pb import generation_pb2 as pb
from text_generation_server.kernels import cpu_kernels
from text_generation_server.speculation.train import main as train_main

PROMPTS = ["A very long story:\n", "def main():\n    return", "Once upon a time", "1, 2, 3, 4,"]
TRAIN_SMALL = ["--prompts", "24", "--length", "64", "--epochs", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = Path(tmp_path_factory.mktemp("speculation"))
    if not is_built(root / "models" / "reference"):
        build(root / "models" / "reference")
    return root


def answers(server: Server) -> list[tuple[str, int, int]]:
    stub = server.stub()
    stop = pb.StoppingCriteria
    greedy = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[{"text": t} for t in PROMPTS], params={"stopping": stop(max_new_tokens=60)}
        )
    ).responses
    sampled = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[{"text": PROMPTS[0]}],
            params={
                "method": pb.SAMPLE,
                "sampling": pb.SamplingParameters(temperature=0.7, top_k=20, seed=42),
                "stopping": stop(max_new_tokens=40),
            },
        )
    ).responses
    cut_at = greedy[1].text[20:23]
    stopped = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[{"text": PROMPTS[1]}],
            params={"stopping": stop(max_new_tokens=60, stop_sequences=[cut_at])},
        )
    ).responses
    streamed = "".join(
        m.text
        for m in stub.GenerateStream(
            pb.SingleGenerationRequest(
                request={"text": PROMPTS[2]}, params={"stopping": stop(max_new_tokens=50)}
            )
        )
    )
    return [(r.text, r.generated_token_count, r.stop_reason) for r in [*greedy, *sampled, *stopped]] + [
        (streamed, 0, 0)
    ]


@pytest.fixture(scope="module")
def expected(root) -> list[tuple[str, int, int]]:
    plain = launch("reference@tgis_native", root)
    try:
        return answers(plain)
    finally:
        plain.stop()


def shared_lm_head(root: Path, speculator: str, log: str) -> str:
    """What the speculator's line adds where its heads read the model's LM head: the trained heads
    are the LM head's copy, and a chain on the CPU kernel reads it where the shard laid the LM head
    out in panels (the layout it measured fastest on this CPU, logged per shape)."""
    config = json.loads((root / "models" / "reference" / "config.json").read_text())
    head = re.search(rf"linear {config['vocab_size']}x{config['hidden_size']} \w+: (\S+)", log)
    panels = head is not None and head.group(1) == "panels"
    if speculator == "mlp" and panels and cpu_kernels.loads("the test expects tensor operations"):
        return "; 3 of its heads read the model's LM head (the same values)"
    return ""


@pytest.mark.parametrize("speculator", ["n-gram", "mlp", "mlp-tree", "draft"])
def test_speculation_gives_the_same_text_and_counts_what_it_verified(root, expected, speculator: str) -> None:
    flags: tuple[str, ...]
    if speculator == "draft":  # the model as its own draft
        model = root / "models" / "reference"
        flags = ("--speculator-name", str(model), "--speculate", "3")
        logged = f"speculative decoding: draft model {model} (llama, 30.5 M parameters), up to 3 candidate"
    elif speculator.startswith("mlp"):
        out = root / "models" / "reference-accelerator"
        if not (out / "config.json").exists():  # the training command, seconds at this size
            train_main(["--model", str(root / "models" / "reference"), "--out", str(out), *TRAIN_SMALL])
        flags = ("--speculator-name", str(out))
        shape = (
            "3 heads; chains on the CPU kernel"
            if cpu_kernels.loads("the test expects tensor operations")
            else "3 heads"
        )
        if speculator == "mlp-tree":  # TGIS's names for the candidate tree, as the launcher's env
            flags += ("--speculator-n-candidates", "3", "--speculator-top-k-tokens-per-head", "2,2,1")
            shape = "3 heads; candidate tree: top 2,2,1 tokens per head, 3 chains"
        logged = f"speculative decoding: MLP speculator {out} ({shape}){{shared}}, up to 3 candidate tokens"
    else:
        flags = ("--speculate", "4")
        logged = "speculative decoding: n-gram (prompt lookup), up to 4 candidate tokens per row"
    if speculator != "mlp":  # the mechanics at every batch size; the MLP speculator's steps are gated
        flags += ("--speculator-batch-gate", "fixed")
    server = launch("reference@tgis_native", root, *flags)
    try:
        assert answers(server) == expected
        samples = scrape(server)
        proposed = samples[("tgi_spec_proposed_tokens_total", ())]
        accepted = samples[("tgi_spec_accepted_tokens_total", ())]
        assert 0 < accepted <= proposed
        assert samples[("tgi_spec_step_accepted_tokens_count", ())] > 0
        log = server.log()
        assert logged.format(shared=shared_lm_head(root, speculator, log)) in log
        measured = "speculating step / plain step, measured: at 1 / 2 / 4 "
        assert (measured in server.log()) == (speculator == "mlp")
    finally:
        server.stop()


def test_an_engine_without_speculation_is_refused_with_one_line(root) -> None:
    with pytest.raises(RuntimeError) as error:
        launch("reference@hf_transformers", root, "--speculate", "3")
    log = str(error.value)
    assert "SPECULATE=3: speculative decoding is served by tgis_native, not hf_transformers" in log
    assert "Traceback" not in log
    with pytest.raises(RuntimeError) as error:
        launch("reference@tgis_native", root, "--speculator-name", str(root / "nowhere"))
    log = str(error.value)
    assert f"speculator directory {root / 'nowhere'} does not exist" in log and "Traceback" not in log
