"""The HTTP port in-process over a fake shard: TGI's REST routes (answers, SSE layout, error
shapes and status codes), the parameter mapping, and the server's hygiene (body limits,
slow clients, disconnects that must free their slot)."""

from __future__ import annotations

import asyncio
import json
import random
import socket

import aiohttp
import pytest

from router import http_server
from router.http_app import PROBE_PATHS, build_app
from router.http_server import HealthCheck, HttpServer
from router.metrics import Metrics
from router.service import GenerationService
from router.tgi_rest import Parameters, TgiRest, info_fields, request_params, unsupported
from router.tracing import Tracing
from tests.router.fakes import FakeShard
from tests.router.stacks import service_over

MAX_NEW = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    def __init__(self, shard: FakeShard, service: GenerationService, server: HttpServer, port: int) -> None:
        self.shard, self.service, self.server, self.port = shard, service, server, port
        self.url = f"http://127.0.0.1:{port}"

    @property
    def metrics(self) -> Metrics:
        return self.service.metrics

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Until every permit is back and the shard holds no request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.service.limiter.in_use or any(self.shard.batches.values()):
            assert loop.time() < deadline, (self.service.limiter.in_use, self.shard.batches)
            await asyncio.sleep(0.01)


@pytest.fixture
async def stack(detokenizer, tokenizer_pool):
    shard = FakeShard(latency_s=0.002)
    service, batcher = service_over(
        shard, detokenizer, tokenizer_pool, max_batch_size=16, permits=256, max_new_tokens=MAX_NEW
    )
    metrics = service.metrics
    info = info_fields(
        model_id="tiny",
        dtype="float32",
        max_concurrent_requests=256,
        max_sequence_length=512,
        max_new_tokens=MAX_NEW,
        max_batch_size=16,
        max_waiting_tokens=2,
        max_batch_prefill_tokens=0,
        version="0.1.0",
    )
    tgi = TgiRest(service, tokenizer_pool, Tracing.setup(None, "test"), info=info, max_new_tokens=MAX_NEW)
    health = HealthCheck(shard, batcher, tokenizer_pool, lambda: service.draining)
    server = HttpServer(build_app(health, metrics.exposition, "text/plain", tgi, version="0.1.0"))
    port = free_port()
    await server.start("127.0.0.1", port)
    task = asyncio.create_task(batcher.run())
    yield Stack(shard, service, server, port)
    task.cancel()
    await server.stop()


async def post(stack: Stack, path: str, body: object) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(stack.url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def sse_events(stack: Stack, body: object, path: str = "/generate_stream") -> list[dict]:
    events = []
    async with aiohttp.ClientSession() as session, session.post(stack.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append(json.loads(line[len(b"data:") :]))
    return events


# ---- the parameter mapping ------------------------------------------------------------------


def test_tgi_parameters_map_onto_request_params() -> None:
    greedy = request_params(Parameters(), stream=False, max_new_tokens=MAX_NEW)
    assert greedy.sampling.greedy and greedy.stopping.max_new_tokens == 100
    assert not greedy.response.generated_tokens  # no details asked for
    assert request_params(Parameters(), stream=False, max_new_tokens=50).stopping.max_new_tokens == 50
    # TGI's rule: a sampling parameter away from its neutral value turns sampling on
    for implied in (
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.9},
        {"typical_p": 0.5},
        {"do_sample": True},
    ):
        p = request_params(Parameters(**implied, seed=7), stream=False, max_new_tokens=MAX_NEW)
        assert not p.sampling.greedy and p.sampling.seed == 7, implied
    for neutral in (
        {"temperature": 1.0},
        {"top_k": 0},
        {"top_p": 1.0},
        {"temperature": 0.0, "do_sample": True},
    ):
        assert request_params(Parameters(**neutral), stream=False, max_new_tokens=MAX_NEW).sampling.greedy, (
            neutral
        )
    p = request_params(
        Parameters(stop=["\n"], return_full_text=True, truncate=9), stream=True, max_new_tokens=MAX_NEW
    )
    assert p.stopping.stop_sequences == ("\n",) and p.stopping.include_stop_sequence  # TGI keeps them
    assert p.response.input_text and p.truncate_input_tokens == 9
    assert p.response.generated_tokens and p.response.token_logprobs  # streams carry every token


def test_parameters_this_server_does_not_serve_are_refused() -> None:
    assert unsupported(Parameters(best_of=1)) is None
    assert unsupported(Parameters(best_of=2)) == "best_of > 1 is not supported by this server"
    assert unsupported(Parameters(watermark=True)) == "watermark is not supported by this server"
    assert (
        unsupported(Parameters(grammar={"type": "json", "value": {}}))
        == "grammar is not supported by this server"
    )
    assert (
        unsupported(Parameters(frequency_penalty=0.5)) == "frequency_penalty is not supported by this server"
    )


# ---- routes ---------------------------------------------------------------------------------


async def test_generate_with_details(stack: Stack) -> None:
    status, answer = await post(
        stack,
        "/generate",
        {"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True, "top_n_tokens": 2}},
    )
    assert status == 200, answer
    details = answer["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5
    assert details["seed"] is None  # greedy
    assert [t["id"] for t in details["tokens"]] == [600, 601, 602, 603, 604]  # the fake shard's ids
    assert all(set(t) == {"id", "text", "logprob", "special"} for t in details["tokens"])
    assert len(details["top_tokens"]) == 5
    status, plain = await post(stack, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    assert plain == {"generated_text": answer["generated_text"]}  # no details unless asked
    status, listed = await post(stack, "/", {"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    assert listed == [plain]  # TGI's POST / answers a list
    await stack.settled()


async def test_stream_layout_and_parity_with_unary(stack: Stack) -> None:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 6, "return_full_text": True}}
    events = await sse_events(stack, body)
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == 6
    assert last["generated_text"] == "hello" + "".join(e["token"]["text"] for e in events)
    _, unary = await post(stack, "/generate", body)
    assert unary["generated_text"] == last["generated_text"]
    assert await sse_events(stack, {**body, "stream": True}, path="/") == events  # POST / with stream
    assert (
        stack.metrics.counters["tgi_request_success"].get(stop_reason="MAX_TOKENS", kind="rest_stream") == 2
    )
    assert stack.metrics.counters["tgi_request_success"].get(stop_reason="MAX_TOKENS", kind="rest") == 1
    await stack.settled()


async def test_tokenize_and_info(stack: Stack, tokenizer_pool) -> None:
    status, tokens = await post(stack, "/tokenize", {"inputs": "hello world"})
    assert status == 200
    assert [t["id"] for t in tokens] == tokenizer_pool.encode_batch_sync(["hello world"])[0]
    assert all(t["text"] == "hello world"[t["start"] : t["stop"]] for t in tokens)
    async with aiohttp.ClientSession() as session, session.get(stack.url + "/info") as r:
        info = await r.json()
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == 512 and info["max_best_of"] == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"inputs": "hi", "parameters": {"do_sample": True, "temperature": 0.01}},
            "temperature must be >= 0.05",
        ),
        ({"inputs": "hi", "parameters": {"top_p": 1.5}}, "top_p must be > 0.0 and <= 1.0"),
        (
            {"inputs": "hi", "parameters": {"max_new_tokens": MAX_NEW + 1}},
            f"max_new_tokens must be <= {MAX_NEW}",
        ),
        ({"inputs": "hi", "parameters": {"best_of": 2}}, "best_of > 1 is not supported by this server"),
        ({"inputs": "hi", "parameters": {"watermark": True}}, "watermark is not supported by this server"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens: "),
        ({"inputs": "hi", "parameters": {"bogus": 1}}, "parameters.bogus: Extra inputs are not permitted"),
        ({"parameters": {}}, "inputs: Field required"),
    ],
)
async def test_bad_parameters_get_422_in_tgi_shape(stack: Stack, body: dict, message: str) -> None:
    for path in ("/generate", "/generate_stream"):
        status, answer = await post(stack, path, body)
        assert status == 422, answer
        assert answer["error_type"] == "validation" and answer["error"].startswith(message), answer
    await stack.settled()


async def test_decoder_input_details_cannot_stream(stack: Stack) -> None:
    status, answer = await post(
        stack, "/generate_stream", {"inputs": "hi", "parameters": {"decoder_input_details": True}}
    )
    assert status == 422
    assert answer["error"] == "decoder_input_details == true is not supported when streaming tokens"
    status, answer = await post(
        stack,
        "/generate",
        {"inputs": "hi", "parameters": {"decoder_input_details": True, "max_new_tokens": 2}},
    )
    assert status == 200 and answer == {"generated_text": answer["generated_text"]}


async def test_overload_is_429_and_generation_failure_424(stack: Stack) -> None:
    stack.service.limiter.available = 0
    status, answer = await post(stack, "/generate", {"inputs": "hi"})
    assert (status, answer) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    status, answer = await post(stack, "/generate_stream", {"inputs": "hi"})
    assert status == 429
    stack.service.limiter.available = stack.service.limiter.permits
    stack.shard.request_errors[1] = "boom"  # the first request that reaches the shard
    status, answer = await post(stack, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    assert status == 424 and answer["error_type"] == "generation", answer
    assert answer["error"] == "Request failed during generation: boom"
    await stack.settled()


async def test_a_failure_mid_stream_is_the_last_event(stack: Stack) -> None:
    stack.shard.request_errors[1] = "boom"
    events = await sse_events(stack, {"inputs": "hi", "parameters": {"max_new_tokens": 5}})
    assert events[-1] == {"error": "Request failed during generation: boom", "error_type": "generation"}
    await stack.settled()


async def test_unknown_paths_and_methods_answer_in_tgi_shape(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/nope") as r:
            assert r.status == 404 and await r.json() == {
                "error": "no route /nope",
                "error_type": "not_found",
            }
        async with session.get(stack.url + "/generate") as r:
            assert r.status == 405 and (await r.json())["error_type"] == "method_not_allowed"
        async with session.post(
            stack.url + "/generate", data=b"{not json", headers={"content-type": "application/json"}
        ) as r:
            assert r.status == 422 and (await r.json())["error_type"] == "validation"
        async with session.get(stack.url + "/openapi.json") as r:
            paths = (await r.json())["paths"]
            assert {"/generate", "/generate_stream", "/", "/tokenize", "/info", *PROBE_PATHS} <= set(paths)
        async with session.get(stack.url + "/docs") as r:
            page = await r.text()
            assert r.status == 200 and "/docs/static/swagger-ui-bundle.js" in page
        async with session.get(stack.url + "/docs/static/swagger-ui-bundle.js") as r:
            assert r.status == 200  # served locally, no CDN


# ---- hygiene --------------------------------------------------------------------------------


async def test_an_oversized_body_gets_413(stack: Stack) -> None:
    big = {"inputs": "x" * (http_server.MAX_BODY_BYTES + 1)}
    status, answer = await post(stack, "/generate", big)
    assert status == 413 and answer["error_type"] == "payload_too_large"

    # without a Content-Length (chunked), counted as it arrives
    async def chunks():
        for _ in range(5):
            yield b" " * (http_server.MAX_BODY_BYTES // 4)

    async with aiohttp.ClientSession() as session, session.post(stack.url + "/generate", data=chunks()) as r:
        assert r.status == 413
    await stack.settled()


async def raw_exchange(port: int, data: bytes, wait_s: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), wait_s)
    finally:
        writer.close()


async def test_slow_clients_are_cut_off(stack: Stack, monkeypatch) -> None:
    monkeypatch.setattr(http_server, "HEADER_TIMEOUT_S", 0.3)
    # headers that never end: the connection is closed, nothing answered
    assert await raw_exchange(stack.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n", 3.0) == b""
    # a body that stalls: 408
    monkeypatch.setattr(stack.server.app, "timeout_s", 0.3)
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 100\r\n\r\n{"
    answer = await raw_exchange(stack.port, head, 3.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    await stack.settled()


async def test_a_client_leaving_a_stream_frees_its_slot_within_a_step(stack: Stack) -> None:
    stack.shard.latency_s = 0.01
    async with aiohttp.ClientSession() as session:
        r = await session.post(
            stack.url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": MAX_NEW}}
        )
        await r.content.readline()
        r.close()  # gone after the first token
    await stack.settled(timeout_s=2.0)
    assert stack.metrics.counters["tgi_request_cancellation"].get(phase="running") == 1


async def test_a_client_leaving_a_unary_call_frees_its_slot(stack: Stack) -> None:
    stack.shard.latency_s = 0.01
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                stack.url + "/generate",
                json={"inputs": "hi", "parameters": {"max_new_tokens": MAX_NEW}},
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
    await stack.settled(timeout_s=2.0)
    assert stack.metrics.counters["tgi_request_cancellation"].get(phase="running") == 1


async def test_200_streams_with_random_disconnects_leak_nothing(stack: Stack) -> None:
    rng = random.Random(0)

    async def one(session: aiohttp.ClientSession, leave_after: int | None) -> int:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 8}}
        async with session.post(stack.url + "/generate_stream", json=body) as r:
            seen = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    seen += 1
                    if leave_after is not None and seen >= leave_after:
                        r.close()
                        return -1
            return seen

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        plans = [rng.choice([None, None, 1, 3, 6]) for _ in range(200)]
        results = await asyncio.gather(*(one(session, plan) for plan in plans))
    assert all(r == 8 for r, plan in zip(results, plans, strict=True) if plan is None)
    await stack.settled(timeout_s=10.0)
    status, _ = await post(stack, "/generate", {"inputs": "still", "parameters": {"max_new_tokens": 2}})
    assert status == 200  # and still serving
