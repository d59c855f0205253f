"""The HTTP doors through the real launcher, driven by the real HF `text-generation` client:
generation, streaming, details, errors, and the same answer over gRPC and TGI REST; and the
OpenAI door through the real `openai` client."""

from __future__ import annotations

import functools
import json
import re
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import openai
import pytest
import text_generation.errors
import transformers
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import FinishReason

from integration_tests.servers import Server, launch
from router.pb import generation_pb2 as pb

# the client (last released 2024-03) calls pydantic's deprecated .dict()
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")

PROMPTS = ["The quick brown fox", "def main():\n    print(", "Hello"]
# closed (else a random model writes on), and short: the servers here take 200 tokens in all
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "additionalProperties": False}
DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["llama", "llama@tgis_native"])
def served(request, server: Callable[[str], Server]) -> Server:
    return server(request.param)


def client(s: Server) -> Client:
    return Client(f"http://127.0.0.1:{s.http_port}", timeout=60)


def grpc_greedy(s: Server, prompt: str, max_new: int) -> pb.GenerationResponse:
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new))
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=prompt)], params=params)
    return s.stub().Generate(request).responses[0]


def grpc_tokens(s: Server, max_new: int, min_new: int) -> pb.GenerationResponse:
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=max_new, min_new_tokens=min_new),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPTS[0])], params=params)
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


def test_the_models_generation_config_eos_ids_and_sampling_defaults(served: Server, tmp_path: Path) -> None:
    """A model whose generation_config.json names several EOS ids (an instruct model ends a turn
    with one, a text with another): the answer ends at the first of any, as EOS (not in the
    text), on every door; min_new_tokens holds each back in the shard. Its sampling parameters
    are the OpenAI door's defaults (top_k 1: sampling gives the greedy answer)."""
    plain = client(served).generate(PROMPTS[0], max_new_tokens=6)
    ids = [t.id for t in plain.details.tokens]
    end_of_turn = ids[2]
    cut = ids.index(end_of_turn)  # its first place
    model = tmp_path / "models" / "llama"
    shutil.copytree(served.model_dir, model)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    generation = {"eos_token_id": [eos, end_of_turn], "temperature": 0.5, "top_k": 1}
    (model / "generation_config.json").write_text(json.dumps(generation))
    s = launch(served.name, tmp_path)
    try:
        answer = client(s).generate(PROMPTS[0], max_new_tokens=6)
        assert answer.details.finish_reason == FinishReason.EndOfSequenceToken
        assert [t.id for t in answer.details.tokens] == ids[: cut + 1]
        assert answer.generated_text == "".join(t.text for t in plain.details.tokens[:cut])
        grpc_answer = grpc_greedy(s, PROMPTS[0], 6)
        assert grpc_answer.stop_reason == pb.EOS_TOKEN and grpc_answer.text == answer.generated_text
        pieces = [t.text for t in grpc_tokens(served, 6, 0).tokens]  # TGIS's tokens: raw pieces
        held = grpc_tokens(s, 6, cut + 2)
        assert held.generated_token_count >= cut + 2
        assert pieces[cut] not in [t.text for t in held.tokens[: cut + 2]]  # masked in the shard
        assert [t.text for t in held.tokens[:cut]] == pieces[:cut]
        oai = openai_client(s)
        model_card = oai.models.list().data[0]  # the served model, its adapters after it
        sampled = oai.completions.create(model=model_card.id, prompt=PROMPTS[0], max_tokens=6, logprobs=1)
        assert sampled.choices[0].text == answer.generated_text and sampled.choices[0].finish_reason == "stop"
        log = s.log_path.read_text()
        assert "sample with the model's generation_config.json: temperature 0.5, top_k 1" in log
    finally:
        s.stop()


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
    best = tgi.generate("Hello", max_new_tokens=5, do_sample=True, best_of=2)
    (other,) = best.details.best_of_sequences
    assert sum(t.logprob for t in best.details.tokens) >= sum(t.logprob for t in other.tokens)


def test_frequency_penalty_in_tgis_form(served: Server) -> None:
    """The client's frequency_penalty reaches the shard (the tokens' log-probabilities, read
    after the penalty, move; the tiny random model's greedy text may not), streamed as answered."""
    tgi = client(served)
    prompt = PROMPTS[1]
    plain = tgi.generate(prompt, max_new_tokens=16)
    penalised = tgi.generate(prompt, max_new_tokens=16, frequency_penalty=2.0)
    assert [t.logprob for t in penalised.details.tokens] != [t.logprob for t in plain.details.tokens]
    streamed = list(tgi.generate_stream(prompt, max_new_tokens=16, frequency_penalty=2.0))
    assert "".join(r.token.text for r in streamed) == penalised.generated_text


def test_guided_decoding_on_every_door(served: Server) -> None:
    """The gRPC oneof, TGI's grammar and OpenAI's response_format / vLLM's structured_outputs and
    guided_* give the same constrained answers; a constraint that does not compile is each door's
    validation error."""
    choices = ["red", "green", "blue"]
    decoding = pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=choices))
    params = pb.Parameters(decoding=decoding, stopping=pb.StoppingCriteria(max_new_tokens=10))
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")], params=params)
    expected = served.stub().Generate(request).responses[0].text
    assert expected in choices
    oai = openai_client(served)
    model = oai.models.list().data[0].id
    for extension in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        answer = oai.completions.create(
            model=model, prompt="Hello", max_tokens=10, temperature=0, extra_body=extension
        )
        assert answer.choices[0].text == expected, extension
    tgi = client(served)
    digits = tgi.generate("Hello", max_new_tokens=12, grammar={"type": "regex", "value": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", digits.generated_text)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a number"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    content = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop", content
    assert set(json.loads(content)) == {"n"} and 0 <= json.loads(content)["n"] <= 99
    with pytest.raises(ValidationError, match="invalid regex for guided decoding"):
        tgi.generate("Hello", max_new_tokens=4, grammar={"type": "regex", "value": "(a"})
    with pytest.raises(openai.BadRequestError, match="invalid regex for guided decoding"):
        oai.completions.create(model=model, prompt="Hello", max_tokens=4, extra_body={"guided_regex": "(a"})


def test_errors_reach_the_client_as_tgi_errors(served: Server) -> None:
    tgi = client(served)
    with pytest.raises(ValidationError, match="max_new_tokens must be <= "):
        tgi.generate("Hello", max_new_tokens=100_000)
    with pytest.raises(ValidationError, match=r"must be >= 0\.05"):
        list(tgi.generate_stream("Hello", do_sample=True, temperature=0.01))


# ---- the OpenAI door, through the `openai` client -------------------------------------------


def openai_client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_openai_completions_give_the_grpc_answer(served: Server, prompt: str) -> None:
    expected = grpc_greedy(served, prompt, 12)
    client = openai_client(served)
    model = client.models.list().data[0]
    answer = client.completions.create(model=model.id, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected.text
    assert answer.usage.completion_tokens == expected.generated_token_count
    assert answer.usage.prompt_tokens == expected.input_token_count
    chunks = list(
        client.completions.create(
            model=model.id,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == expected.generated_token_count


def test_openai_logit_bias_bans_and_raises_tokens(served: Server) -> None:
    """logit_bias by token id (ids read from the TGI door's details): -100 bans the greedy
    answer's first token, +100 makes another one every token of the answer."""
    plain = client(served).generate(PROMPTS[0], max_new_tokens=6)
    first, later = plain.details.tokens[0], plain.details.tokens[3]
    openai_api = openai_client(served)
    model = openai_api.models.list().data[0]

    def tokens(bias: dict[str, int]) -> list[str]:
        answer = openai_api.completions.create(
            model=model.id, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0, logit_bias=bias
        )
        return answer.choices[0].logprobs.tokens

    assert tokens({})[0] == first.text
    assert tokens({str(first.id): -100})[0] != first.text
    assert tokens({str(later.id): 100}) == [later.text] * 6


def greedy_chat(s: Server, **fields: Any) -> Callable[..., Any]:
    """The openai client's chat call to `s`'s model, greedy, with `fields` bound."""
    client = openai_client(s)
    model = client.models.list().data[0]
    return functools.partial(client.chat.completions.create, model=model.id, temperature=0, **fields)


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(served: Server) -> None:
    """A prompt asked again finds its full KV blocks in tgis_native's prefix cache: usage's
    prompt_tokens_details.cached_tokens says how many tokens were not computed (hf_transformers
    keeps no prefix cache: 0)."""
    long = "You answer in one short sentence, politely, and never in lists. " * 6
    ask = greedy_chat(
        served, messages=[{"role": "system", "content": long}, {"role": "user", "content": "hi"}]
    )
    first, again = ask(max_tokens=2), ask(max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    if served.name.endswith("@tgis_native"):
        assert 16 <= cached < again.usage.prompt_tokens and first.choices == again.choices
    else:
        assert cached == 0


def test_openai_tool_calls(served: Server) -> None:
    """A named function and tool_choice "required" through the openai client: the calls come back
    as message.tool_calls whose arguments satisfy the functions' schemas, unary and streamed; the
    tools reach the model's chat template (the prompt grows); "auto" is refused."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = greedy_chat(served, messages=messages, max_tokens=60, tools=tools)
    plain = greedy_chat(served, messages=messages, max_tokens=1)()
    weather = ask(tool_choice={"type": "function", "function": {"name": "weather"}})
    (call,) = weather.choices[0].message.tool_calls
    assert weather.choices[0].finish_reason == "stop" and call.function.name == "weather"
    assert set(json.loads(call.function.arguments)) <= {"city"}
    assert weather.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote the tools
    stream = ask(tool_choice={"type": "function", "function": {"name": "weather"}}, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert streamed == call.function.arguments
    required = ask(tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    for made in required.choices[0].message.tool_calls:
        assert made.function.name == "weather" and set(json.loads(made.function.arguments)) <= {"city"}
    # streamed, each call goes out as it is written: the client's own accumulation puts them together
    client = openai_client(served)
    model = client.models.list().data[0].id
    with client.chat.completions.stream(
        model=model, messages=messages, max_tokens=60, tools=tools, tool_choice="required", temperature=0
    ) as stream:
        calls = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls
    ]
    assert len(calls) > 1  # the arguments came in pieces
    with pytest.raises(openai.BadRequestError, match=r'tool_choice "auto" .* needs the server started with'):
        ask()


@pytest.fixture(scope="module")
def parsing(tmp_path_factory) -> Iterator[Server]:
    env = {"TOOL_CALL_PARSER": "hermes", "REASONING_PARSER": "deepseek_r1", "RESPONSES_STORE_SIZE": "8"}
    s = launch("llama", tmp_path_factory.mktemp("parsers"), env=env)
    yield s
    s.stop()


def test_openai_answers_through_the_models_parsers(parsing: Server, served: Server) -> None:
    """TOOL_CALL_PARSER turns "auto" on (the default with tools) and REASONING_PARSER answers
    thinking apart: the tiny random model writes no call and never closes its thinking (which
    deepseek_r1's template opens), so its whole greedy answer (as a server without parsers
    gives it) is reasoning_content, unary and streamed alike."""
    if served.name != "llama":
        pytest.skip("one engine is enough: the parsers are the router's")
    messages = [{"role": "user", "content": "What time is it?"}]
    tools = [{"type": "function", "function": {"name": "hour"}}]
    plain = greedy_chat(served, messages=messages, max_tokens=8, tools=tools, tool_choice="none")()
    text = plain.choices[0].message.content
    ask = greedy_chat(parsing, messages=messages, max_tokens=8, tools=tools)
    (choice,) = ask().choices
    assert choice.finish_reason == plain.choices[0].finish_reason and choice.message.tool_calls is None
    assert choice.message.content == "" and choice.message.model_extra["reasoning_content"] == text
    deltas = [c.choices[0].delta for c in ask(stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == text
    assert not "".join(d.content or "" for d in deltas)


def test_a_thinking_budget_through_the_launcher(parsing: Server) -> None:
    """thinking_token_budget on a reasoning format the template opens (deepseek_r1): the tiny
    model never closes its thinking, so after 3 tokens the closing marker's ids are forced and the
    answer goes on from them: its ids equal the model's greedy continuation of the prompt, the 3
    tokens and the closing ids (asked through /v1/completions with those token ids); streamed
    alike."""
    from tokenizers import Tokenizer

    client = openai_client(parsing)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What time is it?"}]
    ask = greedy_chat(parsing, messages=messages, max_tokens=10)
    plain = ask(extra_body={"return_token_ids": True})
    limited = ask(extra_body={"return_token_ids": True, "thinking_token_budget": 3})
    ids = limited.choices[0].model_extra["token_ids"]
    assert ids[:3] == plain.choices[0].model_extra["token_ids"][:3] and len(ids) == 10
    tokenizer = Tokenizer.from_file(str(parsing.model_dir / "tokenizer.json"))
    closing = tokenizer.encode("</think>", add_special_tokens=False).ids
    assert ids[3 : 3 + len(closing)] == closing
    assert limited.usage.completion_tokens_details.reasoning_tokens == 3 + len(closing)
    assert plain.usage.completion_tokens_details.reasoning_tokens == 10  # never closed: all thought
    prompt = limited.model_extra["prompt_token_ids"] + ids[: 3 + len(closing)]
    rest = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=10 - len(prompt) + len(limited.model_extra["prompt_token_ids"]),
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert ids[3 + len(closing) :] == rest.choices[0].model_extra["token_ids"]
    message = limited.choices[0].message
    assert message.model_extra["reasoning_content"] == tokenizer.decode(ids[:3]) and message.content
    streamed = [
        c.choices[0].delta for c in ask(stream=True, extra_body={"thinking_token_budget": 3}) if c.choices
    ]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in streamed)
    assert (reasoning, "".join(d.content or "" for d in streamed)) == (
        message.model_extra["reasoning_content"],
        message.content,
    )
    # a JSON Schema shapes the answer after the thinking, which the budget ends (vLLM's
    # structured outputs with a reasoning parser): free thought, then the schema's JSON
    shaped = (
        ask(
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}},
            extra_body={"thinking_token_budget": 3},
        )
        .choices[0]
        .message
    )
    assert shaped.model_extra["reasoning_content"] == message.model_extra["reasoning_content"]
    assert set(json.loads(shaped.content)) == {"n"}


def test_openai_responses_api(served: Server, parsing: Server) -> None:
    """The Responses API through the openai client: the text is the chat door's greedy answer,
    unary and streamed (responses.stream's events); a named function's call comes as a
    function_call item whose arguments satisfy its schema, and goes back with its output as
    input items; json_schema text, logprobs, a model's reasoning item, and refusals."""
    client = openai_client(served)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    chat = greedy_chat(served, messages=messages, max_tokens=8)()
    ask = functools.partial(client.responses.create, model=model, temperature=0, max_output_tokens=8)
    answer = ask(instructions="be brief", input="Hello")
    assert answer.output_text == chat.choices[0].message.content and answer.model == model
    assert answer.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(
        model=model, temperature=0, max_output_tokens=8, instructions="be brief", input="Hello"
    ) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # the last event carries the Response: completed, or incomplete where max_output_tokens cut it
    assert events[-1].type == f"response.{answer.status}"
    assert "".join(deltas) == events[-1].response.output_text == answer.output_text
    tools = [{"type": "function", "name": "weather", "parameters": CITY}]
    called = ask(
        input="Weather in Oslo?",
        tools=tools,
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=60,
    )
    (call,) = called.output
    assert (call.type, call.name) == ("function_call", "weather")
    assert set(json.loads(call.arguments)) <= {"city"}
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    asked = ask(input=history[:1])
    followed = ask(input=history)  # without tools: the servers here take 200 tokens in all
    assert followed.usage.input_tokens > asked.usage.input_tokens  # the call and its output reached it
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": DIGIT, "strict": True}}
    numbered = ask(input="a number", text=fmt, max_output_tokens=20)
    assert set(json.loads(numbered.output_text)) == {"n"}
    scored = ask(input="Hello", include=["message.output_text.logprobs"], top_logprobs=20)  # OpenAI's most
    logprobs = scored.output[0].content[0].logprobs
    assert "".join(t.token for t in logprobs) == scored.output_text
    assert all(len(t.top_logprobs) == 20 for t in logprobs)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in logprobs)
    with pytest.raises(openai.BadRequestError, match="previous_response_id needs responses kept"):
        ask(input="x", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="other", input="x")
    if served.name == "llama":  # the reasoning parser is the router's: one engine is enough
        thinking = greedy_chat(parsing, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)()
        parsed = openai_client(parsing).responses.create(
            model=openai_client(parsing).models.list().data[0].id,
            input="Hello",
            temperature=0,
            max_output_tokens=8,
        )
        assert parsed.output[0].type == "reasoning"
        assert (
            parsed.output[0].content[0].text == thinking.choices[0].message.model_extra["reasoning_content"]
        )


def test_anthropic_messages_api(served: Server) -> None:
    """Anthropic's Messages API through the `anthropic` client: the text is the chat door's
    greedy answer, unary and streamed, with its token counts (count_tokens too); a forced tool
    use comes as a tool_use block whose input satisfies the schema, and goes back with its
    result; output_config's JSON Schema shapes the text; an unknown model and an unserved block
    are refused in Anthropic's error shape. (The 2026 client has no temperature: extra_body.)"""
    import anthropic

    url = f"http://127.0.0.1:{served.http_port}"
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    model = openai_client(served).models.list().data[0].id
    messages = [{"role": "user", "content": "Hello"}]
    system = [{"role": "system", "content": "be brief"}]
    chat = greedy_chat(served, messages=[*system, *messages], max_tokens=8)()
    greedy = {"extra_body": {"temperature": 0}}
    ask = functools.partial(client.messages.create, model=model, max_tokens=8, **greedy)
    answer = ask(system="be brief", messages=messages)
    text = "".join(block.text for block in answer.content if block.type == "text")
    assert text == chat.choices[0].message.content and answer.model == model
    assert answer.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert (answer.usage.input_tokens + answer.usage.cache_read_input_tokens, answer.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    counted = client.messages.count_tokens(model=model, system="be brief", messages=messages)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    with client.messages.stream(
        model=model, max_tokens=8, system="be brief", messages=messages, **greedy
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == answer.stop_reason
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens, final.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        answer.usage.output_tokens,
    )
    tools = [{"name": "weather", "description": "the weather", "input_schema": CITY}]
    asked = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"tools": tools, "tool_choice": {"type": "tool", "name": "weather"}, "max_tokens": 60}
    called = ask(messages=asked, **forced)
    (use,) = called.content
    assert (use.type, use.name, called.stop_reason) == ("tool_use", "weather", "tool_use")
    assert set(use.input) <= {"city"}
    with client.messages.stream(model=model, messages=asked, **forced, **greedy) as stream:
        streamed_use = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed_use.content] == [("tool_use", "weather", use.input)]
    anyone = {**forced, "tool_choice": {"type": "any"}}  # "required": the listed calls as they come
    listed = ask(messages=asked, **anyone)
    with client.messages.stream(model=model, messages=asked, **anyone, **greedy) as stream:
        pieces = [e for e in stream if e.type == "input_json"]
        streamed_any = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed_any.content] == [
        (b.type, b.name, b.input) for b in listed.content
    ]
    assert len(pieces) > 1
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    followed = ask(
        messages=[
            *asked,
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [result]},
        ]
    )
    alone = ask(messages=asked)
    assert followed.usage.input_tokens > alone.usage.input_tokens  # the call and its result reached it
    numbered = ask(
        messages=[{"role": "user", "content": "a number"}],
        output_config={"format": {"type": "json_schema", "schema": DIGIT}},
        max_tokens=20,
    )
    assert set(json.loads(numbered.content[0].text)) == {"n"}
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", max_tokens=4, messages=messages)
    assert missing.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="content of type 'image' is not supported"):
        ask(messages=[{"role": "user", "content": [image]}])


def test_anthropic_thinking_blocks_through_the_reasoning_parser(parsing: Server) -> None:
    """With REASONING_PARSER the model's thinking comes as a thinking block, unary and streamed
    alike, equal to the chat door's reasoning_content (the tiny model never closes its
    thinking: all of its answer is thinking)."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{parsing.http_port}", api_key="-", max_retries=0)
    model = openai_client(parsing).models.list().data[0].id
    messages = [{"role": "user", "content": "Hello"}]
    chat = greedy_chat(parsing, messages=messages, max_tokens=8)()
    thinking = chat.choices[0].message.model_extra["reasoning_content"]
    ask = {"model": model, "max_tokens": 8, "messages": messages, "extra_body": {"temperature": 0}}
    answer = client.messages.create(**ask)
    assert [(b.type, b.thinking) for b in answer.content] == [("thinking", thinking)]
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thinking)]
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == thinking


def test_openai_responses_kept_and_continued(parsing: Server) -> None:
    """RESPONSES_STORE_SIZE through the openai client: a Response is kept, read back with its
    input items, continued by previous_response_id exactly as the whole conversation sent as
    input, and deleted."""
    client = openai_client(parsing)
    ask = functools.partial(
        client.responses.create, model=client.models.list().data[0].id, temperature=0, max_output_tokens=6
    )
    first = ask(input="Hello", instructions="be brief")
    assert first.store is True
    kept = client.responses.retrieve(first.id)
    assert (kept.id, kept.output_text, kept.usage) == (first.id, first.output_text, first.usage)
    (item,) = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.content[0].text == "Hello"
    follow = ask(input="And then?", previous_response_id=first.id)
    whole = [
        {"role": "user", "content": "Hello"},
        *[i.model_dump(exclude_none=True) for i in first.output],
        {"role": "user", "content": "And then?"},
    ]
    sent = ask(input=whole, store=False)
    assert follow.previous_response_id == first.id and sent.store is False
    assert follow.usage.input_tokens == sent.usage.input_tokens
    assert [i.model_dump(exclude={"id"}) for i in follow.output] == [
        i.model_dump(exclude={"id"}) for i in sent.output
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(sent.id)  # store: false
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match=f"Previous response with id '{first.id}' not found"):
        ask(input="x", previous_response_id=first.id)


def test_openai_scores_a_token_prompt_as_evaluation_harnesses_ask(served: Server) -> None:
    """The request lm-evaluation-harness sends to score a text's likelihood: the prompt's token ids,
    echo, logprobs, one new token. The prompt's logprobs are the TGI door's prefill details of the
    same tokens, the first null."""
    prefill = (
        client(served).generate(PROMPTS[1], max_new_tokens=1, decoder_input_details=True).details.prefill
    )
    ids = [t.id for t in prefill]
    oai = openai_client(served)
    model = oai.models.list().data[0]
    answer = oai.completions.create(
        model=model.id, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx([t.logprob for t in prefill[1:]], abs=1e-5)
    assert answer.choices[0].text.startswith(PROMPTS[1]) and answer.usage.prompt_tokens == len(ids)


def test_openai_prompt_logprobs_are_the_grpc_doors_input_token_details(served: Server) -> None:
    """vLLM's `prompt_logprobs` at /v1/completions: the same logprobs, ranks and likeliest tokens
    as TGIS's input token details of the same prompt over gRPC."""
    options = pb.ResponseOptions(input_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=3)
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1), response=options)
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPTS[1])], params=params)
    details = served.stub().Generate(request).responses[0].input_tokens
    oai = openai_client(served)
    model = oai.models.list().data[0].id
    answer = oai.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    prompt = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt) == len(details) == answer.usage.prompt_tokens and prompt[0] is None
    vocabulary = transformers.AutoTokenizer.from_pretrained(served.model_dir).get_vocab()
    for ranked, detail in zip(prompt[1:], details[1:], strict=True):
        token = str(vocabulary[detail.text])
        assert ranked[token]["logprob"] == pytest.approx(detail.logprob, abs=1e-5)
        assert ranked[token]["rank"] == detail.rank
        tops = [str(vocabulary[top.text]) for top in detail.top_tokens]
        assert len(tops) == 3 and list(ranked) == [token, *(t for t in tops if t != token)]
        for rank, (top, info) in enumerate(zip(tops, detail.top_tokens, strict=True), 1):
            assert ranked[top]["logprob"] == pytest.approx(info.logprob, abs=1e-5)
            assert top == token or ranked[top]["rank"] == rank


def test_openai_bad_words_ban_what_transformers_bans(served: Server) -> None:
    """vLLM's bad_words: a word the greedy answer holds is tokenized as vLLM does (as written, and
    after a space where that starts with another token) and banned; the answer equals
    transformers generate with those sequences as bad_words_ids, token for token."""
    import torch

    tokenizer = transformers.AutoTokenizer.from_pretrained(served.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPTS[0])["input_ids"]

    def reference(banned: list[list[int]] | None) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                bad_words_ids=banned,
                pad_token_id=model.config.eos_token_id,
            )
        return out[0, len(prompt) :].tolist()

    def words_ids(word: str) -> list[list[int]]:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])

    free = reference(None)
    word = next(
        text for t in free[1:] if (text := tokenizer.decode([t])).strip() and words_ids(text)[0] == [t]
    )
    oai = openai_client(served)
    answer = oai.completions.create(
        model=oai.models.list().data[0].id,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"bad_words": [word], "return_token_ids": True},
    )
    got = answer.choices[0].model_extra["token_ids"]
    banned = words_ids(word)
    assert got == reference(banned)[: len(got)] and got != free[: len(got)]
    assert not any(ids[0] in got for ids in banned)


def post_json(s: Server, path: str, body: dict[str, Any]) -> Any:
    url, headers = f"http://127.0.0.1:{s.http_port}{path}", {"Content-Type": "application/json"}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_vllm_tokenize_counts_what_the_model_is_given(served: Server) -> None:
    """vLLM's /tokenize (beside TGI's on the same path) gives the ids the gRPC Tokenize gives and
    the counts the OpenAI routes report; /detokenize gives the text back."""
    oai = openai_client(served)
    model = oai.models.list().data[0].id
    (grpc_ids,) = (
        served.stub()
        .Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": PROMPTS[0]}], return_tokens=False))
        .responses
    )
    answer = post_json(served, "/tokenize", {"model": model, "prompt": PROMPTS[0], "return_token_strs": True})
    assert answer["count"] == grpc_ids.token_count and len(answer["token_strs"]) == answer["count"]
    completion = oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == answer["count"]
    messages = [{"role": "user", "content": "Say hello"}]
    chat = post_json(served, "/tokenize", {"model": model, "messages": messages})
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == reply.usage.prompt_tokens and chat["max_model_len"] == 200
    assert post_json(served, "/tokenize", {"inputs": PROMPTS[0]})[0]["start"] == 0  # TGI's answer
    bare = post_json(served, "/tokenize", {"prompt": PROMPTS[0], "add_special_tokens": False})["tokens"]
    assert post_json(served, "/detokenize", {"model": model, "tokens": bare}) == {"prompt": PROMPTS[0]}


def client_token_id(s: Server, prompt: str, at: int) -> int:
    """The id of the greedy answer's token `at` (the TGI door's details name them)."""
    return client(s).generate(prompt, max_new_tokens=at + 1).details.tokens[at].id


def test_openai_chat_and_errors(served: Server) -> None:
    client = openai_client(served)
    model = client.models.list().data[0]
    assert client.models.retrieve(model.id) == model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    messages = [{"role": "user", "content": "Say hello"}]
    answer = client.chat.completions.create(model=model.id, messages=messages, max_tokens=8, temperature=0)
    text = answer.choices[0].message.content
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=model.id, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    sampled = client.chat.completions.create(
        model=model.id, messages=messages, max_tokens=8, seed=3, n=2, logprobs=True, top_logprobs=2
    )
    assert len(sampled.choices) == 2 and all(len(c.logprobs.content) for c in sampled.choices)
    # vLLM's continue_final_message: the answer continues the assistant's text, as a completion of
    # the prompt transformers renders for it (BOS left to the tokenizer, as the door does)
    started = [*messages, {"role": "assistant", "content": "Hello there"}]
    continued = client.chat.completions.create(
        model=model.id,
        messages=started,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(served.model_dir))
    prompt = tokenizer.apply_chat_template(started, tokenize=False, continue_final_message=True)
    prompt = prompt.removeprefix(tokenizer.bos_token or "")
    completed = client.completions.create(model=model.id, prompt=prompt, max_tokens=8, temperature=0)
    assert continued.choices[0].message.content == completed.choices[0].text
    # vLLM's return_token_ids: the ids the TGI door's details name, the prompt's as truncated
    prompt, tgi_door = (
        "Hello there, my dear friend",
        Client(f"http://127.0.0.1:{served.http_port}", timeout=60),
    )
    for truncate in (None, 3):
        tgi = tgi_door.generate(prompt, max_new_tokens=6, decoder_input_details=True, truncate=truncate)
        extra = {"return_token_ids": True, "truncate_prompt_tokens": truncate}
        ids = client.completions.create(
            model=model.id, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra
        )
        assert ids.choices[0].model_extra["prompt_token_ids"] == [t.id for t in tgi.details.prefill]
        assert ids.choices[0].model_extra["token_ids"] == [t.id for t in tgi.details.tokens]
    with pytest.raises(openai.BadRequestError, match="continue_final_message and add_generation_prompt"):
        client.chat.completions.create(
            model=model.id, messages=started, extra_body={"continue_final_message": True}
        )
    greedy = client.completions.create(
        model=model.id, prompt="Hello", max_tokens=8, temperature=0, logprobs=0
    )
    third = client.completions.create(  # vLLM's stop_token_ids: the third token's id ends the answer
        model=model.id,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [client_token_id(served, "Hello", 2)]},
    )
    assert third.choices[0].finish_reason == "stop" and third.usage.completion_tokens <= 3
    # the stop token's text stays (vLLM's rule): the answer is the greedy one up to its third token
    stopped_at = third.usage.completion_tokens
    assert third.choices[0].text == "".join(greedy.choices[0].logprobs.tokens[:stopped_at])
    only = client.completions.create(  # vLLM's allowed_token_ids: one id, so every token is it
        model=model.id,
        prompt="Hello",
        max_tokens=4,
        temperature=0.8,
        seed=1,
        logprobs=0,
        extra_body={"allowed_token_ids": [client_token_id(served, "Hello", 2)]},
    )
    tokens = only.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1 and tokens[0] == greedy.choices[0].logprobs.tokens[2]
    only_top = client.completions.create(  # min_p 1: sampling keeps the likeliest token only
        model=model.id, prompt="Hello", max_tokens=8, temperature=1.0, seed=5, extra_body={"min_p": 1.0}
    )
    assert only_top.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"min_p must be >= 0\.0 and <= 1\.0"):
        client.completions.create(model=model.id, prompt="x", extra_body={"min_p": 2})
    with pytest.raises(openai.BadRequestError, match=r"temperature must be >= 0\.05"):
        client.completions.create(model=model.id, prompt="x", temperature=0.01)
    with pytest.raises(openai.BadRequestError, match="logit_bias token id 1000000 is not in the vocabulary"):
        client.completions.create(model=model.id, prompt="x", logit_bias={"1000000": 1})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x")


# ---- authentication through the real launcher -----------------------------------------------

SECRET = "integration-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("auth")
    s = launch(
        "llama", root, "--tenant-max-concurrent-requests", "4", env={"API_KEY": "k1,k2", "JWT_SECRET": SECRET}
    )
    yield s
    s.stop()


def test_every_door_needs_a_token_and_health_stays_open(guarded: Server) -> None:
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")])
    with pytest.raises(grpc.RpcError) as error:
        guarded.stub().Generate(request)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.value.details() == "missing bearer token (Authorization: Bearer <token>)"
    expired = jwt.encode({"sub": "team-a", "exp": int(time.time()) - 10}, SECRET)
    with pytest.raises(grpc.RpcError) as error:
        guarded.stub().Generate(request, metadata=[("authorization", f"Bearer {expired}")])
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "token expired")
    good = jwt.encode({"sub": "team-a"}, SECRET)
    answer = guarded.stub().Generate(request, metadata=[("authorization", f"Bearer {good}")])
    assert answer.responses[0].generated_token_count > 0
    with pytest.raises(text_generation.errors.UnknownError, match="missing bearer token"):
        client(guarded).generate("Hello", max_new_tokens=2)
    assert (
        Client(f"http://127.0.0.1:{guarded.http_port}", headers={"Authorization": "Bearer k2"})
        .generate("Hello", max_new_tokens=2)
        .generated_text
        is not None
    )
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{guarded.http_port}/v1", api_key="wrong", max_retries=0
        ).models.list()
    authorized = openai.OpenAI(
        base_url=f"http://127.0.0.1:{guarded.http_port}/v1", api_key=good, max_retries=0
    )
    assert authorized.models.list().data
    import anthropic  # its clients send the key as x-api-key

    url = f"http://127.0.0.1:{guarded.http_port}"
    model = authorized.models.list().data[0].id
    message = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
    assert (
        anthropic.Anthropic(base_url=url, api_key="k2", max_retries=0)
        .messages.create(**message)
        .usage.input_tokens
    )
    with pytest.raises(anthropic.AuthenticationError, match="invalid API key"):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**message)
    assert guarded.health() == 200
    log = guarded.log()
    assert "tenant=team-a" in log and "tenant=key#2" in log and SECRET not in log and good not in log


def test_overload_reaches_the_clients_as_429(guarded: Server) -> None:
    """Over the tenant's limit (4 in flight): the OpenAI and TGI clients get their overload error."""
    from concurrent.futures import ThreadPoolExecutor

    good = jwt.encode({"sub": "team-b"}, SECRET)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{guarded.http_port}/v1", api_key=good, max_retries=0)
    streams = [  # each runs to the server's limit of 169 tokens: long enough to stay in flight
        client.completions.create(
            model=guarded.model_dir.as_posix(),
            prompt="x",
            max_tokens=169,
            stream=True,
            extra_body={"min_tokens": 169},
        )
        for _ in range(4)
    ]
    try:
        for stream in streams:
            next(iter(stream))  # all four admitted and generating
        with pytest.raises(openai.RateLimitError, match="Tenant team-b is over its limit of 4"):
            client.completions.create(model=guarded.model_dir.as_posix(), prompt="x", max_tokens=2)
        tgi = Client(f"http://127.0.0.1:{guarded.http_port}", headers={"Authorization": f"Bearer {good}"})
        with pytest.raises(text_generation.errors.OverloadedError):
            tgi.generate("x", max_new_tokens=2)
    finally:
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda s: s.close(), streams))
