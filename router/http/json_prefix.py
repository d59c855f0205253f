"""The settled part of a JSON value still being written, in the form the server answers it in.

A streamed tool call's arguments go out as they are generated, yet the whole call's arguments
are the value re-written by `json.dumps(json.loads(raw), ensure_ascii=False)` (one space after
`:` and `,`, strings re-escaped, numbers as Python writes them). `canonical(raw, start)` reads
one JSON value from `raw[start:]`, which may stop anywhere, and writes what of that form no
later text can change: structure and strings as they come (an escape once whole, a high
surrogate once its low one is there), numbers and words (`true`, `null`, ...) once a character
after them ends them. Written so, each answer is a prefix of the next one's, and the complete
value's is exactly `json.dumps(json.loads(...))` (one exception: a key repeated in an object,
which json.loads keeps once).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
DELIMITERS = WHITESPACE + ',:]}[{"'
PLAIN = re.compile(r'[^"\\]+')
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass(frozen=True, slots=True)
class Prefix:
    """What `canonical` read: the settled text, and where the value ended in `raw` (None: not
    yet, or it is not JSON there)."""

    text: str
    end: int | None


def skip_space(raw: str, at: int) -> int:
    while at < len(raw) and raw[at] in WHITESPACE:
        at += 1
    return at


def canonical(raw: str, start: int = 0) -> Prefix:
    """The settled canonical text of the one JSON value that begins at `raw[start:]` (leading
    whitespace skipped), and its end once it is whole."""
    out: list[str] = []
    stack: list[str] = []  # the open containers' closing brackets
    at = skip_space(raw, start)
    if at >= len(raw):
        return Prefix("", None)
    while at < len(raw):
        char = raw[at]
        if char in WHITESPACE:
            at += 1
            continue
        if char in "{[":
            stack.append("}" if char == "{" else "]")
            out.append(char)
            at += 1
        elif char in "}]":
            if not stack or stack.pop() != char:
                return Prefix("".join(out), None)
            out.append(char)
            at += 1
        elif char in ",:":
            if not stack:
                return Prefix("".join(out), None)
            out.append(char + " ")
            at += 1
        elif char == '"':
            text, at, closed = _string(raw, at)
            out.append(text)
            if not closed:
                return Prefix("".join(out), None)
        else:
            end = at
            while end < len(raw) and raw[end] not in DELIMITERS:
                end += 1
            if end == len(raw):  # a character after it may still make it longer
                return Prefix("".join(out), None)
            try:
                out.append(json.dumps(json.loads(raw[at:end])))
            except ValueError:
                return Prefix("".join(out), None)
            at = end
        if not stack:  # the value is whole
            return Prefix("".join(out), at)
    return Prefix("".join(out), None)


def _string(raw: str, at: int) -> tuple[str, int, bool]:
    """The canonical text of the string that opens at `raw[at]` (its settled part), where reading
    stopped, and whether the string closed."""
    chars: list[str] = []
    at += 1
    while at < len(raw):
        if plain := PLAIN.match(raw, at):  # a run without quotes or escapes, at once
            chars.append(plain.group())
            at = plain.end()
            continue
        char = raw[at]
        if char == '"':
            return json.dumps("".join(chars), ensure_ascii=False), at + 1, True
        code = raw[at + 1 : at + 2]
        if code in ESCAPES:
            chars.append(ESCAPES[code])
            at += 2
            continue
        if code != "u" or at + 6 > len(raw):
            break
        unit = _hex(raw[at + 2 : at + 6])
        if unit is None:
            break
        if 0xD800 <= unit < 0xDC00:  # a high surrogate: one character with the low one after it
            after = raw[at + 6 : at + 8]
            if len(after) < 2 and "\\u".startswith(after):
                break  # cannot tell yet
            if after == "\\u":
                low = _hex(raw[at + 8 : at + 12]) if at + 12 <= len(raw) else None
                if low is None:
                    break
                if 0xDC00 <= low < 0xE000:
                    chars.append(chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)))
                    at += 12
                    continue
        chars.append(chr(unit))
        at += 6
    return json.dumps("".join(chars), ensure_ascii=False)[:-1], at, False


def _hex(digits: str) -> int | None:
    if len(digits) != 4 or any(d not in "0123456789abcdefABCDEF" for d in digits):
        return None
    return int(digits, 16)
