"""Hostile input against the real launcher (a tiny model whose tokenizer adds no BOS, small
limits): each defect a hostile client found has a regression test here, then a seeded fuzz of
the four RPCs must end in allowed statuses only and leave the server answering as before."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from integration_tests import fuzz
from integration_tests.servers import Server, launch
from router.core.validation import EMPTY_INPUT_MESSAGE
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc

logger = logging.getLogger(__name__)
FOUR_MIB_TEXT = "hello world, " * 300_000  # 3.9 MB: just under gRPC's 4 MiB message limit


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    s = launch("gpt2", Path(tmp_path_factory.mktemp("hardening")), *fuzz.HARDENING_FLAGS)
    yield s
    s.stop()


def _code(call, *args) -> tuple[str, str]:
    try:
        call(*args)
    except grpc.RpcError as error:
        return error.code().name, error.details()
    return "OK", ""


def _generate(*texts: str, **kwargs) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(requests=[{"text": t} for t in texts], **kwargs)


def _router(s: Server) -> psutil.Process:
    children = psutil.Process(s.process.pid).children(recursive=True)
    return next(p for p in children if "text-generation-router" in " ".join(p.cmdline()))


# ---- 1. empty prompts ----------------------------------------------------------------------


def test_an_empty_prompt_is_invalid_and_spares_nobody_else(server: Server) -> None:
    stub = server.stub()
    invalid = ("INVALID_ARGUMENT", EMPTY_INPUT_MESSAGE)
    assert _code(stub.Generate, _generate("")) == invalid
    assert _code(stub.Generate, _generate("", "Hello")) == invalid
    stream = lambda request: list(stub.GenerateStream(request))  # noqa: E731
    assert _code(stream, pb.SingleGenerationRequest(request={})) == invalid
    assert _code(stream, pb.SingleGenerationRequest()) == ("INVALID_ARGUMENT", "missing request")
    reply = stub.Generate(_generate("Hello"))
    assert reply.responses[0].generated_token_count == 20


def test_a_batch_with_one_invalid_input_says_why(server: Server) -> None:
    """TGIS fails the whole call on the first invalid input, in request order; the client sees
    that input's reason, and the valid inputs never reach the queue."""
    stub = server.stub()
    code, message = _code(stub.Generate, _generate("Hello", "word " * 300, "", "World"))
    assert code == "INVALID_ARGUMENT" and message.startswith("input tokens (") and "must be < 200" in message
    code, message = _code(stub.Generate, _generate("Hello", "", "word " * 300))
    assert (code, message) == ("INVALID_ARGUMENT", EMPTY_INPUT_MESSAGE)
    replies = stub.Generate(_generate("Hello", "World")).responses
    assert [r.generated_token_count for r in replies] == [20, 20]


# ---- 2. undecodable bodies -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "body"),
    [
        ("GenerateStream", "1a051203eda080"),  # a string field holding invalid UTF-8
        ("ModelInfo", "474e"),  # corrupt wire format
        ("Generate", "0a"),  # truncated
        ("Tokenize", "0aff"),
    ],
)
def test_an_undecodable_body_is_invalid_argument(server: Server, method: str, body: str) -> None:
    channel = grpc.insecure_channel(server.address)
    path = f"/fmaas.GenerationService/{method}"
    call = channel.unary_stream(path) if method == "GenerateStream" else channel.unary_unary(path)
    before = server.log().count("undecodable request")
    code, message = _code(
        lambda: list(call(bytes.fromhex(body))) if method == "GenerateStream" else call(bytes.fromhex(body))
    )
    assert code == "INVALID_ARGUMENT" and message.startswith("cannot parse "), message
    time.sleep(0.2)  # the log line is forwarded by the launcher
    assert server.log().count("undecodable request") == before + 1
    assert "Traceback" not in server.log()


# ---- 4. Tokenize cannot stall generation ---------------------------------------------------


def test_tokenize_storms_do_not_stall_generation(server: Server) -> None:
    async def run() -> tuple[float, list[float], list[str]]:
        stub = server.aio_stub()

        async def tokenize() -> tuple[str, float]:
            request = pb.BatchedTokenizeRequest(requests=[{"text": FOUR_MIB_TEXT}])
            try:
                await stub.Tokenize(request)
            except grpc.aio.AioRpcError as error:
                return error.code().name, time.monotonic()
            return "OK", time.monotonic()

        storm = [asyncio.ensure_future(tokenize()) for _ in range(4)]
        await asyncio.sleep(0.3)
        params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=40, min_new_tokens=40))
        reply = await stub.Generate(_generate("Hello", params=params))
        generated_at = time.monotonic()
        assert reply.responses[0].generated_token_count == 40
        done = await asyncio.gather(*storm)
        return generated_at, [at for _, at in done], [code for code, _ in done]

    generated_at, tokenized_at, codes = asyncio.run(run())
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    # The generation was admitted, run and answered while the storm was still being tokenized.
    assert generated_at < max(tokenized_at)


# ---- 5. memory after huge prompts ----------------------------------------------------------


def test_router_memory_returns_after_huge_prompts(server: Server) -> None:
    router = _router(server)
    stub = server.stub()
    stub.Generate(_generate("Hello"))
    baseline = router.memory_info().rss
    # Refused by its size alone, before tokenization.
    code, message = _code(stub.Generate, _generate(FOUR_MIB_TEXT))
    assert code == "INVALID_ARGUMENT" and message.startswith("input tokens (at least "), message
    # Truncated: tokenized whole (about a million tokens), then only the tail is kept.
    reply = stub.Generate(_generate(FOUR_MIB_TEXT, params=pb.Parameters(truncate_input_tokens=50)))
    assert reply.responses[0].input_token_count == 50
    big_answers = grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", -1)])
    tokenized = generation_pb2_grpc.GenerationServiceStub(big_answers).Tokenize(
        pb.BatchedTokenizeRequest(requests=[{"text": FOUR_MIB_TEXT}], return_tokens=True)
    )
    assert tokenized.responses[0].token_count > 500_000
    deadline = time.monotonic() + 15
    while (grown := router.memory_info().rss - baseline) > 100 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.5)
    logger.info(
        "router RSS %.0f MiB, %.0f MiB above its baseline", router.memory_info().rss / 2**20, grown / 2**20
    )
    assert grown <= 100 * 2**20, f"the router kept {grown / 2**20:.0f} MiB"


# ---- 6. echoed strings ---------------------------------------------------------------------


def test_long_client_strings_are_not_echoed_whole(server: Server) -> None:
    stub = server.stub()
    long_id = "x" * 50_000  # 20 k would already exceed a client's default 16 KiB metadata limit
    code, message = _code(
        lambda: stub.Generate(
            # 7,000: all metadata stays under gRPC's 8 KiB soft limit, above which a server
            # refuses a random share of calls (RESOURCE_EXHAUSTED)
            _generate("hi", prefix_id=long_id),
            metadata=(("x-correlation-id", "c" * 7000),),
        )
    )
    assert code == "INVALID_ARGUMENT", (code, message)
    assert message.startswith("can't retrieve prompt prefix with id 'xxx") and len(message) < 1000
    assert max(len(line) for line in server.log().splitlines()) < 2000


# ---- 7. the small ones ---------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/nope", 404), ("POST", "/health", 405)])
def test_http_errors_have_json_bodies(server: Server, method: str, path: str, status: int) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", method=method, data=b"")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert error.value.code == status
    assert error.value.headers["Content-Type"] == "application/json"
    body = json.loads(error.value.read())
    assert set(body) == {"error", "error_type"} and body["error"]


# ---- the fuzz ------------------------------------------------------------------------------


def test_fuzz_ends_in_allowed_statuses_and_leaves_the_server_as_it_was(server: Server) -> None:
    stub = server.stub()
    probe = _generate(
        "def hello(world):", "import os", params=pb.Parameters(response={"generated_tokens": True})
    )
    before = stub.Generate(probe)
    started = time.monotonic()
    tally = fuzz.run(server.address, structured=3_200, raw=800)  # longer: make fuzz-soak
    logger.info("fuzz: %.0f s\n%s", time.monotonic() - started, tally.summary())
    assert not tally.bad, "\n".join(tally.bad[:20])
    assert tally.calls == 4_000
    # The server answers the same request identically, and every permit came back: as many
    # concurrent inputs as the limit allows all succeed.
    assert stub.Generate(probe) == before
    full = stub.Generate(_generate(*["Hello"] * 16, params=pb.Parameters(stopping={"max_new_tokens": 3})))
    assert [r.generated_token_count for r in full.responses] == [3] * 16
    assert server.health() == 200
    assert "Traceback" not in server.log()
