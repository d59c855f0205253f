"""Our C++ decode attention (kernels/csrc/paged_decode_cpu.cpp) against SDPA over the same keys,
the transposed-key cache layout it reads, and how CPU_ATTENTION behaves where it cannot build;
the LoRA kernel (kernels/csrc/lora_cpu.cpp) against a per-token float reference; the float32 and
bfloat16 linear over panels of 16 outputs (kernels/csrc/panel_cpu.cpp) against torch's linear: every tail
of its 6-row register tiles, its AMX tiles, blocks of prompt rows, biases, leading dimensions, what it
refuses; the greedy choice's first maxima and NaN flags (kernels/csrc/choice_cpu.cpp) against argmax
and isnan, and a step's choice with and without it (engines/step.py)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from text_generation_server.kernels import cpu_build, cpu_kernels
from text_generation_server.kernels.weight_layout import panels_offered
from text_generation_server.kv.paged_kv import BlockPool, PagedKVCache
from text_generation_server.utils.cpu import cpu_flags

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LORA_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernel() -> None:
    try:
        cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:  # e.g. no g++ and no prebuilt library: SDPA serves
        pytest.skip(f"the CPU kernels cannot be had here: {exc}")


def attention_case(dtype, rows, heads, kv_heads, dim, block_size, window, seed=0):
    """A random cache and queries, the kernel's answer and the reference (SDPA per row, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (rows,), generator=gen)
    width = int(-(-lengths.max() // block_size))
    num_blocks = rows * width + 3
    keys = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    flat = (kv_heads, num_blocks, block_size * dim)
    cache = torch.stack((keys.transpose(-1, -2).reshape(flat), values.reshape(flat))).contiguous()
    tables = torch.randperm(num_blocks, generator=gen)[: rows * width].reshape(rows, width)
    query = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    got = cpu_kernels.paged_decode(query, cache, tables, lengths, block_size, scale, window)
    expected = []
    for row in range(rows):
        length = int(lengths[row])
        used = tables[row, : -(-length // block_size)]
        first = max(0, length - window) if window else 0
        k = keys[:, used].reshape(kv_heads, -1, dim)[:, first:length].float()
        v = values[:, used].reshape(kv_heads, -1, dim)[:, first:length].float()
        q = query[row].float().reshape(kv_heads, heads // kv_heads, dim)
        expected.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).reshape(heads, dim)
        )
    return got, torch.stack(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 4])  # 4: the scalar path
def test_decode_attention_matches_sdpa(kernel, dtype, block_size) -> None:
    # heads / KV heads: MHA, GQA 4, MQA 12 (8 + 4), GQA 3 (2 + 1), 24 per KV head (8 + 8 + 8)
    shapes = ((4, 4), (8, 2), (12, 1), (6, 2), (48, 2))
    for (heads, kv_heads), dim, window in itertools.product(shapes, (16, 64, 24), (0, 7, 37)):
        got, expected = attention_case(dtype, 5, heads, kv_heads, dim, block_size, window)
        assert got.dtype == dtype and got.shape == expected.shape
        error = (got.float() - expected).abs().max().item()
        assert error < TOLERANCE[dtype], (heads, kv_heads, dim, window, error)


def test_bad_shapes_are_refused(kernel) -> None:
    cache = torch.zeros(2, 2, 4, 16 * 8)
    query, tables, lengths = (
        torch.zeros(3, 4, 8),
        torch.zeros(3, 1, dtype=torch.long),
        torch.ones(3, dtype=torch.long),
    )
    cpu_kernels.paged_decode(query, cache, tables, lengths, 16, 1.0, None)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_kernels.paged_decode(query, cache, tables, lengths, 8, 1.0, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.paged_decode(query.bfloat16(), cache, tables, lengths, 16, 1.0, None)
    with pytest.raises(RuntimeError, match="one block table and one length per query row"):
        cpu_kernels.paged_decode(query, cache, tables[:2], lengths, 16, 1.0, None)


def lora_reference(y, x, slots, per_row, a, bt, scales) -> torch.Tensor:
    """y + scale_s * (x @ A_s^T) @ Bt_s token by token, in float."""
    out = y.float().clone()
    for i in range(x.shape[0]):
        s = int(slots[i // per_row])
        if s >= 0 and a[s] is not None:
            out[i] += scales[s] * (x[i].float() @ a[s].float().t()) @ bt[s].float()
    return out


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_lora_apply_equals_the_per_token_reference(kernel, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    # features on and off the 16-lane vectors, padded rows of several tokens, an adapter that
    # does not target the module, ranks that differ, rows of the base model
    for tokens, features_in, features_out, per_row in ((17, 512, 96, 1), (12, 100, 37, 3), (4, 16, 5, 2)):
        x = torch.randn(tokens, features_in, generator=gen).to(dtype)
        wide = torch.randn(tokens, features_out + 7, generator=gen).to(dtype)
        y = wide[:, :features_out]  # rows strided, as a view of a wider output
        beside = wide[:, features_out:].clone()
        a = [torch.randn(r, features_in, generator=gen).to(dtype) if r else None for r in (8, 0, 3)]
        bt = [torch.randn(r, features_out, generator=gen).to(dtype) if r else None for r in (8, 0, 3)]
        slots = torch.tensor([(row % 4) - 1 for row in range(tokens // per_row)])
        scales = [0.5, 1.0, 2.0]
        expected = lora_reference(y, x, slots, per_row, a, bt, scales)
        cpu_kernels.lora_apply(y, x, slots, per_row, a, bt, scales)
        # relative to the values (sums of 512 products): the output's rounding, float sums reordered
        error = ((y.float() - expected).abs() / expected.abs().clamp(min=1)).max().item()
        assert error < LORA_TOLERANCE[dtype], (tokens, features_in, features_out, error)
        assert torch.equal(wide[:, features_out:], beside)  # the columns beside y stay


def test_lora_apply_refuses_what_does_not_fit(kernel) -> None:
    x, y, slots = torch.zeros(4, 8), torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)
    a, bt = torch.zeros(2, 8), torch.zeros(2, 6)
    cpu_kernels.lora_apply(y, x, slots, 1, [a], [bt], [1.0])
    with pytest.raises(RuntimeError, match=r"A must be \[rank, in\] and Bt \[rank, out\]"):
        cpu_kernels.lora_apply(y, x, slots, 1, [a], [torch.zeros(2, 5)], [1.0])
    with pytest.raises(RuntimeError, match="slots \\* per_row must equal the tokens"):
        cpu_kernels.lora_apply(y, x, slots, 2, [a], [bt], [1.0])
    with pytest.raises(RuntimeError, match="slot 1 names no adapter"):
        cpu_kernels.lora_apply(y, x, torch.tensor([0, 1, -1, 0]), 1, [a], [bt], [1.0])
    with pytest.raises(RuntimeError, match="dtype differs"):
        cpu_kernels.lora_apply(y, x, slots, 1, [a.bfloat16()], [bt.bfloat16()], [1.0])


@pytest.mark.parametrize("block_size", [4, 16])
def test_transposed_keys_read_back_as_written(block_size: int) -> None:
    cpu = torch.device("cpu")
    plain = PagedKVCache(BlockPool(6, block_size), cpu)
    transposed = PagedKVCache(BlockPool(6, block_size), cpu, transposed_keys=True)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(6 * block_size, generator=gen)[:20]
    key, value = torch.randn(2, 20, 8, generator=gen), torch.randn(2, 20, 8, generator=gen)
    for cache in (plain, transposed):
        cache.write(0, slots, key, value)
    blocks = torch.tensor([5, 0, 3])
    for got, expected in zip(transposed.read_blocks(0, blocks), plain.read_blocks(0, blocks), strict=True):
        assert torch.equal(got, expected)
    k, v = plain.read_blocks(0, torch.arange(6))
    assert torch.equal(k[:, slots], key) and torch.equal(v[:, slots], value)
    # the kernel's layout: dimension i of the token in slot s is at K[h, s // size, i * size + s % size]
    size, layer = block_size, transposed.layers[0]
    assert torch.equal(layer[0, 1, slots // size, 3 * size + slots % size], key[1, :, 3])


def test_cpu_attention_modes(monkeypatch, caplog) -> None:
    cpu = torch.device("cpu")
    assert not cpu_kernels.use_kernel("sdpa", cpu)
    assert not cpu_kernels.use_kernel("kernel", torch.device("meta"))  # not a CPU: never

    def fails() -> None:
        raise cpu_kernels.KernelBuildError("no C++ compiler ('nope' not found; set CXX or install g++)")

    monkeypatch.setattr(cpu_kernels, "load", fails)
    with caplog.at_level(logging.WARNING):
        assert not cpu_kernels.use_kernel("auto", cpu)
    assert "decode attention runs on SDPA, because no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match=r"CPU_ATTENTION=kernel: no C\+\+ compiler"):
        cpu_kernels.use_kernel("kernel", cpu)


def test_the_toolchain_check_names_what_is_missing(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpu_kernels.KernelBuildError, match="'/nonexistent/c\\+\\+' not found"):
        cpu_build.compiler()


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.tgis_cpu.panel_linear(x, torch.ops.tgis_cpu.panel_pack(weight), bias)


# ---- panel_linear (kernels/csrc/panel_cpu.cpp) ----------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 32, 97, 200])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("inputs", [37, 38])
def test_panel_linear_equals_torch_linear(kernel, rows: int, with_bias: bool, inputs: int) -> None:
    """Row counts cover each tile of 1-6 rows, whole tiles, and blocks of 96 prompt rows; input
    widths no vector divides, odd (bfloat16 panels of single inputs) and even (in pairs, where
    the CPU has AVX512-BF16)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, inputs, generator=gen)  # 5 panels: a group of 4 and one alone
    bias = torch.randn(80, generator=gen) if with_bias else None
    x = torch.randn(rows, inputs, generator=gen)
    torch.testing.assert_close(_product(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    # bfloat16: the float32 sums of the same (bfloat16) numbers, rounded once
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    bias16 = bias.bfloat16() if bias is not None else None
    got = _product(x16, weight16, bias16)
    exact = torch.nn.functional.linear(
        x16.float(), weight16.float(), bias16.float() if bias16 is not None else None
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact.bfloat16().float(), rtol=8e-3, atol=1e-5)


def test_panel_linear_on_a_model_sized_product_and_leading_dimensions(kernel) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1376, 512, generator=gen) / 512**0.5
    x = torch.randn(2, 9, 512, generator=gen)
    got = _product(x, weight, None)
    assert got.shape == (2, 9, 1376)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    # prompts over wide inputs take them in slices (the last one partial), the bias added once
    wide_weight, bias = torch.randn(64, 1100, generator=gen) / 1100**0.5, torch.randn(64, generator=gen)
    x = torch.randn(13, 1100, generator=gen)
    torch.testing.assert_close(
        _product(x, wide_weight, bias), torch.nn.functional.linear(x, wide_weight, bias), rtol=1e-4, atol=1e-4
    )
    # a non-contiguous input (a slice of a wider tensor) reads the same values
    wide = torch.randn(5, 1024, generator=gen)
    torch.testing.assert_close(
        _product(wide[:, ::2], weight, None),
        torch.nn.functional.linear(wide[:, ::2], weight),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [512, 1100])
@pytest.mark.parametrize("outputs", [80, 272])
def test_panel_linear_gives_a_row_the_same_outputs_whatever_rows_go_with_it(
    kernel, dtype, inputs: int, outputs: int
) -> None:
    """A decode row alone, in a batch, or among a prompt's rows taken in slices of the inputs: the
    same sums in the same order, bit for bit (speculative decoding's exactness rests on it). 5
    panels: groups of 2-4 and a tail; 17: a thread's 8 or more also take a group of 8."""
    gen = torch.Generator().manual_seed(inputs)
    weight = (torch.randn(outputs, inputs, generator=gen) / inputs**0.5).to(dtype)
    bias = torch.randn(outputs, generator=gen).to(dtype)
    x = torch.randn(200, inputs, generator=gen).to(dtype)
    alone = torch.cat([_product(x[i : i + 1], weight, bias) for i in range(13)])
    exact = torch.nn.functional.linear(x[:13].float(), weight.float(), bias.float())
    torch.testing.assert_close(alone.float(), exact, rtol=1e-2, atol=1e-2)
    for rows in (2, 3, 4, 6, 7, 13, 200):
        assert torch.equal(_product(x[:rows], weight, bias)[:13], alone[:rows]), rows


@pytest.mark.parametrize(
    ("rows", "inputs"),
    [
        (3, 1100),  # a decode step: rows widened on the calling thread, sums rounded as the tiles store them
        (13, 1100),  # a prompt over wide inputs: float32 sums between slices, rounded once at the end
        (160, 512),  # a prompt of more values than are widened in place: at::Tensor::to widens them
    ],
)
def test_panel_linear_in_bfloat16_rounds_the_float32_sums_once_on_every_path(
    kernel, rows: int, inputs: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(64, inputs, generator=gen) / inputs**0.5).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    x[0, 5] = float("nan")  # a NaN stays NaN through the rounding
    got = _product(x, weight, bias)
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 64)
    assert got[0].isnan().all() and not got[1:].isnan().any()
    # within one bfloat16 step everywhere (the float32 sums' order differs from torch's, which can
    # move a rounding by one step), and equal nearly everywhere (truncating would miss half)
    torch.testing.assert_close(got[1:].float(), exact[1:].float(), rtol=8e-3, atol=1e-5)
    assert (got[1:] == exact[1:]).float().mean() > 0.97


@pytest.mark.parametrize("outputs", [80, 272])
@pytest.mark.parametrize(
    ("inputs", "rows"),
    [(64, rows) for rows in (1, 5, 16, 17, 33, 48, 70)] + [(8192, 100)],  # 8192: row blocks of 32
)
def test_panel_linear_on_amx_tiles_sums_in_float32_whatever_rows_go_with_a_row(
    kernel, inputs: int, rows: int, outputs: int
) -> None:
    """bfloat16 panels of a width in multiples of 32 multiply on AMX's tiles where the CPU has
    them, for every number of rows (the tile unit's sums are not `vdpbf16ps`'s bit for bit): one A
    tile against groups of 4 panels and their tails, pairs of A tiles against pairs of panels, the
    rows left over in a tile of their own, row blocks of wide inputs. The float32 sums rounded
    once, the bias last, and each row's outputs the same alone as with the others."""
    assert torch.ops.tgis_cpu.panel_tiles(inputs) == ({"amx_bf16", "avx512_bf16"} <= cpu_flags())
    assert not torch.ops.tgis_cpu.panel_tiles(inputs + 2)  # an even width off the tiles' 32: the pairs
    gen = torch.Generator().manual_seed(inputs + rows)
    weight = (torch.randn(outputs, inputs, generator=gen) / inputs**0.5).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    got = _product(x, weight, bias)
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    torch.testing.assert_close(got.float(), exact.float(), rtol=8e-3, atol=1e-5)
    assert (got == exact).float().mean() > 0.97
    alone = torch.cat([_product(x[i : i + 1], weight, bias) for i in range(rows)])
    assert torch.equal(got, alone)


def test_panel_linear_refuses_what_does_not_fit(kernel) -> None:
    with pytest.raises(RuntimeError, match=r"out_features \(40\) must be a multiple of 16"):
        torch.ops.tgis_cpu.panel_pack(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="a float32 or bfloat16 \\[out, in\\] weight"):
        torch.ops.tgis_cpu.panel_pack(torch.randn(32, 8, dtype=torch.float16))
    packed = torch.ops.tgis_cpu.panel_pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the weight 8"):
        torch.ops.tgis_cpu.panel_linear(torch.randn(2, 9), packed, None)
    with pytest.raises(RuntimeError, match=r"inputs in the weights' dtype \(Float\), not BFloat16"):
        torch.ops.tgis_cpu.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias of 31 values for 32 outputs"):
        torch.ops.tgis_cpu.panel_linear(torch.randn(2, 8), packed, torch.randn(31))


def test_panels_are_offered_only_where_they_can_hold_the_weight() -> None:
    assert not panels_offered(torch.float16, 64)
    assert not panels_offered(torch.float32, 40)


NAN_BITS = (0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0xFF800001)


FIRST_MAX_SHAPES = [(1, 1), (3, 15), (2, 16), (4, 33), (32, 8192), (2, 40000), (1, 70001)]


@pytest.mark.parametrize("rows,vocab", FIRST_MAX_SHAPES)
def test_first_max_is_argmax_and_finds_every_nan(kernel, rows: int, vocab: int) -> None:
    """Ties (scores of 7 values: the first of equal maxima, across lanes and across the chunks a
    long row is split in), rows of -inf, +inf, and NaNs of every kind of bits anywhere."""
    gen = torch.Generator().manual_seed(rows * vocab)
    for trial in range(12):
        scores = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
        if trial % 3 == 1:
            scores[:, int(torch.randint(0, vocab, (1,), generator=gen))] = float("inf")
        if trial % 4 == 2:
            scores[0] = float("-inf")
        if trial % 2 == 1:
            row, column = rows - 1, int(torch.randint(0, vocab, (1,), generator=gen))
            bits = torch.tensor([NAN_BITS[trial % len(NAN_BITS)]], dtype=torch.int64).to(torch.int32)
            scores[row, column] = bits.view(torch.float32)[0]
        ids, nan = cpu_kernels.first_max(scores)
        expected_nan = torch.isnan(scores).any(dim=-1)
        assert torch.equal(nan, expected_nan)
        assert ids.dtype == torch.int64 and bool(((ids >= 0) & (ids < vocab)).all())
        assert torch.equal(ids[~expected_nan], scores.argmax(dim=-1)[~expected_nan])
    wide = torch.randn(rows, vocab + 5, generator=gen)[:, :vocab]  # rows apart in memory
    assert torch.equal(cpu_kernels.first_max(wide)[0], wide.argmax(dim=-1))
    for dtype in (torch.bfloat16, torch.float16):  # the model's logits as they come
        narrow = torch.randn(rows, vocab, generator=gen).to(dtype)
        narrow[0, vocab // 3] = float("nan")
        ids, nan = cpu_kernels.first_max(narrow)
        assert nan.tolist() == [True] + [False] * (rows - 1)
        assert torch.equal(ids[1:], narrow.float().argmax(dim=-1)[1:])


def test_first_max_refuses_what_it_cannot_read(kernel) -> None:
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 scores"):
        cpu_kernels.first_max(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"scores \[rows, vocab\]"):
        cpu_kernels.first_max(torch.randn(8))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.first_max(torch.randn(8, 2).t())


def test_a_step_chooses_on_the_kernel_what_it_chooses_without(kernel, monkeypatch) -> None:
    """engines/step.py's choice with and without the kernel: the same ids, scores and NaN rows,
    for a chooser that changes no score and for one whose processors change them (penalties,
    min_new_tokens, sampling rows; the NaN check reads the logits before they do)."""
    from text_generation_common.messages import LengthPenalty, SamplingParams
    from text_generation_server.engines import step
    from text_generation_server.sampling.chooser import TokenChooser

    vocab, eos = 300, 2
    plain = [SamplingParams()] * 4
    processed = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(min_new_tokens=3, length_penalty=LengthPenalty(0, 1.3)),
        SamplingParams(temperature=0.8, top_k=20, seed=4),
    ]
    prompts = [[5, 6, 7], [8, 9, 9], [11], [12, 13]]
    for params in (plain, processed):
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(1))
        logits[1, 40] = float("nan")
        logits[2, 7] = logits[2, 9] = 30.0  # a tie: the first wins
        answers = []
        for on_kernel in (True, False):
            monkeypatch.setattr(step.cpu_kernels, "loaded", lambda on_kernel=on_kernel: on_kernel)
            chooser = TokenChooser.create(params, prompts, eos, vocab, torch.device("cpu"))
            assert chooser.plain == (params is plain)
            answers.append(step._choose(logits.clone(), chooser))
        (ids, scores, nan), (ids_aten, scores_aten, nan_aten) = answers
        assert nan.tolist() == nan_aten.tolist() == [False, True, False, False]
        healthy = ~nan_aten
        assert torch.equal(ids[healthy], ids_aten[healthy]) and int(ids[2]) == 7
        torch.testing.assert_close(scores[healthy], scores_aten[healthy], equal_nan=True)


def test_a_step_skips_the_float32_copy_only_where_nothing_reads_the_scores(kernel, monkeypatch) -> None:
    """choice_scores: a plain chooser whose rows want no token details chooses on the logits as
    they come (bfloat16 here), with the ids of the float32 path; details, processors, float32
    logits that the caller keeps, or no kernel: a float32 copy."""
    from text_generation_common.messages import GenerationRequest, RequestedDetails, SamplingParams
    from text_generation_server.engines import step
    from text_generation_server.sampling.chooser import TokenChooser

    vocab, eos, prompts = 64, 2, [[5, 6], [7, 7]]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)).bfloat16()
    plain = TokenChooser.create([SamplingParams()] * 2, prompts, eos, vocab, torch.device("cpu"))
    penalised = TokenChooser.create(
        [SamplingParams(repetition_penalty=1.2), SamplingParams()], prompts, eos, vocab, torch.device("cpu")
    )
    requests = [GenerationRequest(i, (5, 6), 4) for i in range(2)]
    detailed = [GenerationRequest(0, (5, 6), 4, details=RequestedDetails(logprobs=True)), requests[1]]

    assert step.choice_scores(logits, plain, requests, keep=True) is logits
    chosen = step.start_choice(logits, plain)
    assert torch.equal(chosen.next_ids, logits.float().argmax(dim=-1))
    for chooser, wanting in ((plain, detailed), (penalised, requests)):
        scores = step.choice_scores(logits, chooser, wanting, keep=False)
        assert scores.dtype == torch.float32 and torch.equal(scores, logits.float())
    full = logits.float()
    assert step.choice_scores(full, plain, requests, keep=True) is full  # nothing changes or reads it
    assert step.choice_scores(full, penalised, requests, keep=True).data_ptr() != full.data_ptr()
    assert step.choice_scores(full, penalised, requests, keep=False) is full
    monkeypatch.setattr(step.cpu_kernels, "loaded", lambda: False)
    assert step.choice_scores(logits, plain, requests, keep=False).dtype == torch.float32
