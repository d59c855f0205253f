"""The engine conformance suite: every registered engine (and the fake engine) must pass it.

Each engine runs on tiny random-weight models (tests/engines/conformance.py says which) and is
held to: greedy parity with its oracle (transformers `generate`), batch invariance across
joins, prunes and run-ahead, seeds, penalties, token details, truncation, and, through the
router's own batcher, stop sequences and streaming equal to unary answers.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from router.core.capacity import capacity_for
from router.core.entry import Output
from router.core.metrics import Metrics
from router.core.stopping import StopReason
from router.core.tokenizer import load_tokenizer
from router.core.validation import ValidatedRequest
from tests.engines.conformance import (
    EngineCase,
    LocalShard,
    LogitBias,
    OpenAIPenalties,
    Oracle,
    Runner,
    TGIFrequencyPenalty,
    alone,
    engine_cases,
    oracle_for,
    through_batcher,
    validated_request,
)
from text_generation_common.engines import ENGINES
from text_generation_common.messages import GenerationRequest, LengthPenalty, RequestedDetails, SamplingParams
from text_generation_server.batches.inputs import NOT_RESUMABLE, truncated_input_ids
from text_generation_server.engines.base import ModelEngine

PROMPTS = (
    "def hello(world):\n    return",
    "import os",
    "class Foo(object):\n    '''A docstring for this class that is long'''\n",
    "x = [1, 2, 3]\nfor i in x:\n    print(i)",
)


@dataclass
class Subject:
    case: EngineCase
    engine: ModelEngine
    oracle: Oracle
    model_dir: Path

    def __post_init__(self) -> None:
        self.tokenizer = load_tokenizer(str(self.model_dir))

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text).ids)

    def request(self, request_id: int, prompt: int, max_new: int, **kwargs) -> GenerationRequest:
        params = kwargs.pop("params", SamplingParams())
        return GenerationRequest(request_id, self.encode(PROMPTS[prompt]), max_new, params=params, **kwargs)

    @property
    def seq2seq(self) -> bool:
        return self.engine.info.seq2seq


@pytest.fixture(scope="module", params=engine_cases(), ids=lambda c: c.id)
def subject(request, tiny_model) -> Iterator[Subject]:
    case: EngineCase = request.param
    model_dir = case.model_dir(tiny_model(case.arch))
    engine = case.build(model_dir)
    yield Subject(case, engine, oracle_for(case, engine, model_dir), model_dir)


def sampled(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=kwargs.pop("temperature", 1.0), seed=seed, **kwargs)


def test_the_engine_reports_what_its_registry_entry_says(subject: Subject) -> None:
    spec = ENGINES.get(subject.case.engine)
    if spec is None:
        pytest.skip("not a registered engine")
    info = subject.engine.info
    assert info.capacity.kind is spec.capabilities.capacity
    assert info.chunked_prefill == spec.capabilities.chunked_prefill
    assert spec.capabilities.seq2seq or not info.seq2seq
    if not torch.cuda.is_available():  # computing on the CPU: the router learns on which CPUs
        assert info.compute_cpus == tuple(sorted(os.sched_getaffinity(0)))
    adapters = subject.engine.adapters
    assert (adapters is not None) == spec.capabilities.prompt_tuning
    # GPT-BigCode sharded on our own layers takes no LoRA yet
    own_layers = torch.distributed.is_initialized() and subject.case.arch == "gpt_bigcode"
    assert (adapters is not None and adapters.lora is not None) == (spec.capabilities.lora and not own_layers)


def test_greedy_matches_the_oracle_alone_and_in_a_batch(subject: Subject) -> None:
    requests = [subject.request(i, i, 12) for i in range(len(PROMPTS))]
    expected = {r.id: subject.oracle(r.input_ids, 12) for r in requests}
    assert {r.id: alone(subject.engine, r) for r in requests} == expected
    assert Runner(subject.engine).run({0: requests}) == expected


@pytest.mark.parametrize(
    ("run_ahead", "steps"), [(False, 1), (True, 1), (True, 3)], ids=["one-step", "run-ahead", "3-step-calls"]
)
def test_batch_invariance_across_joins_and_prunes(subject: Subject, run_ahead: bool, steps: int) -> None:
    first = [
        subject.request(1, 0, 6),
        subject.request(2, 1, 9, params=sampled(7, top_k=20)),
        subject.request(3, 2, 3, params=SamplingParams(repetition_penalty=1.5)),
    ]
    joining = [
        subject.request(4, 3, 5, params=sampled(3, top_p=0.9, temperature=0.7)),
        subject.request(5, 1, 2),
    ]
    together = Runner(subject.engine, run_ahead=run_ahead, steps=steps).run({0: first, 2: joining})
    assert together == {r.id: alone(subject.engine, r) for r in first + joining}


@pytest.mark.parametrize(
    ("run_ahead", "steps"), [(False, 1), (True, 1), (True, 3)], ids=["one-step", "run-ahead", "3-step-calls"]
)
def test_chunked_prefill_gives_the_same_tokens(subject: Subject, run_ahead: bool, steps: int) -> None:
    if not subject.engine.info.chunked_prefill:
        pytest.skip("the engine computes whole prompts (no chunked prefill)")
    details = RequestedDetails(input_tokens=True, logprobs=True)
    schedule = {
        0: [subject.request(1, 2, 6, details=details), subject.request(2, 0, 4, params=sampled(5))],
        3: [subject.request(3, 3, 5), subject.request(4, 1, 3, details=details)],
    }
    whole = Runner(subject.engine, run_ahead=False)  # no step ahead: no answer is pending
    chunked = Runner(subject.engine, run_ahead=run_ahead, token_budget=7, steps=steps)
    assert chunked.run(schedule) == whole.run(schedule)
    assert chunked.pending_steps > 0 and whole.pending_steps == 0
    assert chunked.input_tokens.keys() == whole.input_tokens.keys() == {1, 4}
    for rid, tokens in whole.input_tokens.items():  # the chunks' logits sliced to the right tokens
        got = chunked.input_tokens[rid]
        assert [t.token_id for t in got] == [t.token_id for t in tokens]
        assert [t.logprob for t in got[1:]] == pytest.approx([t.logprob for t in tokens[1:]], abs=1e-4)


def test_seeds_reproduce_and_differ(subject: Subject) -> None:
    one = alone(subject.engine, subject.request(1, 0, 10, params=sampled(11)))
    assert alone(subject.engine, subject.request(2, 0, 10, params=sampled(11))) == one
    assert alone(subject.engine, subject.request(3, 0, 10, params=sampled(12))) != one


def test_repetition_penalty_matches_the_oracle(subject: Subject) -> None:
    if subject.case.engine == "fake":
        pytest.skip("the fake engine's reference is greedy only (batch invariance covers penalties)")
    request = subject.request(1, 3, 12, params=SamplingParams(repetition_penalty=1.8))
    assert alone(subject.engine, request) == subject.oracle(request.input_ids, 12, repetition_penalty=1.8)


def test_openai_penalties_match_the_oracle(subject: Subject) -> None:
    """presence_penalty and frequency_penalty (the OpenAI door's) against transformers' greedy
    `generate` with the same penalties as a logits processor. A negative frequency penalty makes
    the tiny random models repeat tokens (counts past 1), so the answer differs from greedy's."""
    if subject.case.engine == "fake":
        pytest.skip("the fake engine's reference is greedy only (batch invariance covers penalties)")
    from transformers import LogitsProcessorList

    params = SamplingParams(presence_penalty=2.0, frequency_penalty=-6.0)
    request = subject.request(1, 3, 12, params=params)
    start = 1 if subject.engine.info.seq2seq else len(request.input_ids)
    processors = LogitsProcessorList([OpenAIPenalties(start, 2.0, -6.0)])
    got = alone(subject.engine, request)
    assert got == subject.oracle(request.input_ids, 12, logits_processor=processors)
    assert got != subject.oracle(request.input_ids, 12)


def test_tgi_frequency_penalty_matches_the_oracle(subject: Subject) -> None:
    """frequency_penalty in TGI's form (the REST door's: counts over the prompt and the
    generated ids, divided by their number) against transformers' greedy `generate` with the
    same penalty as a logits processor. A strongly negative one makes the model repeat tokens
    of the prompt and the output, so the answer differs from greedy's."""
    if subject.case.engine == "fake":
        pytest.skip("the fake engine's reference is greedy only (batch invariance covers penalties)")
    from transformers import LogitsProcessorList

    params = SamplingParams(frequency_penalty=-40.0, frequency_by_length=True)
    request = subject.request(1, 3, 12, params=params)
    processors = LogitsProcessorList([TGIFrequencyPenalty(-40.0)])
    got = alone(subject.engine, request)
    assert got == subject.oracle(request.input_ids, 12, logits_processor=processors)
    assert got != subject.oracle(request.input_ids, 12)


def test_logit_bias_matches_the_oracle(subject: Subject) -> None:
    """logit_bias (the OpenAI door's) against transformers' greedy `generate` with the same
    biases as a logits processor: the plain answer's first token banned, another token raised
    (it then comes back where the model alone would not choose it)."""
    if subject.case.engine == "fake":
        pytest.skip("the fake engine's reference is greedy only (batch invariance covers the biases)")
    from transformers import LogitsProcessorList

    request = subject.request(1, 3, 12)
    plain = subject.oracle(request.input_ids, 12)
    raised = next(t for t in range(3, subject.engine.info.vocab_size) if t not in plain)
    biases = ((plain[0], -100.0), (raised, 12.0))
    biased = subject.request(1, 3, 12, params=SamplingParams(logit_bias=tuple(sorted(biases))))
    got = alone(subject.engine, biased)
    assert got == subject.oracle(
        request.input_ids, 12, logits_processor=LogitsProcessorList([LogitBias(biases)])
    )
    assert got[0] != plain[0] and raised in got


def test_min_new_tokens_holds_eos_back(subject: Subject) -> None:
    eos = subject.engine.info.eos_token_id
    # Length penalty with a huge decay pushes EOS up as soon as it starts: EOS comes at once
    # after min_new_tokens, never before.
    params = SamplingParams(min_new_tokens=4, length_penalty=LengthPenalty(0, 10.0))
    got = alone(subject.engine, subject.request(1, 0, 12, params=params))
    assert eos not in got[:4] and got[4] == eos and len(got) == 5


def test_token_details(subject: Subject) -> None:
    details = RequestedDetails(input_tokens=True, logprobs=True, ranks=True, top_n_tokens=3)
    requests = [subject.request(i, i, 5, details=details) for i in range(2)]
    runner = Runner(subject.engine)
    runner.run({0: requests})
    for request in requests:
        tokens = runner.tokens[request.id]
        for token in tokens:  # greedy: the chosen token is the most likely one
            assert token.rank == 1 and token.logprob <= 0.0
            assert token.top_tokens[0].token_id == token.token_id
            assert token.top_tokens[0].logprob == pytest.approx(token.logprob)
            assert len(token.top_tokens) >= 3
        inputs = runner.input_tokens[request.id]
        assert [t.token_id for t in inputs] == list(request.input_ids)
        assert math.isnan(inputs[0].logprob)
        if not subject.seq2seq:
            assert all(t.rank >= 1 and t.logprob <= 0.0 for t in inputs[1:])
            if subject.case.engine != "fake":  # each prompt token's logprob under the model itself
                expected = prompt_logprobs(subject.model_dir, request.input_ids)
                assert [t.logprob for t in inputs[1:]] == pytest.approx(expected, abs=2e-3)
        solo = Runner(subject.engine)
        solo.run({0: [request]})
        assert [t.logprob for t in solo.tokens[request.id]] == pytest.approx(
            [t.logprob for t in tokens], abs=1e-4
        )


@functools.cache
def _causal_lm(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt_logprobs(model_dir: Path, ids: Sequence[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1, by transformers in float32 on CPU."""
    with torch.inference_mode():
        logits = _causal_lm(model_dir)(torch.tensor([list(ids)])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_a_resumed_request_goes_on_as_if_it_never_stopped(subject: Subject) -> None:
    """A preempted request comes back with the ids it generated (generated_ids): the shard
    computes them as prompt and generates the rest as the request alone would have, greedy or
    seeded, with penalties over its generated ids and max_new_tokens counting them; alone and
    joining a batch that runs. An encoder-decoder model refuses it."""
    requests = [
        subject.request(1, 0, 10),
        subject.request(2, 3, 10, params=sampled(5, top_k=30, presence_penalty=1.0, repetition_penalty=1.3)),
        subject.request(3, 1, 10, truncate_input_tokens=3, params=SamplingParams(frequency_penalty=-3.0)),
    ]
    full = {r.id: alone(subject.engine, r) for r in requests}
    if subject.seq2seq:
        runner = Runner(subject.engine)
        runner.run({0: [replace(requests[0], generated_ids=tuple(full[1][:2]))]})
        assert runner.errors == {1: NOT_RESUMABLE}
        return
    for taken in (1, 4):
        resumed = [replace(r, id=r.id + 10, generated_ids=tuple(full[r.id][:taken])) for r in requests]
        got = Runner(subject.engine).run({0: [subject.request(9, 2, 6)], 2: resumed})
        assert {r.id - 10: got[r.id] for r in resumed} == {i: ids[taken:] for i, ids in full.items()}
    # what a client of the internal protocol may get wrong fails that request alone
    vocab = subject.engine.info.vocab_size
    bad = [
        replace(requests[0], id=21, generated_ids=tuple(full[1])),  # every token it may take
        replace(requests[0], id=22, generated_ids=(vocab,)),
    ]
    runner = Runner(subject.engine)
    runner.run({0: [*bad, subject.request(23, 2, 3)]})
    assert runner.errors == {
        21: "a resumed request has 10 of its max_new_tokens (10) already",
        22: f"generated token id {vocab} is outside the vocabulary (size {vocab})",
    }
    assert len(runner.tokens[23]) == 3


def test_truncation_keeps_the_last_tokens(subject: Subject) -> None:
    request = subject.request(1, 2, 8, truncate_input_tokens=5)
    ids = request.input_ids
    bos = ids[0] if ids[0] == subject.tokenizer.token_to_id("<s>") else None  # BOS comes back first
    kept = truncated_input_ids(request, bos)
    assert len(kept) == 5 and (bos is None or kept[0] == bos)
    assert alone(subject.engine, request) == subject.oracle(kept, 8)


# ---- through the router's batcher ------------------------------------------------------------


async def router_outputs(
    subject: Subject, requests: list[tuple[ValidatedRequest, bool]], shard: LocalShard | None = None
) -> list[list[Output]]:
    """The outputs of `requests` through the router's batcher, whose decode calls run up to 4
    steps once every request has its first token."""
    shard = shard or LocalShard(subject.engine)
    info = await shard.model_info()
    metrics = Metrics(max_batch_size=8)
    return await through_batcher(
        shard, subject.tokenizer, requests, capacity_for(info, 1.0), metrics, decode_steps=4
    )


def validated(subject: Subject, prompt: int, max_new: int, stop: tuple[str, ...] = ()) -> ValidatedRequest:
    return validated_request(subject.encode(PROMPTS[prompt]), max_new, stop=stop)


async def test_stream_equals_unary_and_stop_sequences_cut(subject: Subject) -> None:
    shard = LocalShard(subject.engine)
    unary, streamed = await router_outputs(
        subject, [(validated(subject, 0, 10), False), (validated(subject, 0, 10), True)], shard
    )
    assert max(shard.steps_asked) == 4  # several tokens per call, the stream cut out of them
    (answer,) = unary
    assert "".join(o.text for o in streamed) == answer.text
    assert [t.token_id for o in streamed for t in o.tokens] == [t.token_id for t in answer.tokens]
    assert answer.tokens and len(answer.text) >= 4
    stop = answer.text[2:4]
    ((cut,),) = await router_outputs(subject, [(validated(subject, 0, 10, stop=(stop,)), False)])
    assert cut.stop_reason is StopReason.STOP_SEQUENCE and cut.text == answer.text[: answer.text.find(stop)]


def test_a_step_reports_its_forward_time(subject: Subject) -> None:
    if subject.case.engine == "fake":
        pytest.skip("the fake engine runs no model")
    batch, errors = subject.engine.new_batch(1, [subject.request(1, 0, 2)])
    assert batch is not None and not errors
    output, _ = subject.engine.generate_token(batch)
    assert 0 < output.forward_ns < 60 * 10**9
    subject.engine.release([1])
