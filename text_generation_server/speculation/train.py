"""Make an MLP speculator for a model by self-distillation, offline, in minutes on a CPU:

    python -m text_generation_server.speculation.train --model MODEL_DIR --out SPECULATOR_DIR \\
        [--prompts 256 --prompt-len 32-256 --length 128 --heads 3 --epochs 4]

1. prompts: random token ids (or the lines of --prompts-file, tokenized with the model's
   tokenizer.json), each continued greedily by the model itself (transformers `generate`). Their
   lengths are spread over --prompt-len (PROMPT_LENGTHS lengths from its shortest to its longest):
   a head learns the states of the positions it was shown, and requests decode anywhere past
   their prompts (for the reference model, 16 random-text prompts of 128 tokens continued by
   128 tokens took 830 engine steps with a speculator trained on 32-token prompts, 768 with
   the default spread: README "Speculative decoding");
2. one forward over every prompt + continuation keeps the model's final hidden states (the LM
   head's input) at every position;
3. the heads learn, with the model's own tokens as targets (cross-entropy, AdamW), what the
   model will say 1, 2, ... heads ahead of each hidden state of the continuations: exactly what
   the speculator is asked when serving (mlp.py). The heads' token embeddings and output layer
   are the model's LM head, frozen and shared (tie_weights), inner size = the model's hidden
   size: only the state transitions (projections, norms) are learned, which hold for tokens
   the few minutes of data never showed;
4. a held-out tenth of the sequences measures each head's top-1 agreement with the model (the
   chance that a candidate is accepted, head by head), logged and written to train.json beside
   the weights, saved in IBM's layout (config.json + model.safetensors).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from text_generation_server.speculation.mlp import MlpSpeculatorConfig, MlpSpeculatorModel, save_speculator

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = 8  # distinct prompt lengths over --prompt-len


@dataclass(frozen=True, slots=True)
class TrainOptions:
    prompts: int = 256
    prompt_len: tuple[int, int] = (32, 256)  # shortest and longest prompt
    length: int = 128  # tokens each prompt is continued by
    heads: int = 3
    epochs: int = 3
    batch: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    seed: int = 0
    prompts_file: Path | None = None


@dataclass(frozen=True, slots=True)
class TrainReport:
    sequences: int
    positions: int
    seconds: float
    held_out_top1: list[float]  # per head: share of held-out positions where it guessed the model's token

    @property
    def expected_accepted(self) -> float:
        """Candidates accepted per step if heads were independent: sum of the running products."""
        total, running = 0.0, 1.0
        for share in self.held_out_top1:
            running *= share
            total += running
        return total


def _load_model(model_dir: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def prompt_lengths(shortest: int, longest: int) -> list[int]:
    """PROMPT_LENGTHS lengths evenly spread from `shortest` to `longest` (fewer where the range
    holds fewer): prompts of one length share a `generate` batch."""
    count = min(PROMPT_LENGTHS, longest - shortest + 1)
    if count == 1:
        return [shortest]
    return sorted({shortest + round(i * (longest - shortest) / (count - 1)) for i in range(count)})


def _prompts(model_dir: Path, options: TrainOptions, vocab: int, rng: random.Random) -> list[list[int]]:
    lengths = prompt_lengths(*options.prompt_len)
    if options.prompts_file is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        lines = [line for line in options.prompts_file.read_text().splitlines() if line.strip()]
        return [tokenizer.encode(line).ids[-rng.choice(lengths) :] for line in lines[: options.prompts]]
    return [[rng.randrange(vocab) for _ in range(rng.choice(lengths))] for _ in range(options.prompts)]


@torch.inference_mode()
def continuations(model: Any, prompts: list[list[int]], length: int, batch: int = 32) -> list[list[int]]:
    """Each prompt + `length` greedy tokens of the model (prompts of one length per batch)."""
    out = []
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(prompt)
    for group in by_length.values():
        for start in range(0, len(group), batch):
            ids = torch.tensor(group[start : start + batch])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=length,
                min_new_tokens=length,
                do_sample=False,
                pad_token_id=model.config.pad_token_id or 0,
            )
            out += generated.tolist()
    return out


@torch.inference_mode()
def hidden_states(model: Any, sequences: list[list[int]], batch: int = 16) -> list[torch.Tensor]:
    """The LM head's input at every position of each sequence: [length, hidden] (float32), in
    the sequences' order (those of one length share a forward)."""
    kept: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: kept.append(args[0]))
    by_length: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        by_length.setdefault(len(sequence), []).append(index)
    states: dict[int, torch.Tensor] = {}
    try:
        for indices in by_length.values():
            for start in range(0, len(indices), batch):
                chunk = indices[start : start + batch]
                model(torch.tensor([sequences[i] for i in chunk]))
                for i, row in zip(chunk, kept.pop().float(), strict=True):
                    states[i] = row
    finally:
        hook.remove()
    return [states[i] for i in range(len(sequences))]


def _initialize(model: MlpSpeculatorModel, lm_head: torch.Tensor) -> None:
    """Every head's token embeddings and output layer are the target's LM head, frozen: "the
    token t" is the direction that makes the target say t, so what a head learns (a transition
    of the state) holds for tokens it never saw. The embeddings are scaled to unit size after
    the head's own factor, and the projections start small (a tenth of fms-extras' scale): a
    fresh head says its input token again, and learns from there."""
    std = 0.1 / math.sqrt(model.config.inner)
    unit = lm_head / lm_head.pow(2).mean().sqrt() / model.emb_weight
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith("proj."):
            torch.nn.init.trunc_normal_(param, 0.0, std)
        elif name.startswith(("emb.", "head.")):
            param.data.copy_(unit if name.startswith("emb.") else lm_head)
            param.requires_grad_(False)


def _loss(
    model: MlpSpeculatorModel, states: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over every head and position, and each head's top-1 hits [heads]."""
    heads = model.config.n_predict
    steps = states.shape[1]
    logits = model(states, tokens)  # [heads, B, T, vocab]
    targets = torch.stack([tokens[:, i + 1 : i + 1 + steps] for i in range(heads)])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 2), targets.flatten())
    hits = (logits.argmax(-1) == targets).float().mean(dim=(1, 2))
    return loss, hits


def train(model_dir: Path, out: Path, options: TrainOptions) -> TrainReport:
    started = time.monotonic()
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    target = _load_model(model_dir)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    hidden_size = int(target.config.hidden_size)
    prompts = _prompts(model_dir, options, vocab, rng)
    sequences = continuations(target, prompts, options.length)
    hidden = hidden_states(target, sequences)
    heads = options.heads
    # per sequence, from its prompt's last position p - 1 on: the state at position j chose
    # token j + 1, for every j of the continuation that leaves `heads` tokens after j + 1 to
    # learn from; tokens[:, k] follows states[:, k]
    ends = [len(s) - options.length for s in sequences]  # the prompts' lengths
    tokens = torch.tensor([s[end:] for s, end in zip(sequences, ends, strict=True)])
    count = options.length - heads
    states = torch.stack([h[end - 1 : end - 1 + count] for h, end in zip(hidden, ends, strict=True)])
    held = max(1, len(sequences) // 10)
    order = list(range(len(sequences)))
    rng.shuffle(order)
    test, fit = order[:held], order[held:]
    config = MlpSpeculatorConfig(
        vocab_size=vocab,
        emb_dim=hidden_size,
        n_predict=heads,
        top_k_tokens_per_head=(1,) * heads,
        n_candidates=1,
        tie_weights=heads > 2,  # one embedding, output layer and norm for every head (stored once)
    )
    model = MlpSpeculatorModel(config)
    _initialize(model, target.get_output_embeddings().weight.detach())
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=options.lr, weight_decay=0.0)
    for epoch in range(options.epochs):
        rng.shuffle(fit)
        model.train()
        for start in range(0, len(fit), options.batch):
            rows = torch.tensor(fit[start : start + options.batch])
            loss, _ = _loss(model, states[rows], tokens[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            rows = torch.tensor(test)
            held_loss, hits = _loss(model, states[rows], tokens[rows])
        logger.info(
            "epoch %d: held-out loss %.3f, top-1 per head %s",
            epoch + 1,
            float(held_loss),
            ", ".join(f"{float(h):.3f}" for h in hits),
        )
    save_speculator(model, out)
    report = TrainReport(
        sequences=len(sequences),
        positions=int(states.shape[0] * states.shape[1]),
        seconds=round(time.monotonic() - started, 1),
        held_out_top1=[round(float(h), 4) for h in hits],
    )
    recorded = {**asdict(options), "prompts_file": str(options.prompts_file or "")}
    (out / "train.json").write_text(json.dumps({**asdict(report), "options": recorded}, indent=2) + "\n")
    logger.info(
        "speculator saved to %s: %d heads, held-out top-1 %s (about %.2f candidates taken per step), %.0f s",
        out,
        heads,
        report.held_out_top1,
        report.expected_accepted,
        report.seconds,
    )
    return report


def _length_range(text: str) -> tuple[int, int]:
    """ "N" or "SHORTEST-LONGEST" (at least 1 token, SHORTEST <= LONGEST)."""
    low, dash, high = text.partition("-")
    try:
        shortest, longest = int(low), int(high if dash else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or SHORTEST-LONGEST") from None
    if not 1 <= shortest <= longest:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths from 1 up, the shortest first")
    return shortest, longest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the target model's directory")
    parser.add_argument("--out", type=Path, required=True, help="where to save the speculator")
    defaults = TrainOptions()
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="prompts to continue")
    parser.add_argument(
        "--prompt-len",
        type=_length_range,
        default=defaults.prompt_len,
        help="tokens per prompt: N, or SHORTEST-LONGEST (spread over that range; default "
        f"{defaults.prompt_len[0]}-{defaults.prompt_len[1]})",
    )
    parser.add_argument("--length", type=int, default=defaults.length, help="greedy tokens per prompt")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="tokens guessed ahead (n_predict)")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--prompts-file", type=Path, default=None, help="one prompt per line (else random ids)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = TrainOptions(
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        length=args.length,
        heads=args.heads,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        prompts_file=args.prompts_file,
    )
    train(args.model, args.out, options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
