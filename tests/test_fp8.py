"""QUANTIZE=fp8 (text_generation_server/quantization/fp8.py): the fp8 linear against its definition
and the float product, each token quantized as if alone, the model's logits against the
unquantized model and its weight bytes (on the CPU, where torch's scaled product runs the same
layer); on a GPU with fp8 (marked gpu): the Triton row kernel against the torch operations, and
both engines' greedy tokens against the quantized model's own `generate`; every refusal's line."""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from tests.engines.conformance import alone
from tests.test_quantization import nn_linear
from tests.test_quantized_checkpoints import greedy
from text_generation_common.messages import GenerationRequest
from text_generation_common.quantize import refusal
from text_generation_server import quantization
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class
from text_generation_server.engines.loading import load_pretrained
from text_generation_server.kernels import fp8_rows_triton
from text_generation_server.quantization import Fp8Linear, checkpoints, fp8, quantize_model
from text_generation_server.testing.quantized_models import (
    as_autofp8,
    build_autofp8,
    build_compressed_tensors,
)

PROMPTS = ((5, 17, 42, 99, 7, 300, 12), (1, 250, 251, 252), (9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13))
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY,
    reason="needs a GPU with fp8 tensor cores (Hopper or newer)",
)


def random_linear(inputs: int, outputs: int, bias: bool, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    linear = nn_linear(inputs, outputs, bias, dtype, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        linear.weight[3] *= 30  # a channel far larger than the others
    return linear


def tokens(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[1] *= 50  # a token far larger than the others
    x[2] = 0  # and one of zeros
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_linear_is_its_definition_and_near_the_float_product(dtype, bias) -> None:
    linear = random_linear(96, 48, bias, dtype, seed=0)
    layer = Fp8Linear.quantize(linear)
    assert layer.weight.dtype == fp8.FP8 and layer.scales.shape == (1, 48)
    x = tokens(5, 96, dtype, seed=1).reshape(1, 5, 96)
    y = layer(x)
    assert y.shape == (1, 5, 48) and y.dtype == dtype
    # the definition: both sides rounded to fp8 per row, scaled back, multiplied in float32
    x_back = DefinedFp8.rounded(x[0].float())
    w_back = layer.weight.float() * layer.scales.t()
    defined = x_back @ w_back.t() + (linear.bias.float() if bias else 0)
    torch.testing.assert_close(y[0].float(), defined, atol=2e-2, rtol=1e-2)
    assert torch.equal(y[0, 2], linear.bias.to(dtype) if bias else torch.zeros(48, dtype=dtype))
    exact = torch.nn.functional.linear(
        x[0].float(), linear.weight.float(), linear.bias.float() if bias else None
    )
    error = (y[0].float() - exact).norm(dim=-1) / exact.norm(dim=-1).clamp(min=1e-6)
    assert error[[0, 1, 3, 4]].max().item() < 0.06, error  # e4m3 keeps 3 mantissa bits


def test_each_token_is_quantized_as_if_alone() -> None:
    layer = Fp8Linear.quantize(random_linear(64, 32, True, torch.bfloat16, seed=2))
    x = tokens(9, 64, torch.bfloat16, seed=3)
    batched = layer(x)
    for row in range(9):
        assert torch.equal(batched[row], layer(x[row : row + 1])[0])
        assert torch.equal(batched[row], layer(x[[row, 1]])[0])


def test_widths_the_fp8_product_cannot_take_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^fp8 products need widths that are multiples of 16, got 40 -> 32$"
    ):
        Fp8Linear.quantize(random_linear(40, 32, False, torch.float32, seed=4))


class DefinedFp8(torch.nn.Module):
    """The fp8 layer as defined: each token and each weight row rounded to e4m3 at its own scale
    (max |row| / 448) and scaled back, their float32 product rounded to bf16 (the product's
    output), then the bias."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(self.rounded(linear.weight.detach().float()), requires_grad=False)
        self.bias = linear.bias

    @staticmethod
    def rounded(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=fp8.TINY) / fp8.FP8_MAX
        return (x / scale).to(fp8.FP8).float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(self.rounded(x.float()), self.weight).to(torch.bfloat16).to(x.dtype)
        return out if self.bias is None else out + self.bias


def last_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(torch.tensor([prompt])).logits[0, -1].float() for prompt in PROMPTS]


def mean_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    cosines = [torch.nn.functional.cosine_similarity(x, y, dim=0).item() for x, y in zip(a, b, strict=True)]
    return sum(cosines) / len(cosines)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_quantized_model_is_its_definition_and_its_weights_halve(tiny_model, dtype) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model("llama"), dtype=getattr(torch, dtype)
    ).eval()
    quantized, defined = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(quantized, "fp8")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    assert sum(isinstance(m, Fp8Linear) for m in quantized.modules()) == len(linears) > 0
    assert type(quantized.lm_head) is torch.nn.Linear  # the LM head keeps its dtype
    dense = sum(m.weight.numel() for m in linears)
    layers = [m for m in quantized.modules() if isinstance(m, Fp8Linear)]
    assert sum(m.weight_bytes() for m in layers) == dense + 4 * sum(m.out_features for m in linears)
    assert sum(m.weight_bytes() for m in layers) <= 0.55 * 2 * dense
    assert quantization.resident_bytes(quantized) < quantization.resident_bytes(model)
    for parent in list(defined.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not defined.lm_head:
                setattr(parent, name, DefinedFp8(child))
    ours, reference = last_logits(quantized), last_logits(defined)
    assert mean_cosine(ours, reference) >= (0.9999 if dtype == "float32" else 0.995)
    # e4m3 keeps 3 mantissa bits: on these random Gaussian weights each layer is ~4 % off (int8
    # per channel ~1 %), so the logits sit further from the unquantized model's than int8's
    assert mean_cosine(ours, last_logits(model)) >= 0.85


# ---- fp8 checkpoints: compressed-tensors FP8_DYNAMIC and FP8, AutoFP8's layout ---------------------

DESCRIBED = {
    "FP8_DYNAMIC": "compressed-tensors fp8 weights, per output channel, symmetric, fp8 activations per token",
    "FP8": (
        "compressed-tensors fp8 weights, per tensor, symmetric, fp8 activations per tensor (static scales)"
    ),
    "AutoFP8": "fp8 fp8 weights, per tensor, symmetric, fp8 activations per tensor (static scales)",
}
NAMED = {
    "FP8_DYNAMIC": "compressed-tensors FP8_DYNAMIC",
    "FP8": "compressed-tensors FP8",
    "AutoFP8": "fp8, activation_scheme static",
}


@dataclass(frozen=True)
class Fp8Checkpoint:
    kind: str
    path: Path
    oracle: Path  # the same tensors in compressed-tensors' layout, which transformers runs on CPU


@pytest.fixture(scope="module", params=list(DESCRIBED))
def fp8_checkpoint(request, tiny_model, tmp_path_factory) -> Fp8Checkpoint:
    """The tiny Llama written by compressed-tensors with llm-compressor's preset: FP8_DYNAMIC
    (weights per channel, each token's activations at its own scale) or FP8 (weights per
    tensor, activations at a scale per layer calibrated on random tokens); or FP8's tensors in
    AutoFP8's layout (`quant_method: fp8`, `activation_scheme: static`)."""
    pytest.importorskip("compressed_tensors", reason="writing the checkpoint needs compressed-tensors")
    kind, model = request.param, tiny_model("llama")
    if kind == "AutoFP8":  # the same tensors: the compressed-tensors checkpoint is the oracle
        oracle = build_compressed_tensors(model, tmp_path_factory.mktemp("fp8"), "FP8")
        path = shutil.copytree(oracle, tmp_path_factory.mktemp("autofp8") / "model")
        return Fp8Checkpoint(kind, as_autofp8(path), oracle)
    path = build_compressed_tensors(model, tmp_path_factory.mktemp("fp8"), kind)
    return Fp8Checkpoint(kind, path, path)


def test_an_fp8_checkpoint_reads_into_fp8_layers_that_are_the_packages(fp8_checkpoint) -> None:
    """Each layer read from the checkpoint computes what compressed-tensors' own layer computes
    (its weights dequantized, each token rounded to fp8 at max |x| / 448, or every token at the
    layer's stored scale, saturating beyond it), within the bf16 rounding of the fp8 product's
    output; the model's logits stay near the package's."""
    path = fp8_checkpoint.path
    config = transformers.AutoConfig.from_pretrained(path)
    plan = checkpoints.plan(config, path)
    assert plan.floating and plan.describe() == DESCRIBED[fp8_checkpoint.kind]
    assert plan.fp8_name == NAMED[fp8_checkpoint.kind]
    ours = checkpoints.load_model(transformers.AutoModelForCausalLM, path, config, plan, torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(fp8_checkpoint.oracle, dtype=torch.float32)
    theirs.eval()
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 14  # 7 projections x 2 layers; the LM head stays dense
    with torch.inference_mode():  # the package decompresses its weights at the first forward
        ours_logits = [ours(torch.tensor([p])).logits[0].float() for p in PROMPTS]
        their_logits = [theirs(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for name, layer in layers.items():
            x = torch.randn(1, 5, layer.in_features, generator=gen)  # the package's tokens are 3-D
            x[0, 1] *= 40
            expected = theirs.get_submodule(name)(x)
            scale = expected.abs().max().item()
            torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2 * scale)
    # every layer's output rounded to bf16 moves some of the next layer's fp8 roundings a step
    cosine = min(
        torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        for a, b in zip(ours_logits, their_logits, strict=True)
    )
    assert cosine >= 0.98


def test_an_fp8_checkpoint_is_refused_where_fp8_cannot_run(fp8_checkpoint) -> None:
    config = ServerConfig(
        model_name=str(fp8_checkpoint.path), deployment_framework="tgis_native", dtype="float32"
    )
    with pytest.raises(ValueError) as error:
        load_pretrained(config)
    if not torch.cuda.is_available():
        assert str(error.value) == (
            f"this checkpoint's fp8 weights ({NAMED[fp8_checkpoint.kind]}) run on GPUs with fp8 tensor "
            "cores (Hopper or newer: compute capability 9.0), not on cpu"
        )


def test_refusals() -> None:
    with pytest.raises(
        ValueError,
        match=r"^QUANTIZE=fp8 runs on GPUs with fp8 tensor cores \(Hopper or newer: compute "
        r"capability 9\.0\), not on cpu; on CPU use int8$",
    ):
        quantization.check("fp8", "tgis_native", torch.device("cpu"))
    assert refusal("fp8", "tgis_native") is None and refusal("fp8", "hf_transformers") is None
    assert refusal("fp8", "tgis_native", 2) == "QUANTIZE=fp8 is not served on 2 shards yet (NUM_SHARD=1)"
    assert (
        refusal("fp8", "hf_optimum_ort")
        == "QUANTIZE=fp8 is served by tgis_native and hf_transformers, not hf_optimum_ort"
    )
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        with pytest.raises(ValueError, match=r"not on compute capability \d\.\d; on CPU use int8$"):
            quantization.check("fp8", "tgis_native", torch.device("cuda"))


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_triton_rows_are_the_torch_rows(dtype) -> None:
    assert fp8_rows_triton.available()
    for rows, width in ((1, 64), (7, 2048), (130, 8192), (3, 1000)):
        x = tokens(max(rows, 3), width, dtype, seed=rows)[:rows].cuda()
        values, scales = fp8.quantize_rows(x)  # Triton on CUDA
        wide = x.float()
        expected_scales = wide.abs().amax(-1, keepdim=True).clamp(min=fp8.TINY) / fp8.FP8_MAX
        expected = (wide / expected_scales).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        assert torch.equal(scales, expected_scales)
        assert torch.equal(values.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@HOPPER
def test_the_fp8_linear_on_the_gpu_is_the_one_on_the_cpu() -> None:
    layer = Fp8Linear.quantize(random_linear(256, 128, True, torch.bfloat16, seed=5))
    x = tokens(12, 256, torch.bfloat16, seed=6)
    on_gpu = copy.deepcopy(layer).cuda()(x.cuda()).cpu()
    torch.testing.assert_close(on_gpu, layer(x), atol=2e-2, rtol=2e-2)


def served_as_its_own_generate(engine: str, model: Path, quantize: str | None) -> None:
    """The engine's greedy tokens are those of transformers' generate over the same fp8 layers."""
    config = ServerConfig(
        model_name=str(model),
        deployment_framework=engine,
        dtype="float32",
        quantize=quantize,
        max_batch_size=4,
        max_sequence_length=128,
        max_new_tokens=16,
    )
    served = get_engine_class(engine)(config)
    assert sum(isinstance(m, Fp8Linear) for m in served.model.modules()) == 14
    reference = load_pretrained(config).model  # the same layers, run by transformers' generate
    for i, prompt in enumerate(PROMPTS):
        assert alone(served, GenerationRequest(i, prompt, 10)) == greedy(reference, prompt, 10)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("engine", ["hf_transformers", "tgis_native"])
def test_engines_serve_quantize_fp8_as_its_own_generate(tiny_model, engine) -> None:
    served_as_its_own_generate(engine, tiny_model("llama"), "fp8")


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("engine", ["hf_transformers", "tgis_native"])
def test_engines_serve_fp8_checkpoints_as_their_own_generate(fp8_checkpoint, engine) -> None:
    served_as_its_own_generate(engine, fp8_checkpoint.path, None)


def test_fp8_variants_outside_the_two_schemes_are_refused_with_one_line(tmp_path) -> None:
    from types import SimpleNamespace

    def declared(weights: dict, inputs: dict | None) -> SimpleNamespace:
        group = {"weights": {"type": "float", "num_bits": 8, "symmetric": True, **weights}}
        group["input_activations"] = inputs
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"g": group},
        }
        return SimpleNamespace(quantization_config=config)

    static = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
    plan = checkpoints.plan(declared({"strategy": "channel"}, static), tmp_path)
    assert plan.static_inputs and not plan.per_tensor and plan.fp8_name == "compressed-tensors FP8"
    for weights, inputs in (
        ({"strategy": "block"}, static),  # fp8 in blocks (DeepSeek's layout)
        ({"strategy": "tensor"}, {**static, "strategy": "token"}),  # static per token: no such scales
        ({"strategy": "tensor"}, None),  # weight-only fp8
    ):
        with pytest.raises(ValueError) as error:
            checkpoints.plan(declared(weights, inputs), tmp_path)
        assert str(error.value).startswith("compressed-tensors float-quantized with 8-bit float")
        assert "\n" not in str(error.value)


def test_autofp8_variants_outside_one_scale_per_tensor_are_refused_with_one_line(tmp_path) -> None:
    from types import SimpleNamespace

    def plan(**declared) -> checkpoints.Plan:
        return checkpoints.plan(
            SimpleNamespace(quantization_config={"quant_method": "fp8", **declared}), tmp_path
        )

    dynamic = plan(activation_scheme="dynamic")
    assert not dynamic.static_inputs and dynamic.fp8_name == "fp8, activation_scheme dynamic"
    with pytest.raises(
        ValueError, match=r"^fp8 checkpoints with block-wise scales \(weight_block_size \[128, 128\]\)"
    ):
        plan(activation_scheme="dynamic", weight_block_size=[128, 128])  # transformers' FineGrainedFP8
    with pytest.raises(ValueError, match=r"^fp8 checkpoints with a quantized KV cache are not served$"):
        plan(activation_scheme="static", kv_cache_quant_targets=["k_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"^fp8 checkpoints with activation_scheme 'per-row' are not served"):
        plan(activation_scheme="per-row")


def test_quantize_fp8_on_an_autofp8_checkpoint_reads_it_as_it_is(tiny_model, tmp_path, monkeypatch) -> None:
    """QUANTIZE=fp8 names AutoFP8's quant_method too: such a checkpoint is served with its own
    scales (static input scales kept), not quantized a second time. The device check is lifted
    so that the loader runs here on the CPU (its fp8 layers compute their definition there)."""
    pytest.importorskip("compressed_tensors", reason="writing the checkpoint needs compressed-tensors")
    monkeypatch.setattr(quantization, "_without_fp8", lambda device: None)
    monkeypatch.setattr(quantization, "check", lambda *args: None)
    path = build_autofp8(tiny_model("llama"), tmp_path / "autofp8")
    config = ServerConfig(
        model_name=str(path), deployment_framework="tgis_native", dtype="float32", quantize="fp8"
    )
    model = load_pretrained(config).model
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 14 and all(m.input_scale is not None for m in layers)
