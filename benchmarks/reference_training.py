"""Training a reference model on this Python's standard-library sources, offline, on a CPU.

A random-weight model is right for timing a step, but its outputs have no structure a speculator
can learn (its final hidden state keeps no linear trace of its input token) and no resemblance to
text. The trained reference models (`reference_model.TRAINED`) start from the same random weights
and take a fixed number of AdamW steps of next-token prediction on the top-level *.py files of
the standard library (tokenized with the model's own tokenizer, each file followed by EOS): a
small code model whose greedy continuations look like Python and repeat what they have seen,
which is what acceptance rates of speculation need to be measured on. The same shapes, so a
trained model's forward costs what the random one's does.

Deterministic for a given torch build and thread count (the seed fixes the data order and the
initial weights; float sums in several threads may round differently elsewhere). About 20
minutes on two cores.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from text_generation_server.testing.tiny_models import stdlib_sources

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrainingRecipe:
    steps: int = 360
    batch: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr: float = 2e-3  # peak, after a linear warm-up
    warmup: int = 20
    final_lr_ratio: float = 0.1  # cosine decay to lr * this
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    held_out_every: int = 20  # every Nth source file (by name) is held out to measure the loss
    seed: int = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.final_lr_ratio + (1.0 - self.final_lr_ratio) * cosine)


def held_out_files(recipe: TrainingRecipe | None = None) -> list[str]:
    """The source files training never sees (the code workload's prompts come from them)."""
    every = (recipe or TrainingRecipe()).held_out_every
    return [f for i, f in enumerate(stdlib_sources()) if i % every == every - 1]


def corpus_ids(tokenizer_json: Path, eos_id: int, recipe: TrainingRecipe) -> tuple[list[int], list[int]]:
    """(training ids, held-out ids): every source file's tokens followed by EOS."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    train: list[int] = []
    held_out: list[int] = []
    excluded = set(held_out_files(recipe))
    for path in stdlib_sources():
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        ids = [*tokenizer.encode(text, add_special_tokens=False).ids, eos_id]
        (held_out if path in excluded else train).extend(ids)
    return train, held_out


def train(model: Any, tokenizer_json: Path, eos_id: int, recipe: TrainingRecipe) -> dict[str, Any]:
    """Train `model` (a float32 causal LM, in place) by `recipe`; returns what the stamp records."""
    import torch

    train_ids, held_out_ids = corpus_ids(tokenizer_json, eos_id, recipe)
    data = torch.tensor(train_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(recipe.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    logger.info(
        "training on %d standard-library tokens (%d held out): %d steps of %d x %d tokens",
        len(train_ids),
        len(held_out_ids),
        recipe.steps,
        recipe.batch,
        recipe.seq_len,
    )
    model.train()
    started = time.monotonic()
    losses: list[float] = []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step)
        starts = torch.randint(0, len(data) - recipe.seq_len, (recipe.batch,), generator=generator)
        batch = torch.stack([data[int(s) : int(s) + recipe.seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == recipe.steps - 1:
            elapsed = time.monotonic() - started
            logger.info("step %d/%d: loss %.3f (%.0f s)", step + 1, recipe.steps, losses[-1], elapsed)
    model.eval()
    held_out_loss = held_out_mean_loss(model, held_out_ids, recipe.seq_len)
    seconds = time.monotonic() - started
    logger.info(
        "trained in %.0f s: last 20 steps' loss %.3f, held out %.3f", seconds, _tail(losses), held_out_loss
    )
    return {
        "recipe": asdict(recipe),
        "train_tokens": len(train_ids),
        "held_out_tokens": len(held_out_ids),
        "final_train_loss": round(_tail(losses), 4),
        "held_out_loss": round(held_out_loss, 4),
        "seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
    }


def held_out_mean_loss(model: Any, ids: list[int], seq_len: int) -> float:
    """Mean next-token loss over consecutive windows of the held-out ids."""
    import torch

    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not windows:
        return float("nan")
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            batch = torch.tensor(windows[i : i + 8], dtype=torch.long)
            total += float(model(input_ids=batch, labels=batch).loss) * len(batch)
    return total / len(windows)


def _tail(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)
