"""The router's tokenizer: the `tokenizers` library (no torch), used off the event loop.

TokenizerPool owns one tokenizers.Tokenizer (truncation and padding disabled) and a thread pool
for encoding, so a long prompt never blocks the asyncio loop. Callers: validation.py (encode),
grpc_server.py (Tokenize), batcher/detokenization (vocabulary pieces).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str) -> Tokenizer:
    """Load tokenizer.json from a directory (or the file itself), without truncation/padding."""
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No existing fast tokenizer ({TOKENIZER_FILE}) found in {path}")
    tokenizer = Tokenizer.from_file(file)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclass(frozen=True, slots=True)
class TokenizedText:
    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]  # UTF-8 byte offsets; (0, 0) for added special tokens


def _byte_offsets(text: str, char_offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets -> UTF-8 byte offsets (TGIS reports bytes). Tokens the post-processor
    adds (BOS, EOS) have (0, 0) either way."""
    if text.isascii():
        return list(char_offsets)
    cumulative = [0]
    for ch in text:
        cumulative.append(cumulative[-1] + len(ch.encode()))
    return [(cumulative[s], cumulative[e]) for s, e in char_offsets]


class TokenizerPool:
    def __init__(self, tokenizer: Tokenizer, workers: int) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer")
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        pieces = [""] * size
        for piece, index in tokenizer.get_vocab(with_added_tokens=True).items():
            if 0 <= index < size:
                pieces[index] = piece
        self._pieces = pieces

    def piece(self, token_id: int) -> str:
        """The raw vocabulary piece of a token (`Ġvery`, `▁The`, `</s>`); "" for unknown ids."""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else ""

    def encode_batch_sync(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    async def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_batch_sync, texts)

    def _tokenize_sync(self, texts: Sequence[str]) -> list[TokenizedText]:
        out = []
        for text, enc in zip(
            texts, self.tokenizer.encode_batch(list(texts), add_special_tokens=True), strict=True
        ):
            out.append(TokenizedText(enc.ids, enc.tokens, _byte_offsets(text, enc.offsets)))
        return out

    async def tokenize(self, texts: Sequence[str]) -> list[TokenizedText]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._tokenize_sync, texts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
