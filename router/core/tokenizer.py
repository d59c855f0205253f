"""The router's tokenizer: the `tokenizers` library (no torch), used off the event loop.

TokenizerPool owns one tokenizers.Tokenizer (truncation and padding disabled) and the threads
that encode, in lanes (see the class), so a long prompt never blocks the asyncio loop and a
large or Tokenize-RPC job never delays the validation of a generation request. Callers:
validation.py (encode), grpc_server.py (Tokenize), detokenization (vocabulary pieces).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from tokenizers import Tokenizer

from router.core.input_bound import max_token_bytes, utf8_length

TOKENIZER_FILE = "tokenizer.json"
BULK_JOB_BYTES = 64 * 1024  # a job this large runs in the bulk lane
BULK_BUDGET_BYTES = 16 * 1024 * 1024  # text the bulk lane holds at most (four 4 MiB messages)
TOKENIZE_BUDGET_BYTES = 16 * 1024 * 1024  # text the Tokenize lane holds at most
TEXT_OVERHEAD_BYTES = 64  # what one text costs beside its bytes (so many empty texts count too)
TRIM_AFTER_BYTES = 1024 * 1024
TRIM_DELAY_S = 0.5
BUSY_MESSAGE = "Server too busy: too much text is waiting for tokenization"

R = TypeVar("R")


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


class TokenizerError(Exception):
    """The tokenizer failed on this input (its message, or the panic's)."""


def _guarded(job: Callable[..., R], *args: object) -> R:
    """Run a tokenization job; a failure of the Rust tokenizer (pyo3 panics are
    BaseExceptions, not Exceptions) becomes a TokenizerError."""
    try:
        return job(*args)
    except BaseException as exc:
        raise TokenizerError(str(exc) or type(exc).__name__) from exc


class TokenizerBusy(Exception):
    """Too much text is already waiting in the lane this job needs; str() is the client message."""


@dataclass(slots=True)
class _Lane:
    """Worker threads for one kind of job, with an optional cap on the text bytes they hold
    (waiting or running)."""

    executor: ThreadPoolExecutor
    budget_bytes: int | None = None
    held_bytes: int = 0

    def reserve(self, cost: int) -> None:
        if self.budget_bytes is not None and self.held_bytes + cost > self.budget_bytes:
            raise TokenizerBusy(BUSY_MESSAGE)
        self.held_bytes += cost


def job_bytes(texts: Sequence[str]) -> int:
    """What a job costs against a lane's budget: its UTF-8 bytes plus a little per text."""
    return sum(utf8_length(t) + TEXT_OVERHEAD_BYTES for t in texts)


def release_free_memory() -> None:
    """Give memory freed by a large job back to the OS (glibc keeps freed heap pages; one 4 MiB
    prompt otherwise leaves the router ~0.5 GiB larger). A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class TokenizerPool:
    """Tokenization off the event loop, in lanes so that one kind of work never waits behind
    another: `generate` (validation of generation inputs, bounded by the concurrency permits),
    `tokenize` (the Tokenize RPC) and `bulk` (any job of at least BULK_JOB_BYTES, one at a time).
    `tokenize` and `bulk` cap the bytes they hold and refuse more (TokenizerBusy). Jobs run with
    the tokenizer's own parallelism off (`TOKENIZERS_PARALLELISM=false`, set by the router), so a
    large job never occupies the threads a small one needs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        workers: int,
        *,
        tokenize_budget_bytes: int = TOKENIZE_BUDGET_BYTES,
        bulk_budget_bytes: int = BULK_BUDGET_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self._lanes = {
            "generate": _Lane(ThreadPoolExecutor(workers, "tokenizer")),
            "tokenize": _Lane(ThreadPoolExecutor(workers, "tokenize-rpc"), tokenize_budget_bytes),
            "bulk": _Lane(ThreadPoolExecutor(1, "tokenizer-bulk"), bulk_budget_bytes),
        }
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        pieces = [""] * size
        for piece, index in tokenizer.get_vocab(with_added_tokens=True).items():
            if 0 <= index < size:
                pieces[index] = piece
        self._pieces = pieces
        self.max_token_bytes = max_token_bytes(tokenizer)

    def piece(self, token_id: int) -> str:
        """The raw vocabulary piece of a token (`Ġvery`, `▁The`, `</s>`); "" for unknown ids."""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else ""

    def token_text(self, token_id: int) -> str:
        """A token decoded alone, special tokens kept (` very`, `</s>`): the text the HTTP doors
        show per token (gRPC shows the piece, as TGIS does)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def encode_batch_sync(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=special)]

    async def encode_batch(self, texts: Sequence[str], *, special: bool = True) -> list[list[int]]:
        """Token ids of generation inputs (special tokens added), or with `special` false of
        pieces of text (words a request names)."""
        return await self._run("generate", texts, self.encode_batch_sync, texts, special)

    def tokenize_sync(self, texts: Sequence[str], *, tokens: bool, offsets: bool) -> list[TokenizedText]:
        """Ids, and if asked pieces and UTF-8 byte offsets: the Tokenize RPC's work. What is not
        asked for is not built (for a long text each is millions of Python objects); offsets
        need the tokenizer's slower path, pieces come from the vocabulary."""
        texts = list(texts)
        if offsets:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        else:  # its Encodings carry no offsets and no token strings
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=True)
        return [
            TokenizedText(
                e.ids,
                [self.piece(i) for i in e.ids] if tokens else [],
                _byte_offsets(text, e.offsets) if offsets else [],
            )
            for text, e in zip(texts, encodings, strict=True)
        ]

    async def run_tokenize_job(self, texts: Sequence[str], job: Callable[[], R]) -> R:
        """Run `job`, which tokenizes `texts` (and may build its answer), in the Tokenize lane."""
        return await self._run("tokenize", texts, job)

    async def _run(self, kind: str, texts: Sequence[str], job: Callable[..., R], *args: object) -> R:
        cost = job_bytes(texts)
        lane = self._lanes["bulk" if cost >= BULK_JOB_BYTES else kind]
        lane.reserve(cost)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(lane.executor, _guarded, job, *args)
        finally:
            lane.held_bytes -= cost
            if cost >= TRIM_AFTER_BYTES:
                # Later, so that what the caller builds from the result is freed first.
                loop.call_later(TRIM_DELAY_S, self._release_memory)

    def _release_memory(self) -> None:
        with contextlib.suppress(RuntimeError):  # the pool was closed meanwhile
            self._lanes["bulk"].executor.submit(release_free_memory)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.executor.shutdown(wait=False, cancel_futures=True)
