"""Token details: logprobs, ranks and top-n against a direct log_softmax of the model's logits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from transformers.generation import logits_process as hf

from tests.shard_harness import Driver, make_request, running_shard
from text_generation_common.messages import RequestedDetails
from text_generation_server.config import ServerConfig
from text_generation_server.engines.hf_transformers import HFTransformersEngine
from text_generation_server.sampling.token_details import _top_tokens, generated_token_infos

PROMPT_A = "def hello(world):\n    return world"
PROMPT_B = "import os"


@pytest.fixture(scope="module")
def llama(tiny_model, tmp_path_factory) -> Iterator[tuple[HFTransformersEngine, object, object]]:
    import transformers

    path = tiny_model("llama")
    socket = str(tmp_path_factory.mktemp("s") / "shard")
    config = ServerConfig(model_name=str(path), uds_path=socket, dtype="float32")
    engine = HFTransformersEngine(config)
    with running_shard(engine, config) as stub:
        yield engine, stub, transformers.AutoTokenizer.from_pretrained(path)


def full_logits(engine: HFTransformersEngine, ids: list[int]) -> torch.Tensor:
    """Raw logits [len(ids), vocab] of the model on `ids` alone."""
    with torch.inference_mode():
        return engine.model(input_ids=torch.tensor([ids])).logits[0].float()


def expected_top(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    values, ids = logprobs.topk(n)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def test_generated_greedy_details(llama) -> None:
    engine, stub, tok = llama
    prompt = tok(PROMPT_A)["input_ids"]
    driver = Driver(stub, engine.info.eos_token_id, stop_at_eos=False)
    # In a padded batch with a shorter neighbour, to check row bookkeeping.
    driver.prefill(
        [
            make_request(1, prompt, 6, logprobs=True, ranks=True, top_n=3),
            make_request(2, tok(PROMPT_B)["input_ids"], 6),
        ]
    )
    driver.run()
    generated = driver.ids(1)
    for step, token in enumerate(driver.tokens[1]):
        logprobs = torch.log_softmax(full_logits(engine, prompt + generated[:step])[-1], -1)
        assert token.logprob == pytest.approx(float(logprobs[token.token_id]), rel=1e-4, abs=1e-5)
        assert token.rank == 1  # greedy picks the argmax
        got = [(t.token_id, t.logprob) for t in token.top_tokens]
        want = expected_top(logprobs, 3)
        assert [i for i, _ in got] == [i for i, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4, abs=1e-5)
    # The neighbour asked for nothing and gets nothing.
    assert all(t.logprob == 0 and t.rank == 0 and not t.top_tokens for t in driver.tokens[2])


def test_generated_sampling_details_use_warped_scores(llama) -> None:
    engine, stub, tok = llama
    prompt = tok(PROMPT_B)["input_ids"]
    driver = Driver(stub, engine.info.eos_token_id, stop_at_eos=False)
    driver.prefill(
        [make_request(1, prompt, 5, temperature=0.7, top_k=5, seed=3, logprobs=True, ranks=True, top_n=8)]
    )
    driver.run()
    generated = driver.ids(1)
    for step, token in enumerate(driver.tokens[1]):
        raw = full_logits(engine, prompt + generated[:step])[-1:].clone()
        scores = hf.TopKLogitsWarper(5)(None, hf.TemperatureLogitsWarper(0.7)(None, raw))[0]
        logprobs = torch.log_softmax(scores, -1)
        assert token.logprob == pytest.approx(float(logprobs[token.token_id]), rel=1e-4, abs=1e-5)
        assert token.rank == int((scores > scores[token.token_id]).sum()) + 1
        # top_n 8 > top_k 5: only the 5 surviving tokens come back.
        assert sorted(t.token_id for t in token.top_tokens) == sorted(scores.topk(5).indices.tolist())


def test_input_token_details(llama) -> None:
    engine, stub, tok = llama
    prompt = tok(PROMPT_A)["input_ids"]
    driver = Driver(stub, engine.info.eos_token_id, stop_at_eos=False)
    driver.prefill(
        [
            make_request(1, tok(PROMPT_B)["input_ids"], 2, input_tokens=True),
            make_request(2, prompt, 2, input_tokens=True, logprobs=True, ranks=True, top_n=2),
        ]
    )
    driver.run()
    plain = driver.input_tokens[1]
    assert [t.token_id for t in plain] == tok(PROMPT_B)["input_ids"]
    assert all(t.logprob == 0 and t.rank == 0 and not t.top_tokens for t in plain)

    detailed = driver.input_tokens[2]
    assert [t.token_id for t in detailed] == prompt
    assert math.isnan(detailed[0].logprob) and detailed[0].rank == 0 and not detailed[0].top_tokens
    logprobs = torch.log_softmax(full_logits(engine, prompt), -1)
    for i, token in enumerate(detailed[1:], start=1):
        row = logprobs[i - 1]
        assert token.logprob == pytest.approx(float(row[token.token_id]), rel=1e-4, abs=1e-5)
        assert token.rank == int((row > row[token.token_id]).sum()) + 1
        assert [t.token_id for t in token.top_tokens] == row.topk(2).indices.tolist()


def test_encoder_input_tokens(tiny_model, tmp_path) -> None:
    import transformers

    path = tiny_model("t5")
    config = ServerConfig(model_name=str(path), uds_path=str(tmp_path / "shard"), dtype="float32")
    engine = HFTransformersEngine(config)
    ids = transformers.AutoTokenizer.from_pretrained(path)(PROMPT_A)["input_ids"]
    with running_shard(engine, config) as stub:
        driver = Driver(stub, engine.info.eos_token_id, stop_at_eos=False)
        driver.prefill(
            [
                make_request(1, ids, 2, input_tokens=True, logprobs=True, ranks=True, top_n=2),
                make_request(2, ids, 2, input_tokens=True),
            ]
        )
        driver.run()
    assert [t.token_id for t in driver.input_tokens[1]] == ids
    assert all(math.isnan(t.logprob) and t.rank == 0 and not t.top_tokens for t in driver.input_tokens[1])
    assert all(t.logprob == 0 for t in driver.input_tokens[2])


def test_top_n_ties_return_more_than_n() -> None:
    scores = torch.tensor([0.0, 5.0, 3.0, 5.0, 3.0, 3.0, -1.0])
    logprobs = torch.log_softmax(scores, -1)
    # The 2nd highest is 5.0 (tied): both 5.0 ids, lower id first.
    assert [t.token_id for t in _top_tokens(scores, logprobs, 2)] == [1, 3]
    # The 3rd highest is 3.0: every 3.0 qualifies, ordered by logprob then id.
    assert [t.token_id for t in _top_tokens(scores, logprobs, 3)] == [1, 3, 2, 4, 5]
    # Without logprobs: ascending id order, no values.
    without = _top_tokens(scores, None, 3)
    assert [t.token_id for t in without] == [1, 2, 3, 4, 5] and all(t.logprob == 0 for t in without)
    # At most 4n candidates.
    flat = torch.zeros(20)
    assert len(_top_tokens(flat, None, 2)) == 8


def test_top_n_never_returns_filtered_tokens() -> None:
    """top_k 1 + top_n 2: the -inf threshold is clamped, so only the survivor comes back."""
    scores = torch.full((1, 6), float("-inf"))
    scores[0, 4] = 1.5
    infos = generated_token_infos(scores, [4], [RequestedDetails(logprobs=True, ranks=True, top_n_tokens=2)])
    assert [t.token_id for t in infos[0].top_tokens] == [4]
    assert infos[0].logprob == 0.0 and infos[0].rank == 1
