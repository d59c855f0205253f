"""Tiny random-weight models, built offline and deterministically.

Owns the one recipe for the small models that unit tests, integration tests and the demo
server run on: a tokenizer trained on this Python's standard-library sources and a 2-layer
model of one of the supported architectures, saved as safetensors with config, generation
config and tokenizer files, exactly as a hub repository would hold them. Same arguments +
same Python/torch versions give the same weights and the same tokenizer.

Tokenizer kinds (all with <unk> <s> </s> <pad> at ids 0-3 and the same vocabulary size):
  byte_level  GPT-2-style byte-level BPE (the default)
  metaspace   SentencePiece/Llama-2-style BPE: Metaspace "▁" pre-tokenizer, byte fallback to
              the 256 <0xNN> tokens (ids 4-259), decoder Sequence[ByteFallback, Metaspace]
  wordpiece   BERT-style WordPiece: lowercasing/accent-stripping normalizer, "##" continuations

    python -m text_generation_server.testing.tiny_models --arch llama --out DIR [--tokenizer KIND]

Callers: tests/conftest.py (session fixtures), tests/test_detokenizer.py (tokenizer kinds),
the README demo (`make run`), benchmarks.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
VOCAB_SIZE = 2000
MAX_POSITIONS = 512
NUM_CORPUS_FILES = 40
SEED = 0
# Larger than the usual 0.02 so that random logits have clear winners: greedy parity tests
# then do not hinge on float noise between padded and unpadded batches.
INIT_STD = 0.25


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How the architecture's tokenizer frames a sequence."""

    add_bos: bool  # prepend <s> (Llama, BLOOM-style BOS-adding tokenizers)
    add_eos: bool  # append </s> (T5)
    has_pad: bool  # pad token configured (GPT-2 has none: pad falls back to EOS)
    chat: bool = False  # tokenizer_config.json carries CHAT_TEMPLATE


# A small chat template in the style of the instruct models' (roles in tags, EOS after each turn);
# it refuses unknown roles the way real templates do, through raise_exception.
CHAT_TEMPLATE = (  # tools and an assistant's calls written as JSON, as real templates do
    "{{ bos_token }}{% if tools %}{{ '<|tools|>\n' + (tools | tojson) + eos_token + '\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('roles must be system, user, assistant or tool') }}{% endif %}"
    "{% if message['tool_calls'] %}{% set text = message['tool_calls'] | tojson %}"
    "{% else %}{% set text = message['content'] %}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + text + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


ARCHITECTURES: dict[str, TokenizerSpec] = {
    "llama": TokenizerSpec(add_bos=True, add_eos=False, has_pad=True, chat=True),
    "gpt2": TokenizerSpec(add_bos=False, add_eos=False, has_pad=False),
    "bloom": TokenizerSpec(add_bos=False, add_eos=False, has_pad=True),
    "gpt_neox": TokenizerSpec(add_bos=False, add_eos=False, has_pad=True),
    "t5": TokenizerSpec(add_bos=False, add_eos=True, has_pad=True),
    # Sliding-window attention (window 8, shorter than the test prompts + outputs).
    "mistral": TokenizerSpec(add_bos=True, add_eos=False, has_pad=True),
    # Multi-query attention (one KV head), GPT-2-like otherwise (StarCoder, Granite code v1).
    "gpt_bigcode": TokenizerSpec(add_bos=False, add_eos=False, has_pad=False),
    # Llama with GQA and the four Granite multipliers (GRANITE_MULTIPLIERS).
    "granite": TokenizerSpec(add_bos=False, add_eos=False, has_pad=True, chat=True),
    # Llama with GQA and q/k/v projection biases.
    "qwen2": TokenizerSpec(add_bos=False, add_eos=False, has_pad=True),
}
SEQ2SEQ_ARCHITECTURES = frozenset({"t5"})
SLIDING_WINDOW = 8
# None of them 1, and an attention multiplier other than head_dim ** -0.5 (0.25): a missed
# multiplier or the default attention scale changes the greedy output.
GRANITE_MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 2.0,
    "attention_multiplier": 0.125,
    "residual_multiplier": 0.5,
    "logits_scaling": 2.0,
}
# Architectures added after the first six draw their biases too (after the matrices, in the same
# name order), so that bias handling is exercised; the first six keep zero biases (and the
# weights they always had).
RANDOM_BIAS_ARCHITECTURES = frozenset({"gpt_bigcode", "granite", "qwen2"})


def stdlib_sources() -> list[str]:
    """This Python's top-level standard-library sources, sorted by name."""
    stdlib = os.path.dirname(os.__file__)
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "*.py")) if os.path.isfile(f))
    if not files:
        raise RuntimeError(f"no standard-library sources found in {stdlib}")
    return files


def _corpus_files() -> list[str]:
    return stdlib_sources()[:NUM_CORPUS_FILES]


@functools.lru_cache(maxsize=1)
def _trained_bpe_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per process; returns its JSON (without post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, expected {i}")
    return str(tok.to_str())


METASPACE = "▁"
NUM_BYTE_TOKENS = 256
FIRST_BYTE_ID = len(SPECIAL_TOKENS)  # <0x00> .. <0xFF> take ids 4-259, like Llama-2's 3-258


@functools.lru_cache(maxsize=1)
def _trained_metaspace_json(vocab_size: int) -> str:
    """Train the SentencePiece-style BPE once per process; returns its JSON (no post-processor).

    The trainer knows nothing of byte fallback, so it learns `vocab_size - 256` pieces and the
    256 byte tokens are then inserted right after the special tokens (merges name pieces by
    text, so shifting ids keeps them valid).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement=METASPACE, prepend_scheme="first")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_BYTE_TOKENS,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=[METASPACE],
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = _with_byte_tokens(data["model"]["vocab"])
    return json.dumps(data, ensure_ascii=False)


def _with_byte_tokens(vocab: dict[str, int]) -> dict[str, int]:
    """Trained vocab -> specials, then <0x00>..<0xFF>, then the trained pieces (ids shifted)."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(NUM_BYTE_TOKENS)]
    clash = sorted(set(byte_tokens) & set(vocab))
    if clash:
        raise RuntimeError(f"trained pieces clash with byte tokens: {clash}")
    out = {t: i for t, i in vocab.items() if i < FIRST_BYTE_ID}
    out.update({t: FIRST_BYTE_ID + b for b, t in enumerate(byte_tokens)})
    out.update({t: i + NUM_BYTE_TOKENS for t, i in vocab.items() if i >= FIRST_BYTE_ID})
    return out


@functools.lru_cache(maxsize=1)
def _trained_wordpiece_json(vocab_size: int) -> str:
    """Train the BERT-style WordPiece once per process; returns its JSON (no post-processor)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    return str(tok.to_str())


TOKENIZER_KINDS: dict[str, Callable[[int], str]] = {
    "byte_level": _trained_bpe_json,
    "metaspace": _trained_metaspace_json,
    "wordpiece": _trained_wordpiece_json,
}


def _trained_tokenizer(kind: str, vocab_size: int) -> Any:
    """The trained tokenizers.Tokenizer of `kind`, special tokens checked at ids 0-3."""
    from tokenizers import Tokenizer

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")
    tok = Tokenizer.from_str(TOKENIZER_KINDS[kind](vocab_size))
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, expected {i}")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"{kind} tokenizer has {tok.get_vocab_size(True)} tokens, expected {vocab_size}")
    return tok


def write_tokenizer(
    out: Path, spec: TokenizerSpec, vocab_size: int = VOCAB_SIZE, kind: str = "byte_level"
) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json into `out`."""
    from tokenizers import processors

    tok = _trained_tokenizer(kind, vocab_size)
    single = " ".join((["<s>"] if spec.add_bos else []) + ["$A"] + (["</s>"] if spec.add_eos else []))
    pair = " ".join(
        (["<s>"] if spec.add_bos else []) + ["$A"] + (["</s>"] if spec.add_eos else []) + ["$B:1"]
    )
    specials = [(t, i) for t, i in (("<s>", BOS_ID), ("</s>", EOS_ID)) if t in single]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    tok.save(str(out / "tokenizer.json"))

    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if spec.has_pad:
        special_map["pad_token"] = "<pad>"
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    # Written by hand rather than by save_pretrained(): transformers 5 would record
    # "TokenizersBackend", which older readers cannot load.
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "model_input_names": ["input_ids", "attention_mask"],
        **special_map,
    }
    if spec.chat:
        config["chat_template"] = CHAT_TEMPLATE
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special_map)


def _model_config(arch: str) -> Any:
    import transformers

    pad = PAD_ID if ARCHITECTURES[arch].has_pad else None
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": pad,
    }
    if arch in ("llama", "mistral"):
        llama_like: dict[str, Any] = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": MAX_POSITIONS,
            "tie_word_embeddings": False,
            **common,
        }
        if arch == "mistral":
            return transformers.MistralConfig(sliding_window=SLIDING_WINDOW, **llama_like)
        return transformers.LlamaConfig(rms_norm_eps=1e-6, **llama_like)
    if arch in ("granite", "qwen2"):
        gqa: dict[str, Any] = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": MAX_POSITIONS,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            **common,
        }
        if arch == "granite":
            return transformers.GraniteConfig(**GRANITE_MULTIPLIERS, **gqa)
        return transformers.Qwen2Config(**gqa)
    if arch == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, **common)
    if arch == "gpt_bigcode":
        return transformers.GPTBigCodeConfig(
            n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, multi_query=True, **common
        )
    if arch == "bloom":
        return transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=False,
            **common,
        )
    if arch == "t5":
        return transformers.T5Config(
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            **{"decoder_start_token_id": PAD_ID, "tie_word_embeddings": False, **common},
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


def build_model(arch: str, dtype: str = "float32") -> Any:
    """A randomly initialised model of `arch`, independent of transformers' own init order."""
    import torch
    import transformers

    config = _model_config(arch)
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if arch in SEQ2SEQ_ARCHITECTURES
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_config(config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        params = sorted(model.named_parameters(), key=lambda kv: kv[0])
        for name, param in params:
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
            elif name.endswith("weight"):  # norm scales
                param.fill_(1.0)
            else:  # biases
                param.zero_()
        if arch in RANDOM_BIAS_ARCHITECTURES:
            for name, param in params:
                if param.ndim == 1 and not name.endswith("weight"):
                    param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
    return model.to(getattr(torch, dtype)).eval()


def build_tiny_model(
    arch: str,
    out: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    safetensors: bool = True,
    tokenizer: str = "byte_level",
) -> Path:
    """Build the tiny `arch` model with its tokenizer into `out` (created); returns the path.

    With `safetensors=False` the weights are written as a `pytorch_model.bin` only, like old
    hub repositories. `tokenizer` picks the tokenizer kind (TOKENIZER_KINDS); the weights do
    not depend on it.
    """
    import torch
    from transformers.utils import logging as hf_logging

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer kind {tokenizer!r}; choose one of {', '.join(TOKENIZER_KINDS)}")
    hf_logging.disable_progress_bar()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, ARCHITECTURES[arch], kind=tokenizer)
    model = build_model(arch, dtype)
    model.save_pretrained(path)
    if not safetensors:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        torch.save(state, path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of safetensors")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZER_KINDS), default="byte_level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    path = build_tiny_model(
        args.arch, args.out, dtype=args.dtype, safetensors=not args.bin, tokenizer=args.tokenizer
    )
    logger.info("built tiny %s model (%s tokenizer) in %s", args.arch, args.tokenizer, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
