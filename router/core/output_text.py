"""One request's decoded output as it grows, token by token (the text state of entry.py).

Text only grows at the end, and its readers look back from the end: the stop-sequence search
(the new characters and, before them, one character less than the longest stop sequence), the
stream's next message (from the first character not sent yet) and the final answer (all of
it). A str grown with `+=` on an attribute is copied whole at every token, quadratic in the
answer's length (a 32,000-token answer: ~190 ms of the event loop). So the part no reader
looks into again is kept as settled pieces, joined once for the final answer, and the rest as
one short string.
"""

from __future__ import annotations

from router.core.detokenizer import REPLACEMENT_CHAR, IncrementalDecoder
from router.core.stopping import StopMatch, find_stop_sequence, held_back
from router.core.validation import StoppingSpec

# Characters the unsettled tail may reach before its settled part moves to the pieces: long
# enough that answers of a few hundred tokens never settle, short enough to copy in a few µs.
SETTLE_AT = 4096


class OutputText:
    """The text `decoder` makes of a request's generated ids, streamed or not, cut as
    `stopping`'s stop sequences say."""

    __slots__ = (
        "_decoder",
        "_hold_bytes",
        "_look_back",
        "_pieces",
        "_sent",
        "_settled",
        "_stopping",
        "_tail",
    )

    def __init__(self, decoder: IncrementalDecoder, stopping: StoppingSpec, *, streamed: bool) -> None:
        self._decoder = decoder
        self._stopping = stopping
        self._pieces: list[str] = []
        self._settled = 0  # characters in _pieces
        self._tail = ""
        self._sent = 0  # characters already streamed, from the start of the answer
        stops = stopping.stop_sequences
        # characters before the new ones that a stop sequence's match may start in
        self._look_back = max((len(s) for s in stops), default=1) - 1
        # A stream holds back the text a stop-sequence cut could still remove (TGIS: 1 byte when
        # the stop sequence is kept, else the longest stop sequence's bytes); None: not a stream.
        self._hold_bytes: int | None = None
        if streamed:
            longest = max((len(s.encode()) for s in stops), default=0)
            self._hold_bytes = min(1, longest) if stopping.include_stop_sequence else longest

    def push(self, token_id: int) -> int:
        """Decode one more generated id; returns how many characters the text gained."""
        delta = self._decoder.push(token_id)
        self._append(delta)
        return len(delta)

    def flush(self) -> None:
        """The request ended (not on a stop sequence): the decoder's last held-back text."""
        self._append(self._decoder.flush())

    def _append(self, delta: str) -> None:
        if len(self._tail) + len(delta) > SETTLE_AT:
            self._settle()
        self._tail += delta

    def _settle(self) -> None:
        keep_from = len(self._tail) - self._look_back
        if self._hold_bytes is not None:
            keep_from = min(keep_from, self._sent - self._settled)
        if keep_from > 0:
            self._pieces.append(self._tail[:keep_from])
            self._settled += keep_from
            self._tail = self._tail[keep_from:]

    def cut_at_stop(self, new_chars: int) -> StopMatch | None:
        """Find a stop sequence the last `new_chars` characters complete (stopping.py's rule) and
        cut the text after it (include_stop_sequence) or before it."""
        match = find_stop_sequence(self._tail, new_chars, self._stopping.stop_sequences)
        if match is not None:
            self._tail = self._tail[: match.end if self._stopping.include_stop_sequence else match.start]
        return match

    def take_delta(self) -> str:
        """The text a stream may send now, marked sent: what is not sent yet, less the bytes a
        stop-sequence cut could still remove and a trailing run of U+FFFD (the start of a
        character whose other bytes are still to come)."""
        start = self._sent - self._settled
        end = len(self._tail) - held_back(self._tail, self._hold_bytes or 0)
        while end > start and self._tail[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        if end <= start:
            return ""
        self._sent = self._settled + end
        return self._tail[start:end]

    def final(self) -> str:
        """The whole answer without a trailing run of U+FFFD (bytes that never completed)."""
        return ("".join(self._pieces) + self._tail).rstrip(REPLACEMENT_CHAR)

    def final_unsent(self) -> str:
        """What the stream's last message carries: the final answer past what was sent."""
        return self.final()[self._sent :]
