"""router/core/detokenizer.py: full and incremental decoding of continuations, per tokenizer family.

Tokenizers come from text_generation_server/testing/tiny_models.py (byte_level, metaspace with
byte fallback, wordpiece), plus decoder variants made by editing their JSON (Llama-2's Sequence,
CTC, none) and a small "</w>"-suffix BPE. The oracle for the incremental decoder is the full
decode: concatenated pushes + flush must equal it for every sequence, and what was pushed must
already be final text. The oracle for the full decode is the tokenizer's own decode of
prompt + continuation.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.core.detokenizer import REPLACEMENT_CHAR, Detokenizer, classify_decoder
from text_generation_server.testing import tiny_models

KINDS = ("byte_level", "metaspace", "wordpiece")
MODES = [
    pytest.param(False, True, id="decoder-skip"),
    pytest.param(False, False, id="decoder-keep"),
    pytest.param(True, True, id="seq2seq-skip"),
    pytest.param(True, False, id="seq2seq-keep"),
]
NUM_RANDOM_SEQUENCES = 300
SNIPPETS = [
    "hello", " world", " ", "  ", "\n", "é", "ü", "naïve", " café", "中文", "日本語", "😀", "👍🏽", "🇫🇷",
    " 😀 ", "ñ", "x", "def f(x):", " return", ",", ".", "don't", "Ω≈ç√", "\t", "▁",
]  # fmt: skip

# sha256 of tokenizer.json written by tiny_models.write_tokenizer with the default kind, recorded
# before the tokenizer kinds were added (Python 3.11.7 stdlib corpus, tokenizers 0.23.3).
DEFAULT_TOKENIZER_SHA256 = {
    "llama": "c3092473316e4e6c1a1646932a2a541a69adeb6cc286ff62b6737fde138966b9",
    "gpt2": "00942405664eb689c2a863d3d870e08169795e01251aad5a1d0c52f900f35916",
    "t5": "408eab6aa7c4898cc376a834245bff20fd51eea37dc6d053217e5d1be57b8835",
}
RECORDED_ON_PYTHON = "3.11.7"
# Llama-2's tokenizer.json decoder (transformers' LlamaConverter).
LLAMA_DECODER: dict[str, Any] = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


# --- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for kind in KINDS:
        out = tmp_path_factory.mktemp(f"tok-{kind}")
        tiny_models.write_tokenizer(out, tiny_models.ARCHITECTURES["llama"], kind=kind)
        dirs[kind] = out
    return dirs


@pytest.fixture(scope="module")
def toks(tokenizer_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_file(str(d / "tokenizer.json")) for kind, d in tokenizer_dirs.items()}


def with_decoder(tok: Tokenizer, decoder: dict[str, Any] | None) -> Tokenizer:
    data = json.loads(tok.to_str())
    data["decoder"] = decoder
    return Tokenizer.from_str(json.dumps(data))


def suffix_bpe() -> Tokenizer:
    """A small BPE whose pieces end words with "</w>" (original GPT / CLIP style)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(tiny_models.SPECIAL_TOKENS),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there!"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def assert_streams_like_decode(detok: Detokenizer, ids: Sequence[int]) -> list[str]:
    """The central invariant, and: every push is final text at its place (so it never carries a
    U+FFFD or a partial character that the full decode does not have there)."""
    full = detok.decode(ids)
    stream = detok.incremental()
    pieces: list[str] = []
    for token_id in ids:
        piece = stream.push(token_id)
        pieces.append(piece)
        assert not piece.endswith(REPLACEMENT_CHAR), (ids, pieces)
        assert full.startswith("".join(pieces)), (ids, pieces, full)
    assert "".join(pieces) + stream.flush() == full, (ids, pieces, full)
    return pieces


def vocab_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None, token
    return int(token_id)


def piece(tok: Tokenizer, token_id: int) -> str:
    return str(tok.id_to_token(token_id))


def byte_ids(tok: Tokenizer) -> list[int]:
    return [vocab_id(tok, f"<0x{b:02X}>") for b in range(256)]


def random_byte_run(tok: Tokenizer, rng: random.Random) -> list[int]:
    """<0xNN> tokens: whole characters, a character cut short, or a stray byte."""
    data = rng.choice(SNIPPETS).encode()
    choice = rng.random()
    if choice < 0.3 and len(data) > 1:
        data = data[: rng.randrange(1, len(data))]
    elif choice < 0.4:
        data = bytes([rng.randrange(0x80, 0x100)])
    return [byte_ids(tok)[b] for b in data]


def random_ids(tok: Tokenizer, rng: random.Random, *, with_bytes: bool) -> list[int]:
    """Uniform random ids, or slices of real encodings with specials and byte runs spliced in."""
    specials = list(range(len(tiny_models.SPECIAL_TOKENS)))
    if rng.random() < 0.25:
        return [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(0, 25))]
    text = "".join(rng.choice(SNIPPETS) for _ in range(rng.randrange(1, 8)))
    ids = tok.encode(text, add_special_tokens=False).ids
    ids = ids[rng.randrange(0, len(ids) + 1) :]
    for _ in range(rng.randrange(0, 4)):
        splice = [rng.choice(specials)]
        if with_bytes and rng.random() < 0.6:
            splice = random_byte_run(tok, rng)
        at = rng.randrange(0, len(ids) + 1)
        ids[at:at] = splice
    return ids


def tokenizer_variants(toks: dict[str, Tokenizer]) -> Iterator[tuple[str, Tokenizer, bool]]:
    """(name, tokenizer, has <0xNN> tokens): the tiny kinds plus decoder variants."""
    yield from ((kind, toks[kind], kind == "metaspace") for kind in KINDS)
    yield "llama-sequence", with_decoder(toks["metaspace"], LLAMA_DECODER), True
    strip_more = {
        "type": "Sequence",
        "decoders": [
            *LLAMA_DECODER["decoders"][:3],
            {"type": "Strip", "content": " ", "start": 2, "stop": 0},
        ],
    }
    yield "strip-2", with_decoder(toks["metaspace"], strip_more), True
    yield "no-decoder", with_decoder(toks["byte_level"], None), False
    ctc = {"type": "CTC", "pad_token": "<pad>", "word_delimiter_token": "|", "cleanup": True}
    yield "ctc", with_decoder(toks["wordpiece"], ctc), False
    yield "bpe-suffix", suffix_bpe(), False


# --- the invariant over random sequences -----------------------------------------------------------


@pytest.mark.parametrize(("seq2seq", "skip_special"), MODES)
def test_pushes_plus_flush_equal_decode_for_random_sequences(
    toks: dict[str, Tokenizer], seq2seq: bool, skip_special: bool
) -> None:
    for name, tok, with_bytes in tokenizer_variants(toks):
        detok = Detokenizer(tok, skip_special_tokens=skip_special, seq2seq=seq2seq)
        rng = random.Random(f"{name}-{seq2seq}-{skip_special}")
        for _ in range(NUM_RANDOM_SEQUENCES):
            assert_streams_like_decode(detok, random_ids(tok, rng, with_bytes=with_bytes))


@pytest.mark.parametrize(("seq2seq", "skip_special"), MODES)
def test_byte_runs_valid_and_invalid(toks: dict[str, Tokenizer], seq2seq: bool, skip_special: bool) -> None:
    """Dense <0xNN> runs: characters split across tokens, cut short, stray bytes, specials between."""
    tok = toks["metaspace"]
    detok = Detokenizer(tok, skip_special_tokens=skip_special, seq2seq=seq2seq)
    rng = random.Random(f"bytes-{seq2seq}-{skip_special}")
    plain = tok.encode(" hi there", add_special_tokens=False).ids
    for _ in range(NUM_RANDOM_SEQUENCES):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            part = rng.random()
            ids += random_byte_run(tok, rng) if part < 0.6 else [rng.choice(plain if part < 0.85 else (1, 2))]
        assert_streams_like_decode(detok, ids)


# --- targeted cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", ["héllo wörld", " 😀 and 👍🏽", "中文 日本語", "ñandú 🇫🇷 Ω≈ç√"])
def test_multibyte_characters_split_across_tokens_never_stream_broken(
    toks: dict[str, Tokenizer], kind: str, text: str
) -> None:
    tok = toks[kind]
    ids = tok.encode("Say: " + text, add_special_tokens=False).ids
    for seq2seq in (False, True):
        pieces = assert_streams_like_decode(Detokenizer(tok, seq2seq=seq2seq), ids)
        assert REPLACEMENT_CHAR not in "".join(pieces)
    if kind != "wordpiece":  # wordpiece lowercases, strips accents, has no emoji: not lossless
        assert Detokenizer(tok, seq2seq=True).decode(ids) == "Say: " + text


def test_byte_fallback_run_is_held_until_a_non_byte_token(toks: dict[str, Tokenizer]) -> None:
    tok = toks["metaspace"]
    zhong = [byte_ids(tok)[b] for b in "中".encode()]
    x_id = vocab_id(tok, "x")
    stream = Detokenizer(tok).incremental()
    assert [stream.push(t) for t in zhong] == ["", "", ""]
    assert stream.push(x_id) == "中x"
    # The same run followed by a stray byte: tokenizers turns the whole run into U+FFFDs.
    invalid = [*zhong, byte_ids(tok)[0xFF], x_id]
    assert Detokenizer(tok).decode(invalid) == REPLACEMENT_CHAR * 4 + "x"
    assert "".join(assert_streams_like_decode(Detokenizer(tok), invalid)) == REPLACEMENT_CHAR * 4 + "x"
    assert Detokenizer(tok).decode(zhong[:2]) == ""  # trailing U+FFFD trimmed


@pytest.mark.parametrize("kind", ["metaspace", "wordpiece", "llama-sequence"])
def test_continuation_keeps_its_leading_space_in_decoder_only_mode(
    toks: dict[str, Tokenizer], kind: str
) -> None:
    tok = with_decoder(toks["metaspace"], LLAMA_DECODER) if kind == "llama-sequence" else toks[kind]
    prompt = tok.encode("hello", add_special_tokens=False).ids
    full = tok.encode("hello world", add_special_tokens=False).ids
    assert full[: len(prompt)] == prompt
    world = full[len(prompt) :]
    if kind != "wordpiece":
        assert piece(tok, world[0]).startswith("▁")
    decoder_only = Detokenizer(tok)
    assert decoder_only.decode(world) == " world"
    stream = decoder_only.incremental()
    assert stream.push(world[0]).startswith(" ")
    assert Detokenizer(tok, seq2seq=True).decode(world) == "world"
    assert "".join(assert_streams_like_decode(Detokenizer(tok, seq2seq=True), world)) == "world"


def test_seq2seq_answer_starts_without_a_space(toks: dict[str, Tokenizer]) -> None:
    """mt0-style: the generated "▁France" is the whole answer, text "France"."""
    tok = toks["metaspace"]
    ids = tok.encode("France", add_special_tokens=False).ids
    assert piece(tok, ids[0]).startswith("▁")
    assert Detokenizer(tok, seq2seq=True).decode(ids) == "France"
    assert Detokenizer(tok, seq2seq=False).decode(ids) == " France"


CONTINUATIONS = [
    ("the quick brown", " fox jumps over the lazy dog"),
    ("def f(x):", " return x"),
    ("hello", ", world."),
    ("import os", " and sys"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("prompt", "continuation"), CONTINUATIONS)
def test_decode_of_continuation_is_the_text_after_the_prompt(
    toks: dict[str, Tokenizer], kind: str, prompt: str, continuation: str
) -> None:
    """Exact oracle: decode(prompt + continuation ids) minus decode(prompt ids), where the prompt's
    ids are a prefix of the whole text's ids (the tokenization splits cleanly)."""
    tok = toks[kind]
    prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    full_ids = tok.encode(prompt + continuation, add_special_tokens=False).ids
    assert full_ids[: len(prompt_ids)] == prompt_ids, "pick texts that split cleanly"
    whole, head = tok.decode(full_ids), tok.decode(prompt_ids)
    assert whole.startswith(head)
    expected = whole[len(head) :]
    assert expected == continuation
    detok = Detokenizer(tok)
    cont_ids = full_ids[len(prompt_ids) :]
    assert detok.decode(cont_ids) == expected
    assert "".join(assert_streams_like_decode(detok, cont_ids)) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_skipped_unless_asked_for(toks: dict[str, Tokenizer], kind: str) -> None:
    tok = toks[kind]
    ids = [*tok.encode("hello", add_special_tokens=False).ids, 1, *tok.encode(" world").ids]
    assert "<s>" not in Detokenizer(tok).decode(ids)
    assert "<s>" in Detokenizer(tok, skip_special_tokens=False).decode(ids)
    assert "<s>" in "".join(assert_streams_like_decode(Detokenizer(tok, skip_special_tokens=False), ids))


def test_no_decoder_prepends_a_space(toks: dict[str, Tokenizer]) -> None:
    tok = with_decoder(toks["byte_level"], None)
    ids = tok.encode("hello", add_special_tokens=False).ids
    assert Detokenizer(tok).decode(ids) == " " + tok.decode(ids)
    assert Detokenizer(tok, seq2seq=True).decode(ids) == tok.decode(ids)


def test_bpe_suffix_decoder_holds_the_last_token() -> None:
    tok = suffix_bpe()
    ids = tok.encode("hello world the fox", add_special_tokens=False).ids
    detok = Detokenizer(tok)
    assert detok.decode(ids) == "hello world the fox"
    stream = detok.incremental()
    pieces = [stream.push(t) for t in ids]
    assert pieces[0] == "" and "".join(pieces) + stream.flush() == "hello world the fox"
    assert "".join(pieces).endswith("the ")


UNSUPPORTED_SEQUENCES = {
    "wordpiece-after-fuse": [{"type": "Fuse"}, {"type": "WordPiece", "prefix": "##", "cleanup": True}],
    "bytefallback-after-fuse": [{"type": "Fuse"}, {"type": "ByteFallback"}],
    "bpe-in-sequence": [{"type": "BPEDecoder", "suffix": "</w>"}, {"type": "Fuse"}],
    "replace-across-tokens": [
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "ab"}, "content": "X"},
    ],
    "strip-end": [{"type": "Strip", "content": " ", "start": 0, "stop": 1}],
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SEQUENCES))
def test_unsupported_decoder_raises_a_clear_error(toks: dict[str, Tokenizer], name: str) -> None:
    tok = with_decoder(toks["wordpiece"], {"type": "Sequence", "decoders": UNSUPPORTED_SEQUENCES[name]})
    with pytest.raises(ValueError, match=r"^Unsupported tokenizer type: "):
        Detokenizer(tok)


def test_unknown_decoder_type_raises() -> None:
    with pytest.raises(ValueError, match=r"^Unsupported tokenizer type: Whatever$"):
        classify_decoder({"type": "Whatever"})


class CountingTokenizer:
    """Delegates to a Tokenizer and counts how many ids each decode call is given."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.decoded_ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


@pytest.mark.parametrize("kind", KINDS)
def test_push_cost_does_not_grow_with_the_history(toks: dict[str, Tokenizer], kind: str) -> None:
    counting = CountingTokenizer(toks[kind])
    detok = Detokenizer(counting)  # type: ignore[arg-type]
    ids = toks[kind].encode("def f(x):\n    return x + 1  # 😀 naïve\n" * 100, add_special_tokens=False).ids
    stream = detok.incremental()
    counting.decoded_ids = 0
    text = "".join(stream.push(t) for t in ids) + stream.flush()
    assert text == detok.decode(ids)
    assert len(ids) > 1000
    assert counting.decoded_ids < 12 * len(ids) + len(ids)  # pushes: O(window) each; then one full decode


# --- tiny_models tokenizer kinds ---------------------------------------------------------------------


@pytest.mark.skipif(
    platform.python_version() != RECORDED_ON_PYTHON,
    reason=f"hashes recorded on Python {RECORDED_ON_PYTHON}: the corpus is the stdlib",
)
@pytest.mark.parametrize("arch", sorted(DEFAULT_TOKENIZER_SHA256))
def test_default_tiny_tokenizer_is_unchanged(tmp_path: Path, arch: str) -> None:
    spec = tiny_models.ARCHITECTURES[arch]
    tiny_models.write_tokenizer(tmp_path, spec)
    assert (
        hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
        == DEFAULT_TOKENIZER_SHA256[arch]
    )
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    tiny_models.write_tokenizer(explicit, spec, kind="byte_level")
    assert (explicit / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_tokenizer_kinds_load_and_frame_like_the_architecture(tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    for arch in ("llama", "gpt2", "t5"):
        out = tmp_path / arch
        out.mkdir()
        tiny_models.write_tokenizer(out, tiny_models.ARCHITECTURES[arch], kind=kind)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        assert tok.get_vocab_size() == tiny_models.VOCAB_SIZE
        assert [tok.id_to_token(i) for i in range(4)] == list(tiny_models.SPECIAL_TOKENS)
        ids = tok.encode("hello world").ids
        spec = tiny_models.ARCHITECTURES[arch]
        assert (ids[0] == tiny_models.BOS_ID) == spec.add_bos
        assert (ids[-1] == tiny_models.EOS_ID) == spec.add_eos
        assert list(AutoTokenizer.from_pretrained(out)("hello world")["input_ids"]) == ids
    if kind == "metaspace":
        assert byte_ids(tok) == list(range(4, 260))
        text = "naïve 😀 中文\ttab"
        assert tok.decode(tok.encode(text).ids) == text


def test_detokenizer_import_stays_torch_free() -> None:
    code = "import sys, router.core.detokenizer; sys.exit(bool({'torch', 'transformers'} & set(sys.modules)))"
    repo = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo, check=False).returncode == 0


def test_a_request_may_ask_for_the_other_special_token_rule(tmp_path) -> None:
    from router.core.detokenizer import Detokenizer
    from router.core.tokenizer import load_tokenizer
    from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

    write_tokenizer(tmp_path, ARCHITECTURES["llama"])
    skipping = Detokenizer(load_tokenizer(str(tmp_path)))
    keeping = skipping.variant(False)
    assert skipping.variant(None) is skipping.variant(True) is skipping
    assert keeping.variant(True) is skipping and skipping.variant(False) is keeping  # made once
    ids = [600, 1, 601]  # <s> between two pieces
    assert keeping.decode(ids) == skipping.decode(ids[:1]) + "<s>" + skipping.decode(ids[2:])
    decoder = keeping.incremental()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == keeping.decode(ids)
