"""IBM's MLP speculator (fms-extras `MLPSpeculator`, TGIS's SPECULATOR_NAME): small heads that
guess the next few tokens from the target model's last hidden state.

    config.json: model_type "mlp_speculator", emb_dim (the target's hidden size), inner_dim
                 (0 = emb_dim), vocab_size, n_predict (heads), top_k_tokens_per_head,
                 n_candidates, tie_weights (fms-extras' tie_wts), scale_input
    weights:     emb.{i}.weight [vocab, inner], proj.{i}.weight [inner, emb or inner],
                 head.{i}.weight [vocab, inner], ln.{i}.weight / .bias [inner], for each head i
                 (a "speculator." prefix, as transformers-style checkpoints write it, is
                 accepted), in model.safetensors or pytorch_model.bin; tied heads may store
                 their shared tensors once (head 0, and proj 1 for proj 2.. )

Head i takes the state s (the target's final hidden state for head 0, after ln0's scaling when
scale_input) and the token t before the one it predicts (the target's own last token for head
0, head i-1's guess after):

    s = gelu(ln_i(proj_i(s) * w_state + emb_i(t) * w_emb * sqrt(inner / 2)))    logits_i = head_i(s)
    w_state = 0.5 ** (0.5 / n_predict),  w_emb = sqrt(1 - w_state ** 2)

ln_i normalises by the root mean square (eps 1e-6), then scales and shifts. Candidates are the
most likely chains of a candidate tree: head i keeps its top_k_tokens_per_head[i] tokens after
each chain so far, and the n_candidates chains of the highest summed log-probability are tried
(SPECULATOR_TOP_K_TOKENS_PER_HEAD / SPECULATOR_N_CANDIDATES override the config's, as in TGIS);
with top-1 per head and one candidate, the chain of each head's top token.

`train.py` makes one for a model by self-distillation, saved in this layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from text_generation_server.speculation import Speculator, Target

MODEL_TYPE = "mlp_speculator"
EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MlpSpeculatorConfig:
    vocab_size: int
    emb_dim: int
    inner_dim: int = 0  # 0 = emb_dim
    n_predict: int = 3
    top_k_tokens_per_head: tuple[int, ...] = field(default=())
    n_candidates: int = 1
    tie_weights: bool = False
    scale_input: bool = False

    @property
    def inner(self) -> int:
        return self.inner_dim or self.emb_dim

    @classmethod
    def read(cls, path: Path) -> MlpSpeculatorConfig:
        """The speculator config in `path`/config.json; ValueError saying what is wrong."""
        file = path / "config.json"
        if not file.is_file():
            raise ValueError(f"speculator {path}: no config.json")
        raw: dict[str, Any] = json.loads(file.read_text())
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"speculator {path}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r} "
                "(IBM's MLP speculator)"
            )
        try:
            config = cls(
                vocab_size=int(raw["vocab_size"]),
                emb_dim=int(raw["emb_dim"]),
                inner_dim=int(raw.get("inner_dim", 0)),
                n_predict=int(raw.get("n_predict", 3)),
                top_k_tokens_per_head=tuple(int(k) for k in raw.get("top_k_tokens_per_head", ())),
                n_candidates=int(raw.get("n_candidates", 1)),
                tie_weights=bool(raw.get("tie_weights", raw.get("tie_wts", False))),
                scale_input=bool(raw.get("scale_input", False)),
            )
        except KeyError as missing:
            raise ValueError(f"speculator {path}: config.json has no {missing.args[0]}") from None
        if config.n_predict < 1:
            raise ValueError(f"speculator {path}: n_predict must be >= 1, got {config.n_predict}")
        return config

    def write(self, path: Path) -> None:
        raw = asdict(self)
        raw["top_k_tokens_per_head"] = list(self.top_k_tokens_per_head) or [1] * self.n_predict
        raw = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MODEL_TYPE, **raw}
        (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


class ScaledNorm(nn.Module):
    """Root-mean-square normalisation, then (optionally) a learned scale and shift."""

    def __init__(self, size: int, affine: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(size)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        if self.weight is not None and self.bias is not None:
            x = x * self.weight + self.bias
        return x


PACKED_ROWS_COMPARED = 1024  # rows of a weight packed at a time to compare it with panels (whole panels)


def _packs_to(weight: torch.Tensor, panels: torch.Tensor) -> bool:
    """Whether `weight` [out, in] packed in panels (panel_cpu.cpp's panel_pack, 16 rows a
    panel) is `panels`: packed and compared PACKED_ROWS_COMPARED rows at a time (no second
    copy of a large vocabulary's head; the first differing rows end it)."""
    size = panels.shape[2]  # outputs per panel
    out = panels.shape[0] * size
    if weight.dtype != panels.dtype or tuple(weight.shape) != (out, panels.shape[1]):
        return False
    for start in range(0, out, PACKED_ROWS_COMPARED):
        end = min(out, start + PACKED_ROWS_COMPARED)
        part = torch.ops.tgis_cpu.panel_pack(weight[start:end].contiguous())
        if not torch.equal(part, panels[start // size : end // size]):
            return False
    return True


class MlpSpeculatorModel(nn.Module):
    def __init__(self, config: MlpSpeculatorConfig) -> None:
        super().__init__()
        self.config = config
        n, inner, vocab = config.n_predict, config.inner, config.vocab_size
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner) for _ in range(n))
        self.proj = nn.ModuleList(
            nn.Linear(config.emb_dim if i == 0 else inner, inner, bias=False) for i in range(n)
        )
        self.head = nn.ModuleList(nn.Linear(inner, vocab, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(ScaledNorm(inner, affine=True) for _ in range(n))
        self.ln0 = ScaledNorm(config.emb_dim, affine=False) if config.scale_input else None
        self.kernel = False  # the top-1 chain on the CPU kernel (use_cpu_kernel)
        self._weights: tuple[list[torch.Tensor], ...] = ()
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt(1 - self.state_weight**2) * math.sqrt(inner / 2)
        if config.tie_weights:
            self._tie()

    def _tie(self) -> None:
        first_emb, first_head, first_ln = self.emb[0], self.head[0], self.ln[0]
        for i in range(1, self.config.n_predict):
            self.emb[i].weight = first_emb.weight
            self.head[i].weight = first_head.weight
            self.ln[i].weight, self.ln[i].bias = first_ln.weight, first_ln.bias
            if i >= 2:
                self.proj[i].weight = self.proj[1].weight

    def _step(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        z = self.emb[i](tokens) * self.emb_weight
        out: torch.Tensor = nn.functional.gelu(self.ln[i](self.proj[i](state) * self.state_weight + z))
        return out

    def _input(self, state: torch.Tensor) -> torch.Tensor:
        return self.ln0(state) / math.sqrt(2) if self.ln0 is not None else state

    def forward(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Training (teacher forcing): `state` [B, T, emb] the target's hidden states, `tokens`
        [B, T + n_predict] where tokens[:, j] follows state[:, j] -> logits [n_predict, B, T, vocab]:
        head i at position j predicts tokens[:, j + i + 1]."""
        steps = state.shape[1]
        state = self._input(state)
        out = []
        for i in range(self.config.n_predict):
            state = self._step(i, state, tokens[:, i : i + steps])
            out.append(self.head[i](state))
        return torch.stack(out)

    def use_cpu_kernel(self) -> bool:
        """Run `chain` on the C++ kernel (kernels/csrc/speculator_cpu.cpp: each head's argmax
        in one pass over its weights) where the model is on CPU and the kernels load; whether
        it does (where they cannot load, the warning says why)."""
        from text_generation_server.kernels import cpu_kernels

        device = self.head[0].weight.device
        self.kernel = device.type == "cpu" and cpu_kernels.loads(
            "the MLP speculator's heads run as tensor operations"
        )
        if not self.kernel:
            return False
        params = dict(self.named_parameters(remove_duplicate=False))
        heads = range(self.config.n_predict)
        self._weights = tuple(
            [params[f"{name}.{i}.{kind}"] for i in heads]
            for name, kind in (
                ("proj", "weight"),
                ("emb", "weight"),
                ("ln", "weight"),
                ("ln", "bias"),
                ("head", "weight"),
            )
        )
        return True

    def read_lm_head(self, panels: torch.Tensor) -> int:
        """Chains on the CPU kernel: every head whose weights are the values of the target's LM
        head `panels` (kernels/weight_layout.py PanelLinear's packed weight: a self-distilled
        speculator's frozen copy, train.py) reads those panels instead, memory the target's
        step has just read (speculator_cpu.cpp). How many heads do (0 without the kernel)."""
        if not self.kernel:
            return 0
        heads = self._weights[4]
        same: dict[int, bool] = {}  # tied heads are one tensor: compared once
        for i, weight in enumerate(heads):
            if id(weight) not in same:
                same[id(weight)] = _packs_to(weight, panels)
            if same[id(weight)]:
                heads[i] = panels
        return sum(1 for weight in heads if weight is panels)

    @torch.inference_mode()
    def chain(self, state: torch.Tensor, last: torch.Tensor, steps: int) -> torch.Tensor:
        """The most likely continuation: `state` [R, emb], `last` [R] the token after it ->
        [R, steps] (steps <= n_predict), each head's top token fed to the next (the tree of
        top 1 per head, without its scores: one argmax per head)."""
        if self.kernel:
            return torch.ops.tgis_cpu.mlp_speculator_chain(
                state.contiguous(),
                last,
                *self._weights,
                self.state_weight,
                self.emb_weight,
                self.ln0 is not None,
                steps,
            )
        state = self._input(state)
        tokens = last
        chain = []
        for i in range(steps):
            state = self._step(i, state, tokens)
            tokens = self.head[i](state).argmax(dim=-1)
            chain.append(tokens)
        return torch.stack(chain, dim=1)

    @torch.inference_mode()
    def candidates(
        self, state: torch.Tensor, last: torch.Tensor, top_k: Sequence[int], count: int
    ) -> torch.Tensor:
        """The candidate tree: `state` [R, emb], `last` [R] -> [R, n, len(top_k)] token chains,
        the likeliest first (n = min(count, prod(top_k))). Head i extends every chain so far by
        its top_k[i] tokens (its state fed with each); chains are ranked by their summed
        log-probabilities."""
        if max(top_k) == 1:
            return self.chain(state, last, len(top_k)).unsqueeze(1)
        rows = state.shape[0]
        state = self._input(state)  # [R * width, ...] as chains multiply: width chains per row
        tokens = last
        scores = torch.zeros(rows, 1, device=state.device)
        chains = torch.empty(rows, 1, 0, dtype=torch.long, device=state.device)
        for i, k in enumerate(top_k):
            width = chains.shape[1]
            state = self._step(i, state, tokens)
            logits = self.head[i](state).float()
            best, ids = logits.log_softmax(dim=-1).topk(k, dim=-1)  # [R * width, k]
            scores = (scores.unsqueeze(-1) + best.view(rows, width, k)).view(rows, width * k)
            grown = chains.unsqueeze(2).expand(rows, width, k, i)
            chains = torch.cat((grown, ids.view(rows, width, k, 1)), dim=-1).view(rows, width * k, i + 1)
            state = state.repeat_interleave(k, dim=0)
            tokens = ids.view(-1)
        order = scores.topk(min(count, chains.shape[1]), dim=-1).indices
        return chains.gather(1, order.unsqueeze(-1).expand(-1, -1, chains.shape[2]))


def weight_names(config: MlpSpeculatorConfig) -> dict[str, str]:
    """Parameter name -> the checkpoint name it is read from (tied parameters: the first head's)."""
    names = {}
    for i in range(config.n_predict):
        tied = config.tie_weights and i > 0
        names[f"emb.{i}.weight"] = f"emb.{0 if tied else i}.weight"
        names[f"head.{i}.weight"] = f"head.{0 if tied else i}.weight"
        names[f"ln.{i}.weight"] = f"ln.{0 if tied else i}.weight"
        names[f"ln.{i}.bias"] = f"ln.{0 if tied else i}.bias"
        names[f"proj.{i}.weight"] = f"proj.{1 if tied and i >= 2 else i}.weight"
    return names


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors = sorted(path.glob("*.safetensors"))
    if safetensors:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in safetensors:
            tensors.update(load_file(str(file)))
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"speculator {path}: no *.safetensors or pytorch_model.bin")
    return {name.removeprefix("speculator."): tensor for name, tensor in tensors.items()}


def is_mlp_speculator(path: Path) -> bool:
    """Whether `path` holds an MLP speculator (its config.json's model_type)."""
    try:
        return bool(json.loads((path / "config.json").read_text()).get("model_type") == MODEL_TYPE)
    except (OSError, ValueError):
        return False


def load_speculator(path: Path, target: Target) -> MlpSpeculatorModel:
    """The speculator in `path` for `target`; ValueError (one line) when it does not fit the
    target or its files are incomplete."""
    config = MlpSpeculatorConfig.read(path)
    if config.emb_dim != target.hidden_size:
        raise ValueError(
            f"speculator {path} reads hidden states of {config.emb_dim}, the model's are {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        vocab = target.vocab_size
        raise ValueError(
            f"speculator {path} predicts a vocabulary of {config.vocab_size}, the model's has {vocab}"
        )
    tensors = _read_tensors(path)
    model = MlpSpeculatorModel(config)
    state = {}
    for name, source in weight_names(config).items():
        if source not in tensors:
            raise ValueError(f"speculator {path}: the weights have no {source}")
        state[name] = tensors[source]
    expected = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"speculator {path}: {name} is {tuple(tensor.shape)}, its config makes it "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=True)
    return model.to(device=target.device, dtype=target.dtype).eval()


def save_speculator(model: MlpSpeculatorModel, path: Path) -> None:
    """`model` in IBM's layout (config.json + model.safetensors, each tensor stored once)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.write(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    stored = sorted(set(weight_names(model.config).values()))
    save_file(
        {name: params[name].detach().contiguous().cpu() for name in stored}, str(path / "model.safetensors")
    )


def tree_shape(
    config: MlpSpeculatorConfig, n_candidates: int | None, top_k: Sequence[int] | None
) -> tuple[tuple[int, ...], int]:
    """The candidate tree to try: top tokens per head and chains, from SPECULATOR_TOP_K_TOKENS_PER_HEAD
    / SPECULATOR_N_CANDIDATES where set, else the speculator's config (top-1 per head where it
    names none); ValueError (one line) when they do not fit its heads."""
    heads = config.n_predict
    per_head = tuple(top_k) if top_k else config.top_k_tokens_per_head or (1,) * heads
    if len(per_head) != heads:
        raise ValueError(
            f"SPECULATOR_TOP_K_TOKENS_PER_HEAD {','.join(map(str, per_head))} names {len(per_head)} "
            f"heads, the speculator has {heads}"
        )
    if min(per_head) < 1:
        raise ValueError(f"SPECULATOR_TOP_K_TOKENS_PER_HEAD must be >= 1 per head, got {per_head}")
    count = n_candidates or config.n_candidates
    if count < 1:
        raise ValueError(f"SPECULATOR_N_CANDIDATES must be >= 1, got {count}")
    return per_head, count


class MlpSpeculator(Speculator):
    needs_hidden = True

    def __init__(
        self,
        model: MlpSpeculatorModel,
        path: Path,
        n_candidates: int | None = None,
        top_k: Sequence[int] | None = None,
    ) -> None:
        self.model = self.network = model
        self.heads = model.config.n_predict
        self.top_k, self.n_candidates = tree_shape(model.config, n_candidates, top_k)
        self.chains = min(self.n_candidates, math.prod(self.top_k))
        self.dtype = next(model.parameters()).dtype
        shape = f"{self.heads} heads"
        if self.chains > 1:
            top = ",".join(map(str, self.top_k))
            shape += f"; candidate tree: top {top} tokens per head, {self.chains} chains"
        elif model.use_cpu_kernel():
            # the kernel reads the heads' weights as loaded: no layout to choose for them
            self.network = None
            shape += "; chains on the CPU kernel"
        self.name = f"MLP speculator {path} ({shape})"

    def share_lm_head(self, panels: torch.Tensor) -> int:
        shared = self.model.read_lm_head(panels)
        if shared:
            self.name += f"; {shared} of its heads read the model's LM head (the same values)"
        return shared

    def propose(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]]:
        chains = self.propose_chains(requests, histories, limits, hidden, [False] * len(limits))
        return [found[0] if found else [] for found in chains]

    def propose_chains(
        self,
        requests: Sequence[int],
        histories: Sequence[Sequence[int]],
        limits: Sequence[int],
        hidden: torch.Tensor | None,
        several: Sequence[bool],
    ) -> list[list[list[int]]]:
        rows = [row for row, k in enumerate(limits) if k > 0]
        out: list[list[list[int]]] = [[] for _ in limits]
        if not rows or hidden is None:
            return out
        device = hidden.device
        last = torch.tensor([histories[row][-1] for row in rows], device=device)
        steps = min(self.heads, max(limits[row] for row in rows))
        trees = any(several[row] for row in rows)
        top_k = self.top_k[:steps] if trees else (1,) * steps
        # the rows that ask (all of them at c = 1: the states as they are, no copy)
        if len(rows) < len(limits):
            hidden = hidden.index_select(0, torch.tensor(rows, device=device))
        state = hidden.to(self.dtype)
        found = self.model.candidates(state, last, top_k, self.n_candidates if trees else 1).tolist()
        for row, chains in zip(rows, found, strict=True):
            out[row] = [chain[: limits[row]] for chain in (chains if several[row] else chains[:1])]
        return out
