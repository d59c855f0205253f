"""A reasoning model's thinking, split from its answer: the chat door's `reasoning_content`.

Reasoning models write their thinking between `<think>` and `</think>`, then the answer.
REASONING_PARSER names the served model's way (vLLM's names):
  - `deepseek_r1` (DeepSeek-R1 and its distillations): the chat template opens the thinking in
    the prompt, so the output is thinking up to `</think>` (a leading `<think>` is dropped), then
    the answer; an output without `</think>` is all thinking (cut by max_tokens);
  - `qwen3` (Qwen3, QwQ): thinking only where the output opens it with `<think>`; an output that
    does not (`enable_thinking: false`) is all answer.
The answer then goes on as a chat's text does (stop sequences, tool calls). Streamed, thinking
and answer go out as they come, less the end of the text that may still become a tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.http.tool_parsers import held_prefix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    opened_by_prompt: bool  # the template opens the thinking: the output starts inside it


FORMATS = {f.name: f for f in (ReasoningFormat("deepseek_r1", True), ReasoningFormat("qwen3", False))}


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
            if stripped.startswith(START):
                self.pending, self.phase, self.thought = stripped[len(START) :], "thinking", True
            elif START.startswith(stripped):
                return "", ""  # blank so far, or the start of the tag
            else:
                self.phase = "thinking" if self.fmt.opened_by_prompt else "answer"
        if self.phase == "thinking":
            at = self.pending.find(END)
            if at < 0:
                cut = len(self.pending) - held_prefix(self.pending, END)
                thinking, self.pending = self.pending[:cut], self.pending[cut:]
                return thinking, ""
            thinking, self.pending = self.pending[:at], self.pending[at + len(END) :]
            self.phase = "answer"
        answer, self.pending = self.pending, ""
        return thinking, answer

    def end(self) -> tuple[str, str]:
        """(thinking, answer) held back until the output's end."""
        rest, self.pending = self.pending, ""
        thinking = self.phase == "thinking" or (self.phase == "open?" and self.fmt.opened_by_prompt)
        return (rest, "") if thinking else ("", rest)
