"""A draft model as speculator (SPECULATOR_NAME naming a causal LM that is not an MLP
speculator): a smaller model of the same vocabulary guesses the next tokens greedily, on a
tgis_native engine of its own (its paged KV cache, C++ decoder stack on CPU, its own block
tables per request).

Per step, for the rows asked (`propose`):
  1. catch up: each row's sequence in the draft holds the K/V of some of its tokens; the longest
     prefix of them that the row's history still starts with is kept (what the target rejected
     is cut off), and one forward writes the rest of the history (at least its last token: a new
     request's whole prompt, else the tokens taken since) -> the first candidate of every row;
  2. k - 1 decode steps of the draft, each candidate fed back -> the next.
The draft's K/V then cover the history and the candidates but the last; the next call keeps what
the target accepted. A row the draft has no room for (its KV cache is full) gets no candidates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from text_generation_server.config import ServerConfig
from text_generation_server.engines.step import greedy_ids
from text_generation_server.engines.tgis_native.runner import StepPiece
from text_generation_server.kv.paged_kv import OutOfBlocks, SequenceKV
from text_generation_server.speculation import Speculator, Target

logger = logging.getLogger(__name__)


def _digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters as its checkpoint holds them, whichever layout its linears took at
    load: a oneDNN-packed or quantized linear keeps its weight as a buffer beside a `weight` of
    shape only (on the meta device), which parameters() does not list."""
    shapes = (getattr(module, "weight", None) for module in model.modules())
    laid_out = sum(
        w.numel()
        for w in shapes
        if isinstance(w, torch.Tensor) and not isinstance(w, torch.nn.Parameter) and w.is_meta
    )
    return laid_out + sum(p.numel() for p in model.parameters())


class DraftSpeculator(Speculator):
    def __init__(self, engine: object, path: Path) -> None:
        from text_generation_server.engines.tgis_native.engine import TgisNativeEngine

        assert isinstance(engine, TgisNativeEngine)
        self.engine = engine
        self.runner = engine.runner
        self.allocations = engine.allocations
        self.max_tokens = engine.context.max_sequence_length
        self.written: dict[int, list[int]] = {}  # request id -> the tokens whose K/V the draft holds
        params = parameter_count(engine.model)
        model_type = getattr(engine.model.config, "model_type", "?")
        self.name = f"draft model {path} ({model_type}, {params / 1e6:.1f} M parameters)"

    @classmethod
    def load(cls, path: Path, config: ServerConfig, target: Target) -> DraftSpeculator:
        """The draft model in `path` on its own tgis_native engine, for `target`; ValueError (one
        line) when it cannot speculate for it."""
        from text_generation_server.engines.tgis_native.engine import TgisNativeEngine

        tokenizer = path / "tokenizer.json"
        theirs = target.tokenizer
        if theirs is not None and tokenizer.is_file() and _digest(tokenizer) != _digest(theirs):
            raise ValueError(
                f"draft model {path} has another tokenizer than the model (tokenizer.json differs)"
            )
        draft_config = dataclasses.replace(
            config,
            model_name=str(path),
            revision=config.speculator_revision,
            dtype=target.dtype_name,
            max_sequence_length=target.max_sequence_length,
            quantize=None,
            speculate=0,
            speculator_name=None,
            speculator_revision=None,
            prefix_caching=False,
            prefix_store_path=None,
            kv_cache_blocks=0,
            cpu_kv_cache_space=0.0,
        )
        try:
            engine = TgisNativeEngine(draft_config)
        except ValueError as exc:
            raise ValueError(f"draft model {path}: {exc}") from None
        if engine.context.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {path} has a vocabulary of {engine.context.vocab_size}, the model's has "
                f"{target.vocab_size}"
            )
        return cls(engine, path)

    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in limits]
        pieces, rows = [], []
        for row, (request, history, limit) in enumerate(zip(requests, histories, limits, strict=True)):
            if limit <= 0:
                continue
            try:
                sequence = self._caught_up(request, history, limit)
            except OutOfBlocks:
                self.release([request])
                continue
            written = self.written[request]
            missing = list(history[len(written) :])
            written += missing
            pieces.append(StepPiece(sequence, missing))
            rows.append(row)
        if not rows:
            return out
        with torch.inference_mode():
            ends: list[int] = []
            for piece in pieces:
                ends.append((ends[-1] if ends else -1) + len(piece.tokens))
            held = {row: piece.kv for row, piece in zip(rows, pieces, strict=True)}
            tokens = greedy_ids(self.runner.forward(pieces, ends)).tolist()
            for row, token in zip(rows, tokens, strict=True):
                out[row].append(token)
            for step in range(1, max(limits[row] for row in rows)):
                rows = [row for row in rows if limits[row] > step]
                sequences = [held[row] for row in rows]
                fed = [out[row][-1] for row in rows]
                tokens = greedy_ids(self.runner.decode(sequences, fed, [None] * len(rows))).tolist()
                for row, last, token in zip(rows, fed, tokens, strict=True):
                    self.written[requests[row]].append(last)
                    out[row].append(token)
        return out

    def _caught_up(self, request: int, history: Sequence[int], limit: int) -> SequenceKV:
        """The request's sequence in the draft, cut back to the longest prefix of what it holds
        that `history` still starts with, short of the history's last token (which the catch-up
        forward feeds, to guess what follows it), with the blocks for the catch-up and `limit` - 1
        candidates fed back reserved (OutOfBlocks: no room for them)."""
        sequence = self.allocations.get(request)
        if sequence is None:
            sequence = self.allocations.open(request, (), self.max_tokens)
            self.written[request] = []
        written = self.written[request]
        keep, most = 0, min(len(written), len(history) - 1)
        while keep < most and written[keep] == history[keep]:
            keep += 1
        del written[keep:]
        sequence.truncate(keep)
        sequence.reserve(len(history) - keep + limit - 1)
        return sequence

    def release(self, request_ids: Iterable[int]) -> None:
        ids = list(request_ids)
        self.allocations.release(ids)
        for request in ids:
            self.written.pop(request, None)
