"""Prompts of exact token lengths, the same for every server of a run.

A prompt is text that the model's own tokenizer (tokenizer.json, special tokens included) turns
into exactly `input_len` ids; its ids are kept too, for clients that send token ids. Text is
built from random vocabulary pieces (printable, no special tokens), then re-tokenized and cut at a
token boundary or extended until the count is exact — so a server that tokenizes the text sees
the same length as one that receives the ids. The gRPC client also sends
`truncate_input_tokens = input_len`, which is then a no-op.

Workloads (`build_workload`):
  fixed          every prompt input_len in / output_len out (the primary 128/128 shape)
  mixed          lengths drawn uniformly from [len·(1−r), len·(1+r)], r = range_ratio
  shared-prefix  prompts of input_len whose first prefix_len tokens are one of num_prefixes
                 common prefixes (prefix caches can reuse them)
  code           every prompt input_len in / output_len out, cut from a source file of this
                 Python's standard library (the files reference_training.py holds out) at a
                 line start: code completion, whose outputs may repeat their prompts (n-gram
                 speculation's case)
  long-prompt-mix  `streams` decode streams of input_len in / output_len out, and `long_count`
                 long prompts of long_len in / long_output_len out sent while they decode
                 (`build_long_mix`; driven by longmix.py, not by the closed loop)

Only the `tokenizers` library is used (no torch), so the load generator stays light.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.reference_training import held_out_files

WORKLOADS = ("fixed", "mixed", "shared-prefix", "code", "long-prompt-mix")
LONG_MIX = "long-prompt-mix"
DEFAULT_OUTPUT_LEN = {LONG_MIX: 256}  # the others: 128
MAX_FIX_STEPS = 400


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    ids: tuple[int, ...]  # the tokenizer's ids for `text`, special tokens included
    output_len: int
    adapter_id: str = ""  # the adapter this request names (long-prompt-mix with long_adapters)

    @property
    def input_len(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: str = "fixed"
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.5  # mixed
    prefix_len: int = 0  # shared-prefix; 0 = input_len // 2
    num_prefixes: int = 1  # shared-prefix
    seed: int = 0
    streams: int = 16  # long-prompt-mix: concurrent decode streams (input_len / output_len)
    long_len: int = 2048  # long-prompt-mix: tokens of each long prompt
    long_count: int = 4  # long-prompt-mix: long prompts per run
    long_output_len: int = 16  # long-prompt-mix: tokens each long prompt generates
    long_interval_s: float = 0.5  # long-prompt-mix: seconds between long prompts
    long_adapters: bool = False  # long-prompt-mix: each measured long prompt names an adapter not loaded yet

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {', '.join(WORKLOADS)}")
        if self.input_len < 2 or self.output_len < 1:
            raise ValueError("input length must be >= 2 and output length >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")
        if self.num_prefixes < 1:
            raise ValueError("num_prefixes must be >= 1")
        if self.kind == LONG_MIX:
            if self.streams < 1 or self.long_count < 1:
                raise ValueError("long-prompt-mix needs at least one stream and one long prompt")
            if self.long_len < 2 or self.long_output_len < 1:
                raise ValueError("long prompts need >= 2 input tokens and >= 1 output token")
            if self.long_interval_s < 0:
                raise ValueError(f"long interval must be >= 0 s, got {self.long_interval_s}")

    @property
    def shared_prefix_len(self) -> int:
        return self.prefix_len or self.input_len // 2

    def describe(self) -> str:
        base = f"{self.kind} {self.input_len} in / {self.output_len} out"
        if self.kind == "mixed":
            return f"{base} (±{self.range_ratio:.0%})"
        if self.kind == "shared-prefix":
            return f"{base} ({self.num_prefixes} prefix(es) of {self.shared_prefix_len} tokens)"
        if self.kind == "code":
            return f"{base} (standard-library source)"
        if self.kind == LONG_MIX:
            return (
                f"{self.kind}: {self.streams} streams of {self.input_len} in / {self.output_len} out, "
                f"{self.long_count} long prompts of {self.long_len} in / {self.long_output_len} out "
                f"every {self.long_interval_s:g} s while they decode"
                + (", each naming an adapter not loaded yet" if self.long_adapters else "")
            )
        return base

    def max_total_len(self) -> int:
        """The most tokens (input + output) one request of this workload holds."""
        if self.kind == "mixed":
            return round(self.input_len * (1 + self.range_ratio)) + round(
                self.output_len * (1 + self.range_ratio)
            )
        total = self.input_len + self.output_len
        if self.kind == LONG_MIX:
            total = max(total, self.long_len + self.long_output_len)
        return total


class PromptMaker:
    """Random text of an exact token count under one model's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (needed for exact prompt lengths)")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.special_count = len(self.tokenizer.encode("").ids)
        self.pieces = self._clean_pieces()
        self._sources: list[str] | None = None  # the code workload's files, read when first asked

    def _clean_pieces(self) -> list[str]:
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        pieces = []
        for token_id in range(vocab):
            piece = self.tokenizer.decode([token_id], skip_special_tokens=True)
            if piece and piece not in specials and piece.isprintable() and "\ufffd" not in piece:
                pieces.append(piece)
        if len(pieces) < 16:
            raise RuntimeError(f"the tokenizer has only {len(pieces)} printable pieces")
        return pieces

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def exact(self, n: int, rng: random.Random, head: str = "", head_ids: tuple[int, ...] = ()) -> Prompt:
        """Text of exactly `n` tokens that starts with `head` (whose ids must stay `head_ids`)."""
        if n <= self.special_count:
            raise ValueError(f"a prompt needs more than {self.special_count} token(s), asked for {n}")
        text = head
        for _ in range(MAX_FIX_STEPS):
            encoding = self.tokenizer.encode(text)
            ids = encoding.ids
            if len(ids) == n and tuple(ids[: len(head_ids)]) == head_ids:
                return Prompt(text, tuple(ids), 0)
            if len(ids) < n or tuple(ids[: len(head_ids)]) != head_ids:
                if tuple(ids[: len(head_ids)]) != head_ids:
                    text = head  # the tail merged into the head: start the tail again
                    missing = n - len(head_ids)
                else:
                    missing = n - len(ids)
                text += "".join(rng.choice(self.pieces) for _ in range(missing))
                continue
            end = encoding.offsets[n - 1][1]  # cut after token n (a token boundary)
            cut = text[:end] if len(head) < end < len(text) else text[:-1]
            text = cut if len(cut) > len(head) else head
        raise RuntimeError(f"could not make a prompt of exactly {n} tokens")

    def code(self, n: int, rng: random.Random) -> Prompt:
        """`n` tokens of standard-library source from a random line of a random held-out file."""
        if self._sources is None:
            self._sources = [Path(f).read_text(encoding="utf-8", errors="replace") for f in held_out_files()]
        for _ in range(MAX_FIX_STEPS):
            lines = rng.choice(self._sources).splitlines(keepends=True)
            start = rng.randrange(len(lines))
            text = "".join(lines[start : start + 4 * n])  # more than n tokens, unless the file ends
            encoding = self.tokenizer.encode(text)
            if len(encoding.ids) < n:
                continue
            cut = text[: encoding.offsets[n - 1][1]]
            ids = self.encode(cut)
            if len(ids) == n:
                return Prompt(cut, tuple(ids), 0)
        raise RuntimeError(f"could not cut a source prompt of exactly {n} tokens")


def _lengths(rng: random.Random, base: int, ratio: float, low: int) -> int:
    if ratio == 0.0:
        return base
    return max(low, rng.randint(round(base * (1 - ratio)), round(base * (1 + ratio))))


def build_workload(maker: PromptMaker, spec: WorkloadSpec, count: int, salt: str | int = 0) -> list[Prompt]:
    """`count` prompts of `spec`; the same (spec, count, salt) gives the same prompts."""
    rng = random.Random(f"{spec.seed}:{salt}:{spec.kind}")
    low_input = maker.special_count + 1
    prompts: list[Prompt] = []
    prefixes: list[Prompt] = []
    if spec.kind == "shared-prefix":
        if not low_input <= spec.shared_prefix_len < spec.input_len:
            raise ValueError(
                f"prefix length {spec.shared_prefix_len} must be in "
                f"[{low_input}, input length {spec.input_len})"
            )
        prefix_rng = random.Random(f"{spec.seed}:prefixes")  # same prefixes at every point
        prefixes = [maker.exact(spec.shared_prefix_len, prefix_rng) for _ in range(spec.num_prefixes)]
    for i in range(count):
        if spec.kind == "mixed":
            n = _lengths(rng, spec.input_len, spec.range_ratio, low_input)
            out = _lengths(rng, spec.output_len, spec.range_ratio, 1)
            prompt = maker.exact(n, rng)
        elif spec.kind == "shared-prefix":
            prefix = prefixes[i % len(prefixes)]
            out = spec.output_len
            prompt = maker.exact(spec.input_len, rng, head=prefix.text, head_ids=prefix.ids)
        elif spec.kind == "code":
            out = spec.output_len
            prompt = maker.code(spec.input_len, rng)
        else:
            out = spec.output_len
            prompt = maker.exact(spec.input_len, rng)
        prompts.append(Prompt(prompt.text, prompt.ids, out))
    return prompts


def build_long_mix(
    maker: PromptMaker, spec: WorkloadSpec, salt: str | int = 0, adapters_from: int | None = None
) -> tuple[list[Prompt], list[Prompt]]:
    """The stream prompts (`streams` of input_len / output_len) and the long prompts
    (`long_count` of long_len / long_output_len) of one long-prompt-mix run; with
    `adapters_from`, long prompt i names adapter lora-(adapters_from + i)."""
    if spec.kind != LONG_MIX:
        raise ValueError(f"build_long_mix needs the {LONG_MIX} workload, got {spec.kind!r}")
    rng = random.Random(f"{spec.seed}:{salt}:{spec.kind}")
    streams = [maker.exact(spec.input_len, rng) for _ in range(spec.streams)]
    longs = [maker.exact(spec.long_len, rng) for _ in range(spec.long_count)]
    return (
        [Prompt(p.text, p.ids, spec.output_len) for p in streams],
        [
            Prompt(
                p.text,
                p.ids,
                spec.long_output_len,
                "" if adapters_from is None else f"lora-{adapters_from + i}",
            )
            for i, p in enumerate(longs)
        ],
    )
