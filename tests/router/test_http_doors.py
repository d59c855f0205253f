"""The HTTP port in-process over a fake shard: TGI's REST routes (answers, SSE layout, error
shapes and status codes), the parameter mapping, and the server's hygiene (body limits,
slow clients, disconnects that must free their slot)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import socket

import aiohttp
import pytest

from router.api.auth import AuthConfig, Authenticator
from router.api.service import GenerationService
from router.core.metrics import Metrics
from router.core.pacing import StreamPacing
from router.core.validation import ValidationError
from router.http import http_server
from router.http.adapter_admin import AdapterAdmin
from router.http.anthropic_messages import MessagesApi
from router.http.chat_template import load_chat_template
from router.http.http_app import PROBE_PATHS, build_app
from router.http.http_server import HealthCheck, HttpServer
from router.http.openai_api import OpenAIApi
from router.http.openai_params import ChatRequest, CompletionRequest
from router.http.openai_params import request_params as openai_request_params
from router.http.openai_params import unsupported as openai_unsupported
from router.http.openai_responses import ResponsesApi
from router.http.reasoning import FORMATS
from router.http.tgi_rest import (
    Parameters,
    TgiRest,
    best_of_refusal,
    info_fields,
    request_params,
    unsupported,
)
from router.http.tool_parsers import Hermes, Qwen3Coder
from tests.router.fakes import EOS, FakeShard
from tests.router.stacks import service_over
from text_generation_common.guided import Grammars
from text_generation_common.messages import GenerationRequest, Guided, GuidedKind
from text_generation_server.testing.ports import free_port

MAX_NEW = 200
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}},
            "required": ["city"],
        },
    },
}


class Stack:
    def __init__(
        self, shard: FakeShard, service: GenerationService, server: HttpServer, port: int, openai: OpenAIApi
    ) -> None:
        self.shard, self.service, self.server, self.port = shard, service, server, port
        self.openai = openai  # the OpenAI door (tests may give it a tool call parser)
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
def auth() -> AuthConfig:
    """Off; auth tests parametrize it."""
    return AuthConfig()


@pytest.fixture
async def stack(detokenizer, tokenizer_pool, tokenizer_dir, auth):
    shard = FakeShard(latency_s=0.002)
    service, batcher = service_over(
        shard, detokenizer, tokenizer_pool, max_batch_size=16, permits=256, max_new_tokens=MAX_NEW
    )
    metrics = service.metrics
    service.tenant_limit = auth.tenant_max_concurrent_requests
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
        max_best_of=2,
    )
    tgi = TgiRest(service, tokenizer_pool, info=info, max_new_tokens=MAX_NEW)
    health = HealthCheck(shard, batcher, tokenizer_pool, lambda: service.draining)
    empty = tokenizer_pool.encode_batch_sync([""])[0]
    openai = OpenAIApi(
        service,
        tokenizer_pool,
        model_name="tiny",
        max_sequence_length=512,
        max_new_tokens=MAX_NEW,
        chat_template=load_chat_template(str(tokenizer_dir), tokenizer_pool.piece(empty[0])),
        list_adapters=shard.list_adapters,
    )
    ResponsesApi(openai)
    MessagesApi(openai)
    server = HttpServer(
        build_app(health, metrics.exposition, "text/plain", tgi, openai, Authenticator(auth), version="0.1.0")
    )
    port = free_port()
    await server.start("127.0.0.1", port)
    task = asyncio.create_task(batcher.run())
    yield Stack(shard, service, server, port, openai)
    task.cancel()
    await server.stop()


async def post(stack: Stack, path: str, body: object) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(stack.url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def sse_events(stack: Stack, body: object, path: str = "/generate_stream") -> list:
    """The stream's `data:` payloads, parsed (OpenAI's closing `[DONE]` kept as the string)."""
    events: list = []
    async with aiohttp.ClientSession() as session, session.post(stack.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data:"):
                data = line[len(b"data:") :].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
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
    assert unsupported(Parameters(best_of=2)) is None  # served (best_of_refusal has TGI's rules)
    sampled = {"do_sample": True}
    for p, stream, refusal in [
        (Parameters(best_of=2, **sampled), False, None),
        (Parameters(best_of=3, **sampled), False, "`best_of` must be > 0 and <= 2. Given: 3"),
        (Parameters(best_of=0, **sampled), False, "`best_of` must be > 0 and <= 2. Given: 0"),
        (Parameters(best_of=2, **sampled), True, "`best_of` != 1 is not allowed for this endpoint"),
        (Parameters(best_of=2), False, "you must use sampling when `best_of` is > 1"),
        (Parameters(best_of=2, seed=4, **sampled), False, "`seed` must not be set when `best_of` > 1"),
        (Parameters(best_of=1, seed=4), True, None),
    ]:
        assert best_of_refusal(p, stream=stream, max_best_of=2) == refusal
    assert unsupported(Parameters(watermark=True)) == "watermark is not supported by this server"
    assert unsupported(Parameters(frequency_penalty=0.5)) is None  # served in TGI's form


def test_tgi_frequency_penalty_reaches_greedy_and_sampled_requests_in_tgis_form() -> None:
    for do_sample in (False, True):
        parameters = Parameters(frequency_penalty=-1.25, do_sample=do_sample, seed=3)
        s = request_params(parameters, stream=False, max_new_tokens=MAX_NEW).sampling
        assert s.greedy != do_sample
        assert (s.frequency_penalty, s.frequency_by_length, s.presence_penalty) == (-1.25, True, 0.0)
    for unset in (Parameters(), Parameters(frequency_penalty=0.0)):
        s = request_params(unset, stream=False, max_new_tokens=MAX_NEW).sampling
        assert (s.frequency_penalty, s.frequency_by_length) == (0.0, False)


def test_tgi_grammar_and_openai_guided_parameters_become_constraints() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tgi = request_params(
        Parameters(grammar={"type": "json", "value": schema}), stream=False, max_new_tokens=100
    )
    assert tgi.sampling.guided == Guided(GuidedKind.JSON_SCHEMA, json.dumps(schema))
    tgi = request_params(
        Parameters(grammar={"type": "regex", "value": "a+"}), stream=False, max_new_tokens=100
    )
    assert tgi.sampling.guided == Guided(GuidedKind.REGEX, "a+")
    with pytest.raises(ValueError, match="type"):
        Parameters(grammar={"type": "lark", "value": "x"})

    def openai(**fields) -> Guided | None:
        body = ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)
        assert openai_unsupported(body) is None
        return openai_request_params(
            body, max_new_tokens=100, top_n=0, logprobs=False, stream=False
        ).sampling.guided

    assert openai() is None and openai(response_format={"type": "text"}) is None
    assert openai(response_format={"type": "json_object"}) == Guided(GuidedKind.JSON)
    assert openai(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ) == Guided(GuidedKind.JSON_SCHEMA, json.dumps(schema))
    assert openai(guided_json=schema) == Guided(GuidedKind.JSON_SCHEMA, json.dumps(schema))
    assert openai(guided_regex="a+") == Guided(GuidedKind.REGEX, "a+")
    assert openai(guided_choice=["x", "y"]) == Guided(GuidedKind.CHOICE, choices=("x", "y"))
    assert openai(guided_grammar='start: "x"') == Guided(GuidedKind.GRAMMAR, 'start: "x"')
    structured = {  # vLLM's current names
        "json": schema,
        "json_object": True,
        "regex": "a+",
        "choice": ["x", "y"],
        "grammar": 'start: "x"',
    }
    want = [
        Guided(GuidedKind.JSON_SCHEMA, json.dumps(schema)),
        Guided(GuidedKind.JSON),
        Guided(GuidedKind.REGEX, "a+"),
        Guided(GuidedKind.CHOICE, choices=("x", "y")),
        Guided(GuidedKind.GRAMMAR, 'start: "x"'),
    ]
    for (field, value), guided in zip(structured.items(), want, strict=True):
        assert openai(structured_outputs={field: value, "disable_any_whitespace": True}) == guided
    assert openai(structured_outputs={"json": json.dumps(schema)}) == want[0]
    assert openai(structured_outputs={"json_object": False}) is None
    for two in ({"guided_regex": "a", "guided_choice": ["a"]}, {"structured_outputs": structured}):
        with pytest.raises(ValidationError, match="only one constraint may be given"):
            openai(**two)
    with pytest.raises(ValidationError, match="only one constraint may be given"):
        openai(guided_regex="a", structured_outputs={"regex": "b"})
    unserved = (
        {"whitespace_pattern": " "},
        {"structural_tag": "{}"},
        {"disable_additional_properties": True},
    )
    for option in unserved:
        refused = ChatRequest(
            messages=[{"role": "user", "content": "hi"}], structured_outputs={"regex": "a", **option}
        )
        (name,) = option
        assert openai_unsupported(refused) == f"structured_outputs.{name} is not supported by this server"
    with pytest.raises(ValidationError, match=r"json_schema needs json_schema\.schema"):
        openai(response_format={"type": "json_schema"})
    refused = ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "xml"})
    assert openai_unsupported(refused) == "response_format xml is not supported by this server"


def test_openai_penalties_reach_greedy_and_sampled_requests() -> None:
    for temperature in (0.0, 0.7):
        body = ChatRequest(
            messages=[{"role": "user", "content": "hi"}],
            temperature=temperature,
            presence_penalty=0.5,
            frequency_penalty=-1.25,
        )
        assert openai_unsupported(body) is None
        s = openai_request_params(body, max_new_tokens=100, top_n=0, logprobs=False, stream=False).sampling
        assert s.greedy == (temperature == 0.0)
        assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.25)
    plain = ChatRequest(messages=[{"role": "user", "content": "hi"}], presence_penalty=0)
    s = openai_request_params(plain, max_new_tokens=100, top_n=0, logprobs=False, stream=False).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.0, 0.0, ())


def test_openai_requests_sample_with_the_models_defaults_where_they_leave_them_unset() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0, "min_p": 0.05, "repetition_penalty": 1.1}

    def sampling(**fields):
        body = CompletionRequest(prompt="hi", seed=1, **fields)
        return openai_request_params(
            body, max_new_tokens=100, top_n=0, logprobs=False, stream=False, defaults=defaults
        ).sampling

    s = sampling()
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    s = sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    greedy = sampling(temperature=0)
    assert greedy.greedy and greedy.repetition_penalty == 1.1  # the penalty applies to greedy choices too
    plain = openai_request_params(
        CompletionRequest(prompt="hi"), max_new_tokens=100, top_n=0, logprobs=False, stream=False
    ).sampling
    assert plain.temperature == 1.0 and plain.top_k == 0  # OpenAI's own defaults


def test_openai_stop_token_ids_reach_the_request() -> None:
    body = CompletionRequest(prompt="hi", stop_token_ids=[7, 9], allowed_token_ids=[1, 2, 3])
    params = openai_request_params(body, max_new_tokens=100, top_n=0, logprobs=False, stream=False)
    assert params.sampling.stop_token_ids == (7, 9) and params.sampling.allowed_token_ids == (1, 2, 3)


def test_openai_min_p_reaches_sampled_requests_only() -> None:
    for temperature, min_p in ((0.7, 0.1), (0.0, 0.0)):  # greedy: no warper at all
        body = CompletionRequest(prompt="hi", temperature=temperature, min_p=0.1)
        assert (
            openai_request_params(
                body, max_new_tokens=100, top_n=0, logprobs=False, stream=False
            ).sampling.min_p
            == min_p
        )


def test_openai_logit_bias_reaches_greedy_and_sampled_requests_by_token_id() -> None:
    for temperature in (0.0, 0.7):
        body = CompletionRequest(
            prompt="hi", temperature=temperature, logit_bias={"50": -100, "7": 2.5, "12": 0}
        )
        assert openai_unsupported(body) is None
        s = openai_request_params(body, max_new_tokens=100, top_n=0, logprobs=False, stream=False).sampling
        assert s.logit_bias == ((7, 2.5), (12, 0.0), (50, -100.0))


# ---- routes ---------------------------------------------------------------------------------


REFUSALS = [  # (path, body, status, kind): every way the HTTP doors refuse a generate request;
    # kind: the call's tgi_request_count label (the body's model refuses some before any door)
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 0}}, 422, "rest"),
    ("/", {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 0}}, 422, "rest_stream"),
    ("/generate", {"inputs": "hi", "parameters": {"best_of": 2}}, 422, "rest"),  # greedy
    ("/generate", {"inputs": "hi", "parameters": {"repetition_penalty": 1e308}}, 422, "rest"),  # inf as held
    ("/generate", {"inputs": "hi", "parameters": {"frequency_penalty": 2.5}}, 422, "rest"),
    ("/generate", {"inputs": "hi", "parameters": {"temperature": 1e39, "do_sample": True}}, 422, "rest"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 500}}, 422, "rest"),  # shared validation
    ("/generate_stream", {"inputs": "hi", "parameters": {"decoder_input_details": True}}, 422, "rest_stream"),
    ("/generate_stream", {"inputs": "hi", "parameters": {"top_k": -1}}, 422, "rest_stream"),
    ("/", {"inputs": "hi", "parameters": {"top_p": 2.0}}, 422, "rest"),
    ("/", {"inputs": "hi", "stream": True, "parameters": {"top_p": 2.0}}, 422, "rest_stream"),
    ("/v1/completions", {"prompt": "hi", "model": "other"}, 404, "openai"),
    ("/v1/completions", {"prompt": "hi", "n": 100}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "n": 100, "stream": True}, 400, "openai_stream"),
    ("/v1/completions", {"prompt": ["hi"] * 9, "n": 2}, 400, "openai"),  # n x prompts over 16
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"the": 1}}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e308}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "top_p": 2.0}, 400, "openai_stream"),
    ("/v1/completions", {"prompt": 7}, 400, "openai"),
    ("/v1/completions", {"prompt": "hi", "model": "team/gone"}, 404, "openai"),  # after the lookup
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
        400,
        "openai",
    ),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, 400, "openai"),  # SCHEDULING_POLICY fcfs
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400, "openai"),
    ("/v1/responses", {"input": "hi", "context_management": [{"type": "compaction"}]}, 400, "openai"),
    (
        "/v1/responses",
        {"input": "hi", "stream": True, "tools": [{"type": "web_search"}]},
        400,
        "openai_stream",
    ),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400, "openai"),  # the body's model
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "openai"),
    ("/v1/responses", {"input": "hi", "temperature": 0.01}, 400, "openai"),  # shared validation
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "openai",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}], "stream": True},
        400,
        "openai_stream",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"), REFUSALS, ids=[f"{p} {b}" for p, b, _, _ in REFUSALS]
)
async def test_every_refusal_of_the_http_doors_counts_as_a_validation_failure(
    stack: Stack, path: str, body: dict, status: int, kind: str
) -> None:
    """Every refusal is one validation failure and one call of its kind (one path for every door,
    a body its route's model refuses included: counted, refused, its permits given back)."""
    failures = stack.metrics.counters["tgi_request_failure"]
    calls = stack.metrics.counters["tgi_request_count"]
    kinds = ("rest", "rest_stream", "openai", "openai_stream")
    before = failures.get(err="validation"), {k: calls.get(kind=k) for k in kinds}
    got, answer = await post(stack, path, body)
    assert got == status, answer
    counted = {k: calls.get(kind=k) - before[1][k] for k in kinds}
    assert failures.get(err="validation") == before[0] + 1
    assert counted == {k: int(k == kind) for k in kinds}
    assert stack.service.limiter.in_use == 0
    await stack.settled()


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


@pytest.mark.parametrize("interval", [1, 3])
async def test_stream_layout_and_parity_with_unary(stack: Stack, interval: int) -> None:
    """One event per token, whatever STREAM_INTERVAL says (TGI's events carry one token each)."""
    stack.service.pacing = StreamPacing(interval)
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
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == 512 and info["max_best_of"] == 2


async def test_vllm_tokenize_and_detokenize_share_the_path_with_tgi(stack: Stack, tokenizer_pool) -> None:
    raw = tokenizer_pool.tokenizer
    ids = tokenizer_pool.encode_batch_sync(["hello world"])[0]
    status, answer = await post(stack, "/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert status == 200
    assert answer == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    bare = raw.encode("hello world", add_special_tokens=False).ids
    assert ids == [ids[0], *bare]  # the tokenizer adds BOS
    status, answer = await post(
        stack, "/tokenize", {"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True}
    )
    assert answer["tokens"] == bare and answer["token_strs"] == [tokenizer_pool.piece(i) for i in bare]
    # a chat's ids are those the chat route gives the model (one BOS: the template writes one)
    messages = [{"role": "user", "content": "hello world"}]
    status, chat = await post(
        stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    )
    assert status == 200, chat
    status, answer = await post(stack, "/tokenize", {"messages": messages})
    assert status == 200 and answer["tokens"] == chat["prompt_token_ids"] and answer["tokens"][1] != ids[0]
    status, doubled = await post(stack, "/tokenize", {"messages": messages, "add_special_tokens": True})
    assert doubled["tokens"] == [ids[0], *answer["tokens"]]  # vLLM's: BOS added on the template's
    status, opened = await post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert opened["count"] < answer["count"]
    # TGI's body still gets TGI's answer and error shape; vLLM's bodies get OpenAI's
    status, tokens = await post(stack, "/tokenize", {"inputs": "hello world"})
    assert status == 200 and [t["id"] for t in tokens] == ids
    status, error = await post(stack, "/tokenize", {"inputs": 5})
    assert status == 422 and error["error_type"] == "validation" and "inputs" in error["error"]
    status, error = await post(stack, "/tokenize", {"prompt": 5})
    assert status == 400 and "prompt" in error["error"]["message"]
    status, error = await post(stack, "/tokenize", {"prompt": "x", "mm_processor_kwargs": {}})
    assert status == 400 and "mm_processor_kwargs" in error["error"]["message"]
    status, error = await post(stack, "/tokenize", {"model": "no/such model", "prompt": "x"})
    assert status == 404 and error["error"]["message"] == "The model `no/such model` does not exist."
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    status, error = await post(stack, "/tokenize", both)
    assert status == 400 and "continue_final_message" in error["error"]["message"]
    status, error = await post(stack, "/tokenize", {"messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and error["error"]["param"] == "messages"
    async with aiohttp.ClientSession() as session, session.post(stack.url + "/tokenize", data=b"{") as r:
        assert r.status == 422 and (await r.json())["error_type"] == "validation"
    assert stack.metrics.counters["tgi_tokenize_request_count"].get() == 6
    # /detokenize: the ids' text, special tokens kept
    status, answer = await post(stack, "/detokenize", {"tokens": bare})
    assert status == 200 and answer == {"prompt": "hello world"}
    status, answer = await post(stack, "/detokenize", {"model": "tiny", "tokens": ids})
    assert answer["prompt"] == raw.decode(ids, skip_special_tokens=False) != "hello world"
    size = raw.get_vocab_size(with_added_tokens=True)
    status, error = await post(stack, "/detokenize", {"tokens": [1, size]})
    assert status == 400 and error["error"]["param"] == "tokens" and str(size) in error["error"]["message"]
    status, error = await post(stack, "/detokenize", {"model": "../x", "tokens": [1]})
    assert status == 404
    stack.service.draining = True  # tokenize calls are refused while draining, at every door
    assert (await post(stack, "/tokenize", {"inputs": "x"}))[0] == 503
    assert (await post(stack, "/tokenize", {"prompt": "x"}))[0] == 503


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
        ({"inputs": "hi", "parameters": {"best_of": 3}}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"inputs": "hi", "parameters": {"watermark": True}}, "watermark is not supported by this server"),
        (
            {"inputs": "hi", "parameters": {"frequency_penalty": -2.5}},
            "frequency_penalty must be >= -2.0 and <= 2.0",
        ),
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


async def test_best_of_returns_the_likeliest_of_its_sampled_answers(stack: Stack) -> None:
    body = {
        "inputs": "hello",
        "parameters": {"max_new_tokens": 4, "best_of": 2, "do_sample": True, "details": True},
    }
    status, answer = await post(stack, "/generate", body)
    assert status == 200, answer
    (other,) = answer["details"]["best_of_sequences"]
    assert set(other) >= {"generated_text", "finish_reason", "generated_tokens", "seed", "tokens", "prefill"}
    assert other["seed"] != answer["details"]["seed"]  # each answer sampled with its own seed

    def likelihood(d: dict) -> float:
        return sum(t["logprob"] for t in d["tokens"])

    assert likelihood(answer["details"]) >= likelihood(other)
    status, plain = await post(
        stack, "/generate", {**body, "parameters": {**body["parameters"], "details": False}}
    )
    assert status == 200 and set(plain) == {"generated_text"}
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


async def test_a_failure_mid_stream_ends_an_openai_stream_with_an_error_event(stack: Stack) -> None:
    stack.shard.request_errors[1] = "boom"
    events = await sse_events(
        stack, {"prompt": "hi", "max_tokens": 5, "stream": True}, path="/v1/completions"
    )
    error = {"message": "Request failed during generation: boom", "type": "server_error", "param": None}
    assert events[-2:] == [{"error": {**error, "code": 500}}, "[DONE]"]
    await stack.settled()


async def test_an_openai_stream_carries_several_tokens_per_chunk_with_a_stream_interval(stack: Stack) -> None:
    body = {"prompt": "hi", "max_tokens": 9, "stream": True, "logprobs": 1}

    def texts_and_logprobs(events: list) -> tuple[str, list]:
        chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
        text = "".join(c["text"] for c in chunks)
        return text, [lp for c in chunks if c.get("logprobs") for lp in c["logprobs"]["token_logprobs"]]

    each = await sse_events(stack, body, path="/v1/completions")
    stack.service.pacing = StreamPacing(4)
    fewer = await sse_events(stack, body, path="/v1/completions")
    assert texts_and_logprobs(fewer) == texts_and_logprobs(each)
    assert len(texts_and_logprobs(each)[1]) == 9
    assert len(fewer) < len(each)
    await stack.settled()


async def test_openai_choices_sample_with_distinct_seeds(stack: Stack) -> None:
    """With a seed and n > 1, choice i samples with seed + i: the same seed for all would make
    every choice the same text."""
    seeds: dict[int, int | None] = {}

    def script(request: GenerationRequest, step: int) -> int:
        seeds[request.id] = request.params.seed
        return 10 + step

    stack.shard.script = script
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "seed": 5, "temperature": 1.0}
    status, answer = await post(stack, "/v1/completions", body)
    assert status == 200, answer
    assert sorted(seeds.values()) == [5, 6, 7, 8]
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
        for method in ("GET", "POST"):  # vLLM's /ping answers as /health
            async with session.request(method, stack.url + "/ping") as r:
                assert r.status == 200
        async with session.get(stack.url + "/version") as r:
            assert r.status == 200 and (await r.json()) == {"version": "0.1.0"}
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


# ---- the OpenAI door ------------------------------------------------------------------------


async def test_openai_completions_answer_like_the_tgi_door(stack: Stack) -> None:
    _, tgi = await post(stack, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 6}})
    status, answer = await post(
        stack, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    )
    assert status == 200, answer
    assert answer["object"] == "text_completion" and answer["model"] == "tiny"
    (choice,) = answer["choices"]
    assert choice["text"] == tgi["generated_text"] and choice["finish_reason"] == "length"
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    events = await sse_events(
        stack,
        {
            "prompt": "hello",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        path="/v1/completions",
    )
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == answer["usage"]
    chunks = events[:-2]
    assert len(chunks) == 6 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert all("usage" not in c for c in chunks)
    continuous = await sse_events(  # vLLM's continuous_usage_stats: each chunk with its usage so far
        stack,
        {
            "prompt": "hello",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        path="/v1/completions",
    )
    assert [c["usage"]["completion_tokens"] for c in continuous[:-2]] == [1, 2, 3, 4, 5, 6]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in continuous[:-1])
    assert continuous[-2]["usage"] == answer["usage"]
    await stack.settled()


async def test_openai_choices_logprobs_and_echo(stack: Stack) -> None:
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 3, "seed": 5, "logprobs": 2, "echo": True}
    status, answer = await post(stack, "/v1/completions", body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["text"][0] for c in answer["choices"]] == ["a", "a", "b", "b"]  # echoed prompts, n each
    logprobs = answer["choices"][0]["logprobs"]
    # echo: the prompt's two tokens (BOS, "a") first, then the three generated
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(len(top or {}) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][2] == 1
    events = await sse_events(stack, {**body, "stream": True}, path="/v1/completions")
    per_choice: dict[int, str] = {}
    streamed_tokens: dict[int, int] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            per_choice[c["index"]] = per_choice.get(c["index"], "") + c["text"]
            streamed_tokens[c["index"]] = streamed_tokens.get(c["index"], 0) + len(
                (c["logprobs"] or {}).get("tokens", [])
            )
    assert sorted(per_choice) == [0, 1, 2, 3] and per_choice[0] == answer["choices"][0]["text"]
    assert streamed_tokens == {0: 5, 1: 5, 2: 5, 3: 5}
    await stack.settled()


async def test_openai_prompts_as_token_ids_and_echo_with_the_prompts_logprobs(
    stack: Stack, tokenizer_pool
) -> None:
    """/v1/completions takes a prompt's token ids as they are (one list, or one per prompt); with
    echo and logprobs the prompt's tokens come first in the logprobs, as vLLM answers them (what
    evaluation harnesses score a text's likelihood with)."""
    text = "hello world"
    ids = tokenizer_pool.encode_batch_sync([text])[0]
    body = {"max_tokens": 4, "temperature": 0}
    status, by_text = await post(stack, "/v1/completions", {**body, "prompt": text})
    assert status == 200, by_text
    status, by_ids = await post(stack, "/v1/completions", {**body, "prompt": ids})
    assert status == 200, by_ids
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)
    status, cut = await post(stack, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 2})
    assert cut["usage"]["prompt_tokens"] == 2
    status, two = await post(stack, "/v1/completions", {**body, "prompt": [ids, ids[1:]]})
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["prompt_tokens"] == 2 * len(
        ids
    ) - 1
    status, echoed = await post(
        stack, "/v1/completions", {**body, "prompt": ids, "echo": True, "logprobs": 1}
    )
    (choice,) = echoed["choices"]
    assert choice["text"] == text + by_text["choices"][0]["text"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids) + 4
    assert logprobs["tokens"][: len(ids)] == [tokenizer_pool.token_text(i) for i in ids]
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][len(ids)] == len(text)
    for prompt, message in [
        ([5, 10**7], "prompt token id 10000000 is not in the vocabulary"),
        ([], "prompt must not be empty"),
    ]:
        status, refused = await post(stack, "/v1/completions", {**body, "prompt": prompt})
        assert status == 400 and refused["error"]["message"].startswith(message), refused
    await stack.settled()


async def test_openai_prompt_logprobs_as_vllm_answers_them(stack: Stack, tokenizer_pool) -> None:
    """vLLM's `prompt_logprobs` n: per prompt token (null for the first) the token's logprob and
    rank and the n likeliest in its place, keyed by id; chat answers carry it once, at the top.
    The fake shard puts prompt token k at logprob -k, rank 2, behind id + 1, id + 2, ..."""
    ids = tokenizer_pool.encode_batch_sync(["hello world"])[0]
    body = {"prompt": "hello world", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    status, answer = await post(stack, "/v1/completions", body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["logprobs"] is None and choice["text"]  # no other logprobs, nothing echoed
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for k, (token, ranked) in enumerate(zip(ids[1:], prompt[1:], strict=True), 1):
        assert list(ranked) == [str(token), str(token + 1), str(token + 2)]
        assert ranked[str(token)] == {
            "logprob": -float(k),
            "rank": 2,
            "decoded_token": tokenizer_pool.token_text(token),
        }
        assert [ranked[str(token + i)]["rank"] for i in (1, 2)] == [1, 2]
        assert ranked[str(token + 1)]["logprob"] == -0.5 * k
    # 0: the token alone; with echo and logprobs 1, the echoed tokens name one likeliest each
    status, answer = await post(
        stack,
        "/v1/completions",
        {**body, "prompt_logprobs": 0, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True},
    )
    (choice,) = answer["choices"]
    assert [list(r) for r in choice["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    assert choice["prompt_logprobs"][1][str(ids[1])]["decoded_token"] == f"token_id:{ids[1]}"
    status, answer = await post(stack, "/v1/completions", {**body, "echo": True, "logprobs": 1})
    tops = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(top) == 1 for top in tops[1 : len(ids)])
    # up to OpenAI's 20 likeliest (the gRPC door keeps the adapter's 10)
    status, answer = await post(stack, "/v1/completions", {**body, "prompt_logprobs": 20})
    assert status == 200 and all(len(r) == 21 for r in answer["choices"][0]["prompt_logprobs"][2:]), answer
    # chat: once, for the messages the template rendered
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "prompt_logprobs": 1}
    status, answer = await post(stack, "/v1/chat/completions", chat)
    assert status == 200, answer
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"] // 2
    assert all(len(r) == 2 for r in answer["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in answer["choices"][0]
    for refused, message in [
        ({**body, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
        ({**body, "prompt_logprobs": 21}, "prompt_logprobs: Input should be less than or equal to 20"),
        ({**body, "prompt_logprobs": -1}, "prompt_logprobs: Input should be greater than or equal to 0"),
    ]:
        status, error = await post(stack, "/v1/completions", refused)
        assert status == 400 and error["error"]["message"] == message, error
    await stack.settled()


async def test_openai_cache_salt_reaches_the_shard(stack: Stack) -> None:
    """vLLM's cache_salt goes with the request to the shard (whose prefix cache keys by it); an
    empty one is refused, as vLLM refuses it."""
    salts: list[str] = []

    def script(request: GenerationRequest, step: int) -> int:
        salts.append(request.cache_salt)
        return 600 + step

    stack.shard.script = script
    body = {"prompt": "hi", "max_tokens": 2}
    status, _ = await post(stack, "/v1/completions", {**body, "cache_salt": "tenant-7"})
    assert status == 200 and set(salts) == {"tenant-7"}
    salts.clear()
    status, _ = await post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and set(salts) == {""}
    status, error = await post(stack, "/v1/completions", {**body, "cache_salt": ""})
    assert status == 400 and error["error"]["message"].startswith("cache_salt: String should have at least 1")
    await stack.settled()


async def test_anthropic_messages_count_as_their_own_kind(stack: Stack) -> None:
    """/v1/messages calls count in tgi_request_count as anthropic / anthropic_stream, their
    refusals too, with Anthropic's error shape."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = await post(stack, "/v1/messages", body)
    assert status == 200 and answer["type"] == "message"
    events = await sse_events(stack, {**body, "stream": True}, path="/v1/messages")
    assert events[-1] == {"type": "message_stop"}
    status, error = await post(stack, "/v1/messages", {**body, "max_tokens": 10**6})
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    calls = stack.metrics.counters["tgi_request_count"]
    assert (calls.get(kind="anthropic"), calls.get(kind="anthropic_stream")) == (2, 1)
    await stack.settled()


async def test_openai_chat_uses_the_model_template(stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    _, expected = await post(stack, "/generate", {"inputs": rendered, "parameters": {"max_new_tokens": 5}})
    body = {
        "model": "tiny",
        "messages": messages,
        "max_completion_tokens": 5,
        "temperature": 0,
        "logprobs": True,
    }
    status, answer = await post(stack, "/v1/chat/completions", body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected["generated_text"]}
    assert len(choice["logprobs"]["content"]) == 5
    events = await sse_events(stack, {**body, "stream": True}, path="/v1/chat/completions")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == expected["generated_text"] and events[-2]["choices"][0]["finish_reason"] == "length"
    status, answer = await post(
        stack, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}
    )
    assert status == 400 and answer["error"]["message"] == "roles must be system, user, assistant or tool"
    assert answer["error"]["param"] == "messages"
    await stack.settled()


async def test_openai_tool_calls_of_a_named_function_and_of_required(
    stack: Stack, tokenizer_dir, tokenizer_pool
) -> None:
    """tool_choice names a function or asks for calls: the constraint reaches the shard, and the
    answer (here the fake shard's scripted JSON, then EOS) becomes message.tool_calls, unary and
    streamed; a list of calls cut by max_tokens stays text."""
    stack.service.validator.grammars = Grammars((tokenizer_dir / "tokenizer.json").read_text(), 2000, EOS)
    constraints: list[Guided | None] = []

    def answer_with(text: str) -> None:
        ids = tokenizer_pool.encode_batch_sync([text])[0][1:]  # without BOS

        def script(request: GenerationRequest, step: int) -> int:
            constraints.append(request.params.guided)
            return ids[step] if step < len(ids) else EOS

        stack.shard.script = script

    chat = "/v1/chat/completions"
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "max_tokens": 40,
        "temperature": 0,
    }
    arguments = '{"city": "Oslo"}'
    answer_with(arguments)
    status, answer = await post(stack, chat, body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": arguments}
    parameters = WEATHER["function"]["parameters"]
    assert constraints[-1] == Guided(GuidedKind.JSON_SCHEMA, json.dumps(parameters))
    events = await sse_events(stack, {**body, "stream": True}, path=chat)
    opening = events[0]["choices"][0]["delta"]
    assert opening["content"] is None and opening["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": "",
    }
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d) == arguments
    assert events[-2]["choices"][0]["finish_reason"] == "stop"

    calls = '[{"name": "weather", "parameters": {"city": "Rome"}}]'
    answer_with(calls)
    required = {**body, "tool_choice": "required"}
    status, answer = await post(stack, chat, required)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Rome"}'}
    ]
    schema = json.loads(constraints[-1].spec)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["parameters"] == parameters
    events = await sse_events(stack, {**required, "stream": True, "logprobs": True}, path=chat)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    chunks = [e["choices"][0] for e in events[1:-1]]  # each call as it comes, the tokens' logprobs with it
    assert len(chunks) > 2 and chunks[-1]["finish_reason"] == "tool_calls"
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", ())]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"] == {
        "name": "weather",
        "arguments": "",
    }
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'
    logprobs = [t for c in chunks for t in (c.get("logprobs") or {}).get("content") or ()]
    assert len(logprobs) == choice_tokens(tokenizer_pool, calls) + 1
    status, answer = await post(stack, chat, {**required, "max_tokens": 3})
    (choice,) = answer["choices"]
    assert (
        choice["finish_reason"] == "length"
        and choice["message"]["content"] == calls[: len(choice["message"]["content"])]
    )
    assert "tool_calls" not in choice["message"]
    await stack.settled()


async def test_openai_auto_tool_calls_in_the_models_format(stack: Stack, tokenizer_pool) -> None:
    """tool_choice "auto" with the model's parser: free text (no constraint), its calls read out
    of it, unary and streamed (the text before a call streams as it comes, then the call: its
    name, then its arguments as they settle); an answer without calls is plain text."""
    stack.openai.tool_parser = Hermes()
    answer = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    ids = tokenizer_pool.encode_batch_sync([answer])[0][1:]  # without BOS
    constraints: list[Guided | None] = []

    def script(request: GenerationRequest, step: int) -> int:
        constraints.append(request.params.guided)
        return ids[step] if step < len(ids) else EOS

    stack.shard.script = script
    chat = "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "max_tokens": 60}
    status, unary = await post(stack, chat, {**body, "temperature": 0})
    assert status == 200, unary
    (choice,) = unary["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'}
    ]
    assert set(constraints) == {None}
    events = await sse_events(stack, {**body, "stream": True, "temperature": 0}, path=chat)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert all("<" not in d.get("content", "") for d in deltas)
    assert streamed_calls(deltas) == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert len([d for d in deltas if "tool_calls" in d]) > 2  # the arguments as they come
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    stack.shard.script = lambda request, step: 600 + step
    status, plain = await post(stack, chat, {**body, "max_tokens": 4})
    assert (
        plain["choices"][0]["finish_reason"] == "length"
        and "tool_calls" not in plain["choices"][0]["message"]
    )
    await stack.settled()


async def test_openai_auto_calls_in_xml_read_with_the_requests_schemas(stack: Stack, tokenizer_pool) -> None:
    """qwen3_coder's values are text: each is read as the type the request's own function gives
    its parameter, unary and streamed."""
    stack.openai.tool_parser = Qwen3Coder()
    answer = (
        "Ok.\n<tool_call>\n<function=forecast>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    ids = tokenizer_pool.encode_batch_sync([answer])[0][1:]  # without BOS
    stack.shard.script = lambda request, step: ids[step] if step < len(ids) else EOS
    days = {"type": "object", "properties": {"days": {"type": "integer"}}}
    for kind in ("integer", "string"):
        days["properties"]["days"]["type"] = kind
        tool = {"type": "function", "function": {"name": "forecast", "parameters": days}}
        body = {"messages": [{"role": "user", "content": "?"}], "tools": [tool], "temperature": 0}
        status, unary = await post(stack, "/v1/chat/completions", body)
        assert status == 200, unary
        (call,) = unary["choices"][0]["message"]["tool_calls"]
        expected = '{"days": 3}' if kind == "integer" else '{"days": "3"}'
        assert call["function"] == {"name": "forecast", "arguments": expected}
        events = await sse_events(stack, {**body, "stream": True}, path="/v1/chat/completions")
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert streamed_calls(deltas) == [{"name": "forecast", "arguments": expected}]
    await stack.settled()


def streamed_calls(deltas: list[dict]) -> list[dict]:
    """The calls a chat stream's deltas add up to: each call's first delta names it (and has its
    id), the later ones of its index carry more of its arguments."""
    calls: list[dict] = []
    for delta in deltas:
        for call in delta.get("tool_calls", ()):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return calls


async def test_openai_chat_answers_a_reasoning_models_thinking_apart(
    stack: Stack, tokenizer_pool, tokenizer_dir
) -> None:
    """REASONING_PARSER: the thinking comes as reasoning_content, the answer as content (and its
    calls as tool_calls), unary and streamed alike; a constrained answer is all answer."""
    stack.openai.reasoning = FORMATS["qwen3"]
    stack.openai.tool_parser = Hermes()
    tokenizer_json = (tokenizer_dir / "tokenizer.json").read_text()

    def answer_with(text: str) -> None:
        ids = tokenizer_pool.encode_batch_sync([text])[0][1:]  # without BOS
        stack.shard.script = lambda request, step: ids[step] if step < len(ids) else EOS

    chat = "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, "temperature": 0}
    answer_with("<think>\nplan it</think>\n\nHello there.")
    status, unary = await post(stack, chat, {**body, "logprobs": True})
    assert status == 200, unary
    message = unary["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nHello there.", "reasoning_content": "\nplan it"}
    tokens = len(unary["choices"][0]["logprobs"]["content"])
    events = await sse_events(stack, {**body, "stream": True, "logprobs": True}, path=chat)
    deltas = [e["choices"][0] for e in events[1:-1]]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "\nplan it"
    assert "".join(d["delta"].get("content", "") for d in deltas) == "\n\nHello there."
    assert sum(len((d["logprobs"] or {}).get("content", [])) for d in deltas) == tokens  # every token once
    assert deltas[-1]["finish_reason"] == "stop"
    stack.openai.reasoning = FORMATS["deepseek_v3"]  # hybrid: thinks where the chat turns it on
    answer_with("plan it</think>Hello there.")
    status, unary = await post(stack, chat, body)
    assert unary["choices"][0]["message"] == {"role": "assistant", "content": "plan it</think>Hello there."}
    status, unary = await post(stack, chat, {**body, "chat_template_kwargs": {"thinking": True}})
    message = unary["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan it", "Hello there.")
    stack.openai.reasoning = FORMATS["qwen3"]
    answer_with("<think>\nplan it</think>\n\nHello there.")
    hidden = {**body, "include_reasoning": False}  # vLLM's: the thinking is read apart, not answered
    status, unary = await post(stack, chat, hidden)
    assert unary["choices"][0]["message"] == {"role": "assistant", "content": "\n\nHello there."}
    events = await sse_events(stack, {**hidden, "stream": True}, path=chat)
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello there."

    answer_with(
        '<think>weather</think><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    status, unary = await post(stack, chat, {**body, "tools": [WEATHER]})
    (choice,) = unary["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "weather"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"city": "Oslo"}',
    }
    events = await sse_events(stack, {**body, "tools": [WEATHER], "stream": True}, path=chat)
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weather"
    assert streamed_calls(deltas) == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert not "".join(d.get("content") or "" for d in deltas)

    answer_with('"<think>x</think>"')  # (the fake shard does not apply the constraint)
    stack.service.validator.grammars = Grammars(tokenizer_json, 2000, EOS)
    status, unary = await post(stack, chat, {**body, "response_format": {"type": "json_object"}})
    assert unary["choices"][0]["message"] == {"role": "assistant", "content": '"<think>x</think>"'}
    await stack.settled()


async def test_a_thinking_budget_ends_a_reasoning_models_thinking_for_it(
    stack: Stack, tokenizer_pool
) -> None:
    """thinking_token_budget (and Anthropic's thinking.budget_tokens): after that many tokens of
    thinking that does not close, the closing marker is the answer's next text, and the answer
    goes on after it: reasoning_content is the budget's tokens, unary and streamed alike. Without
    REASONING_PARSER the chat door refuses a budget, and the Messages door leaves it out."""
    from router.core.thinking import ThinkingMarkers

    chat = "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    status, refused = await post(stack, chat, {**body, "thinking_token_budget": 3})
    assert status == 400 and "--reasoning-parser" in refused["error"]["message"]
    fmt = FORMATS["deepseek_r1"]  # the template opens the thinking: the answer thinks from its start
    stack.openai.reasoning = fmt
    encode = functools.partial(tokenizer_pool.encode_batch_sync, special=False)
    stack.service.validator.thinking = ThinkingMarkers.of(fmt.opened_by_prompt, fmt.starts, fmt.ends, encode)
    ids = encode(["a long thought that goes on and on and never ends at all"])[0]
    stack.shard.script = lambda request, step: ids[step] if step < len(ids) else EOS
    closing = encode(["</think>"])[0]
    status, unary = await post(stack, chat, {**body, "thinking_token_budget": 3})
    assert status == 200, unary
    message = unary["choices"][0]["message"]
    decode = tokenizer_pool.tokenizer.decode
    assert message["reasoning_content"] == decode(ids[:3])
    assert message["content"] == decode(ids[:3] + closing + ids[3 + len(closing) : 12]).split("</think>")[1]
    assert unary["usage"]["completion_tokens"] == 12
    assert unary["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 3 + len(closing)
    }  # thought, closed
    events = await sse_events(stack, {**body, "thinking_token_budget": 3, "stream": True}, path=chat)
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    plain_answer = (await post(stack, chat, body))[1]
    plain = plain_answer["choices"][0]["message"]
    assert plain["reasoning_content"] == decode(ids[:12]) and not plain["content"]  # no budget: all thought
    assert plain_answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    messages = {"model": "tiny", "max_tokens": 12, "messages": body["messages"], "temperature": 0}
    thinking = {"type": "enabled", "budget_tokens": 3}
    status, answer = await post(stack, "/v1/messages", {**messages, "thinking": thinking})
    assert status == 200, answer
    blocks = {b["type"]: b for b in answer["content"]}
    assert blocks["thinking"]["thinking"] == message["reasoning_content"]
    assert blocks["text"]["text"] == message["content"]
    await stack.settled()


async def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(stack: Stack) -> None:
    """The prompt tokens the shard found in its prefix cache: OpenAI's usage
    prompt_tokens_details.cached_tokens (each choice's, streamed alike), Anthropic's
    cache_read_input_tokens (input_tokens the others), the Responses API's
    input_tokens_details.cached_tokens; never more than the prompt."""
    stack.shard.cached_prompt = 3
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "n": 2}
    status, answer = await post(stack, "/v1/chat/completions", chat)
    assert status == 200 and answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(stack, streamed, path="/v1/chat/completions")
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}
    body = {"model": "tiny", "max_tokens": 2, "messages": chat["messages"]}
    status, message = await post(stack, "/v1/messages", body)
    prompt = answer["usage"]["prompt_tokens"] // 2
    assert message["usage"] == {
        "input_tokens": prompt - 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
        "output_tokens": 2,
    }
    status, response = await post(stack, "/v1/responses", {"input": "hi there", "max_output_tokens": 2})
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 3
    stack.shard.cached_prompt = 10_000
    status, answer = await post(stack, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"]
    await stack.settled()


def choice_tokens(tokenizer_pool, text: str) -> int:
    return len(tokenizer_pool.encode_batch_sync([text])[0]) - 1


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", {"prompt": "hi", "model": "other"}, 404, "The model `other` does not exist."),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-3.5"}, 404, "The model `gpt-3.5` does not exist."),
        (
            "/v1/completions",
            {"prompt": "hi", "model": "/models/x"},
            404,
            "The model `/models/x` does not exist.",
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": 0.01}, 400, "temperature must be >= 0.05"),
        (
            "/v1/completions",
            {"prompt": "hi", "presence_penalty": 2.5},
            400,
            "presence_penalty must be >= -2.0",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.01},
            400,
            "frequency_penalty must be >= -2.0 and <= 2.0",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "logit_bias": {"7": 1, "10000000": -1}},
            400,
            "logit_bias token id 10000000 is not in the vocabulary",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 1, "07": -1}},
            400,
            "logit_bias names a token id more than once",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "logit_bias": {"x7": 1}},
            400,
            "logit_bias keys must be token ids, not 'x7'",
        ),
        ("/v1/completions", {"prompt": "hi", "bogus": 1}, 400, "bogus: Extra inputs are not permitted"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
            400,
            "chat_template_kwargs may not set messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools.0.type: Field required",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]},
            400,
            'tool_choice "auto" (the default with tools) needs the server started with --tool-call-parser',
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            400,
            "tool_choice names the function 'other', which is not among tools",
        ),
        ("/v1/nope", {}, 404, "no route /v1/nope"),
    ],
)
async def test_openai_errors_in_openai_shape(
    stack: Stack, path: str, body: dict, status: int, message: str
) -> None:
    got, answer = await post(stack, path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["message"].startswith(message), answer


async def test_openai_model_names_an_adapter_of_the_store(stack: Stack) -> None:
    stack.shard.adapters = {"team/lora": 0, "soft": 4}
    seen: list[str] = []

    def script(request, step: int) -> int:
        seen.append(request.adapter_id)
        return 600 + step

    stack.shard.script = script
    async with aiohttp.ClientSession() as session, session.get(stack.url + "/v1/models") as r:
        models = (await r.json())["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("tiny", None, "tiny"),
        ("soft", "tiny", "soft"),
        ("team/lora", "tiny", "team/lora"),
    ]
    # OpenAI's retrieve: one entry of the list, or 404
    async with aiohttp.ClientSession() as session:
        for name, entry in [("tiny", models[0]), ("team/lora", models[2])]:
            async with session.get(f"{stack.url}/v1/models/{name}") as r:
                assert r.status == 200 and await r.json() == entry
        for name in ("team/gone", "a..b", "other"):
            async with session.get(f"{stack.url}/v1/models/{name}") as r:
                answer = await r.json()
                assert r.status == 404 and answer["error"]["message"] == f"The model `{name}` does not exist."
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "model": "team/lora"}
    status, answer = await post(stack, "/v1/completions", body)
    assert status == 200 and answer["model"] == "team/lora" and set(seen) == {"team/lora"}
    seen.clear()
    chat = {"messages": [{"role": "user", "content": "x"}], "model": "soft", "max_tokens": 2, "stream": True}
    events = await sse_events(stack, chat, "/v1/chat/completions")
    assert {e["model"] for e in events[:-1]} == {"soft"} and set(seen) == {"soft"}
    seen.clear()
    status, answer = await post(stack, "/v1/completions", {**body, "model": "tiny"})
    assert status == 200 and answer["model"] == "tiny" and set(seen) == {""}
    failures = stack.metrics.counters["tgi_request_failure"]
    before = failures.get(err="validation")
    status, answer = await post(stack, "/v1/completions", {**body, "model": "team/gone"})
    assert (status, answer["error"]["message"]) == (404, "The model `team/gone` does not exist.")
    assert failures.get(err="validation") == before + 1
    await stack.settled()


async def test_openai_special_tokens_kept_where_a_request_asks(stack: Stack) -> None:
    stack.shard.script = lambda request, step: 1 if step == 1 else 600 + step  # <s> second
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    texts = {}
    for skip in (None, True, False):
        fields = {} if skip is None else {"skip_special_tokens": skip}
        status, answer = await post(stack, "/v1/completions", {**body, **fields})
        events = await sse_events(stack, {**body, **fields, "stream": True}, "/v1/completions")
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert status == 200 and streamed == answer["choices"][0]["text"], (skip, streamed)
        texts[skip] = streamed
    assert texts[None] == texts[True] == texts[False].replace("<s>", "", 1) and "<s>" in texts[False]
    status, answer = await post(stack, "/v1/completions", {**body, "spaces_between_special_tokens": False})
    assert status == 400
    assert answer["error"]["message"] == "spaces_between_special_tokens false is not supported by this server"
    await stack.settled()


async def test_openai_token_ids_beside_the_text(stack: Stack, tokenizer_pool) -> None:
    stack.shard.script = lambda request, step: EOS if step == 3 else 600 + step  # EOS 4th
    prompt_ids = tokenizer_pool.encode_batch_sync(["hi there"])[0]
    body = {"prompt": "hi there", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    _, answer = await post(stack, "/v1/completions", body)
    (choice,) = answer["choices"]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == [600, 601, 602, EOS]
    events = await sse_events(stack, {**body, "stream": True}, "/v1/completions")
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [i for c in choices for i in c["token_ids"]] == choice["token_ids"]
    stack.openai.bos_token_id = 1  # a tokenizer that puts BOS first gets it back on truncation
    _, answer = await post(stack, "/v1/completions", {**body, "truncate_prompt_tokens": 2})
    assert answer["choices"][0]["prompt_token_ids"] == [1, prompt_ids[-1]]
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    _, answer = await post(stack, "/v1/chat/completions", {**chat, "n": 2, "seed": 1})
    assert answer["prompt_token_ids"][-1] != EOS and len(answer["prompt_token_ids"]) > 2
    assert [c["token_ids"] for c in answer["choices"]] == [[600, 601, 602, EOS]] * 2
    events = await sse_events(stack, {**chat, "stream": True}, "/v1/chat/completions")
    assert events[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    streamed = [i for e in events[:-1] for c in e["choices"] for i in c.get("token_ids", ())]
    assert streamed == [600, 601, 602, EOS]
    _, answer = await post(
        stack, "/v1/completions", {**body, "logprobs": 1, "return_tokens_as_token_ids": True}
    )
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:600", "token_id:601", "token_id:602", f"token_id:{EOS}"]
    assert all(set(top) <= {f"token_id:{i}" for i in range(2000)} for top in logprobs["top_logprobs"])
    plain = (await post(stack, "/v1/completions", {**body, "logprobs": 1, "return_token_ids": False}))[1]
    assert "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"]["text_offset"] == logprobs["text_offset"]
    await stack.settled()


async def test_every_door_takes_a_priority_header(stack: Stack) -> None:
    async def status(path: str, body: dict, priority: str) -> tuple[int, str]:
        headers = {"x-request-priority": priority}
        async with (
            aiohttp.ClientSession() as session,
            session.post(stack.url + path, json=body, headers=headers) as r,
        ):
            answer = await r.json(content_type=None)
        return r.status, str(answer.get("error", "")) if isinstance(answer, dict) else ""

    tgi, oai = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, {"prompt": "hi", "max_tokens": 2}
    assert (await status("/generate", tgi, "0"))[0] == 200 and (await status("/v1/completions", oai, " 0 "))[
        0
    ] == 200
    code, error = await status("/generate", tgi, "high")
    assert code == 422 and "x-request-priority must be an integer, not 'high'" in error
    code, error = await status("/v1/completions", oai, "2")
    assert code == 400 and "--scheduling-policy priority" in error
    stack.service.validator.by_priority = True
    assert (await status("/v1/completions", oai, "2"))[0] == 200
    assert (await status("/v1/completions", {**oai, "priority": -1}, "x"))[0] == 200  # the body's wins
    await stack.settled()


async def test_adapters_added_and_removed_at_run_time(stack: Stack) -> None:
    AdapterAdmin(stack.openai, stack.shard, stack.service.validator.prefixes)

    async def admin(route: str, body: dict) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{stack.url}/v1/{route}", json=body) as r,
        ):
            text = await r.text()
        return r.status, text if r.status == 200 else json.loads(text)["error"]["message"]

    async def models() -> list[str]:
        async with aiohttp.ClientSession() as session, session.get(stack.url + "/v1/models") as r:
            return [m["id"] for m in (await r.json())["data"]]

    assert await models() == ["tiny"]
    hot = {"lora_name": "team/hot", "lora_path": "/adapters/hot"}
    assert await admin("load_lora_adapter", hot) == (
        200,
        "Success: LoRA adapter 'team/hot' added successfully.",
    )
    assert await models() == ["tiny", "team/hot"]  # the listing read again at once
    body = {"prompt": "hi", "max_tokens": 2, "model": "team/hot"}
    assert (await post(stack, "/v1/completions", body))[0] == 200
    assert await admin("load_lora_adapter", hot) == (
        400,
        "The lora adapter 'team/hot' has already been loaded.",
    )
    assert (await admin("load_lora_adapter", {**hot, "load_inplace": True}))[0] == 200
    assert await admin("load_lora_adapter", {"lora_name": "x"}) == (
        400,
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    assert (await admin("load_lora_adapter", {"lora_name": "x", "lora_path": "/elsewhere"}))[0] == 404
    assert (await admin("load_lora_adapter", {"lora_name": "a.b", "lora_path": "/adapters/x"}))[0] == 400
    removed = (200, "Success: LoRA adapter 'team/hot' removed successfully.")
    assert await admin("unload_lora_adapter", {"lora_name": "team/hot"}) == removed
    assert await admin("unload_lora_adapter", {"lora_name": "team/hot"}) == (
        404,
        "The lora adapter 'team/hot' cannot be found.",
    )
    assert await models() == ["tiny"]
    status, answer = await post(stack, "/v1/completions", body)  # not served from a stale cache
    assert (status, answer["error"]["message"]) == (404, "The model `team/hot` does not exist.")
    await stack.settled()


async def test_the_adapter_routes_exist_only_where_allowed(stack: Stack) -> None:
    status, _ = await post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x"})
    assert status == 404 and not stack.shard.adapters


RANDOM_VALUES = (None, 0, 1, -1, 2.5, "", "x", "Oslo", True, [], {}, [1, 2], ["a"], {"a": 1}, [{"type": "x"}])


def random_body(r: random.Random, route: str) -> dict:
    """A body of the route's own fields and a few foreign ones, each of any JSON type."""
    fields = {
        "/v1/completions": ["prompt", "max_tokens", "temperature", "logprobs", "echo", "n", "stop", "stream"],
        "/v1/chat/completions": [
            "messages",
            "max_tokens",
            "tools",
            "tool_choice",
            "response_format",
            "stream",
        ],
        "/v1/responses": [
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "text",
            "include",
            "reasoning",
            "stream",
        ],
        "/generate": ["inputs", "parameters", "stream"],
        "/v1/messages": [
            "messages",
            "system",
            "tools",
            "tool_choice",
            "output_config",
            "stop_sequences",
            "stream",
        ],
    }[route]
    shared = ["structured_outputs", "priority", "return_token_ids", "skip_special_tokens", "model", "seed"]
    valid = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 3},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "/v1/responses": {"input": "hi", "max_output_tokens": 3},
        "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
        "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    }[route]
    changed = r.sample(fields + shared, r.randint(0, 3))
    body = {**valid, **{name: r.choice(RANDOM_VALUES) for name in changed}}
    nested = {  # well-formed containers holding values of any type
        "messages": [
            {
                "role": r.choice(["user", "assistant", "tool", "x"]),
                "content": r.choice(
                    [
                        *RANDOM_VALUES,
                        [
                            {
                                "type": r.choice(["text", "tool_use", "tool_result", "thinking", "image"]),
                                **{
                                    k: r.choice(RANDOM_VALUES)
                                    for k in r.sample(
                                        ["text", "id", "name", "input", "tool_use_id", "content", "thinking"],
                                        3,
                                    )
                                },
                            }
                        ],
                    ]
                ),
            }
        ],
        "input": [
            {
                "type": r.choice(["message", "function_call", "function_call_output", "reasoning", "x"]),
                **{
                    key: r.choice(RANDOM_VALUES)
                    for key in r.sample(
                        ["role", "content", "call_id", "name", "arguments", "output", "summary"], 3
                    )
                },
            }
        ],
        "parameters": {"max_new_tokens": r.choice([1, 2, 0, -1, "x", None])},
    }
    for name, value in nested.items():
        if name in changed and r.random() < 0.7:
            body[name] = value
    return body


async def test_random_bodies_get_clear_answers(stack: Stack) -> None:
    """Bodies of random shapes at each generate route: an answer or a clear refusal in the
    route's error shape, never a server error, and nothing left held."""
    r = random.Random(7)
    routes = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/v1/messages"]
    seen = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(800):
            route = r.choice(routes)
            body = random_body(r, route)
            async with session.post(stack.url + route, json=body) as response:
                text = await response.text()
            assert response.status in (200, 400, 404, 422), (route, body, response.status, text)
            if response.content_type == "text/event-stream":  # a stream ends as its route ends them
                last = text.strip().split("\n\n")[-1]
                ends = {
                    "/v1/responses": ("response.completed", "response.incomplete", "response.failed"),
                    "/v1/messages": ("message_stop", "event: error"),
                }
                assert any(end in last for end in ends.get(route, ("[DONE]", "generated_text"))), (body, last)
            if response.status != 200:
                error = json.loads(text)["error"]
                assert error["message"] if isinstance(error, dict) else error, (route, body)
            seen.add((route, response.status))
    assert len(seen) >= 10, seen  # both answers and refusals at every route
    await stack.settled()


async def test_random_bodies_at_the_token_counting_routes_get_clear_answers(stack: Stack) -> None:
    """TGI's and vLLM's /tokenize, /detokenize and Anthropic's count_tokens with bodies of random
    shapes: an answer or a clear refusal, never a server error."""
    r = random.Random(11)
    valid = {
        "/tokenize": [{"inputs": "hi"}, {"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}],
        "/detokenize": [{"tokens": [5, 6]}],
        "/v1/messages/count_tokens": [{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}],
    }
    fields = ["inputs", "prompt", "messages", "tokens", "model", "add_special_tokens", "return_token_strs",
              "tools", "system", "documents", "chat_template_kwargs", "parameters"]  # fmt: skip
    seen = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            route = r.choice(list(valid))
            body = dict(r.choice(valid[route]))
            body |= {name: r.choice(RANDOM_VALUES) for name in r.sample(fields, r.randint(0, 2))}
            async with session.post(stack.url + route, json=body) as response:
                text = await response.text()
            assert response.status in (200, 400, 404, 422), (route, body, response.status, text)
            if response.status != 200:
                error = json.loads(text)["error"]
                assert error["message"] if isinstance(error, dict) else error, (route, body)
            seen.add((route, response.status))
    assert {route for route, status in seen if status == 200} == set(valid), seen
    assert len(seen) >= 6, seen


async def test_openai_stop_reason_names_what_stopped_the_answer(stack: Stack) -> None:
    stack.shard.script = lambda request, step: EOS if step == 5 else 600 + step
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 0}
    plain = (await post(stack, "/v1/completions", body))[1]["choices"][0]  # EOS at the 6th token
    cases = [
        ({}, None),  # the model's EOS
        ({"max_tokens": 3}, None),
        ({"stop_token_ids": [602]}, 602),
        ({"stop": [plain["text"][2:4]]}, plain["text"][2:4]),
    ]
    for fields, want in cases:
        (choice,) = (await post(stack, "/v1/completions", {**body, **fields}))[1]["choices"]
        assert choice["stop_reason"] == want, (fields, choice)
        events = await sse_events(stack, {**body, **fields, "stream": True}, "/v1/completions")
        last = [e["choices"][0] for e in events[:-1] if e["choices"]][-1]
        assert last["finish_reason"] is not None and last["stop_reason"] == want, (fields, last)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stop_token_ids": [601]}
    assert (await post(stack, "/v1/chat/completions", chat))[1]["choices"][0]["stop_reason"] == 601
    await stack.settled()


async def test_openai_ignore_eos_and_overload(stack: Stack) -> None:
    stack.shard.script = lambda request, step: EOS if step == 1 else 600 + step  # EOS at the 2nd step
    status, answer = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "temperature": 0})
    assert answer["usage"]["completion_tokens"] == 2 and answer["choices"][0]["finish_reason"] == "stop"
    body = {"prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, answer = await post(stack, "/v1/completions", body)
    assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"
    stack.service.limiter.available = 1
    status, answer = await post(stack, "/v1/completions", {"prompt": "hi", "n": 2})
    assert status == 429 and answer["error"]["message"] == "Model is overloaded"
    stack.service.limiter.available = stack.service.limiter.permits
    async with aiohttp.ClientSession() as session, session.get(stack.url + "/v1/models") as r:
        (model,) = (await r.json())["data"]
    assert model["id"] == "tiny" and model["max_model_len"] == 512 and model["parent"] is None


async def test_a_client_leaving_an_openai_stream_frees_every_choice(stack: Stack) -> None:
    stack.shard.latency_s = 0.01
    body = {"prompt": "hi", "n": 3, "max_tokens": MAX_NEW, "stream": True}
    async with aiohttp.ClientSession() as session:
        r = await session.post(stack.url + "/v1/completions", json=body)
        await r.content.readline()
        r.close()
    await stack.settled(timeout_s=2.0)
    assert stack.metrics.counters["tgi_request_cancellation"].get(phase="running") == 3


# ---- authentication -------------------------------------------------------------------------

SECRET = "s3cret-for-tests-only-0123456789abcdef"
KEYED = AuthConfig(api_keys=("key-one", "key-two"), jwt_secret=SECRET, tenant_max_concurrent_requests=1)


def token(**claims) -> str:
    import jwt

    return jwt.encode({"sub": "team-a", **claims}, SECRET, algorithm="HS256")


async def call(stack: Stack, path: str, body: object, bearer: str | None) -> tuple[int, object, dict]:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(stack.url + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None), dict(r.headers)


@pytest.mark.parametrize("auth", [KEYED])
async def test_http_doors_need_a_token(stack: Stack, auth: AuthConfig, caplog) -> None:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
    status, answer, headers = await call(stack, "/generate", body, None)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert answer == {
        "error": "missing bearer token (Authorization: Bearer <token>)",
        "error_type": "unauthenticated",
    }
    status, answer, _ = await call(stack, "/v1/completions", {"prompt": "hi"}, "nope")
    assert status == 401 and answer["error"]["message"] == "invalid API key"  # not a key, not a JWT
    import time as clock

    status, answer, _ = await call(stack, "/generate", body, token(exp=int(clock.time()) - 60))
    assert (status, answer["error"]) == (401, "token expired")
    forged = token()[:-4] + "AAAA"
    status, answer, _ = await call(stack, "/generate", body, forged)
    assert (status, answer["error"]) == (401, "invalid token: signature verification failed")
    caplog.set_level("INFO", "router.api.service")
    assert (await call(stack, "/generate", body, "key-two"))[0] == 200
    assert (await call(stack, "/generate", body, token()))[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Request generated")]
    assert lines[0].endswith("tenant=key#2") and lines[1].endswith("tenant=team-a"), lines
    assert all("key-two" not in r.getMessage() and SECRET not in r.getMessage() for r in caplog.records)
    async with aiohttp.ClientSession() as session:  # probes, metrics and docs stay open
        for path in (*PROBE_PATHS, "/docs", "/openapi.json"):
            async with session.get(stack.url + path) as r:
                assert r.status == 200, path


@pytest.mark.parametrize("auth", [KEYED])
async def test_one_tenant_cannot_hold_every_slot(stack: Stack, auth: AuthConfig) -> None:
    stack.shard.latency_s = 0.01
    long = {"inputs": "hi", "parameters": {"max_new_tokens": 50}}
    first = asyncio.create_task(call(stack, "/generate", long, token()))
    while not stack.service.limiter.in_use:
        await asyncio.sleep(0.005)
    status, answer, _ = await call(stack, "/generate", long, token())  # team-a again: over its 1
    assert status == 429 and answer["error"] == "Tenant team-a is over its limit of 1 requests in flight"
    status, _, _ = await call(
        stack, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, "key-one"
    )
    assert status == 200  # another tenant still gets in
    assert (await first)[0] == 200
    assert stack.metrics.counters["tgi_queue_rejected"].get(reason="tenant_limit") == 1
    await stack.settled()
    assert not stack.service.tenant_in_flight


async def test_every_http_connection_sends_without_nagle(stack: Stack) -> None:
    """A streamed event must leave when written: with Nagle's algorithm on, the first event after
    the headers waited for the client's delayed ACK (~40 ms on a kept-alive connection)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/health/live") as r:
            assert r.status == 200
        assert stack.server._server is not None
        connections = stack.server._server.server_state.connections
        assert connections  # the kept-alive connection of this session
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
