"""Speculative decoding through the real launcher: `--speculate 4` on tgis_native gives the same
text as the same server without it (greedy, seeded sampling, stop sequences, a busy batch and a
stream), counts what it verified in /metrics, says what runs in its log, and an engine without
speculation is refused with one line. The model is the benchmarks' reference Llama, whose
random-weight greedy output falls into short loops that n-gram lookup predicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reference_model import build, is_built
from integration_tests.servers import Server, launch
from integration_tests.test_ops import scrape
from router.pb import generation_pb2 as pb

PROMPTS = ["A very long story:\n", "def main():\n    return", "Once upon a time", "1, 2, 3, 4,"]


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


def test_speculation_gives_the_same_text_and_counts_what_it_verified(root) -> None:
    plain = launch("reference@tgis_native", root)
    try:
        expected = answers(plain)
    finally:
        plain.stop()
    server = launch("reference@tgis_native", root, "--speculate", "4")
    try:
        assert answers(server) == expected
        samples = scrape(server)
        proposed = samples[("tgi_spec_proposed_tokens_total", ())]
        accepted = samples[("tgi_spec_accepted_tokens_total", ())]
        assert 0 < accepted <= proposed
        assert samples[("tgi_spec_step_accepted_tokens_count", ())] > 0
        assert (
            "speculative decoding: n-gram (prompt lookup), up to 4 candidate tokens per row" in server.log()
        )
    finally:
        server.stop()


def test_an_engine_without_speculation_is_refused_with_one_line(root) -> None:
    with pytest.raises(RuntimeError) as error:
        launch("reference@hf_transformers", root, "--speculate", "3")
    log = str(error.value)
    assert "SPECULATE=3: speculative decoding is served by tgis_native, not hf_transformers" in log
    assert "Traceback" not in log
