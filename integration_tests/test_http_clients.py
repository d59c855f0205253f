"""The HTTP doors through the real launcher, driven by the real HF `text-generation` client:
generation, streaming, details, errors, and the same answer over gRPC and TGI REST."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from text_generation import Client
from text_generation.errors import ValidationError

from integration_tests.servers import Server
from router.pb import generation_pb2 as pb

# the client (last released 2024-03) calls pydantic's deprecated .dict()
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")

PROMPTS = ["The quick brown fox", "def main():\n    print(", "Hello"]


@pytest.fixture(scope="module", params=["llama", "llama@tgis_native"])
def served(request, server: Callable[[str], Server]) -> Server:
    return server(request.param)


def client(s: Server) -> Client:
    return Client(f"http://127.0.0.1:{s.http_port}", timeout=60)


def grpc_greedy(s: Server, prompt: str, max_new: int) -> pb.GenerationResponse:
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new))
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=prompt)], params=params)
    return s.stub().Generate(request).responses[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_door_gives_the_same_greedy_answer(served: Server, prompt: str) -> None:
    expected = grpc_greedy(served, prompt, 12)
    tgi = client(served)
    unary = tgi.generate(prompt, max_new_tokens=12)  # the client always asks for details
    assert unary.generated_text == expected.text
    assert unary.details.generated_tokens == expected.generated_token_count
    streamed = list(tgi.generate_stream(prompt, max_new_tokens=12))
    assert streamed[-1].generated_text == expected.text
    assert "".join(r.token.text for r in streamed) == expected.text
    assert len(streamed) == expected.generated_token_count


def test_details_and_sampling(served: Server) -> None:
    tgi = client(served)
    answer = tgi.generate(
        "Hello",
        max_new_tokens=5,
        decoder_input_details=True,
        top_n_tokens=2,
        do_sample=True,
        seed=42,
    )
    details = answer.details
    assert details.seed == 42 and details.generated_tokens == len(details.tokens) <= 5
    assert details.prefill and details.prefill[0].logprob is None
    assert all(len(top) == 2 for top in details.top_tokens)
    again = tgi.generate("Hello", max_new_tokens=5, do_sample=True, seed=42)
    assert again.generated_text == answer.generated_text  # a seed makes sampling repeatable


def test_errors_reach_the_client_as_tgi_errors(served: Server) -> None:
    tgi = client(served)
    with pytest.raises(ValidationError, match="max_new_tokens must be <= "):
        tgi.generate("Hello", max_new_tokens=100_000)
    with pytest.raises(ValidationError, match=r"must be >= 0\.05"):
        list(tgi.generate_stream("Hello", do_sample=True, temperature=0.01))
