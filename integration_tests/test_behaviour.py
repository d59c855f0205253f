"""End-to-end behaviour through the real launcher that YAML cases cannot express: batch
invariance against transformers, seeds, time limits, overload, cancellation, ModelInfo."""

from __future__ import annotations

import asyncio
import re
import time
from functools import cache

import grpc
import pytest
import torch

from integration_tests.faults import long_params
from integration_tests.servers import Server, launch
from router.core.detokenizer import Detokenizer
from router.core.tokenizer import load_tokenizer
from router.pb import generation_pb2 as pb

PROMPTS = [
    "A very long story:\n",
    "def hello(world):\n    return",
    "import os",
    "class Foo(object):\n    '''A docstring'''\n",
    "x = [1, 2, 3]",
    "Hello there",
]


def greedy(max_new: int, **decoding) -> pb.Parameters:
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=max_new),
        response=pb.ResponseOptions(generated_tokens=True),
        decoding=pb.DecodingParameters(**decoding),
    )


@cache
def oracle(
    model_dir: str, prompt: str, max_new: int, repetition_penalty: float = 1.0
) -> tuple[list[str], str]:
    """transformers generate: (token pieces, text decoded the way the router decodes)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    auto = transformers.AutoModelForSeq2SeqLM if "t5" in model_dir else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=model.generation_config.pad_token_id or model.config.eos_token_id,
        )
    new = out[0, 1:] if model.config.is_encoder_decoder else out[0, ids.shape[1] :]
    new_ids = new.tolist()
    eos = model.config.eos_token_id
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in new_ids]
    text_ids = new_ids[:-1] if new_ids and new_ids[-1] == eos else new_ids
    detokenizer = Detokenizer(load_tokenizer(model_dir), seq2seq=model.config.is_encoder_decoder)
    return pieces, detokenizer.decode(text_ids)


async def stream_text(stub, prompt: str, params: pb.Parameters) -> tuple[list[str], str]:
    pieces, text = [], ""
    async for message in stub.GenerateStream(
        pb.SingleGenerationRequest(request={"text": prompt}, params=params)
    ):
        pieces.extend(t.text for t in message.tokens)
        text += message.text
    return pieces, text


@pytest.mark.parametrize(
    ("model", "penalty"), [("llama", 1.0), ("llama-sp", 1.0), ("gpt2", 100.0), ("t5", 1.0)]
)
def test_batch_invariance_and_transformers_parity(server, model: str, penalty: float) -> None:
    """A prompt's greedy output is the same alone and in busy batches, unary or streamed, and
    equals transformers generate (gpt2: EOS == pad with a huge repetition penalty)."""
    assert_batch_invariance_and_parity(server(model), penalty)


def assert_batch_invariance_and_parity(s: Server, penalty: float = 1.0) -> None:
    """Six prompts alone, then all at once (unary, streamed, batched, staggered joins): every
    answer equals transformers generate (also run by integration_tests/test_sharded.py)."""
    decoding = {"repetition_penalty": penalty} if penalty != 1.0 else {}
    lengths = [12, 7, 16, 9, 14, 5]
    expected = [oracle(str(s.model_dir), p, n, penalty) for p, n in zip(PROMPTS, lengths, strict=True)]

    async def run() -> None:
        stub = s.aio_stub()
        # Alone, one after the other.
        for prompt, n, want in zip(PROMPTS, lengths, expected, strict=True):
            reply = await stub.Generate(
                pb.BatchedGenerationRequest(requests=[{"text": prompt}], params=greedy(n, **decoding))
            )
            r = reply.responses[0]
            assert ([t.text for t in r.tokens], r.text) == want, prompt
        # Everything at once: single and batched unary calls, streams, staggered joins.
        calls = []
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
            calls.append(
                stub.Generate(
                    pb.BatchedGenerationRequest(requests=[{"text": prompt}], params=greedy(n, **decoding))
                )
            )
            calls.append(stream_text(stub, prompt, greedy(n, **decoding)))
            if i % 2:
                await asyncio.sleep(0.01)
        batched = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[{"text": p} for p in PROMPTS[:3]], params=greedy(12, **decoding)
            )
        )
        results = await asyncio.gather(*calls, batched)
        for i, want in enumerate(expected):
            unary, streamed = results[2 * i].responses[0], results[2 * i + 1]
            assert ([t.text for t in unary.tokens], unary.text) == want, f"unary {i}"
            assert streamed == want, f"stream {i}"
        for prompt, r in zip(PROMPTS[:3], results[-1].responses, strict=True):
            assert ([t.text for t in r.tokens], r.text) == oracle(str(s.model_dir), prompt, 12, penalty)

    asyncio.run(run())


def test_identical_sampled_inputs_get_distinct_seeds(server) -> None:
    stub = server("llama").stub()
    params = pb.Parameters(method=pb.SAMPLE, stopping=pb.StoppingCriteria(max_new_tokens=10))
    reply = stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "Hello there"}] * 5, params=params))
    seeds = [r.seed for r in reply.responses]
    assert len(set(seeds)) == 5 and all(0 < seed <= 2**32 - 1 for seed in seeds)
    assert len({r.text for r in reply.responses}) == 5


@pytest.mark.parametrize("limit_ms", [1, 40])
def test_time_limit(server, limit_ms: int) -> None:
    stub = server("llama").stub()
    start = time.monotonic()
    reply = stub.Generate(
        pb.BatchedGenerationRequest(requests=[{"text": "def doit():\n"}], params=long_params(limit_ms))
    )
    elapsed = time.monotonic() - start
    r = reply.responses[0]
    assert r.stop_reason == pb.TIME_LIMIT and 1 <= r.generated_token_count < 169
    assert elapsed >= limit_ms / 1000
    messages = list(
        stub.GenerateStream(
            pb.SingleGenerationRequest(request={"text": "def doit():\n"}, params=long_params(limit_ms))
        )
    )
    assert messages[-1].stop_reason == pb.TIME_LIMIT and 1 <= messages[-1].generated_token_count < 169


def test_deadline_expiring_in_the_queue(server) -> None:
    """With the batch full, a request whose deadline passes while it waits answers TIME_LIMIT
    with 0 tokens (unary, with its input count; and streamed)."""
    s = server("llama")

    async def run() -> None:
        stub = s.aio_stub()
        busy = [
            stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": f"x{i}"}], params=long_params()))
            for i in range(8)
        ]
        busy_tasks = [asyncio.ensure_future(b) for b in busy]
        await asyncio.sleep(0.05)  # admitted: the batch is full for their 169 steps

        async def streamed() -> list[pb.GenerationResponse]:
            request = pb.SingleGenerationRequest(request={"text": "Hello there"}, params=long_params(30))
            return [m async for m in stub.GenerateStream(request)]

        # both wait at once, so that both deadlines pass within the busy requests' run even where
        # it is short (on a 2-core Zen 4 EPYC a stream sent after the unary request's answer was
        # admitted once the batch ended and took a token)
        late, messages = await asyncio.gather(
            stub.Generate(
                pb.BatchedGenerationRequest(requests=[{"text": "Hello there"}], params=long_params(30))
            ),
            streamed(),
        )
        r = late.responses[0]
        assert (r.stop_reason, r.generated_token_count, r.input_token_count, r.text) == (
            pb.TIME_LIMIT,
            0,
            5,
            "",
        )
        assert messages[0].input_token_count == 5
        assert messages[-1].stop_reason == pb.TIME_LIMIT and messages[-1].generated_token_count == 0
        for reply in await asyncio.gather(*busy_tasks):
            assert reply.responses[0].generated_token_count == 169

    asyncio.run(run())


def test_overload_is_refused_at_once(server) -> None:
    stub = server("llama").stub()
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "x"}] * 65))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == "Model is overloaded"
    # Permits were not leaked.
    assert len(stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "x"}] * 64)).responses) == 64


def test_cancelled_streams_free_their_slots(server) -> None:
    s = server("llama")

    async def run() -> None:
        stub = s.aio_stub()
        calls = [
            stub.GenerateStream(
                pb.SingleGenerationRequest(request={"text": f"cancel me {i}"}, params=long_params())
            )
            for i in range(8)
        ]
        for call in calls:
            await call.read()  # message 1
            await call.read()  # a first token
        for call in calls:
            call.cancel()
        reply = await stub.Generate(
            pb.BatchedGenerationRequest(requests=[{"text": "after"}], params=greedy(3))
        )
        assert reply.responses[0].generated_token_count == 3

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cancelled = re.findall(r"Streaming response generated (\d+) tokens before CANCELLED", s.log())
        if len(cancelled) >= 8:
            break
        time.sleep(0.1)
    assert len(cancelled) >= 8 and all(int(n) < 169 for n in cancelled)


@pytest.mark.parametrize(
    ("model", "kind"),
    [("llama", pb.ModelInfoResponse.DECODER_ONLY), ("t5", pb.ModelInfoResponse.ENCODER_DECODER)],
)
def test_model_info(server, model: str, kind: int) -> None:
    info = server(model).stub().ModelInfo(pb.ModelInfoRequest(model_id="ignored"))
    assert (info.model_kind, info.max_sequence_length, info.max_new_tokens) == (kind, 200, 169)


@pytest.mark.parametrize("name", ["llama", "llama@hf_transformers"])
def test_scheduling_by_priority(tmp_path, name: str) -> None:
    """SCHEDULING_POLICY=priority with one place in the batch: a long seeded sampling request
    (priority 0) holds it; of two requests that arrive, the later one of lower value (-1, gRPC
    metadata x-request-priority) preempts it and runs first; the long one resumes ahead of the
    earlier arrival of value 5 (the OpenAI door's `priority`), which runs last. The long one's
    answer is the one it gets when nothing preempts it."""
    import json
    import urllib.request

    s = launch(name, tmp_path, "--max-batch-size", "1", env={"SCHEDULING_POLICY": "priority"})
    busy_params = long_params()
    busy_params.method = pb.SAMPLE
    busy_params.sampling.CopyFrom(pb.SamplingParameters(temperature=1.0, top_k=50, seed=7))
    busy_params.decoding.repetition_penalty = 1.2
    busy_request = pb.BatchedGenerationRequest(requests=[{"text": "busy"}], params=busy_params)
    try:

        def openai_completion(priority: int) -> float:
            body = {"prompt": "late", "max_tokens": 4, "priority": priority}
            request = urllib.request.Request(
                f"http://127.0.0.1:{s.http_port}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
            return time.monotonic()

        async def run() -> tuple[float, float]:
            stub = s.aio_stub()
            busy = asyncio.ensure_future(stub.Generate(busy_request))
            await asyncio.sleep(0.1)  # it holds the one place for its 169 steps
            low = asyncio.ensure_future(asyncio.to_thread(openai_completion, 5))
            await asyncio.sleep(0.1)
            high = stub.Generate(
                pb.BatchedGenerationRequest(requests=[{"text": "urgent"}], params=greedy(4)),
                metadata=(("x-request-priority", "-1"),),
            )
            await high
            high_done = time.monotonic()
            preempted = (await busy).responses[0]
            busy_done = time.monotonic()
            low_done = await low
            assert preempted.generated_token_count == 169
            alone = (await stub.Generate(busy_request)).responses[0]
            assert preempted.text == alone.text
            return high_done, busy_done, low_done

        high_done, busy_done, low_done = asyncio.run(run())
        assert high_done < busy_done < low_done
        with urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/metrics", timeout=10) as response:
            assert "\ntgi_request_preemption_total 1.0\n" in response.read().decode()
    finally:
        s.stop()
