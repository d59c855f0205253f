"""OpenAI tool calling at the chat door (router/http/openai_tools.py, tool_parsers.py): which
tool_choice is served, the constraint each asks for, the calls read back from the answer (whole
and streamed), each model family's call format, and what the template sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.core.validation import ValidationError
from router.http.chat_template import ChatTemplate
from router.http.openai_params import ChatRequest, request_params
from router.http.openai_tools import (
    TEXT,
    HeldAnswer,
    NamedToolChoice,
    Reading,
    Tool,
    ToolMode,
    guided_for,
    read,
    template_message,
    template_tools,
    tool_mode,
)
from router.http.reasoning import FORMATS
from router.http.tool_parsers import (
    DeepSeekV3,
    DeepSeekV31,
    Glm45,
    Granite,
    Granite20bFc,
    Hermes,
    KimiK2,
    Llama3Json,
    Mistral,
    Pythonic,
    Qwen3Coder,
    parser_named,
)
from text_generation_common.guided import Grammars
from text_generation_common.messages import GuidedKind

CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": CITY}}),
    Tool.model_validate({"type": "function", "function": {"name": "now", "description": "the time"}}),
]


SCHEMAS = {
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "typed": {
        "properties": {
            "code": {"type": "string"},
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "y": {"type": "number"},
            "flag": {"type": "boolean"},
            "obj": {"type": "object"},
            "items": {"type": "array"},
            "gone": {"type": "integer"},
            "bad": {"type": "integer"},
            "z": {"type": "number"},
            "either": {"type": ["integer", "string"]},
        }
    },
}
QWEN = Qwen3Coder().for_tools(SCHEMAS)
GLM = Glm45().for_tools(SCHEMAS)


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_the_served_tool_choices_and_the_refused_ones() -> None:
    assert tool_mode(None, None) == TEXT and tool_mode(TOOLS, "none") == TEXT
    assert tool_mode(TOOLS, "required") == ToolMode("required")
    assert tool_mode(TOOLS, named("now")) == ToolMode("named", "now")
    assert tool_mode(TOOLS, None, Hermes()) == tool_mode(TOOLS, "auto", Hermes()) == ToolMode("auto")
    assert tool_mode(None, "auto") == TEXT  # nothing to call
    for tools, choice, message in [
        (
            TOOLS,
            None,
            'tool_choice "auto" (the default with tools) needs the server started with --tool-call-parser',
        ),
        (
            TOOLS,
            "auto",
            'tool_choice "auto" (the default with tools) needs the server started with --tool-call-parser',
        ),
        (None, "required", "tool_choice needs tools"),
        ([], named("now"), "tool_choice needs tools"),
        (TOOLS, named("later"), "tool_choice names the function 'later', which is not among tools"),
    ]:
        with pytest.raises(ValidationError) as error:
            tool_mode(tools, choice)
        assert str(error.value).startswith(message)


def test_the_constraints_compile_and_describe_the_calls(tokenizer_dir: Path) -> None:
    assert guided_for(TOOLS, TEXT) is None and guided_for(TOOLS, ToolMode("auto")) is None
    weather = guided_for(TOOLS, ToolMode("named", "weather"))
    now = guided_for(TOOLS, ToolMode("named", "now"))
    required = guided_for(TOOLS, ToolMode("required"))
    assert weather is not None and now is not None and required is not None
    assert weather.kind == GuidedKind.JSON_SCHEMA and json.loads(weather.spec) == CITY
    assert json.loads(now.spec) == {"type": "object"}  # a function without a schema takes any object
    schema = json.loads(required.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["weather"], ["now"]]
    assert [o["properties"]["parameters"] for o in options] == [CITY, {"type": "object"}]
    assert "maxItems" not in schema
    single = guided_for(TOOLS, ToolMode("required"), parallel=False)
    assert single is not None and json.loads(single.spec) == {**schema, "maxItems": 1}
    grammars = Grammars((tokenizer_dir / "tokenizer.json").read_text(), 2000, 2)
    for constraint in (weather, now, required, single):
        grammars.check(constraint)


def functions(reading: Reading) -> list[dict] | None:
    return None if reading.calls is None else [c["function"] for c in reading.calls]


def test_the_calls_are_read_back_from_the_answer() -> None:
    named_call = read(ToolMode("named", "weather"), '{"city": "Ro')  # cut: kept as it is
    assert named_call.content is None and named_call.finish is None  # the stop reason's
    (call,) = named_call.calls or []
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Ro'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    required = ToolMode("required")
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    listed = read(required, text)
    assert listed.content is None and listed.finish == "tool_calls"
    assert functions(listed) == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert len({c["id"] for c in listed.calls or []}) == 2
    for broken in ('[{"name": "weather", "param', "[]", '{"name": "now"}', "[1]", '[{"name": 3}]'):
        assert read(required, broken) == Reading(broken), broken
    assert read(TEXT, text) == Reading(text)


HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
)


DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_DONE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
KIMI_CALLS, KIMI_CALL, KIMI_ARGS, KIMI_END, KIMI_DONE = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
FORMAT_CASES = [
    (
        DeepSeekV3(),
        f'Let me look.{DS_CALLS}{DS_CALL}function{DS_SEP}weather\n```json\n{{"city":"Oslo"}}\n```{DS_END}'
        f"{DS_CALL}function{DS_SEP}now\n```json\n{{}}\n```{DS_END}{DS_DONE}",
        "Let me look.",
        [("weather", '{"city": "Oslo"}'), ("now", "{}")],
    ),
    (
        DeepSeekV3(),
        f"{DS_CALLS}{DS_CALL}function{DS_SEP}now\n```json\n{{oops",
        f"{DS_CALLS}{DS_CALL}function{DS_SEP}now\n```json\n{{oops",
        None,
    ),
    (
        DeepSeekV31(),
        f'Sure.{DS_CALLS}{DS_CALL}weather{DS_SEP}{{"city": "Rome", "days": 2}}{DS_END}'
        f"{DS_CALL}now{DS_SEP}{{}}{DS_END}{DS_DONE}",
        "Sure.",
        [("weather", '{"city": "Rome", "days": 2}'), ("now", "{}")],
    ),
    (
        DeepSeekV31(),
        f"{DS_CALLS}{DS_CALL}{DS_SEP}{{}}{DS_END}",
        f"{DS_CALLS}{DS_CALL}{DS_SEP}{{}}{DS_END}",
        None,
    ),
    (
        KimiK2(),
        f'Checking.{KIMI_CALLS}{KIMI_CALL}functions.weather:0{KIMI_ARGS}{{"city": "Oslo"}}{KIMI_END}'
        f"{KIMI_CALL}functions.now:1 {KIMI_ARGS} {{}}{KIMI_END}{KIMI_DONE}",
        "Checking.",
        [("weather", '{"city": "Oslo"}'), ("now", "{}")],
    ),
    (KimiK2(), "no calls <|tool", "no calls <|tool", None),
    (Hermes(), HERMES_TEXT, "Let me check.", [("weather", '{"city": "Oslo"}'), ("now", "{}")]),
    (
        Hermes(),
        'x<tool_call>{"name": "now", "arguments": {}}',
        "x",
        [("now", "{}")],
    ),  # cut after the JSON
    (Hermes(), "no calls here", "no calls here", None),
    (Hermes(), '<tool_call>{"name": "now", "argu', '<tool_call>{"name": "now", "argu', None),
    (
        Hermes(),
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        None,
    ),
    (
        Llama3Json(),
        ' {"name": "weather", "parameters": {"city": "Rome"}}',
        None,
        [("weather", '{"city": "Rome"}')],
    ),
    (
        Llama3Json(),
        '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "arguments": {"a": 1}}',
        None,
        [("now", "{}"), ("now", '{"a": 1}')],
    ),
    (
        Llama3Json(),
        'Hello {"name": "now", "parameters": {}}',
        'Hello {"name": "now", "parameters": {}}',
        None,
    ),
    (
        Llama3Json(),
        '{"name": "now", "parameters": {}} and text',
        '{"name": "now", "parameters": {}} and text',
        None,
    ),
    (
        Pythonic(),
        ' [weather(city="Oslo", days=2, hourly=True), now()]',
        None,
        [("weather", '{"city": "Oslo", "days": 2, "hourly": true}'), ("now", "{}")],
    ),
    (Pythonic(), "[now(at=__import__('os').getcwd())]", "[now(at=__import__('os').getcwd())]", None),
    (Pythonic(), '[weather("Oslo")]', '[weather("Oslo")]', None),  # positional: no name for it
    (Pythonic(), "[now(a={1, 2})]", "[now(a={1, 2})]", None),  # a set is no JSON
    (Pythonic(), "[now(", "[now(", None),
    (Pythonic(), "Sunny [now()]", "Sunny [now()]", None),
    (
        Granite(),
        '<|tool_call|>[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]',
        None,
        [("weather", '{"city": "Oslo"}'), ("now", "{}")],
    ),
    (Granite(), ' <tool_call> [{"name": "now", "arguments": "{}"}]', None, [("now", "{}")]),
    (Granite(), '[{"name": "now", "arguments": {}}]', None, [("now", "{}")]),  # marker skipped
    (Granite(), 'It is [{"name": "now"}]', 'It is [{"name": "now"}]', None),
    (Granite(), "<tool_call>[]", "<tool_call>[]", None),
    (Granite(), '[{"name": "now", "arguments": {}}] ok', '[{"name": "now", "arguments": {}}] ok', None),
    (
        Granite20bFc(),
        'Sure.<function_call> {"name": "weather", "arguments": {"city": "Rome"}} '
        '<function_call> {"name": "now", "arguments": {}}',
        "Sure.",
        [("weather", '{"city": "Rome"}'), ("now", "{}")],
    ),
    (Granite20bFc(), "<function_call> {oops", "<function_call> {oops", None),
    (
        Mistral(),
        'Checking.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}]',
        "Checking.",
        [("weather", '{"city": "Oslo"}')],
    ),  # tokenizers before v11
    (
        Mistral(),
        '[TOOL_CALLS]weather{"city": "Rome"}[TOOL_CALLS]now{}',
        None,
        [("weather", '{"city": "Rome"}'), ("now", "{}")],
    ),  # v11
    (Mistral(), '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', None, [("weather", '{"city": "Oslo"}')]),
    (Mistral(), "[TOOL_CALLS]weather", "[TOOL_CALLS]weather", None),
    (Mistral(), '[TOOL_CALLS]{"city": "Oslo"}', '[TOOL_CALLS]{"city": "Oslo"}', None),  # no name
    (Mistral(), "no calls [TOOL", "no calls [TOOL", None),
    (
        QWEN,
        "Let me check.\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
        "</function>\n</tool_call>",
        "Let me check.",
        [("weather", '{"city": "Oslo", "days": 3}'), ("now", "{}")],
    ),
    (
        QWEN,  # each value as its schema's type makes it; text where it is not of that type
        "<function=typed><parameter=code>\n007\n</parameter><parameter=n>-2</parameter>"
        "<parameter=x>2.5</parameter><parameter=y>1e3</parameter><parameter=flag>True</parameter>"
        '<parameter=obj>{"a": [1]}</parameter><parameter=items>[1, 2]</parameter>'
        "<parameter=gone>null</parameter><parameter=bad>many</parameter><parameter=z>nan</parameter>"
        "<parameter=either>4</parameter><parameter=other>\n  spaced  \n</parameter></function>",
        None,
        [
            (
                "typed",
                '{"code": "007", "n": -2, "x": 2.5, "y": 1000.0, "flag": true, "obj": {"a": [1]}, '
                '"items": [1, 2], "gone": null, "bad": "many", "z": "nan", "either": 4, '
                '"other": "  spaced  "}',
            )
        ],
    ),
    (QWEN, "<tool_call>\n<function=now>", None, [("now", "{}")]),  # cut: what there is
    (QWEN, "plain <tool_call> text", "plain <tool_call> text", None),
    (
        GLM,
        "Let me check.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>now</tool_call>",
        "Let me check.",
        [("weather", '{"city": "Oslo", "days": 3}'), ("now", "{}")],
    ),
    (  # GLM-4.7: no line breaks
        GLM,
        '<tool_call>typed<arg_key>obj</arg_key><arg_value>{"a": [1]}</arg_value>'
        "<arg_key>code</arg_key><arg_value>007</arg_value></tool_call>",
        None,
        [("typed", '{"obj": {"a": [1]}, "code": "007"}')],
    ),
    (GLM, "<tool_call>", "<tool_call>", None),  # no name
    (GLM, "no calls", "no calls", None),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FORMAT_CASES)
def test_each_format_gives_its_calls_and_the_text_around_them(parser, text: str, content, calls) -> None:
    reading = read(ToolMode("auto"), text, parser)
    assert reading.content == content
    if calls is None:
        assert reading.calls is None and reading.finish is None
    else:
        assert functions(reading) == [{"name": n, "arguments": a} for n, a in calls]
        assert reading.finish == "tool_calls"


STREAMED = (
    HERMES_TEXT,
    "plain words <tool",
    '{"name": "now", "parameters": {}}',
    "Hi {x}",
    "[now(a=1)]",
    '<|tool_call|>[{"name": "now", "arguments": {}}]',
    'Sure.<function_call> {"name": "now", "arguments": {}}',
    "Ok[TOOL_CALLS]now{}",
    "text [TOOL_",
    "Sure.\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
    "Bare <function=now></function>",
    "Yes<tool_call>now\n</tool_call>",
)
CALL_MARKS = (
    "<tool_call>",
    '"name"',
    "<|tool_call|>",
    "<function_call>",
    "[TOOL_CALLS]",
    "now{",
    "<function=",
)


@pytest.mark.parametrize(
    "parser",
    [Hermes(), Llama3Json(), Pythonic(), Granite(), Granite20bFc(), Mistral(), Qwen3Coder(), Glm45()],
)
@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_a_streamed_answer_sends_text_as_it_comes_and_no_call_as_text(parser, pieces: int) -> None:
    """Whatever pieces the answer comes in, the content sent as it comes plus the rest at the end
    is the whole answer's content, no part of a call is ever sent as text, and the calls sent
    add up to the whole answer's."""
    for text in STREAMED:
        held = HeldAnswer(ToolMode("auto"), parser)
        sent, deltas = streamed(held, text, pieces)
        end, more = held.end()
        whole = read(ToolMode("auto"), text, parser)
        assert not any(mark in sent for mark in CALL_MARKS) or whole.calls is None
        assert (sent + (end.content or "")).strip() == (whole.content or "").strip()
        assert assembled(deltas + more) == functions(whole) and end.finish == whole.finish


def streamed(held: HeldAnswer, text: str, pieces: int) -> tuple[str, list[dict]]:
    """The content and the call deltas sent while `text` came in pieces of `pieces` characters."""
    content, deltas = "", []
    for i in range(0, len(text), pieces):
        more, calls = held.add(text[i : i + pieces])
        content, deltas = content + more, deltas + calls
    return content, deltas


def assembled(deltas: list[dict]) -> list[dict] | None:
    """The calls OpenAI's call deltas make, as a client puts them together (None: none); each
    call's first delta has its id, type and name, and every later one only its index."""
    calls: list[dict] = []
    for delta in deltas:
        if delta["index"] == len(calls):
            assert delta["id"].startswith("call_") and delta["type"] == "function"
            assert delta["function"]["arguments"] == "" and delta["function"]["name"]
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls or None


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FORMAT_CASES)
@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_each_formats_calls_stream_as_they_are_written(
    parser, text: str, content, calls, pieces: int
) -> None:
    """Each call goes out once its name is whole and its arguments as they settle (the formats
    that can), always adding up to the whole answer's calls; the id of a call stays its own."""
    held = HeldAnswer(ToolMode("auto"), parser)
    sent, deltas = streamed(held, text, pieces)
    end, more = held.end()
    whole = read(ToolMode("auto"), text, parser)
    assert (sent + (end.content or "")).strip() == (content or "").strip() and end.finish == whole.finish
    if whole.calls is None:  # text after all (cut, or more than calls): a call begun stays as sent
        assert not more
        return
    assert assembled(deltas + more) == functions(whole) == [{"name": n, "arguments": a} for n, a in calls]
    ids = [d["id"] for d in deltas + more if "id" in d]
    assert len(set(ids)) == len(calls)
    assert deltas, "the calls began before the answer ended"


def test_a_required_list_is_held_whole_and_the_parsers_are_named() -> None:
    held = HeldAnswer(ToolMode("required"), None)
    text = '[{"name": "now", "parameters": {"a": "bc"}}, {"name": "weather", "parameters": {}}]'
    content, deltas = streamed(held, text, 3)
    end, more = held.end()
    assert content == "" and end.content is None and end.finish == "tool_calls"
    expected = [{"name": "now", "arguments": '{"a": "bc"}'}, {"name": "weather", "arguments": "{}"}]
    assert assembled(deltas) == expected and not more  # the list's calls went out as they came
    assert parser_named(None) is None and isinstance(parser_named("hermes"), Hermes)
    assert isinstance(parser_named("llama3_json"), Llama3Json)
    assert isinstance(parser_named("pythonic"), Pythonic)
    assert isinstance(parser_named("llama4_pythonic"), Pythonic)
    assert isinstance(parser_named("llama4_json"), Llama3Json)
    assert isinstance(parser_named("granite"), Granite) and isinstance(parser_named("mistral"), Mistral)
    assert isinstance(parser_named("granite-20b-fc"), Granite20bFc)
    assert isinstance(parser_named("qwen3_coder"), Qwen3Coder) and isinstance(
        parser_named("qwen3_xml"), Qwen3Coder
    )
    assert isinstance(parser_named("glm45"), Glm45) and isinstance(parser_named("glm47"), Glm45)
    assert isinstance(parser_named("deepseek_v3"), DeepSeekV3) and isinstance(parser_named("kimi_k2"), KimiK2)
    names = (
        "deepseek_v3, deepseek_v31, glm45, glm47, granite, granite-20b-fc, hermes, kimi_k2, llama3_json, "
        "llama4_json, llama4_pythonic, mistral, pythonic, qwen3_coder, qwen3_xml"
    )
    with pytest.raises(ValueError, match=f"unknown tool call parser 'xlam': one of {names}"):
        parser_named("xlam")


def test_the_template_sees_the_tools_and_earlier_calls_with_object_arguments() -> None:
    template = ChatTemplate(
        "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% else %}{{ m.content }}{% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered = template.render([template_message(m) for m in messages], tools=template_tools(TOOLS))
    assert rendered == '[weather][now]user:Weather?;assistant:{"city": "Oslo"}"not json";tool:sunny;'
    assert template.render(messages[:1], tools=template_tools(None)) == "user:Weather?;"
    assert template_tools(TOOLS) == [
        {"type": "function", "function": {"name": "weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "now", "description": "the time"}},
    ]


def test_a_format_of_special_tokens_keeps_them_in_answers_that_may_call() -> None:
    """`mistral`'s [TOOL_CALLS] is a special token: a request that may call keeps the answer's
    special tokens unless it says otherwise (as vLLM sets it); other formats and requests keep
    the server's rule (None)."""
    tools = [t.model_dump() for t in TOOLS]
    messages = [{"role": "user", "content": "hi"}]

    def skip(parser, reasoning=None, **fields) -> bool | None:
        body = ChatRequest.model_validate({"messages": messages, "tools": tools, **fields})
        params = request_params(
            body,
            max_new_tokens=8,
            top_n=0,
            logprobs=False,
            stream=False,
            tool_parser=parser,
            reasoning=reasoning,
        )
        return params.response.skip_special_tokens

    assert skip(Mistral()) is False and skip(Mistral(), tool_choice="auto") is False
    assert skip(Mistral(), skip_special_tokens=True) is True
    assert skip(Mistral(), tool_choice="none") is None and skip(Mistral(), tool_choice="required") is None
    assert skip(Hermes()) is None and skip(Granite()) is None and skip(Glm45()) is False
    assert skip(DeepSeekV3()) is False and skip(DeepSeekV31()) is False and skip(KimiK2()) is False
    # Magistral's [THINK] too, where the answer is read for thinking (a forced call's too: the
    # constraint applies after the thinking)
    assert skip(None, FORMATS["mistral"], tool_choice="none") is False
    assert skip(None, FORMATS["mistral"], tool_choice="required") is False
    assert skip(None, FORMATS["qwen3"], tool_choice="none") is None


@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        (Hermes(), '<tool_call>{"name": "weather", "arguments": {"city":"Os', '{"city": "Os'),
        (Hermes(), '<tool_call>{"arguments": {"days": 12', None),  # no name yet
        (Hermes(), '<tool_call>{"name": "weather", "arguments": {"days": 12', '{"days": '),
        (Llama3Json(), '{"name": "weather", "parameters": {"city": "Ro\\u00e9\\ud83d', '{"city": "Roé'),
        (Mistral(), '[TOOL_CALLS]weather{"city": "Oslo", "d', '{"city": "Oslo", "d'),
        (
            QWEN,
            "<function=weather>\n<parameter=city>\nline one\nline two\n</para",
            '{"city": "line one\\nline two',
        ),
        (QWEN, "<function=weather>\n<parameter=days>\n12", '{"days": '),  # an integer: once whole
        (Pythonic(), '[weather(city="Os', "{"),  # one whole value at a time
        (
            Pythonic(),
            "[weather(city=\"a, (b)\", days=[1, 2], note='it\\'s'",
            '{"city": "a, (b)", "days": [1, 2]',
        ),
        (Pythonic(), '[now(), weather(city="Oslo")', '{"city": "Oslo"}'),
        (
            QWEN,
            "<function=weather>\n<parameter=days>\n12\n</parameter>\n<parameter=city>O",
            '{"days": 12, "city": "O',
        ),
        (GLM, "<tool_call>weather<arg_key>city</arg_key><arg_value>Ber", '{"city": "Ber'),
    ],
)
def test_a_calls_arguments_go_out_as_they_settle(parser, text: str, arguments) -> None:
    """Mid-answer, a call's arguments so far: strings as they come (an escape once whole, a line
    break or the start of a closing tag held back), other values once whole."""
    held = HeldAnswer(ToolMode("auto"), parser)
    _, deltas = streamed(held, text, 1)
    calls = assembled(deltas)
    if arguments is None:
        assert calls is None
    else:
        assert calls is not None and calls[-1]["arguments"] == arguments


def test_a_long_call_is_read_again_as_it_grows_by_a_share_not_at_every_chunk() -> None:
    """Reading an answer's calls reads it whole: past READ_EVERY_CHUNK characters it is read once
    it grew by a sixteenth, so a 25 kB call is read a few hundred times, not six thousand, and
    what goes out still adds up to the whole call."""
    content = 'def f(x):\n    return x * 2  # "quoted" \\ é\n' * 500
    text = f'<tool_call>{{"name": "write", "arguments": {{"content": {json.dumps(content)}}}}}</tool_call>'
    reads = 0

    class Counted(Hermes):
        def partial(self, text: str):
            nonlocal reads
            reads += 1
            return super().partial(text)

    held = HeldAnswer(ToolMode("auto"), Counted())
    _, deltas = streamed(held, text, 4)
    _, more = held.end()
    assert len(text) > 20_000 and reads < 400
    assert assembled(deltas + more) == functions(read(ToolMode("auto"), text, Hermes()))
    assert len(deltas) > 20  # the arguments still went out as they came, in pieces
