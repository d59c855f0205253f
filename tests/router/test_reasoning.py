"""A reasoning model's thinking split from its answer (router/http/reasoning.py): each format's
whole outputs, and streamed ones in any pieces giving the same split."""

from __future__ import annotations

import pytest

from router.http.reasoning import FORMATS, ReasoningStream, reasoning_format, split

R1, QWEN3, GRANITE, MISTRAL = FORMATS["deepseek_r1"], FORMATS["qwen3"], FORMATS["granite"], FORMATS["mistral"]


@pytest.mark.parametrize(
    ("fmt", "text", "thinking", "answer"),
    [
        (R1, "Think a bit.</think>\n\nHello!", "Think a bit.", "\n\nHello!"),
        (R1, "<think>\nThink.</think>Hi", "\nThink.", "Hi"),  # the tag repeated: dropped
        (R1, "Still thinking when cut", "Still thinking when cut", ""),
        (R1, "", "", ""),
        (QWEN3, "<think>\nPlan.\n</think>\n\nAnswer.", "\nPlan.\n", "\n\nAnswer."),
        (QWEN3, "\n<think>x</think>y", "x", "y"),
        (QWEN3, "Answer straight away.", None, "Answer straight away."),  # enable_thinking false
        (QWEN3, "<thin", None, "<thin"),  # a cut output that only looked like the tag
        (QWEN3, "<think>cut while thinking", "cut while thinking", ""),
        (QWEN3, "No tag, then </think> later", None, "No tag, then </think> later"),
        (
            GRANITE,
            "Here is my thought process:\nAdd them.\nHere is my response:\n4",
            "\nAdd them.\n",
            "\n4",
        ),
        (GRANITE, "Here's my thought process: a Here's my response: b", " a ", " b"),
        (GRANITE, "Here is my thought process: x Here's my response: y", " x ", " y"),
        (GRANITE, "4, because 2 + 2.", None, "4, because 2 + 2."),
        (GRANITE, "Here is my", None, "Here is my"),
        (GRANITE, "Here is my thought process: cut", " cut", ""),
        (MISTRAL, "[THINK]Sum.[/THINK]4", "Sum.", "4"),
        (MISTRAL, "4", None, "4"),
    ],
)
def test_each_format_splits_thinking_from_the_answer(fmt, text: str, thinking, answer: str) -> None:
    assert split(fmt, text) == (thinking, answer)


STREAMED = (
    "<think>\nPlan.\n</think>\n\nAnswer <b>.",
    "Think.</think>Hi</think>",
    "Plain <th",
    "  ",
    "Here is my thought process:\nPlan. Here is my\nHere's my response: Answer. Here is my",
    "[THINK]Plan [/THI[/THINK]Answer [",
)


@pytest.mark.parametrize("fmt", [R1, QWEN3, GRANITE, MISTRAL])
@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_a_streamed_output_splits_as_the_whole_one(fmt, size: int) -> None:
    for text in STREAMED:
        stream = ReasoningStream(fmt)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(stream.end())
        thinking, answer = split(fmt, text)
        assert "".join(t for t, _ in pieces) == (thinking or "")
        assert "".join(a for _, a in pieces) == answer
        assert all(end not in t for t, _ in pieces for end in fmt.ends)


def test_the_formats_are_named() -> None:
    assert reasoning_format(None) is None and reasoning_format("qwen3") is QWEN3
    assert reasoning_format("granite") is GRANITE and reasoning_format("mistral") is MISTRAL
    with pytest.raises(
        ValueError,
        match="unknown reasoning parser 'o1': one of deepseek_r1, deepseek_v3, granite, mistral, qwen3",
    ):
        reasoning_format("o1")


def test_a_hybrid_format_reads_thinking_only_where_the_chat_turns_it_on() -> None:
    """deepseek_v3 (DeepSeek-V3.1's hybrid template): a chat thinks where its template variables
    set `thinking: true`, and is then read as deepseek_r1 reads it; the other formats read every
    chat."""
    v3 = reasoning_format("deepseek_v3")
    assert v3 is not None and v3.for_chat(None) is None and v3.for_chat({"thinking": False}) is None
    assert v3.for_chat({"thinking": True}) is v3 and split(v3, "plan</think>answer") == ("plan", "answer")
    assert QWEN3.for_chat(None) is QWEN3 and R1.for_chat({"thinking": False}) is R1
