"""Which generated tokens may complete a stop sequence: the shard ends a decode call of several
steps (MAX_DECODE_STEPS) after a step that gives a request one of its own, so that the router,
which finds stop sequences in the decoded text (entry.py), sees that step's tokens at once
instead of after the rest of the call.

A token may complete stop sequence S when S ends inside the token's text for some text before
it: the text contains S, or it starts with a non-empty suffix of S (what came before supplied
the rest). Texts are read as inside a continuation (Detokenizer.token_texts). A token whose
text holds U+FFFD (part of a character, finished by a later token) counts for every stop
sequence with a character outside ASCII; one whose text is unknown or holds NUL (the separator
of the texts searched here) counts for every stop sequence. Missing a token only
costs latency (the router still finds the stop when the call returns, and drops the tokens
after it); an extra one only ends a call early, and an early end is not free: the router and
the shard exchange a call more (at c = 1 on two cores, about 1.5 ms each: a stop sequence ending
in a space, whose call-ending tokens are every token that starts with one, made calls 5x as many
and requests 20-25 % slower). So a set of more than a sixteenth of the vocabulary (at most
MAX_CALL_END_IDS) is not sent: such calls end on stop sequences only when they return.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import OrderedDict
from collections.abc import Sequence

from router.core.detokenizer import REPLACEMENT_CHAR

logger = logging.getLogger(__name__)

MAX_CALL_END_IDS = 4096
VOCABULARY_SHARE = 16  # a set of more than 1 / this of the vocabulary is not sent
MIN_CAP = 16
CACHED_STOP_SETS = 256  # distinct sets of stop sequences remembered (least recently used out)
_SEPARATOR = "\0"


class CallEnds:
    """The call-ending tokens of sets of stop sequences over one vocabulary's texts. `compute`
    only reads what the constructor built (any thread); `ids` and its cache are the event
    loop's."""

    def __init__(self, texts: Sequence[str | None], cap: int | None = None) -> None:
        """`cap`: the most ids a set may have (default: a sixteenth of the vocabulary, at least
        MIN_CAP, at most MAX_CALL_END_IDS)."""
        self.cap = (
            cap if cap is not None else max(MIN_CAP, min(MAX_CALL_END_IDS, len(texts) // VOCABULARY_SHARE))
        )
        always = []
        partial = []
        parts = []
        starts = []
        at = 1  # the joined text starts with a separator
        for token_id, text in enumerate(texts):
            if text is None or _SEPARATOR in text:
                always.append(token_id)
                text = ""
            elif REPLACEMENT_CHAR in text:
                partial.append(token_id)
            starts.append(at)
            parts.append(text)
            at += len(text) + 1
        # every text between separators: one find for S locates the texts that contain S
        self._joined = _SEPARATOR + _SEPARATOR.join(parts) + _SEPARATOR
        self._starts = starts
        # the texts in order: those that start with a suffix of S lie together (one bisection)
        self._order = sorted(range(len(parts)), key=parts.__getitem__)
        self._sorted = [parts[i] for i in self._order]
        self._longest = max(map(len, parts), default=0)  # no text starts with a longer suffix
        self._always = frozenset(always)
        self._partial = frozenset(partial)
        self._cache: OrderedDict[tuple[str, ...], frozenset[int]] = OrderedDict()

    async def ids(self, stop_sequences: Sequence[str]) -> frozenset[int]:
        """The tokens that may complete one of `stop_sequences` (empty: none, or too many): from
        the cache for a set seen lately, else computed off the event loop (a scan of the texts)."""
        key = tuple(stop_sequences)
        if not key:
            return frozenset()
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        found = await asyncio.get_running_loop().run_in_executor(None, self.compute, key)
        self._cache[key] = found
        if len(self._cache) > CACHED_STOP_SETS:
            self._cache.popitem(last=False)
        return found

    def compute(self, stop_sequences: Sequence[str]) -> frozenset[int]:
        """`ids` without the cache: one scan of the texts per stop sequence."""
        if not stop_sequences:
            return frozenset()
        ids = set(self._always)
        if not all(seq.isascii() for seq in stop_sequences):
            ids |= self._partial
        under_cap = len(ids) <= self.cap
        for seq in stop_sequences:
            under_cap = under_cap and (len(seq) > self._longest or self._add_holding(seq, ids))
            under_cap = under_cap and all(self._add_starting(seq[k:], ids) for k in self._suffix_starts(seq))
        if not under_cap:
            logger.debug("stop sequences %r: over %d call-ending tokens", stop_sequences, self.cap)
            return frozenset()
        return frozenset(ids)

    def _suffix_starts(self, seq: str) -> range:
        """Where the proper suffixes of `seq` that a text may start with begin."""
        return range(max(1, len(seq) - self._longest), len(seq))

    def _add_holding(self, seq: str, ids: set[int]) -> bool:
        """Add the texts that contain `seq`; False once `ids` passes the cap."""
        joined, starts = self._joined, self._starts
        at = joined.find(seq)
        while at >= 0:
            ids.add(bisect.bisect_right(starts, at) - 1)  # the text where the match begins
            if len(ids) > self.cap:
                return False
            at = joined.find(seq, at + 1)
        return True

    def _add_starting(self, suffix: str, ids: set[int]) -> bool:
        """Add the texts that start with `suffix`; False once `ids` passes the cap."""
        texts, order = self._sorted, self._order
        at = bisect.bisect_left(texts, suffix)
        while at < len(texts) and texts[at].startswith(suffix):
            ids.add(order[at])
            if len(ids) > self.cap:
                return False
            at += 1
        return True
