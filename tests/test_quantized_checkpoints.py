"""Pre-quantized checkpoints (text_generation_server/quantization/checkpoints.py) and bitsandbytes:
GPTQ and compressed-tensors files made offline from the tiny Llama (testing/quantized_models.py),
served by both engines with greedy output equal to the reference forward token for token in
float32 (GPTQ: a slow dequantization written here from the format's definition; compressed-
tensors: transformers' own loader with the compressed-tensors package), logits close in bf16,
the same tokens alone and in a busy batch with joins, and every refusal in one line."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.engines.conformance import Runner, alone
from text_generation_common.messages import GenerationRequest
from text_generation_server import quantization
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class
from text_generation_server.engines.loading import load_pretrained
from text_generation_server.quantization import Int4Linear, Int8GroupLinear, Int8Linear
from text_generation_server.quantization.checkpoints import unpack_ints
from text_generation_server.quantization.int4 import BLOCK, KERNEL_MAX_ROWS, pack, torch_kernel_rows
from text_generation_server.testing.quantized_models import (
    build_awq,
    build_compressed_tensors,
    build_gptq,
    pack_ints,
)
from text_generation_server.utils.cpu import cpu_flags

AMX = frozenset({"amx_tile", "amx_bf16", "amx_int8", "avx512vbmi"})  # what the tile products need

PROMPTS = ((5, 17, 42, 99, 7, 300, 12), (1, 250, 251, 252), (9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13))
GROUP = 32  # the tiny Llama's layers are 64 and 128 wide
CHECKPOINTS = {  # name -> how it is made
    "gptq-act-order": lambda src, out: build_gptq(src, out, GROUP, act_order=True),
    "gptq-v2-zeros": lambda src, out: build_gptq(
        src, out, GROUP, symmetric=False, checkpoint_format="gptq_v2"
    ),
    "gptq-per-channel": lambda src, out: build_gptq(src, out, -1),
    "gptq-8bit-act-order": lambda src, out: build_gptq(src, out, GROUP, act_order=True, bits=8),
    "gptq-8bit-v2-zeros": lambda src, out: build_gptq(
        src, out, GROUP, symmetric=False, checkpoint_format="gptq_v2", bits=8
    ),
    "gptq-8bit-per-channel": lambda src, out: build_gptq(src, out, -1, calibration=None, bits=8),
    "awq": lambda src, out: build_awq(src, out, GROUP),
    "ct-w8a8": lambda src, out: build_compressed_tensors(src, out, "W8A8"),
    "ct-w4a16": lambda src, out: build_compressed_tensors(src, out, "W4A16", GROUP),
    "ct-w4a16-zeros": lambda src, out: build_compressed_tensors(src, out, "W4A16_ASYM", GROUP),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = CHECKPOINTS[name](tiny_model("llama"), tmp_path_factory.mktemp(name))
        return built[name]

    return get


def reference(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's reference forward: GPTQ dequantized here, slowly, from the format's
    definition; compressed-tensors through transformers and the package, except W4A16 with zero
    points (transformers 5.23 cannot load its packed zero points) dequantized with the package's
    own unpacking."""
    declared = json.loads((path / "config.json").read_text())["quantization_config"]
    if (
        declared["quant_method"] == "compressed-tensors"
        and declared["config_groups"]["group_0"]["weights"]["symmetric"]
    ):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return model
    plain = dict(declared)
    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config)
    stored = load_file(path / "model.safetensors")
    model.load_state_dict({k: v for k, v in stored.items() if k in model.state_dict()}, strict=False)
    for name, module in model.named_modules():
        if f"{name}.qweight" in stored and plain["quant_method"] == "awq":
            module.weight.data.copy_(awq_weight(stored, name))
        elif f"{name}.qweight" in stored:
            module.weight.data.copy_(gptq_weight(stored, name, plain["checkpoint_format"], plain["bits"]))
        elif f"{name}.weight_packed" in stored:
            module.weight.data.copy_(packed_weight(stored, name))
    return model.to(dtype).eval()


def gptq_weight(
    stored: dict[str, torch.Tensor], name: str, checkpoint_format: str, bits: int
) -> torch.Tensor:
    qweight, qzeros = stored[f"{name}.qweight"], stored[f"{name}.qzeros"]
    per, top = 32 // bits, 2**bits - 1  # values per int32, the largest value
    ints = torch.zeros(qweight.shape[0] * per, qweight.shape[1])
    for row in range(ints.shape[0]):  # input channel k sits in word k // per at bits `bits` (k % per)
        ints[row] = ((qweight[row // per] >> (bits * (row % per))) & top).float()
    zeros = torch.zeros(qzeros.shape[0], qzeros.shape[1] * per)
    for col in range(zeros.shape[1]):
        zeros[:, col] = ((qzeros[:, col // per] >> (bits * (col % per))) & top).float()
    if checkpoint_format == "gptq":
        zeros += 1
    groups = stored[f"{name}.g_idx"].long()
    return ((ints - zeros[groups]) * stored[f"{name}.scales"].float()[groups]).t()


def awq_weight(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """AutoAWQ's GEMM layout: nibble i of each int32 holds output channel [0, 2, 4, 6, 1, 3, 5, 7][i]
    of its eight; rows are input channels (weights) or groups (zero points)."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def channels(words: torch.Tensor) -> torch.Tensor:
        values = torch.zeros(words.shape[0], words.shape[1] * 8)
        for word in range(words.shape[1]):
            for nibble in range(8):
                values[:, 8 * word + order[nibble]] = ((words[:, word] >> (4 * nibble)) & 15).float()
        return values

    ints, zeros = channels(stored[f"{name}.qweight"]), channels(stored[f"{name}.qzeros"])
    scales = stored[f"{name}.scales"].float()
    group = ints.shape[0] // scales.shape[0]
    return ((ints - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)).t()


def packed_weight(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = torch.Size(stored[f"{name}.weight_shape"].tolist())
    ints = unpack_from_int32(stored[f"{name}.weight_packed"], 4, shape).float()
    scales = stored[f"{name}.weight_scale"].float()
    zeros = unpack_from_int32(stored[f"{name}.weight_zero_point"], 4, scales.shape, packed_dim=0).float()
    group = shape[1] // scales.shape[1]
    return (ints - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


def served(path: Path, engine: str, dtype: str = "float32", **kwargs) -> object:
    config = ServerConfig(
        model_name=str(path),
        deployment_framework=engine,
        dtype=dtype,
        max_batch_size=4,
        max_sequence_length=128,
        max_new_tokens=16,
        **kwargs,
    )
    return get_engine_class(engine)(config)


def greedy(model: Any, prompt: tuple[int, ...], new: int) -> list[int]:
    """`new` tokens of transformers' greedy `generate` after `prompt`, on the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


# ---- the layers ---------------------------------------------------------------------------------


def random_groups(
    gen: torch.Generator, out_features: int, in_features: int, group: int, bits: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random `bits`-bit integers [out, in], scales (below `scale`) and zero points [out, in / group],
    and the weights they define."""
    ints = torch.randint(0, 2**bits, (out_features, in_features), generator=gen)
    scales = torch.rand(out_features, in_features // group, generator=gen) * scale
    zeros = torch.randint(0, 2**bits, scales.shape, generator=gen).float()
    weight = (ints - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    return ints, scales, zeros, weight


@pytest.mark.parametrize("bits", [4, 8])
def test_ints_pack_and_unpack_along_either_dimension(bits) -> None:
    values = torch.randint(0, 2**bits, (16, 24), generator=torch.Generator().manual_seed(0))
    for dim in (0, 1):
        assert torch.equal(unpack_ints(pack_ints(values, dim, bits), dim, bits).long(), values)


def packed_in_blocks(q: torch.Tensor, block: int) -> torch.Tensor:
    """The slow form of torch's CPU int4 layout with `block` output rows a block: byte i of input
    channel k holds row i in its low nibble and row block / 2 + i in its high one."""
    out, in_features = q.shape
    packed = torch.empty(out // block, in_features, block // 2, dtype=torch.uint8)
    for b in range(out // block):
        for k in range(in_features):
            for i in range(block // 2):
                packed[b, k, i] = int(q[b * block + i, k]) | int(q[b * block + block // 2 + i, k]) << 4
    return packed.view(out, in_features // 2)


def test_the_packed_layout_is_torchs_where_its_int4_kernel_reads_blocks_of_64() -> None:
    """Where torch packs 64 output rows a block (AVX-512) its int4 kernel reads our weights and
    serves calls of few rows; where it packs 32 (four AVX2 float vectors) it never gets them."""
    q = torch.randint(0, 16, (2 * BLOCK, 24), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
    assert torch.equal(pack(q), packed_in_blocks(q, BLOCK))
    theirs = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    if torch_kernel_rows():
        assert torch_kernel_rows() == KERNEL_MAX_ROWS and torch.equal(theirs, pack(q))
    else:
        assert torch.equal(theirs, packed_in_blocks(q, BLOCK // 2))


@pytest.mark.parametrize("shape", [(32, 64, 32), (96, 256, 128), (128, 128, 64)])
def test_int4_weights_unpack_to_their_definition(shape) -> None:
    """Pins the packed layout (read back by Int4Linear.unpacked) for widths that fill whole
    blocks of 64 output channels and widths that do not."""
    out_features, in_features, group = shape
    gen = torch.Generator().manual_seed(1)
    ints, scales, zeros, expected = random_groups(gen, out_features, in_features, group, 4, 0.1)
    layer = Int4Linear(ints, scales, zeros, group, None, torch.float32)
    torch.testing.assert_close(layer.unpacked(), expected, rtol=0, atol=1e-6)
    x = torch.randn(3, in_features, generator=gen)
    torch.testing.assert_close(layer(x), x @ expected.t(), rtol=1e-5, atol=1e-5)
    order = torch.randperm(in_features, generator=gen)
    shuffled = Int4Linear(ints, scales, zeros, group, None, torch.float32, order=order)
    original = torch.empty_like(expected)
    original[:, order] = expected
    torch.testing.assert_close(shuffled(x), x @ original.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpp_product_over_unpacked_slices_equals_the_tensor_form(dtype) -> None:
    """csrc/grouped_cpu.cpp against Int4Linear.unpacked: widths that do not fill the packed blocks,
    groups smaller than its tiles, groups that are no multiple of 16 (the transposes take sixteen
    channels), and a layer of several slices (2,100 x 2,048 in bf16 > 8 MB)."""
    from text_generation_server.kernels import cpu_kernels

    cpu_kernels.load()
    gen = torch.Generator().manual_seed(4)
    for out_features, in_features, group in ((32, 64, 32), (200, 384, 64), (72, 96, 24), (2100, 2048, 128)):
        ints, scales, zeros, _ = random_groups(gen, out_features, in_features, group, 4, 0.1)
        bias = torch.randn(out_features, generator=gen)
        layer = Int4Linear(ints, scales, zeros, group, bias, dtype)
        for rows in (60, 70):  # slices of 2 MB up to 64 rows, of 8 MB beyond
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            ours = torch.ops.tgis_cpu.int4_linear_unpacked(
                x, layer.packed, layer.scale_offset, group, out_features, layer.bias_value
            )
            theirs = torch.nn.functional.linear(x.float(), layer.unpacked().float(), layer.bias_value.float())
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the products' own rounding
            torch.testing.assert_close(
                ours.float(), theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item()
            )


def test_the_int4_tile_product_computes_the_weights_definition() -> None:
    """csrc/grouped_cpu.cpp's int4_linear on AMX (x times the integers per group, then each group's
    scale and offset; where this CPU has no AMX the same call takes the other products) against
    the weights' definition in float32, and against the products without tiles: rows within one
    tile, whole tiles and beyond, groups of 32, 128, one per channel and of 160 (built 128
    channels at a time), output widths that do not fill the packed blocks, a bias."""
    from text_generation_server.kernels import cpu_kernels

    cpu_kernels.load()
    gen = torch.Generator().manual_seed(8)
    for out_features, in_features, group in ((64, 128, 32), (200, 512, 128), (96, 256, 256), (64, 320, 160)):
        ints, scales, zeros, weight = random_groups(gen, out_features, in_features, group, 4, 0.1)
        bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
        layer = Int4Linear(ints, scales, zeros, group, bias, torch.bfloat16)
        for rows in (1, 5, 16, 17, 40):
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            expected = x.float() @ weight.t() + bias.float()
            scale = expected.abs().max().item()
            for tiles in (True, False):
                ours = torch.ops.tgis_cpu.int4_linear(
                    x, layer.packed, layer.scale_offset, group, out_features, bias, torch_kernel_rows(), tiles
                )
                # bf16: the output's rounding, the scales' and offsets' rounding to bf16 (and
                # without tiles the weights')
                torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=1e-2 * scale)


def test_int4_kernel_and_unpacked_product_agree_in_bf16() -> None:
    """Calls with few rows take the int4 kernel, calls with many the unpacked weights: the same
    rows give the same values within bf16 rounding either way."""
    gen = torch.Generator().manual_seed(2)
    ints = torch.randint(0, 16, (128, 256), generator=gen)
    scales = torch.rand(128, 2, generator=gen) / 10
    layer = Int4Linear(
        ints, scales, torch.full_like(scales, 8.0), 128, torch.randn(128, generator=gen), torch.bfloat16
    )
    x = torch.randn(KERNEL_MAX_ROWS + 5, 256, generator=gen).to(torch.bfloat16)
    few, many = layer(x[:2]), layer(x)[:2]
    torch.testing.assert_close(few.float(), many.float(), rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_8bit_group_layers_compute_their_definition_directly_and_over_unpacked_slices(dtype) -> None:
    """csrc/grouped_cpu.cpp's int8_group_linear against the weights' definition: row counts the
    direct kernels take (up to 12 with 16 lanes, up to 64 on AVX2 in passes of up to 4 rows; odd
    output widths for their blocks of output rows) and beyond (the unpacked slices), groups that
    are no multiple of 16 lanes (sliced there, direct on AVX2) or of 8 (always sliced),
    per-channel groups, act-order, and the tensor-operation fallback."""
    from text_generation_server.kernels import cpu_kernels

    cpu_kernels.load()
    gen = torch.Generator().manual_seed(5)
    shapes = (
        (33, 64, 32),
        (200, 384, 64),
        (48, 96, 24),
        (64, 256, 256),
        (22, 60, 12),
        (35, 64, 32),
        (22, 64, 16),
    )
    for out_features, in_features, group in shapes:
        ints, scales, zeros, weight = random_groups(gen, out_features, in_features, group, 8, 0.01)
        bias = torch.randn(out_features, generator=gen)
        order = torch.randperm(in_features, generator=gen)
        original = torch.empty_like(weight)
        original[:, order] = weight
        plain = Int8GroupLinear(ints, scales, zeros, group, bias, dtype)
        shuffled = Int8GroupLinear(ints, scales, zeros, group, bias, dtype, order=order)
        torch.testing.assert_close(plain.unpacked(), weight, rtol=0, atol=1e-6)
        for rows in (1, 2, 3, 5, 7, 12, 13, 40, 64, 65):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            for layer, expected in ((plain, weight), (shuffled, original)):
                theirs = torch.nn.functional.linear(x.float(), expected, bias.to(dtype).float())
                ours = layer(x)
                assert ours.dtype == dtype
                tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
                scale = theirs.abs().max().item()
                torch.testing.assert_close(ours.float(), theirs, rtol=tolerance, atol=tolerance * scale)
            fallback = torch.nn.functional.linear(x, plain.unpacked().to(dtype), plain.bias_value)
            torch.testing.assert_close(plain(x).float(), fallback.float(), rtol=2e-2, atol=2e-2 * scale)


def test_the_8bit_tile_product_computes_the_weights_definition() -> None:
    """csrc/grouped_cpu.cpp's int8_group_linear on AMX's integer products (bf16 x in 16-bit fixed
    point per row, the integers as they are stored; where this CPU has no AMX the same call takes
    the other products) against the weights' definition in float32 and against the products
    without tiles: every row count the tiles serve (3 to 64: one tile of x rows, several, an odd
    last one), output widths that do not fill the last 16 rows, groups of 64, 128 and 256 (summed
    128 channels at a time), a row whose values span five orders of magnitude, a bias."""
    from text_generation_server.kernels import cpu_kernels

    cpu_kernels.load()
    gen = torch.Generator().manual_seed(9)
    for out_features, in_features, group in ((40, 128, 64), (200, 512, 128), (64, 512, 256)):
        ints, scales, zeros, weight = random_groups(gen, out_features, in_features, group, 8, 0.01)
        bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
        layer = Int8GroupLinear(ints, scales, zeros, group, bias, torch.bfloat16)
        for rows in (3, 8, 16, 17, 40, 64):
            x = torch.randn(rows, in_features, generator=gen)
            x[0] *= torch.logspace(-3, 2, in_features)[torch.randperm(in_features, generator=gen)]
            x = x.to(torch.bfloat16)
            expected = x.float() @ weight.t() + bias.float()
            scale = expected.abs().max().item()
            op = torch.ops.tgis_cpu.int8_group_linear
            product = functools.partial(op, x, layer.values, layer.scale_offset)
            for tiles in (True, False):
                ours = product(group, bias, tiles)
                assert ours.dtype == torch.bfloat16
                torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=1e-2 * scale)
            if cpu_flags() >= AMX:  # without a bias, one rounding to bf16 (2^-9) is all the tiles
                alone = product(group, None, True)  # add: their sums are exact
                torch.testing.assert_close(
                    alone.float(), expected - bias.float(), rtol=2.5e-3, atol=1e-3 * scale
                )
        # an infinity or NaN in x (fixed point cannot carry them) reaches the output as the float
        # products give it, and leaves the other rows as they were
        x = torch.randn(8, in_features, generator=gen).to(torch.bfloat16)
        x[1, 3], x[5, 0] = float("inf"), float("nan")
        ours = torch.ops.tgis_cpu.int8_group_linear(x, layer.values, layer.scale_offset, group, bias, True)
        theirs = torch.ops.tgis_cpu.int8_group_linear(x, layer.values, layer.scale_offset, group, bias, False)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        assert not ours[[1, 5]].isfinite().any() and ours[[0, 2, 3, 4, 6, 7]].isfinite().all()


def test_w8a8_layers_quantize_each_token_as_compressed_tensors_defines() -> None:
    """int8 weights per channel times each token's activations rounded to max |x| / 127.5."""
    gen = torch.Generator().manual_seed(3)
    ints = torch.randint(-127, 128, (48, 96), generator=gen).to(torch.int8)
    scales = torch.rand(48, generator=gen) / 50
    layer = Int8Linear(ints, scales, None, torch.float32)
    x = torch.randn(6, 96, generator=gen)
    x[2] *= 30
    step = x.abs().amax(1, keepdim=True) / 127.5
    expected = (torch.round(x / step).clamp(-128, 127) * step) @ (ints.float() * scales[:, None]).t()
    torch.testing.assert_close(layer(x), expected, rtol=1e-3, atol=2e-3 * expected.abs().max().item())


# ---- checkpoints through the engines ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_checkpoints_load_into_our_layers_and_match_the_reference_logits(checkpoint, name) -> None:
    path = checkpoint(name)
    for dtype in (torch.float32, torch.bfloat16):
        config = ServerConfig(model_name=str(path), deployment_framework="tgis_native", dtype=str(dtype)[6:])
        ours = load_pretrained(config).model
        layers = [m for m in ours.modules() if isinstance(m, (Int4Linear, Int8GroupLinear, Int8Linear))]
        assert len(layers) == 14  # 7 projections x 2 layers; the LM head stays dense
        theirs = reference(path, dtype)
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                a, b = ours(ids).logits[0].float(), theirs(ids).logits[0].float()
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
            # float32: the same arithmetic, but W8A8's activations: the package rounds a token's
            # negative extreme (exactly -127.5 steps) to -128, oneDNN's kernel to -127;
            # bf16: our scales are rounded to bf16, the reference's weights after scaling
            floor = 0.995 if dtype == torch.bfloat16 or name == "ct-w8a8" else 0.99999
            assert cosine >= floor, (name, dtype, cosine)


@pytest.mark.parametrize("engine", ["tgis_native", "hf_transformers"])
@pytest.mark.parametrize(
    "name",
    [
        "gptq-act-order",
        "gptq-v2-zeros",
        "gptq-8bit-act-order",
        "gptq-8bit-v2-zeros",
        "awq",
        "ct-w4a16",
        "ct-w8a8",
    ],
)
def test_engines_serve_the_checkpoints_greedy_output(checkpoint, name, engine) -> None:
    path = checkpoint(name)
    engine_ = served(path, engine)
    if name == "ct-w8a8":  # the kernel's int8 activations differ from the package's in ties
        # (see the logits test) and in rare rounding: the oracle is transformers' generate over
        # our layers; the logits test holds them to the package's forward
        theirs = load_pretrained(
            ServerConfig(model_name=str(path), deployment_framework=engine, dtype="float32")
        ).model
    else:
        theirs = reference(path, torch.float32)
    expected = {i: greedy(theirs, prompt, 10) for i, prompt in enumerate(PROMPTS)}
    for i, prompt in enumerate(PROMPTS):
        assert alone(engine_, GenerationRequest(i, prompt, 10)) == expected[i], (name, i)
    requests = [GenerationRequest(i, prompt, 10) for i, prompt in enumerate(PROMPTS)]
    busy = Runner(engine_).run({0: requests[:2], 3: requests[2:]})  # a join while two decode
    assert busy == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["ct-w8a8", "gptq-act-order", "gptq-8bit-act-order", "awq"])
def test_the_cpp_decoder_stack_runs_quantized_layers_as_the_modules_do(checkpoint, name, dtype) -> None:
    """Decode rows (the int4 kernel in bf16, 8-bit weights read directly) and prompts (the
    unpacked weights) of the C++ decoder stack against the model's modules over the same cache."""
    from tests.engines.test_cpu_decoder import both_logits, started
    from tests.engines.test_tgis_native import config_for
    from text_generation_server.engines.tgis_native import TgisNativeEngine

    engine = TgisNativeEngine(config_for(checkpoint(name), cpu_forward="layers", dtype=dtype))
    decoder = engine.runner.decoder
    assert decoder is not None
    if name == "ct-w8a8":  # oneDNN's packed weights, or ours where its int8 products saturate
        assert all(
            (a is not None) != (b is not None) for a, b in zip(decoder.int8, decoder.w8a8, strict=True)
        )
    else:
        assert all(p is not None for p in decoder.grouped)
    batch = started(engine, [5, 17, 9])
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for ids in ([7, 8, 9], [300, 2, 41]):
        ours, theirs = both_logits(engine, batch, ids)
        if name == "ct-w8a8":  # each token's activations are rounded to integers, and a token whose
            # largest magnitude is negative sits at exactly -127.5 steps, where the quotient's last
            # bit picks -127 or -128: the two paths' inputs differ in the last bit (their norms
            # sum in another order), so some tokens fall a step apart, which moves these logits
            # by up to ~3 % (seen on an AVX2 CPU: cosine 0.99965); a wrong product gives far less
            cosine = torch.nn.functional.cosine_similarity(ours.float(), theirs.float(), dim=-1)
            assert cosine.min().item() >= 0.999
        else:
            torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)


# ---- bitsandbytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
@pytest.mark.parametrize("engine", ["hf_transformers", "tgis_native"])
def test_bitsandbytes_serves_what_transformers_bitsandbytes_generates(tiny_model, scheme, engine) -> None:
    path = tiny_model("llama")
    engine_ = served(path, engine, dtype="bfloat16", quantize=scheme)
    assert type(engine_.model.model.layers[0].mlp.up_proj).__module__.startswith("bitsandbytes")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        device_map="cpu",
        **{"quantization_config": quantization.load_kwargs(scheme, torch.bfloat16)["quantization_config"]},
    ).eval()
    for i, prompt in enumerate(PROMPTS[:2]):
        assert alone(engine_, GenerationRequest(i, prompt, 6)) == greedy(theirs, prompt, 6), (scheme, i)


# ---- refusals -----------------------------------------------------------------------------------


def refusal(path: Path, quantize: str | None = None, engine: str = "tgis_native") -> str:
    config = ServerConfig(
        model_name=str(path), deployment_framework=engine, dtype="float32", quantize=quantize
    )
    with pytest.raises(ValueError) as error:
        load_pretrained(config)
    return str(error.value)


def test_refusals_are_one_line(checkpoint, tiny_model, tmp_path) -> None:
    gptq = checkpoint("gptq-act-order")
    assert refusal(gptq, "int8") == (
        "QUANTIZE=int8 contradicts the checkpoint, which is quantized with gptq (config.json "
        "quantization_config); leave QUANTIZE unset or set it to gptq"
    )
    assert refusal(gptq, "compressed-tensors").startswith(
        "QUANTIZE=compressed-tensors contradicts the checkpoint"
    )
    assert refusal(tiny_model("llama"), "gptq").endswith(
        "declares no quantization (its config.json has no quantization_config); gptq serves checkpoints "
        "quantized with gptq"
    )

    def variant(source: Path, **changes) -> Path:
        out = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        for item in source.iterdir():
            (out / item.name).symlink_to(item)
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"].update(changes)
        (out / "config.json").unlink()
        (out / "config.json").write_text(json.dumps(config))
        return out

    assert (
        refusal(variant(gptq, bits=3))
        == "GPTQ checkpoints with 3-bit weights are not served (4-bit and 8-bit are)"
    )
    assert refusal(variant(gptq, quant_method="exl2")) == (
        "this checkpoint is quantized with exl2, which is not served; "
        "served checkpoints: gptq, awq, compressed-tensors, fp8"
    )
    assert refusal(variant(checkpoint("awq"), version="gemv")) == (
        "AWQ checkpoints are served in 4-bit GEMM layout with zero points, not 4-bit, gemv"
    )
    assert refusal(variant(checkpoint("ct-w8a8"), format="float-quantized")).startswith(
        "compressed-tensors float-quantized with 8-bit channel weights is not served"
    )
    assert "\n" not in refusal(variant(gptq, checkpoint_format="marlin"))


def test_bitsandbytes_4bit_refuses_input_sizes_its_cpu_kernels_cannot_take(tmp_path) -> None:
    from text_generation_server.testing.tiny_models import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "odd")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96  # down_proj takes 96 inputs: not a multiple of 64
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name in list(weights):
        if "gate_proj" in name or "up_proj" in name:
            weights[name] = weights[name][:96].contiguous()
        elif "down_proj" in name:
            weights[name] = weights[name][:, :96].contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert refusal(path, "bitsandbytes-nf4") == (
        "QUANTIZE=bitsandbytes-nf4: bitsandbytes' CPU 4-bit kernels need input sizes that are multiples "
        "of 64; model.layers.0.mlp.down_proj takes 96"
    )


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_compensation_beats_rounding_to_nearest_on_the_layer_output(act_order) -> None:
    """The writer's GPTQ: on correlated inputs X, ||X (W - Q)^T|| is well below round-to-nearest's."""
    from text_generation_server.testing.quantized_models import _gptq_dequantized, _gptq_tensors

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen)
    inputs = torch.randn(512, 256, generator=gen) @ torch.randn(256, 256, generator=gen) * 0.2
    hessian = 2 * inputs.t() @ inputs / 512

    def error(hessian_or_none) -> float:
        tensors = _gptq_tensors("layer", weight, 64, act_order, True, "gptq", hessian_or_none)
        return ((inputs @ (weight - _gptq_dequantized(tensors, True)).t()) ** 2).mean().item()

    assert error(hessian) < 0.6 * error(None)


@pytest.mark.parametrize("name", ["gptq-act-order", "gptq-8bit-act-order"])
def test_lora_on_a_quantized_base_is_the_same_on_both_forward_paths(
    checkpoint, tiny_model, tmp_path, name
) -> None:
    """Adapters stay in the activation dtype over 4-bit and 8-bit base layers, through the C++
    decoder stack and through the modules alike."""
    from tests.adapter_helpers import engine_with_store
    from text_generation_server.testing.tiny_prompts import build_lora

    build_lora(tiny_model("llama"), tmp_path / "a", 1, 6, ["q_proj", "v_proj", "down_proj"])
    requests = [GenerationRequest(1, PROMPTS[0], 8, adapter_id="a"), GenerationRequest(2, PROMPTS[0], 8)]
    outputs = {}
    for mode in ("layers", "modules"):
        engine = engine_with_store("tgis_native", checkpoint(name), tmp_path, cpu_forward=mode)
        assert (engine.runner.decoder is not None) == (mode == "layers")
        outputs[mode] = Runner(engine).run({0: requests})
    assert outputs["layers"] == outputs["modules"]
    assert outputs["layers"][1] != outputs["layers"][2]  # the adapter matters


@pytest.mark.parametrize("arch", ["qwen2", "granite", "mistral", "gpt_neox", "bloom"])
def test_gptq_checkpoints_of_other_architectures_serve_their_reference_greedy_output(
    tiny_model, tmp_path, arch
) -> None:
    """Biases (Qwen2's q/k/v, GPT-NeoX's and BLOOM's everywhere), Granite's multipliers, fused
    QKV projections, a tied LM head (BLOOM, on hf_transformers): each architecture's GPTQ
    checkpoint against its dequantized reference (calibrated GPTQ where the writer walks
    model.model.layers, else rounding)."""
    llama_like = arch in ("qwen2", "granite", "mistral")
    path = build_gptq(tiny_model(arch), tmp_path / arch, GROUP, calibration=(4, 16) if llama_like else None)
    engine = served(path, "hf_transformers" if arch == "bloom" else "tgis_native")
    theirs = reference(path, torch.float32)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert alone(engine, GenerationRequest(i, prompt, 8)) == greedy(theirs, prompt, 8), (arch, i)
