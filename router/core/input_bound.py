"""A lower bound on an input's token count from its length in bytes, without tokenizing it.

Validation uses it to refuse an input that is surely too long before spending seconds and
hundreds of MiB on tokenizing it (a 4 MiB prompt is ~2 M tokens). The bound holds only for
tokenizers whose tokens tile the whole text: a BPE model that covers every byte (byte-level
pre-tokenization or byte fallback), a normalizer and pre-tokenizers that never delete or shrink
text, and no added token that absorbs the whitespace around it. Then every token covers at most
`max_token_bytes` bytes of the (never shorter) normalized text, so an input of B bytes has at
least ceil(B / max_token_bytes) tokens. For any other tokenizer there is no bound (None) and
every input is tokenized.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

BYTE_FALLBACK_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))
# Pre-tokenizers that split text without removing any of it (with a behavior other than
# "Removed" where they have one).
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters a byte-level pre-tokenizer maps bytes to (GPT-2's table)."""
    printable = [b for lo, hi in (("!", "~"), ("¡", "¬"), ("®", "ÿ")) for b in range(ord(lo), ord(hi) + 1)]
    others = [b for b in range(256) if b not in printable]
    return frozenset(chr(b) for b in printable) | frozenset(chr(256 + i) for i in range(len(others)))


def _components(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer / pre-tokenizer node flattened: Sequence nodes give their members."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [c for member in node.get(key, []) for c in _components(member, key)]
    return [node]


def _normalizer_keeps_length(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind in ("Prepend", "ByteLevel"):
        return True
    if kind == "Replace":
        pattern = node.get("pattern", {})
        if "String" not in pattern:
            return False  # a regex may match more bytes than its replacement has
        return len(str(node.get("content", "")).encode()) >= len(str(pattern["String"]).encode())
    return False  # Unicode normalization, lowercasing, stripping, ... may shrink text


def _pre_tokenizer_keeps_text(node: dict[str, Any]) -> bool:
    return node.get("type") in KEEPING_PRE_TOKENIZERS and node.get("behavior") != "Removed"


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most bytes of input one token can stand for, or None when no such bound holds."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    normalizers = _components(spec.get("normalizer"), "normalizers")
    pre_tokenizers = _components(spec.get("pre_tokenizer"), "pretokenizers")
    if not all(_normalizer_keeps_length(n) for n in normalizers):
        return None
    if not all(_pre_tokenizer_keeps_text(p) for p in pre_tokenizers):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token also swallows the whitespace beside it
    vocab = model.get("vocab") or {}
    byte_level = any(c.get("type") == "ByteLevel" for c in normalizers + pre_tokenizers)
    pieces = vocab.keys()
    covers_every_byte = (byte_level and pieces >= _byte_level_alphabet()) or (
        bool(model.get("byte_fallback")) and pieces >= BYTE_FALLBACK_PIECES
    )
    if not covers_every_byte:
        return None  # unknown characters could fold into one unknown token, or vanish
    return max(len(p.encode()) for p in [*pieces, *(str(t.get("content", "")) for t in added)])


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def min_tokens(text: str, token_bytes: int | None) -> int:
    """A lower bound on the tokens of `text` (0 when there is none)."""
    return math.ceil(utf8_length(text) / token_bytes) if token_bytes else 0
