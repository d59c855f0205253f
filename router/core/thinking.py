"""A reasoning model's thinking held to a budget of tokens (vLLM's `thinking_token_budget`,
Anthropic's `thinking.budget_tokens`), and counted (usage's reasoning_tokens).

The served format (REASONING_PARSER, router/http/reasoning.py) says how thinking opens and
closes; here as token ids (`ThinkingMarkers`, tokenized once at start). An answer thinks from its
first token where the chat template opens the thinking (deepseek_r1), else where it begins with
an opening marker. `ThinkingWatch` follows one answer's ids: once it has thought `budget` tokens
(its first ones, the opening marker included) without closing, the batcher ends the thinking for
it: the closing marker's ids are the answer's next tokens (forced, as vLLM forces them), and the
request goes on from them in the shard as a preempted one resumes (generated_ids), so the shard
needs nothing of its own for it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThinkingMarkers:
    """How the served format opens (each of `starts`) and closes (each of `ends`) its thinking,
    as token ids; `opened_by_prompt`: the chat template opens it, the answer starts inside."""

    opened_by_prompt: bool
    starts: tuple[tuple[int, ...], ...]
    ends: tuple[tuple[int, ...], ...]

    @classmethod
    def of(
        cls,
        opened_by_prompt: bool,
        starts: Sequence[str],
        ends: Sequence[str],
        encode: Callable[[Sequence[str]], list[list[int]]],
    ) -> ThinkingMarkers:
        """The markers of a format's `starts` and `ends` text, tokenized by `encode` (without
        special tokens added); a closing marker also as it is tokenized after a space (where
        its first token then differs: a text marker in the middle of a sentence), the plain
        form first (the one forced)."""
        ids = [tuple(i) for i in encode([*starts, *ends, *(f" {end}" for end in ends)])]
        closing = ids[len(starts) :]
        return cls(opened_by_prompt, tuple(ids[: len(starts)]), tuple(dict.fromkeys(closing)))


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """A request's limit on its thinking: `budget` tokens (>= 1) of the served format's; None:
    no limit, its thinking only counted (usage's reasoning_tokens)."""

    budget: int | None
    markers: ThinkingMarkers


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # the answer may still begin with an opening marker
    OPEN = "open"  # thinking
    DONE = "done"  # closed, or the answer does not think


class ThinkingWatch:
    """One answer's thinking as its ids come (`feed`, with all of them each time)."""

    def __init__(self, limit: ThinkingBudget) -> None:
        self.limit = limit
        self.phase = Phase.OPEN if limit.markers.opened_by_prompt else Phase.UNDECIDED
        self.seen = 0  # tokens of the answer so far
        self.thought = 0  # of them, thinking

    def feed(self, ids: Sequence[int]) -> None:
        markers = self.limit.markers
        self.seen = len(ids)
        if self.phase is Phase.UNDECIDED:
            if any(tuple(ids[: len(start)]) == start for start in markers.starts):
                self.phase = Phase.OPEN
            elif not any(start[: len(ids)] == tuple(ids[: len(start)]) for start in markers.starts):
                self.phase = Phase.DONE
        if self.phase is Phase.OPEN:
            self.thought = len(ids)
            if any(len(ids) >= len(end) and tuple(ids[len(ids) - len(end) :]) == end for end in markers.ends):
                self.phase = Phase.DONE

    @property
    def over(self) -> bool:
        """It has thought its budget without closing: its thinking is to be ended now."""
        budget = self.limit.budget
        return budget is not None and self.phase is Phase.OPEN and self.thought >= budget

    @property
    def left(self) -> int | None:
        """Tokens it may still think, where it thinks or may begin to (None: it does not, or
        without limit)."""
        if self.phase is Phase.DONE or self.limit.budget is None:
            return None
        return self.limit.budget - (self.thought if self.phase is Phase.OPEN else self.seen)

    @property
    def closing(self) -> tuple[int, ...]:
        """The ids that end its thinking."""
        return self.limit.markers.ends[0]
