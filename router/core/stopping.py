"""Stop reasons, their order, and stop-sequence matching on the decoded output (TGIS rules).

Checked after every generated token, first match wins (tgis-api §6):
  1. deadline passed                 -> TIME_LIMIT (even before min_new_tokens)
  2. fewer than min_new_tokens        -> go on
  3. the token is EOS                 -> EOS_TOKEN
  4. max_new_tokens reached           -> TOKEN_LIMIT if the server capped it, else MAX_TOKENS
  5. a stop sequence ends in the text
     that this token added            -> STOP_SEQUENCE (its earliest such occurrence)
Callers: router/core/entry.py.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import IntEnum


class StopReason(IntEnum):
    """fmaas.StopReason, number for number."""

    NOT_FINISHED = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    CANCELLED = 3
    TIME_LIMIT = 4
    STOP_SEQUENCE = 5
    TOKEN_LIMIT = 6
    ERROR = 7

    @property
    def finished(self) -> bool:
        return self is not StopReason.NOT_FINISHED

    @property
    def succeeded(self) -> bool:
        """Finished with an answer for the client (not cancelled, not failed)."""
        return self not in (StopReason.NOT_FINISHED, StopReason.CANCELLED, StopReason.ERROR)


@dataclass(frozen=True, slots=True)
class StopMatch:
    sequence: str
    start: int  # character index of the match in the output
    end: int


def find_stop_sequence(output: str, new_chars: int, stop_sequences: Sequence[str]) -> StopMatch | None:
    """The stop sequence completed by the last `new_chars` characters of `output`.

    Only matches that include at least one new character count (earlier text was checked
    before). Sequences are tried in order; the first that matches wins, at its earliest
    occurrence in the window: the cut a character-by-character check would make, so a token
    that adds several overlapping matches ("   " with the stop "  ") cuts where the stream of
    the same text would. NOTE: TGIS takes the last occurrence (rfind), which cuts overlapping
    matches later than the text's first match. Character matching equals TGIS's byte matching:
    UTF-8 is self-synchronising.
    """
    for seq in stop_sequences:
        start = max(0, len(output) + 1 - new_chars - len(seq))
        at = output.find(seq, start)
        if at >= 0:
            return StopMatch(seq, at, at + len(seq))
    return None


def check_stop(
    *,
    generated: int,
    token_id: int,
    eos_token_ids: Collection[int],
    min_new_tokens: int,
    max_new_tokens: int,
    capped: bool,
    deadline: float | None,
    now: float,
) -> StopReason:
    """Checks 1-4; stop sequences (5) need the decoded text and are the caller's. Each of
    `eos_token_ids` (the model's EOS and its other end-of-sequence ids) is an EOS."""
    if deadline is not None and now > deadline:
        return StopReason.TIME_LIMIT
    if generated < min_new_tokens:
        return StopReason.NOT_FINISHED
    if token_id in eos_token_ids:
        return StopReason.EOS_TOKEN
    if generated >= max_new_tokens:
        return StopReason.TOKEN_LIMIT if capped else StopReason.MAX_TOKENS
    return StopReason.NOT_FINISHED


def held_back(text: str, hold_bytes: int) -> int:
    """How many trailing characters of `text` cover at least `hold_bytes` UTF-8 bytes."""
    if hold_bytes <= 0:
        return 0
    count = covered = 0
    for ch in reversed(text):
        if covered >= hold_bytes:
            break
        covered += len(ch.encode())
        count += 1
    return count
