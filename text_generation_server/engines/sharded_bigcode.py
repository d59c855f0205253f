"""GPT-BigCode (IBM's granite-code, StarCoder) split over tensor-parallel ranks by our own layers.

transformers has no tensor-parallel plan for GPT-BigCode, and its multi-query attention (one
KV head) cannot be split by heads: every rank keeps the KV head whole (replicated, as TGIS
does) and takes 1/N of the query heads. In every block:

    attn.c_attn   rows [q | k | v]  -> this rank's query rows, then all the k and v rows  (column)
    attn.c_proj   this rank's input columns, all-reduce, then the bias                    (row)
    mlp.c_fc      this rank's rows                                                        (column)
    mlp.c_proj    this rank's input columns, all-reduce, then the bias                    (row)

Embeddings, norms and the LM head stay whole on every rank. The model is built on the meta
device with the local shapes and each rank reads only its rows / columns of the safetensors
files. Multi-head GPT-BigCode (multi_query=False) is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split over the ranks."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        torch.distributed.all_reduce(y)
        return y + self.bias


def check(hf_config: Any, shards: int) -> None:
    """Refuse, with one line, a GPT-BigCode model these layers cannot split over `shards`."""
    if not getattr(hf_config, "multi_query", True):
        raise ValueError(
            "multi-head GPT-BigCode models (multi_query=false) cannot be sharded: run them on one shard"
        )
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    for what, count in (("attention heads", hf_config.n_head), ("MLP features", inner)):
        if count % shards:
            raise ValueError(
                f"this model has {count} {what}, which do not divide over {shards} shards: "
                "choose a NUM_SHARD that divides it"
            )


def load(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    shards: int,
    attn_implementation: str | None,
) -> Any:
    """This rank's part of the GPT-BigCode model in `model_dir` (safetensors only)."""
    import transformers

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"sharded GPT-BigCode reads safetensors weights and {model_dir} has none: convert them "
            "with `text-generation-server convert-to-safetensors`"
        )
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kwargs)
    embed, head_dim = hf_config.n_embd, hf_config.n_embd // hf_config.n_head
    q_local = embed // shards
    inner_local = (hf_config.n_inner or 4 * embed) // shards
    slicers: dict[str, Any] = {}  # parameter name -> its rows/columns of the stored slice
    with torch.device("meta"):
        for i, block in enumerate(model.transformer.h):
            attn, mlp, name = block.attn, block.mlp, f"transformer.h.{i}"
            kv_rows = 2 * attn.kv_dim
            attn.c_attn = nn.Linear(embed, q_local + kv_rows, dtype=dtype)
            attn.c_proj = RowParallelLinear(q_local, embed, dtype)
            attn.embed_dim = attn.split_size = q_local  # the query width c_attn's output splits at
            attn.num_heads = q_local // head_dim
            attn.num_key_value_groups = attn.num_heads // attn.kv_heads
            mlp.c_fc = nn.Linear(embed, inner_local, dtype=dtype)
            mlp.c_proj = RowParallelLinear(inner_local, embed, dtype)
            q_rows = slice(rank * q_local, (rank + 1) * q_local)
            kv = slice(embed, embed + kv_rows)
            slicers[f"{name}.attn.c_attn.weight"] = lambda t, q=q_rows, kv=kv: torch.cat([t[q], t[kv]])
            slicers[f"{name}.attn.c_attn.bias"] = slicers[f"{name}.attn.c_attn.weight"]
            slicers[f"{name}.attn.c_proj.weight"] = lambda t, q=q_rows: t[:, q]
            rows = slice(rank * inner_local, (rank + 1) * inner_local)
            slicers[f"{name}.mlp.c_fc.weight"] = lambda t, r=rows: t[r]
            slicers[f"{name}.mlp.c_fc.bias"] = slicers[f"{name}.mlp.c_fc.weight"]
            slicers[f"{name}.mlp.c_proj.weight"] = lambda t, r=rows: t[:, r]
    model.to_empty(device=device)
    if getattr(hf_config, "tie_word_embeddings", True):
        model.lm_head.weight = model.transformer.wte.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.lm_head.weight is model.transformer.wte.weight
    wanted = set(params) - ({"lm_head.weight"} if tied else set())
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as stored:
            for key in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key not in params:
                    continue
                view = stored.get_slice(key)  # indexing it reads only those rows / columns
                slicer = slicers.get(key)
                tensor = slicer(view) if slicer is not None else view[:]
                with torch.no_grad():
                    params[key].copy_(tensor.to(dtype))
                wanted.discard(key)
    if wanted:
        raise ValueError(f"the safetensors files of {model_dir} lack {', '.join(sorted(wanted)[:3])}")
    return model
