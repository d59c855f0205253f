"""Steps of Llama-family models on CPU in one C++ call (kernels/csrc/decoder_cpu.cpp).

At batch 1 a decode step of the 30 M reference model took ~7 ms on a 2-core AMX Xeon, of which
~3 ms were its 57 matrix products: the rest was Python and operator dispatch of ~40 small tensor
operations per layer in transformers' modules. `CpuDecoder` runs the decoder stack in one call
over the model's own weights (the Linear layouts the engine chose, oneDNN packed or plain) and
the paged cache, leaving to Python the embedding lookup, the rotary table and the LM head:
decode-only steps over the runner's persistent buffers (`decode`), and any other step (prompts,
chunks, decode rows beside them, soft prompts spliced into the embeddings) from its StepLayout
(`forward`).

A Llama-family layer whose q, k and v (and gate and up) projections are all panels of one dtype
multiplies each group as one product (`fuse_panels`: their panels side by side, each projection's
weight a view of its part): fewer parallel regions a step, the same sums. Its rotary cos and
sin are rows of a table the model's rotary module computed once (`rotary_table`).

Which models: `llama`, `mistral`, `qwen2` and `granite` (their multipliers) with SiLU MLPs and
full-width rotary embeddings (`decoder_layers`), and the LayerNorm family with fused q|k|v
projections and GELU (`decoder_layers_ln`): `gpt2` and `gpt_bigcode` (learned positions),
`gpt_neox` (partial rotary embeddings, parallel residual). The decode attention must be our CPU
kernel (its K layout), one shard (no collectives inside). LoRA adapters apply inside the call
with our LoRA kernel (one call per projection that an adapter of the step targets) where the
step has few adapter tokens (decode steps: the kernel's limit, lora.KERNEL_MAX_WORK); other LoRA
steps run the modules, and so do quantized LayerNorm models.

CPU_FORWARD picks: `layers` (this, or a start-up error saying why not), `modules`
(transformers' forward) or `auto` (this where the model allows it, else the modules, the reason
logged).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from text_generation_server.attention.layout import StepLayout
from text_generation_server.kernels.weight_layout import OneDnnLinear, PackedLinear, PanelLinear
from text_generation_server.kv.paged_kv import PagedKVCache
from text_generation_server.lora import LoraLinear, LoraWeights, step_of
from text_generation_server.quantization import Int8Linear
from text_generation_server.quantization.grouped import GroupedLinear
from text_generation_server.quantization.int4 import torch_kernel_rows
from text_generation_server.quantization.int8 import EXACT, SPLIT

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "granite")
LAYER_NORM_TYPES = ("gpt2", "gpt_bigcode", "gpt_neox")  # decoder_layers_ln
ACTIVATIONS = ("silu", "swish")
LAYER_NORM_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")
# per model type: (the layers, first norm, fused q|k|v, attention output, second norm, MLP in, MLP
# out, final norm) as attribute paths, in decoder_layers_ln's order
LAYER_NORM_NAMES = {
    "gpt2": (
        "transformer.h", "ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj",
        "transformer.ln_f",
    ),
    "gpt_neox": (
        "gpt_neox.layers", "input_layernorm", "attention.query_key_value", "attention.dense",
        "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h", "gpt_neox.final_layer_norm",
    ),
}  # fmt: skip
LAYER_NORM_NAMES["gpt_bigcode"] = LAYER_NORM_NAMES["gpt2"]
# the projections decoder_layers multiplies together where their panels are fused (fuse_panels)
FUSED_GROUPS = (
    (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj")),
    (("mlp", "gate_proj"), ("mlp", "up_proj")),
)
PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


NO_ROWS = torch.empty(0, dtype=torch.long)  # a step without decode rows


@dataclass(frozen=True, slots=True)
class LoraArgs:
    """A step's LoRA adapters as the decoder op takes them: each token's adapter (`slots`, -1:
    none; None: no adapter in the step), then per projection one A, Bt and scale per adapter."""

    slots: torch.Tensor | None
    a: list[torch.Tensor | None]
    bt: list[torch.Tensor | None]
    scales: list[float]


NO_LORA = LoraArgs(None, [], [], [])


class Unsupported(ValueError):
    """This model or setting cannot take the C++ decoder stack (the message says why)."""


class Projection(NamedTuple):
    """A projection as decoder_cpu.cpp takes it."""

    # as the kernel takes it (int8: its range row; w8a8: its scales; grouped: its scales and offsets)
    weight: torch.Tensor
    bias: torch.Tensor | None  # (int8, w8a8: float32)
    onednn: bool  # oneDNN packed weights
    int8: Any = None  # oneDNN-packed int8 weights (quantization/int8.py's 8-bit way), else None
    w8a8: torch.Tensor | None = None  # int8 weights for our exact W8A8 kernel (int8.py's exact way)
    # weights in groups of input channels, else None: packed 4-bit (quantization/int4.py, uint8)
    # or 8-bit values (quantization/int8_groups.py, int8)
    grouped: torch.Tensor | None = None
    grouped_order: torch.Tensor | None = None  # such a layer's input channel order (act-order)
    out_features: int = 0


def _linear(module: Any) -> Projection:
    """A projection's weights as decoder_cpu.cpp takes them."""
    base = getattr(module, "base", module)  # a LoRA wrapper: the base module's weights
    if isinstance(base, PackedLinear):  # decoder_cpu.cpp knows panels by their 3 dimensions
        packed = base.packed_weight
        assert isinstance(packed, torch.Tensor)
        return Projection(packed, base.bias, isinstance(base, OneDnnLinear))
    if isinstance(base, Int8Linear):
        bias = base.bias_float
        assert bias is None or isinstance(bias, torch.Tensor)
        if base.way == SPLIT:  # only where our C++ kernels (this stack among them) are not here
            raise Unsupported("its int8 layers split each token's integers (our C++ kernels are not here)")
        if base.way == EXACT:
            ints, scales = base.ints, base.scales
            assert isinstance(ints, torch.Tensor) and isinstance(scales, torch.Tensor)
            return Projection(scales, bias, False, w8a8=ints)
        bounds = base.bounds
        assert isinstance(bounds, torch.Tensor)
        return Projection(bounds, bias, False, int8=base.packed)
    if isinstance(base, GroupedLinear):
        return Projection(
            base.scale_offset, base.bias_value, False, grouped=base.integers, grouped_order=base.order,
            out_features=base.out_features,
        )  # fmt: skip
    if type(base) is torch.nn.Linear:
        return Projection(base.weight, base.bias, False)
    raise Unsupported(
        f"its projections are {type(base).__name__}, not Linear"
    )  # GPT-2's Conv1D: see weight_layout.py


@dataclass(slots=True)
class CpuDecoder:
    model: Any
    projections: list[tuple[Any, str]]  # (owner module, attribute) of every projection, in order
    params: list[torch.Tensor | None]
    onednn: list[bool]
    int8: list[Any]  # per projection: its oneDNN-packed int8 weights (Projection), else None
    w8a8: list[torch.Tensor | None]  # per projection: its int8 weights for our W8A8 kernel, else None
    grouped: list[torch.Tensor | None]  # per projection: its weights in groups (Projection), else None
    grouped_order: list[torch.Tensor | None]  # per projection: such a layer's input order, else None
    grouped_out: list[int]  # per projection: such a layer's output features, else 0
    caches: list[torch.Tensor]
    heads: int
    kv_heads: int
    eps: float
    scale: float
    residual_multiplier: float
    embedding_multiplier: float
    logits_scaling: float
    block_size: int
    window: int
    family: str = "llama"  # or "layer_norm" (decoder_layers_ln)
    interleaved: bool = False  # layer_norm: the fused projection's output is [q, k, v] per head
    parallel_residual: bool = False  # layer_norm: GPT-NeoX's parallel attention and MLP
    activation: str = ""  # layer_norm: gelu_new, gelu_pytorch_tanh or gelu
    position_embeddings: Any = None  # layer_norm: the learned position table (wpe), or None
    rotary: Any = None  # layer_norm: the rotary embedding module (GPT-NeoX), or None
    # llama: per layer q|k|v's and gate|up's panels and biases where fused (fuse_panels), else empty
    fused: list[torch.Tensor | None] = field(default_factory=list)
    # llama: the rotary embedding's cos and sin of positions 0 .. n - 1 (rotary_table), or None
    rotary_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        lora: LoraArgs = NO_LORA,
    ) -> torch.Tensor:
        """A decode-only step: one token per row (`ids` [rows] at `positions`, its K/V to
        `slots`) -> logits [rows, vocab]."""
        hidden = self._layers(self.embed(ids), positions, slots, None, tables, lengths, [], [], [], lora)
        return self._logits(hidden)

    def forward(
        self,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        keep: torch.Tensor | None,
        lora: LoraArgs = NO_LORA,
    ) -> torch.Tensor:
        """Any step: the packed tokens' `embeddings` [T, hidden] (self.embed, soft prompts spliced
        in) at `positions` [T], attended as `layout` says -> logits of the tokens `keep` (all: None)."""
        rows = layout.decode
        decode, tables, lengths = NO_ROWS, None, None
        if rows is not None:
            tokens = rows.tokens
            decode = tokens if isinstance(tokens, torch.Tensor) else torch.arange(tokens.start, tokens.stop)
            tables, lengths = rows.tables, rows.lengths
        bounds = [value for alone in layout.others for value in (alone.start, alone.end, alone.keys)]
        blocks = [alone.blocks for alone in layout.others]
        masks = [alone.mask for alone in layout.others]
        hidden = self._layers(
            embeddings, positions, layout.slots, decode, tables, lengths, bounds, blocks, masks, lora
        )
        return self._logits(hidden if keep is None else hidden.index_select(0, keep))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `ids` [T] -> [T, hidden] (before Granite's multiplier)."""
        embeddings: torch.Tensor = self.model.get_input_embeddings()(ids)
        return embeddings

    def _layers(
        self,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        decode: torch.Tensor | None,
        tables: torch.Tensor | None,
        lengths: torch.Tensor | None,
        bounds: list[int],
        blocks: list[torch.Tensor | None],
        masks: list[torch.Tensor | None],
        lora: LoraArgs,
    ) -> torch.Tensor:
        if self.family == "layer_norm":  # transformers: inputs_embeds + wpe(position_ids)
            cos = sin = None
            if self.rotary is not None:
                cos, sin = (t[0] for t in self.rotary(embeddings.unsqueeze(0), positions.unsqueeze(0)))
            if self.position_embeddings is not None:
                embeddings = embeddings + self.position_embeddings(positions)
            out: torch.Tensor = torch.ops.tgis_cpu.decoder_layers_ln(
                embeddings.contiguous(), self.params, self.onednn, self.interleaved,
                self.parallel_residual, cos, sin, self.caches, slots, decode, tables, lengths, bounds, blocks,
                masks, lora.slots, lora.a, lora.bt, lora.scales, self.block_size, self.heads, self.kv_heads,
                self.eps, self.scale, self.window, self.activation,
            )  # fmt: skip
            return out
        if self.embedding_multiplier != 1.0:
            embeddings = embeddings * self.embedding_multiplier
        cos, sin = self._rotary(embeddings, positions)
        hidden: torch.Tensor = torch.ops.tgis_cpu.decoder_layers(
            embeddings.contiguous(), cos, sin, self.params, self.onednn, self.int8, self.w8a8,
            self.grouped, self.grouped_order, self.grouped_out, torch_kernel_rows(), self.fused, self.caches,
            slots, decode, tables, lengths, bounds, blocks, masks, lora.slots, lora.a, lora.bt, lora.scales,
            self.block_size, self.heads, self.kv_heads,
            self.eps, self.scale, self.residual_multiplier, self.window,
        )  # fmt: skip
        return hidden

    def table_rotary(self, positions: int) -> None:
        """Look the rotary cos and sin of positions 0 .. `positions` - 1 up in a table from now on
        (rotary_table; Llama family: the LayerNorm family's rotary is GPT-NeoX's own module)."""
        if self.family == "llama":
            self.rotary_table = rotary_table(self.model, positions)

    def _rotary(self, embeddings: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of `positions`: rows of the table where it holds them, else
        the model's rotary module."""
        if self.rotary_table is not None:
            cos, sin = self.rotary_table
            try:
                return cos.index_select(0, positions), sin.index_select(0, positions)
            except IndexError:  # a position past the table
                pass
        cos, sin = self.model.model.rotary_emb(embeddings.unsqueeze(0), positions.unsqueeze(0))
        return cos[0], sin[0]

    def lora_for(
        self, loras: Sequence[LoraWeights | None], repeats: Sequence[int], kernel: bool
    ) -> LoraArgs | None:
        """The LoRA arguments of a step whose pieces (`repeats` tokens each) use `loras`; None
        where the step's adapters are for the modules (more adapter tokens than our LoRA kernel
        serves, or no kernel)."""
        step = step_of(loras, torch.device("cpu"), False, repeats)
        if step is None:
            return NO_LORA
        step.kernel = kernel
        if not step.use_kernel(1):
            return None
        count = len(step.adapters)
        a: list[torch.Tensor | None] = []
        bt: list[torch.Tensor | None] = []
        scales: list[float] = []
        for owner, name in self.projections:
            module = getattr(owner, name)
            if isinstance(module, LoraLinear):
                args = module.kernel_args(step.adapters)
                a += args.a
                bt += args.bt
                scales += args.scales
            else:
                a += [None] * count
                bt += [None] * count
                scales += [0.0] * count
        return LoraArgs(step.slots, a, bt, scales)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.get_output_embeddings()(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits


def build(
    model: Any, cache: PagedKVCache, backend_name: str, world_size: int, window: int | None
) -> CpuDecoder:
    """The C++ decoder stack over `model`'s weights and `cache`; raise Unsupported saying why not."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if cache.device.type != "cpu":
        raise Unsupported(f"the model is on {cache.device.type}")
    if world_size > 1:
        raise Unsupported(f"the model is split over {world_size} shards")
    if backend_name != "cpu_kernel":
        raise Unsupported(f"decode attention runs on {backend_name}, not our CPU kernel")
    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"its dtype is {model.dtype}")
    if model_type in LAYER_NORM_TYPES:
        return _build_layer_norm(model, cache, window)
    if model_type not in MODEL_TYPES:
        raise Unsupported(f"it serves {', '.join(MODEL_TYPES + LAYER_NORM_TYPES)} models, not {model_type}")
    if getattr(config, "hidden_act", None) not in ACTIVATIONS:
        raise Unsupported(f"its MLP activation is {getattr(config, 'hidden_act', None)}, not SiLU")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("its rotary embedding covers part of each head")
    layers = list(model.model.layers)
    params: list[torch.Tensor | None] = []
    onednn: list[bool] = []
    int8: list[Any] = []
    w8a8: list[torch.Tensor | None] = []
    grouped: list[torch.Tensor | None] = []
    grouped_order: list[torch.Tensor | None] = []
    grouped_out: list[int] = []
    projections: list[tuple[Any, str]] = []
    fused: list[torch.Tensor | None] = []
    for layer in layers:
        attention = layer.self_attn
        if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
            raise Unsupported("its attention normalizes queries and keys")
        for group in FUSED_GROUPS:
            fused += fuse_panels([getattr(getattr(layer, owner), name) for owner, name in group])
        params.append(layer.input_layernorm.weight)
        for owner, name in PROJECTIONS:
            holder = getattr(layer, owner)
            projections.append((holder, name))
            projection = _linear(getattr(holder, name))
            params += [projection.weight, projection.bias]
            onednn.append(projection.onednn)
            int8.append(projection.int8)
            w8a8.append(projection.w8a8)
            grouped.append(projection.grouped)
            grouped_order.append(projection.grouped_order)
            grouped_out.append(projection.out_features)
            if name == "o_proj":
                params.append(layer.post_attention_layernorm.weight)
    params.append(model.model.norm.weight)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return CpuDecoder(
        model=model,
        projections=projections,
        params=[p.detach() if p is not None else None for p in params],
        onednn=onednn,
        int8=int8,
        w8a8=w8a8,
        grouped=grouped,
        grouped_order=grouped_order,
        grouped_out=grouped_out,
        caches=[cache.layers[i] for i in range(len(layers))],
        heads=heads,
        kv_heads=kv_heads,
        eps=float(layers[0].input_layernorm.variance_epsilon),
        scale=float(getattr(config, "attention_multiplier", None) or head_dim**-0.5),
        residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
        embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0)),
        logits_scaling=float(getattr(config, "logits_scaling", 1.0)),
        block_size=cache.pool.block_size,
        window=window or 0,
        fused=fused if any(t is not None for t in fused) else [],
    )


def rotary_table(model: Any, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cos and sin [positions, head_dim] the model's rotary module gives positions 0 ..
    positions - 1 (its own computation, once), so that a step looks its rows up instead of
    running the module's ~10 small operations; None for rotary embeddings that change with the
    sequence's length (dynamic NTK, LongRoPE: the module recomputes their frequencies)."""
    rotary = model.model.rotary_emb
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if positions <= 0 or "dynamic" in rope_type or rope_type == "longrope":
        return None
    with torch.inference_mode():
        probe = torch.empty(0, dtype=model.dtype, device=model.device)
        cos, sin = rotary(probe, torch.arange(positions, device=model.device).unsqueeze(0))
    return cos[0].contiguous(), sin[0].contiguous()


def fuse_panels(modules: Sequence[Any]) -> list[torch.Tensor | None]:
    """[panels, bias] of `modules` (projections of the same input) multiplied as one: their
    panels concatenated, each module's own weight becoming a view of its part, and their biases
    in float32 (as panel_linear adds them); [None, None] where they are not all panels of one
    input width and dtype, or only some have a bias. Each output's sum is the one it has alone."""
    bases = [getattr(module, "base", module) for module in modules]  # a LoRA wrapper: its base
    if not all(type(base) is PanelLinear for base in bases):
        return [None, None]
    packed = [base.packed_weight for base in bases]
    if len({(p.dtype, p.shape[1]) for p in packed}) != 1:
        return [None, None]
    biases = [base.bias for base in bases]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return [None, None]
    panels = torch.cat(packed)
    start = 0
    for base, part in zip(bases, packed, strict=True):
        base.packed_weight = panels[start : start + part.shape[0]]
        start += part.shape[0]
    bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases])
    return [panels, bias]


def _attribute(owner: Any, path: str) -> Any:
    for name in path.split("."):
        owner = getattr(owner, name)
    return owner


def _build_layer_norm(model: Any, cache: PagedKVCache, window: int | None) -> CpuDecoder:
    """build() for GPT-2, GPT-BigCode and GPT-NeoX (decoder_layers_ln)."""
    config = model.config
    neox = config.model_type == "gpt_neox"
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(
        config, "reorder_and_upcast_attn", False
    ):
        raise Unsupported("its attention scales by layer or upcasts")
    if getattr(config, "add_cross_attention", False):
        raise Unsupported("it has cross-attention")
    activation = config.hidden_act if neox else config.activation_function
    if activation not in LAYER_NORM_ACTIVATIONS:
        raise Unsupported(f"its MLP activation is {activation}, not GELU")
    layers_path, *parts, final_path = LAYER_NORM_NAMES[config.model_type]
    blocks = list(_attribute(model, layers_path))
    params: list[torch.Tensor | None] = []
    onednn: list[bool] = []
    projections: list[tuple[Any, str]] = []
    for block in blocks:
        for path in parts:
            part = _attribute(block, path)
            if isinstance(part, torch.nn.LayerNorm):
                params += [part.weight, part.bias]
                continue
            holder_path, _, name = path.rpartition(".")
            projection = _linear(part)
            if any(p is not None for p in (projection.int8, projection.w8a8, projection.grouped)):
                raise Unsupported("its layers are quantized")
            projections.append((_attribute(block, holder_path), name))
            params += [projection.weight, projection.bias]
            onednn.append(projection.onednn)
    final = _attribute(model, final_path)
    params += [final.weight, final.bias]
    caches = [cache.layers[i] for i in range(len(blocks))]
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    first_norm, attention = (
        _attribute(blocks[0], parts[0]),
        _attribute(blocks[0], parts[1].rpartition(".")[0]),
    )
    return CpuDecoder(
        model=model,
        projections=projections,
        params=[p.detach() if p is not None else None for p in params],
        onednn=onednn,
        int8=[],
        w8a8=[],
        grouped=[],
        grouped_order=[],
        grouped_out=[],
        caches=caches,
        heads=heads,
        kv_heads=int(caches[0].shape[1]) if caches else heads,
        eps=float(first_norm.eps),
        scale=float(getattr(attention, "scaling", head_dim**-0.5)),
        residual_multiplier=1.0,
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        block_size=cache.pool.block_size,
        window=window or 0,
        family="layer_norm",
        interleaved=neox or not getattr(config, "multi_query", True),  # GPT-BigCode without MQA too
        parallel_residual=neox and bool(config.use_parallel_residual),
        activation=activation,
        position_embeddings=None if neox else model.transformer.wpe,
        rotary=model.gpt_neox.rotary_emb if neox else None,
    )


def decoder_for(
    mode: str, model: Any, cache: PagedKVCache, backend_name: str, world_size: int, window: int | None
) -> CpuDecoder | None:
    """The decoder CPU_FORWARD (`mode`) asks for, or None for the model's modules; says which."""
    if mode == "modules":
        logger.info("forward: the model's modules (CPU_FORWARD=modules)")
        return None
    try:
        decoder = build(model, cache, backend_name, world_size, window)
    except Unsupported as exc:
        if mode == "layers":
            raise ValueError(
                f"CPU_FORWARD=layers: the C++ decoder stack cannot serve this model: {exc}"
            ) from None
        if cache.device.type == "cpu":
            logger.info("forward: the model's modules, because %s", exc)
        return None
    logger.info("forward: the decoder layers in one C++ call (csrc/decoder_cpu.cpp)")
    return decoder
