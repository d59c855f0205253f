"""Generated token ids -> text for the router, for every common tokenizer family (TGIS decoder.rs).

Owns the decoding rules of tgis-internals §7 on top of the `tokenizers` library (never torch or
transformers). The router builds one `Detokenizer` per model from its tokenizers.Tokenizer and
shares it across all requests; it decodes whole continuations for unary answers (`decode`) and
hands out one `IncrementalDecoder` per request for streaming and stop-sequence matching (`push`
for every generated token except a final EOS, then `flush`). Callers: router/server.py builds it,
router/scheduling/batcher.py passes it on, router/core/entry.py decodes each request's tokens.

Central invariant, for every id sequence and both modes:

    "".join(d.push(t) for t in ids) + d.flush() == detok.decode(ids)

so a push never returns a partial UTF-8 character or any text that later tokens could change.

Strategy, picked once from the tokenizer's JSON "decoder" (members of a Sequence inspected):

| decoder                                  | decode of a continuation          | incremental window        |
|------------------------------------------|-----------------------------------|---------------------------|
| ByteLevel, CTC, Replace, Fuse, ByteFall. | plain                             | plain                     |
| Metaspace, WordPiece, none (" "-joined), | placeholder token prepended, its  | placeholder prepended     |
| Strip after Fuse (Llama's Sequence)      | text stripped (plain for seq2seq) | (plain for a seq2seq      |
|                                          |                                   | window at the first id)   |
| BPEDecoder ("</w>" suffix)               | plain                             | last real token held back,|
|                                          |                                   | placeholder appended      |
| anything else                            | ValueError("Unsupported tokenizer type: ...")                 |

Incremental decoding is the prefix-offset / read-offset technique: the decoder keeps a window of
ids whose first `read` ids are already returned, decodes window[:read] and window[:end], returns
the difference when the text grew and does not end in U+FFFD, then drops the ids before the old
read offset. Each push costs O(window), never O(history). On top of that, a run of <0xNN>
byte-fallback tokens is held until a non-byte token closes it: `tokenizers` turns the whole run
into U+FFFDs when any byte in it is invalid, so an early valid character could still change.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# TGIS: the first id of encode("A") stands in for the prompt; the others are fallbacks.
PLACEHOLDER_TEXTS = ("A", "a", "x", "0", ".")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Per-id classes for the incremental decoder.
_REAL, _TRANSPARENT, _BYTE = 0, 1, 2  # _TRANSPARENT: never reaches the decoder (skipped special)


@dataclass(frozen=True, slots=True)
class DecoderTraits:
    """What a tokenizer's decoder does beyond concatenating per-token texts."""

    first_token_differs: bool = False  # the first token decodes differently: prepend a placeholder
    last_token_differs: bool = False  # the last token decodes differently: hold it back
    byte_runs: bool = False  # consecutive <0xNN> tokens decode as one unit (ByteFallback)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"Unsupported tokenizer type: {what}")


def _member_names(members: Sequence[dict[str, Any]]) -> str:
    return "Sequence[" + ", ".join(str(m.get("type")) for m in members) + "]"


# NOTE(detok): each rule gets (member JSON, fused) where `fused` means an earlier member joined
# all tokens into one string, and returns (traits to add, fuses). A rule raises when the member
# would make a window's text depend on tokens outside it.
_Rule = Callable[[dict[str, Any], bool], tuple[DecoderTraits, bool]]


def _rule_byte_level(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    return DecoderTraits(), True


def _rule_fuse(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    return DecoderTraits(), True


def _rule_metaspace(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    return DecoderTraits(first_token_differs=True), fused


def _rule_wordpiece(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    if fused:  # its cleanup would then rewrite text across token boundaries
        raise _unsupported("WordPiece decoder after Fuse")
    return DecoderTraits(first_token_differs=True), False


def _rule_byte_fallback(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    if fused:
        raise _unsupported("ByteFallback decoder after Fuse")
    return DecoderTraits(byte_runs=True), False


def _rule_replace(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    pattern = member.get("pattern", {})
    if fused and not (isinstance(pattern.get("String"), str) and len(pattern["String"]) == 1):
        raise _unsupported(f"Replace decoder of {pattern} after Fuse")
    return DecoderTraits(), fused


def _rule_strip(member: dict[str, Any], fused: bool) -> tuple[DecoderTraits, bool]:
    # NOTE(detok): tokenizers 0.23 panics (PanicException, not an Exception) when a Strip with
    # stop > 0 meets an empty token, e.g. an all-special continuation: refuse it up front.
    if member.get("stop", 0) > 0:
        raise _unsupported("Strip decoder with stop > 0")
    # Before Fuse it strips every token alike; after Fuse only the start of the whole text.
    return DecoderTraits(first_token_differs=fused and member.get("start", 0) > 0), fused


_SEQUENCE_RULES: dict[str, _Rule] = {
    "ByteLevel": _rule_byte_level,
    "Fuse": _rule_fuse,
    "Metaspace": _rule_metaspace,
    "WordPiece": _rule_wordpiece,
    "ByteFallback": _rule_byte_fallback,
    "Replace": _rule_replace,
    "Strip": _rule_strip,
}


def _classify_sequence(members: Sequence[dict[str, Any]]) -> DecoderTraits:
    fused = False
    first = runs = False
    for member in members:
        rule = _SEQUENCE_RULES.get(str(member.get("type")))
        if rule is None:
            raise _unsupported(f"{member.get('type')} decoder in {_member_names(members)}")
        traits, fused = rule(member, fused)
        first, runs = first or traits.first_token_differs, runs or traits.byte_runs
    return DecoderTraits(first_token_differs=first, byte_runs=runs)


def classify_decoder(decoder: dict[str, Any] | None) -> DecoderTraits:
    """Traits of a tokenizer JSON "decoder" entry; ValueError when it cannot be decoded exactly."""
    if decoder is None:  # tokens are joined with " ": the first one has no leading space
        return DecoderTraits(first_token_differs=True)
    kind = decoder.get("type")
    if kind == "Sequence":
        return _classify_sequence(decoder.get("decoders") or [])
    if kind == "BPEDecoder":  # suffix -> " " except on the last token
        return DecoderTraits(last_token_differs=True)
    if kind == "CTC":  # per-token, plus dedup against the previous token (kept in the window)
        return DecoderTraits()
    if kind in _SEQUENCE_RULES:
        return _classify_sequence([decoder])
    raise _unsupported(str(kind))


class Detokenizer:
    """Decodes generated continuations for one tokenizer; shared by all requests (thread-safe, no
    per-request state)."""

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, seq2seq: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._seq2seq = seq2seq
        self._twin: Detokenizer | None = None  # the other special-token rule (variant)
        self.traits = classify_decoder(json.loads(tokenizer.to_str()).get("decoder"))
        self._classes = self._id_classes()
        self._placeholder, self._placeholder_text = self._pick_placeholder()
        logger.debug(
            "detokenizer: %s, placeholder %d (%r), seq2seq=%s, skip_special_tokens=%s",
            self.traits,
            self._placeholder,
            self._placeholder_text,
            seq2seq,
            skip_special_tokens,
        )

    def variant(self, skip_special_tokens: bool | None) -> Detokenizer:
        """This detokenizer, or its twin (made once) for a request that asks for the other rule
        about special tokens (None: the server's)."""
        if skip_special_tokens is None or skip_special_tokens == self._skip_special:
            return self
        if self._twin is None:
            twin = Detokenizer(
                self._tokenizer, skip_special_tokens=skip_special_tokens, seq2seq=self._seq2seq
            )
            twin._twin = self
            self._twin = twin
        return self._twin

    def decode(self, ids: Sequence[int]) -> str:
        """Full decode of a generated continuation (the ids that follow the prompt), trailing U+FFFD
        trimmed."""
        return self._window_text(list(ids), at_start=True, final=True).rstrip(REPLACEMENT_CHAR)

    def incremental(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def token_texts(self) -> list[str | None] | None:
        """Every id's text as it reads inside a continuation, after other text ("" for ids that
        decode to nothing, None where the placeholder did not survive: unknown); None for all
        where a token's text depends on the token after it (last_token_differs)."""
        if self.traits.last_token_differs:
            return None
        ids = range(len(self._classes))
        skip = self._skip_special
        if not self.traits.first_token_differs:
            return list(self._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=skip))
        texts = self._tokenizer.decode_batch([[self._placeholder, i] for i in ids], skip_special_tokens=skip)
        return [self._after_placeholder(text) for text in texts]

    def _id_class(self, token_id: int) -> int:
        """_REAL, _TRANSPARENT (skipped special or unknown id: `tokenizers` drops it) or _BYTE."""
        return self._classes[token_id] if 0 <= token_id < len(self._classes) else _TRANSPARENT

    def _window_text(self, ids: list[int], *, at_start: bool, final: bool) -> str:
        """Text of `ids` as they read inside the continuation.

        `at_start`: ids[0] is the first generated id. `final`: ids end the continuation; otherwise
        (last_token_differs) their last token is decoded as if more followed.
        """
        if self.traits.last_token_differs and not final:
            return self._decode_before_placeholder(ids)
        if self.traits.first_token_differs and not (at_start and self._seq2seq):
            return self._decode_after_placeholder(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_after_placeholder(self, ids: list[int]) -> str:
        text = self._tokenizer.decode([self._placeholder, *ids], skip_special_tokens=self._skip_special)
        after = self._after_placeholder(text)
        if after is None:
            raise RuntimeError(f"decoded text {text[:32]!r} lost the placeholder {self._placeholder_text!r}")
        return after

    def _after_placeholder(self, text: str) -> str | None:
        """The text decoded after the placeholder (None: the placeholder did not survive)."""
        head = self._placeholder_text
        return text[len(head) :] if text.startswith(head) else None

    def _decode_before_placeholder(self, ids: list[int]) -> str:
        text = self._tokenizer.decode([*ids, self._placeholder], skip_special_tokens=self._skip_special)
        if not text.endswith(self._placeholder_text):
            raise RuntimeError(f"decoded text {text[-32:]!r} lost the placeholder {self._placeholder_text!r}")
        return text[: len(text) - len(self._placeholder_text)]

    def _id_classes(self) -> bytearray:
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        size = max([self._tokenizer.get_vocab_size(with_added_tokens=True), *(i + 1 for i in vocab.values())])
        classes = bytearray([_TRANSPARENT]) * size  # ids missing from the vocabulary decode to nothing
        for token_id in vocab.values():
            classes[token_id] = _REAL
        if self._skip_special:
            for token_id, added in self._tokenizer.get_added_tokens_decoder().items():
                if added.special and token_id < len(classes):
                    classes[token_id] = _TRANSPARENT
        if self.traits.byte_runs:
            for token, token_id in vocab.items():
                if classes[token_id] == _REAL and _BYTE_TOKEN.fullmatch(token):
                    classes[token_id] = _BYTE
        return classes

    def _pick_placeholder(self) -> tuple[int, str]:
        """TGIS's placeholder is the first id of encode("A"); take the first plain token with text of
        its own from encoding "A" (or a fallback text, for vocabularies without it)."""
        added = self._tokenizer.get_added_tokens_decoder()
        for sample in PLACEHOLDER_TEXTS:
            for token_id in self._tokenizer.encode(sample, add_special_tokens=False).ids:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
                if text and token_id not in added and self._id_class(token_id) == _REAL:
                    return token_id, text
        if self.traits.first_token_differs or self.traits.last_token_differs:
            raise _unsupported(f"no placeholder token: none of {PLACEHOLDER_TEXTS} encodes to a plain token")
        return -1, ""  # never used: plain decoding only


class IncrementalDecoder:
    """Per-request streaming state: a window of ids over the continuation (not thread-safe).

    continuation ids  ... | w[0] ... w[read-1] | w[read] ... w[end-1] | held ... |
                           ^ prefix offset      ^ read offset          ^ end of what may be returned
    """

    __slots__ = (
        "_at_start",
        "_detok",
        "_finished",
        "_ids",
        "_last_real",
        "_prefix_text",
        "_read",
        "_run_start",
    )

    def __init__(self, detokenizer: Detokenizer) -> None:
        self._detok = detokenizer
        self._ids: list[int] = []  # the window; earlier ids are dropped
        self._read = 0  # text of _ids[:_read] has been returned
        self._at_start = True  # _ids[0] is the first id of the continuation
        self._last_real = -1  # window index of the last id that reaches the decoder
        self._run_start = -1  # window index where an open <0xNN> run began, -1 if none
        self._prefix_text: str | None = None  # cached window text of _ids[:_read]
        self._finished = False

    def push(self, token_id: int) -> str:
        """Text that this token makes certain: never a partial UTF-8 character, never a trailing
        U+FFFD."""
        if self._finished:
            raise RuntimeError("push() after flush()")
        self._append(token_id)
        end = self._safe_end()
        if end <= self._read:
            return ""
        prefix_text = self._prefix()
        new_text = self._detok._window_text(self._ids[:end], at_start=self._at_start, final=False)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance(end)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete byte sequence at the end), trailing U+FFFD
        trimmed."""
        if self._finished:
            return ""
        self._finished = True
        prefix_text = self._prefix()
        text = self._detok._window_text(self._ids, at_start=self._at_start, final=True)
        return text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)

    def _append(self, token_id: int) -> None:
        id_class = self._detok._id_class(token_id)
        self._ids.append(token_id)
        if id_class == _TRANSPARENT:
            return
        self._last_real = len(self._ids) - 1
        if id_class != _BYTE:
            self._run_start = -1
        elif self._run_start < 0:
            self._run_start = self._last_real

    def _safe_end(self) -> int:
        """Window index up to which text cannot change any more (exclusive)."""
        end = len(self._ids)
        if self._detok.traits.last_token_differs:
            end = max(self._last_real, 0)
        if self._run_start >= 0:
            end = min(end, self._run_start)
        return end

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._detok._window_text(
                self._ids[: self._read], at_start=self._at_start, final=False
            )
        return self._prefix_text

    def _advance(self, end: int) -> None:
        """Text up to `end` was returned: the old read offset becomes the window start."""
        shift = self._read
        if shift:
            del self._ids[:shift]
            self._at_start = False
            self._last_real = max(self._last_real - shift, -1)
            if self._run_start >= 0:
                self._run_start -= shift
        self._read = end - shift
        self._prefix_text = None
