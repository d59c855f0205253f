"""QUANTIZE=int8 on CPU (text_generation_server/quantization/int8.py): the int8 linear against the float
product, every way of multiplying against W8A8's integer products, our exact kernel's rounding,
batch invariance bit for bit, the model's logits against the unquantized model, both engines'
greedy tokens against the quantized model's own `generate`, the bytes, and the refusals; the
model-level tests run the 8-bit way (where this CPU's int8 products do not saturate) and our
exact kernel (on any CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.engines.conformance import alone
from tests.test_quantized_checkpoints import greedy
from text_generation_common.messages import GenerationRequest
from text_generation_server import quantization
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class
from text_generation_server.kernels import cpu_kernels
from text_generation_server.quantization import Int8Linear, int8, quantize_model
from text_generation_server.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(
    "onednn" not in torch.backends.quantized.supported_engines,
    reason="this torch has no oneDNN quantized engine",
)

PROMPTS = ((5, 17, 42, 99, 7, 300, 12), (1, 250, 251, 252), (9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_against_the_float_product(dtype, bias) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn_linear(96, 40, bias, dtype, gen)
    layer = Int8Linear.quantize(linear)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    x[1, 2] *= 40  # one token far larger than the others
    y = layer(x)
    assert y.shape == (2, 5, 40) and y.dtype == dtype
    reference = torch.nn.functional.linear(
        x.float(), linear.weight.float(), None if not bias else linear.bias.float()
    )
    error = (y.float() - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert error.max().item() < 0.03


def with_way(monkeypatch, way: str) -> None:
    """Int8 layers built after this multiply `way`: the 8-bit way only where this CPU's int8
    products do not saturate, the exact one where our C++ kernels build."""
    if way == int8.EIGHT_BIT and int8.products_saturate():
        pytest.skip("this CPU's int8 products saturate at 8 bits (no VNNI or AMX-INT8)")
    if way == int8.EXACT and not cpu_kernels.loads("skipped"):
        pytest.skip("our C++ kernels do not build here")
    monkeypatch.setattr(int8, "product_way", lambda: way)


WAYS = [int8.EIGHT_BIT, int8.EXACT, int8.SPLIT]


def w8a8(x: torch.Tensor, ints: torch.Tensor, scales: torch.Tensor, lowest: int = -128) -> torch.Tensor:
    """W8A8's definition in float64: each token's integers round(x / (max |x| / 127.5)), halves to
    even, clamped to [lowest, 127] (-128: the definition's), times the integer weights, scaled back."""
    steps = x.float().abs().amax(1, keepdim=True).clamp(min=int8.TINY) / 127.5
    integers = torch.round(x.float() / steps).clamp(lowest, 127).double()
    return (integers @ ints.double().t()) * (scales.double() * steps.double())


@pytest.mark.parametrize("way", WAYS)
def test_every_way_computes_w8a8s_integer_products(monkeypatch, way) -> None:
    """Each token rounded to round(127.5 x / max |x|) times the int8 weights, exactly (up to the
    float products' rounding): large integers against large weights, which saturate 8-bit
    products on CPUs without VNNI, a token far larger than the others, one of zeros; the exact
    kernel's and the split's rounding is the definition's even at a token's negative extreme
    (-127.5 steps: -128), the 8-bit kernel's may give -127 there (it does on a 2-core Zen 4 EPYC
    with AVX512-VNNI), and the seed's third token meets it."""
    with_way(monkeypatch, way)
    gen = torch.Generator().manual_seed(7)
    ints = torch.randint(-127, 128, (40, 256), generator=gen)
    ints[:4] = 127
    scales = torch.rand(40, generator=gen) / 100
    layer = Int8Linear(ints, scales, None, torch.float32)
    assert layer.way == way
    x = torch.randn(6, 256, generator=gen)
    x[0] = x[0].abs() + 2.0  # every value high in its token's range
    x[2] *= 50
    x[4] = 0.0
    if way != int8.EIGHT_BIT:
        x[5, 9] = -x[5].abs().max() - 1.0  # the negative extreme
    expected = w8a8(x, ints, scales)
    y = layer(x).double()
    if way == int8.EIGHT_BIT:  # each token as the definition has it, or with -127 at its negative extreme
        either = w8a8(x, ints, scales, lowest=-127)
        close = ((y - expected).abs() <= 1e-6 * expected.abs().max() + 1e-5 * expected.abs()).all(1)
        y = torch.where(close.unsqueeze(1), expected, y)
        expected = torch.where(close.unsqueeze(1), expected, either)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_exact_kernel_rounds_each_token_as_w8a8_defines_for_any_shape(dtype) -> None:
    """csrc/w8a8_cpu.cpp against the definition: 1 to 70 rows (passes of 1-4 rows, blocks of 32, a
    row alone over pairs of tasks or groups of 8 panels, AMX's tiles), input widths that are not multiples of
    16 (the tail), 1 to 300 outputs (a task's or a panel's tail, odd and even numbers of tasks a
    thread, groups of 8 or 4 panels and single ones), a row alone giving what it
    gives among others, bfloat16 and float16 outputs that are the float32 ones rounded, weights of
    -128; with identity weights its integers exactly, halves to even (quotients of k + 0.5) and a
    quotient of 127.49999 at the negative extreme (-127, where a reciprocal's product gives -128)."""
    if not cpu_kernels.loads("skipped"):
        pytest.skip("our C++ kernels do not build here")
    op = torch.ops.tgis_cpu.w8a8_linear
    gen = torch.Generator().manual_seed(3)
    shapes = ((1, 256, 40), (1, 100, 9), (1, 520, 64), (2, 100, 9), (3, 16, 1), (5, 33, 6), (33, 8, 3))
    # VNNI: a row alone through groups of 8 panels, more rows through groups of 4
    shapes += ((70, 520, 13), (1, 64, 300), (6, 48, 100))
    # AMX-INT8: 4 rows or more over inputs in tiles of 64 (one A tile through groups of 4 panels
    # and their tails, pairs of A tiles through pairs of panels, the rows left over)
    shapes += ((4, 64, 17), (16, 128, 40), (17, 256, 70), (45, 192, 300), (70, 64, 13))
    for rows, inputs, outputs in shapes:
        ints = torch.randint(-128, 128, (outputs, inputs), generator=gen, dtype=torch.int8)
        ints[0] = -128
        scales, bias = torch.rand(outputs, generator=gen) / 100, torch.randn(outputs, generator=gen)
        x = torch.randn(rows, inputs, generator=gen)
        x[0] = x[0].abs() + 2.0
        x = x.to(dtype)
        expected = w8a8(x, ints, scales) + bias.double()
        packed = torch.ops.tgis_cpu.w8a8_pack(ints)
        y = op(x, packed, scales, bias)
        assert y.dtype == dtype and y.shape == (rows, outputs)
        assert torch.equal(op(x[-1:], packed, scales, bias), y[-1:])
        if dtype != torch.float32:  # written in x's dtype: the float32 outputs rounded once
            assert torch.equal(y, op(x.float(), packed, scales, bias).to(dtype))
        tolerance = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())
    x = torch.zeros(2, 64)
    x[0, 0] = 127.5 * 0.25  # steps of exactly 0.25: every value below is a half step
    x[0, 1:] = (torch.arange(1, 64) - 32 + 0.5) * 0.25
    x[1] = torch.randn(64, generator=gen)
    x[1, 7] = -2.1152193546295166  # max |x|: -2.1152194 / (2.1152194 / 127.5) = -127.49999 in float32
    x[1] = x[1].clamp(-2.1, 2.1)
    x[1, 7] = -2.1152193546295166
    identity = torch.eye(64, dtype=torch.int8)
    steps = x.abs().amax(1, keepdim=True) / 127.5
    integers = op(x, torch.ops.tgis_cpu.w8a8_pack(identity), torch.ones(64), None) / steps
    expected = torch.round(x / steps).clamp(-128, 127)
    assert torch.equal(integers.round(), expected)
    assert (integers - expected).abs().max() < 1e-4
    assert expected[0, 2] == -30 and expected[0, 3] == -28  # -29.5 and -27.5: halves to even
    assert expected[1, 7] == -127


def test_the_way_follows_the_cpus_int8_products_and_our_kernels(monkeypatch) -> None:
    """Our exact kernel where oneDNN's products saturate or the CPU has AVX512-VNNI (with AMX or
    without), when it builds; else oneDNN's 8-bit product where it does not saturate; else the split."""
    way = int8.product_way.__wrapped__
    for flags, saturate, loads, expected in (
        ({"avx512_vnni", "avx512bw", "amx_int8"}, False, True, int8.EXACT),  # faster than oneDNN's tiles too
        ({"avx512_vnni", "avx512bw"}, False, True, int8.EXACT),  # ours reads the weights faster
        ({"avx_vnni"}, False, True, int8.EIGHT_BIT),  # AVX-VNNI alone: not measured against ours
        ({"avx2"}, True, True, int8.EXACT),
        ({"avx512_vnni", "avx512bw"}, False, False, int8.EIGHT_BIT),
        ({"avx2"}, True, False, int8.SPLIT),
    ):
        monkeypatch.setattr(int8, "cpu_flags", lambda flags=frozenset(flags): flags)
        monkeypatch.setattr(int8, "products_saturate", lambda saturate=saturate: saturate)
        monkeypatch.setattr(cpu_kernels, "loads", lambda otherwise, loads=loads: loads)
        assert way() == expected, (flags, saturate, loads)


def test_the_saturation_probe_follows_the_cpus_int8_instructions() -> None:
    """AVX512-VNNI and AMX-INT8 multiply int8 in 32 bits; AVX2 alone sums pairs in 16."""
    flags = cpu_flags()
    if flags & {"avx512_vnni", "amx_int8"}:
        assert not int8.products_saturate()
    elif "avx2" in flags and "avx_vnni" not in flags:
        assert int8.products_saturate()
    else:
        pytest.skip("neither kind of CPU")


@pytest.fixture(params=[int8.EIGHT_BIT, int8.EXACT])
def int8_way(request, monkeypatch) -> str:
    """The way the int8 layers QUANTIZE=int8 makes in this test multiply."""
    with_way(monkeypatch, request.param)
    return request.param


def nn_linear(
    inputs: int, outputs: int, bias: bool, dtype: torch.dtype, gen: torch.Generator
) -> torch.nn.Linear:
    linear = torch.nn.Linear(inputs, outputs, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outputs, inputs, generator=gen) / inputs**0.5)
        if bias:
            linear.bias.copy_(torch.randn(outputs, generator=gen))
    return linear.to(dtype)


def test_each_token_is_quantized_as_if_alone() -> None:
    """A token's output does not depend on the tokens beside it, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    layer = Int8Linear.quantize(nn_linear(64, 32, True, torch.bfloat16, gen))
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    x[4] *= 100
    x[7] *= 0.01
    batched = layer(x)
    for row in range(9):
        assert torch.equal(batched[row], layer(x[row : row + 1])[0])
        assert torch.equal(batched[row], layer(x[[row, 4]])[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_logits_stay_close_and_weights_shrink(tiny_model, dtype, int8_way) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model("llama"), dtype=getattr(torch, dtype)
    ).eval()
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "int8")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    layers = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == len(linears) > 0 and all(m.way == int8_way for m in layers)
    assert isinstance(quantized.lm_head, torch.nn.Linear)  # the LM head keeps its dtype
    dense = sum(m.weight.numel() for m in linears)
    # 1 byte a weight and 4 (a scale) an output channel: within 0.55 of bf16's 2 bytes a weight
    # (issue 29's bound) from 40 input channels on (this model's layers take 64 or 128)
    weight_bytes = sum(m.weight_bytes() for m in layers)
    assert weight_bytes == dense + 4 * sum(m.out_features for m in linears)
    # what the shard reports holding: the exact way's weights as buffers, the 8-bit way's packed
    # (and its range rows as buffers), each counted once
    resident = quantization.resident_bytes(quantized) - quantization.resident_bytes(model)
    bounds = sum(4 * m.in_features for m in layers if m.way != int8.EXACT)
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert resident == weight_bytes + bounds - dense_bytes
    cosines = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            a, b = model(ids).logits[0, -1].float(), quantized(ids).logits[0, -1].float()
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=0).item())
    assert sum(cosines) / len(cosines) >= 0.99, cosines


@pytest.mark.parametrize("engine", ["hf_transformers", "tgis_native"])
def test_engines_serve_the_quantized_models_own_generate(tiny_model, engine, int8_way) -> None:
    path = tiny_model("llama")
    config = ServerConfig(
        model_name=str(path),
        deployment_framework=engine,
        dtype="float32",
        quantize="int8",
        max_batch_size=4,
        max_sequence_length=128,
        max_new_tokens=16,
    )
    served = get_engine_class(engine)(config)
    assert any(isinstance(m, Int8Linear) and m.way == int8_way for m in served.model.modules())
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_model(reference, "int8")
    for i, prompt in enumerate(PROMPTS):
        assert alone(served, GenerationRequest(i, prompt, 10)) == greedy(reference, prompt, 10)


@pytest.mark.parametrize("way", WAYS)
def test_the_cpp_decoder_stack_runs_int8_layers_as_the_modules_do(tiny_model, monkeypatch, way) -> None:
    """The 8-bit way on oneDNN's packed weights, the exact way on our kernel; split layers (only
    where our C++ kernels, this stack among them, are not here) are refused with the reason."""
    from tests.engines.test_cpu_decoder import both_logits, started
    from tests.engines.test_tgis_native import config_for
    from text_generation_server.engines.tgis_native import TgisNativeEngine

    with_way(monkeypatch, way)
    config = config_for(tiny_model("llama"), quantize="int8", cpu_forward="layers")
    if way == int8.SPLIT:
        refusal = r"C\+\+ decoder stack cannot serve this model: its int8 layers split"
        with pytest.raises(ValueError, match=refusal):
            TgisNativeEngine(config)
        return
    engine = TgisNativeEngine(config)
    decoder = engine.runner.decoder
    assert decoder is not None
    assert all((p is not None) == (way == int8.EIGHT_BIT) for p in decoder.int8)
    assert all((p is not None) == (way == int8.EXACT) for p in decoder.w8a8)
    batch = started(engine, [5, 17, 9])
    for ids in ([7, 8, 9], [300, 2, 41]):
        ours, theirs = both_logits(engine, batch, ids)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_refusals(tiny_model) -> None:
    cuda = torch.device("cuda")
    with pytest.raises(
        ValueError,
        match=r"^QUANTIZE=int8 runs on CPU \(our int8 / int4 layers, bitsandbytes' CPU backend\), "
        r"not on cuda$",
    ):
        quantization.check("int8", "tgis_native", cuda)
    quantization.check(None, "hf_optimum_ort", cuda)
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("gpt2"))
    with pytest.raises(ValueError, match=r"^QUANTIZE=int8: this model has no Linear layers to quantize$"):
        quantize_model(gpt2, "int8")
    with pytest.raises(ValueError, match=r"QUANTIZE=int8 is served by tgis_native and hf_transformers"):
        ServerConfig(
            model_name=str(tiny_model("llama")), deployment_framework="hf_optimum_ort", quantize="int8"
        )


def test_lora_on_an_int8_base_is_the_same_on_both_forward_paths(tiny_model, tmp_path, int8_way) -> None:
    from tests.adapter_helpers import engine_with_store
    from tests.engines.conformance import Runner
    from text_generation_server.testing.tiny_prompts import build_lora

    base = tiny_model("llama")
    build_lora(base, tmp_path / "a", 1, 6, ["q_proj", "v_proj", "down_proj"])
    requests = [GenerationRequest(1, PROMPTS[0], 8, adapter_id="a"), GenerationRequest(2, PROMPTS[0], 8)]
    outputs = {}
    for mode in ("layers", "modules"):
        engine = engine_with_store("tgis_native", base, tmp_path, quantize="int8", cpu_forward=mode)
        assert (engine.runner.decoder is not None) == (mode == "layers")
        assert any(isinstance(m, Int8Linear) and m.way == int8_way for m in engine.model.modules())
        outputs[mode] = Runner(engine).run({0: requests})
    assert outputs["layers"] == outputs["modules"]
    assert outputs["layers"][1] != outputs["layers"][2]  # the adapter matters
