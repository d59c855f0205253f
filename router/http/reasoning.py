"""A reasoning model's thinking, split from its answer: the chat door's `reasoning_content`.

Reasoning models write their thinking between two markers (most: `<think>` and `</think>`),
then the answer. REASONING_PARSER names the served model's way (vLLM's names):
  - `deepseek_r1` (DeepSeek-R1 and its distillations): the chat template opens the thinking in
    the prompt, so the output is thinking up to `</think>` (a leading `<think>` is dropped), then
    the answer; an output without `</think>` is all thinking (cut by max_tokens);
  - `deepseek_v3` (DeepSeek-V3.1 and later, hybrid): as `deepseek_r1` in a chat whose template
    variables set `thinking: true` (its template then opens the thinking), else no thinking;
  - `qwen3` (Qwen3, QwQ): thinking only where the output opens it with `<think>`; an output that
    does not (`enable_thinking: false`) is all answer;
  - `granite` (IBM Granite 3.2+ with `thinking: true`): as `qwen3`, between `Here is my thought
    process:` and `Here is my response:` (or `Here's ...`, which some builds write);
  - `mistral` (Magistral): as `qwen3`, between `[THINK]` and `[/THINK]`, which are special tokens,
    so the chat's answers keep their special tokens unless the request sets skip_special_tokens.
The answer then goes on as a chat's text does (stop sequences, tool calls); a constraint
(guided decoding, a forced call) applies to the answer after the thinking (messages.Guided's
after_thinking, composed into one grammar in text_generation_common/guided.py). Streamed, thinking
and answer go out as they come, less the end of the text that may still become a marker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.http.tool_parsers import held_prefix

THINK = ("<think>",), ("</think>",)


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    opened_by_prompt: bool  # the template opens the thinking: the output starts inside it
    starts: tuple[str, ...] = THINK[0]  # what opens the thinking (any of them)
    ends: tuple[str, ...] = THINK[1]  # what closes it
    needs_special_tokens: bool = False  # the markers are special tokens
    # a chat template variable that turns the model's thinking on (DeepSeek-V3.1's `thinking`):
    # a chat without it true does not think; None: every chat is read for thinking
    switch: str | None = None

    def for_chat(self, variables: Mapping[str, Any] | None) -> ReasoningFormat | None:
        """The format a chat with these template variables is read in (None: it does not think)."""
        if self.switch is None or (variables or {}).get(self.switch) is True:
            return self
        return None

    def start_in(self, text: str) -> str | None:
        """The start marker `text` begins with, if any."""
        return next((s for s in self.starts if text.startswith(s)), None)

    def first_end(self, text: str) -> tuple[int, str] | None:
        """Where the first end marker in `text` is, and which."""
        found = [(at, end) for end in self.ends if (at := text.find(end)) >= 0]
        return min(found) if found else None


GRANITE_MARKERS = (
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)
FORMATS = {
    f.name: f
    for f in (
        ReasoningFormat("deepseek_r1", True),
        ReasoningFormat("deepseek_v3", True, switch="thinking"),
        ReasoningFormat("qwen3", False),
        ReasoningFormat("granite", False, *GRANITE_MARKERS),
        ReasoningFormat("mistral", False, ("[THINK]",), ("[/THINK]",), needs_special_tokens=True),
    )
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format REASONING_PARSER names (None: none); ValueError for an unknown name."""
    if not name:
        return None
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def split(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """A whole output as (thinking, answer); thinking None where there was none."""
    stream = ReasoningStream(fmt)
    thinking, answer = stream.feed(text)
    more_thinking, more_answer = stream.end()
    thinking += more_thinking
    return (thinking if stream.thought else None), answer + more_answer


@dataclass
class ReasoningStream:
    """One streamed output, split as it comes."""

    fmt: ReasoningFormat
    # "open?" (a leading <think> may still come), "thinking", "answer"
    phase: str = "open?"
    pending: str = ""  # text held back: it may still become a tag
    thought: bool = field(init=False)  # some of the output is thinking

    def __post_init__(self) -> None:
        self.thought = self.fmt.opened_by_prompt

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) to send now, of the output grown by `text`."""
        self.pending += text
        thinking = ""
        if self.phase == "open?":
            stripped = self.pending.lstrip()
            if (start := self.fmt.start_in(stripped)) is not None:
                self.pending, self.phase, self.thought = stripped[len(start) :], "thinking", True
            elif any(s.startswith(stripped) for s in self.fmt.starts):
                return "", ""  # blank so far, or the start of a marker
            else:
                self.phase = "thinking" if self.fmt.opened_by_prompt else "answer"
        if self.phase == "thinking":
            found = self.fmt.first_end(self.pending)
            if found is None:
                held = max(held_prefix(self.pending, end) for end in self.fmt.ends)
                cut = len(self.pending) - held
                thinking, self.pending = self.pending[:cut], self.pending[cut:]
                return thinking, ""
            at, end = found
            thinking, self.pending = self.pending[:at], self.pending[at + len(end) :]
            self.phase = "answer"
        answer, self.pending = self.pending, ""
        return thinking, answer

    def end(self) -> tuple[str, str]:
        """(thinking, answer) held back until the output's end."""
        rest, self.pending = self.pending, ""
        thinking = self.phase == "thinking" or (self.phase == "open?" and self.fmt.opened_by_prompt)
        return (rest, "") if thinking else ("", rest)
