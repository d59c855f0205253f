"""The C++ decoder stack of tgis_native on CPU (engines/tgis_native/cpu_decoder.py) against the
model's own modules on the same inputs and cache, decode-only steps and steps with prompts, and
CPU_FORWARD's choices and refusals. (The conformance suite runs it against transformers'
generate, and the modules beside it.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil

import pytest
import torch

from tests.engines.test_tgis_native import config_for
from text_generation_common.messages import GenerationRequest, RequestedDetails
from text_generation_server.engines.tgis_native import TgisNativeEngine
from text_generation_server.engines.tgis_native.cpu_decoder import (
    CpuDecoder,
    build,
    decoder_for,
    rotary_table,
)
from text_generation_server.kernels import cpu_kernels
from text_generation_server.kernels.weight_layout import OneDnnLinear, PanelLinear, panels_offered

# float32: summation orders differ (norm statistics, fused multiply-adds); bfloat16: the same
# roundings as transformers' code, but a norm whose float statistic differs in its last bit can
# round an element to the neighbouring bfloat16
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu():
    """The C++ decoder stack is the CPU's forward: on a GPU host too, these engines load on the
    CPU (the loader takes a visible GPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    try:
        cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        pytest.skip(f"the CPU kernels cannot be had here: {exc}")


def started(engine: TgisNativeEngine, prompts: list[int], seed: int = 0):
    """A batch of len(prompts) requests with prompts of those lengths, prefilled and stepped twice."""
    rng = random.Random(seed)
    vocab = engine.info.vocab_size
    requests = [
        GenerationRequest(i + 1, tuple(rng.randrange(3, vocab) for _ in range(n)), 20)
        for i, n in enumerate(prompts)
    ]
    batch, errors = engine.new_batch(1, requests)
    assert batch is not None and not errors
    for _ in range(3):
        _, batch = engine.generate_token(batch)
    return batch


def both_logits(engine: TgisNativeEngine, batch, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's logits by the C++ decoder and by the modules, over the same buffers (the
    second writes the same K/V again)."""
    runner, rows = engine.runner, len(ids)
    assert runner.decoder is not None
    buffers = runner.buffers
    buffers.fill([batch.states[r.id].kv for r in batch.requests], ids, rows)
    with torch.inference_mode():
        ours = runner.decoder.decode(
            buffers.ids(rows),
            buffers.positions(rows),
            buffers.slots(rows),
            buffers.tables(rows),
            buffers.lengths(rows),
        )
        theirs = runner.decode_step(rows, 0, 0)()
    return ours, theirs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "granite", "gpt2", "gpt_bigcode", "gpt_neox"])
def test_logits_match_the_modules(tiny_model, arch, dtype) -> None:
    # llama: GQA; mistral: sliding window; qwen2: q/k/v biases; granite: its four multipliers;
    # gpt2: LayerNorm, learned positions, Conv1D (as Linears), GELU's formula; gpt_bigcode: multi-query;
    # gpt_neox: q/k/v per head, partial rotary, parallel residual, erf GELU
    assert_logits_match(
        TgisNativeEngine(config_for(tiny_model(arch), dtype=dtype, cpu_forward="layers")), dtype
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_head_gpt_bigcode_logits_match_the_modules(tiny_model, tmp_path, dtype) -> None:
    """GPT-BigCode without multi-query attention: q, k, v interleaved per head, as GPT-NeoX's."""
    import transformers

    mqa = tiny_model("gpt_bigcode")
    config = transformers.AutoConfig.from_pretrained(mqa)
    config.multi_query = False
    torch.manual_seed(0)
    transformers.GPTBigCodeForCausalLM(config).save_pretrained(tmp_path)
    for file in mqa.iterdir():
        if "token" in file.name:
            shutil.copy(file, tmp_path / file.name)
    engine = TgisNativeEngine(config_for(tmp_path, dtype=dtype, cpu_forward="layers"))
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.interleaved and decoder.kv_heads == decoder.heads
    assert_logits_match(engine, dtype)


def assert_logits_match(engine: TgisNativeEngine, dtype: str) -> None:
    batch = started(engine, [5, 17, 40])
    rng = random.Random(1)
    for _ in range(6):
        ours, theirs = both_logits(
            engine, batch, [rng.randrange(3, engine.info.vocab_size) for _ in range(3)]
        )
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        scale = theirs.float().abs().max().item()
        assert (ours.float() - theirs.float()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1.0)
    if dtype == "bfloat16":  # most steps are bit for bit the modules' answer
        assert torch.equal(ours, theirs) or (ours != theirs).float().mean().item() < 0.01


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("llama", "bfloat16")]
)  # qwen2: q/k/v biases
@pytest.mark.parametrize("layout", ["onednn", "plain", "panels"])
def test_every_weight_layout(tiny_model, layout, arch, dtype) -> None:
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    if layout == "onednn" and dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 linears on this CPU")
    if layout == "panels" and not panels_offered(torch.float32, 16):
        pytest.skip("no panels layout here (it needs AVX2, FMA and our C++ kernels)")
    engine = TgisNativeEngine(
        config_for(tiny_model(arch), dtype=dtype, cpu_forward="layers", linear_layout=layout)
    )
    decoder = engine.runner.decoder
    assert decoder is not None and all(decoder.onednn) == (layout == "onednn")
    assert any(isinstance(m, OneDnnLinear) for m in engine.model.modules()) == (layout == "onednn")
    assert any(isinstance(m, PanelLinear) for m in engine.model.modules()) == (layout == "panels")
    if dtype == "bfloat16":
        assert_logits_match(engine, dtype)
        return
    batch = started(engine, [9, 3])
    ours, theirs = both_logits(engine, batch, [7, 11])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def panels_here() -> None:
    if not panels_offered(torch.float32, 16):
        pytest.skip("no panels layout here (it needs AVX2, FMA and our C++ kernels)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_projections_give_the_sums_of_each(tiny_model, arch, dtype) -> None:
    """q|k|v and gate|up in one product each: the projections' weights become views of the fused
    panels (no copy kept), and the logits equal, bit for bit, those of one product per
    projection, at 1 row and at several (3: the split parts are copied out)."""
    panels_here()
    engine = TgisNativeEngine(
        config_for(tiny_model(arch), dtype=dtype, cpu_forward="layers", linear_layout="panels")
    )
    decoder = engine.runner.decoder
    assert decoder is not None and len(decoder.fused) == 4 * len(engine.model.model.layers)
    layer = engine.model.model.layers[0]
    qkv = decoder.fused[0]
    assert qkv is not None and qkv.untyped_storage().data_ptr() == (
        layer.self_attn.k_proj.packed_weight.untyped_storage().data_ptr()
    )
    assert (decoder.fused[1] is not None) == (arch == "qwen2")
    unfused = dataclasses.replace(decoder, fused=[])
    batch = started(engine, [5, 17, 40])
    rng = random.Random(2)
    for rows in (1, 3, 3):
        ids = [rng.randrange(3, engine.info.vocab_size) for _ in range(rows)]
        buffers = engine.runner.buffers
        buffers.fill([batch.states[r.id].kv for r in batch.requests[:rows]], ids, rows)
        args = [buffers.ids(rows), buffers.positions(rows), buffers.slots(rows), buffers.tables(rows)]
        with torch.inference_mode():
            fused = decoder.decode(*args, buffers.lengths(rows))
            alone = unfused.decode(*args, buffers.lengths(rows))
        assert torch.equal(fused, alone)


def test_fused_projections_step_apart_for_their_adapters(tiny_model, tmp_path) -> None:
    """A step whose adapters target k (of q|k|v) and up (of gate|up) multiplies those groups one
    projection at a time, so each takes its adapter: the modules' tokens."""
    from tests.adapter_helpers import engine_with_store
    from tests.engines.conformance import Runner
    from text_generation_server.testing.tiny_prompts import build_lora

    panels_here()
    base = tiny_model("llama")
    build_lora(base, tmp_path / "a", 1, 8, ["k_proj", "up_proj"])
    requests = [
        GenerationRequest(i, (5, 17, 42, 99, 7 + i), 8, adapter_id=a) for i, a in enumerate(("a", ""))
    ]
    outputs = {}
    for mode in ("layers", "modules"):
        engine = engine_with_store("tgis_native", base, tmp_path, cpu_forward=mode, linear_layout="panels")
        assert mode == "modules" or engine.runner.decoder.fused
        outputs[mode] = Runner(engine).run({0: requests})
    assert outputs["layers"] == outputs["modules"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_rows_come_from_a_table_of_the_modules_values(tiny_model, dtype) -> None:
    """The cos and sin of a step's positions: rows of a table the rotary module computed at load,
    equal to what it computes for those positions; a position past the table asks the module."""
    engine = TgisNativeEngine(config_for(tiny_model("llama"), dtype=dtype, cpu_forward="layers"))
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.rotary_table is not None
    cos_table, _ = decoder.rotary_table
    assert (
        cos_table.shape[0] == engine.context.max_sequence_length + 16
        and cos_table.dtype == engine.model.dtype
    )
    rotary = engine.model.model.rotary_emb
    embeddings = torch.zeros(4, engine.model.config.hidden_size, dtype=engine.model.dtype)
    for positions in ([0, 1, 2, 3], [7, 50, 90, 143], [3, 140, 143, 500]):  # 500: past the table
        at = torch.tensor(positions)
        cos, sin = decoder._rotary(embeddings, at)
        want_cos, want_sin = rotary(embeddings.unsqueeze(0), at.unsqueeze(0))
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=0)


def test_rotary_embeddings_that_change_with_the_length_are_not_tabled(tiny_model) -> None:
    engine = TgisNativeEngine(config_for(tiny_model("llama"), cpu_forward="layers"))
    rotary = engine.model.model.rotary_emb
    rotary.rope_type = "dynamic"
    assert rotary_table(engine.model, 64) is None
    rotary.rope_type = "default"
    cos, sin = rotary_table(engine.model, 64)
    assert (
        cos.shape
        == sin.shape
        == (64, engine.model.config.hidden_size // engine.model.config.num_attention_heads)
    )


def test_greedy_tokens_equal_the_modules(tiny_model) -> None:
    """Whole generations through the engine's own steps: the same tokens either way."""
    outputs = {}
    for mode in ("layers", "modules"):
        engine = TgisNativeEngine(config_for(tiny_model("llama"), cpu_forward=mode))
        assert isinstance(engine.runner.decoder, CpuDecoder) == (mode == "layers")
        rng = random.Random(3)
        requests = [
            GenerationRequest(i + 1, tuple(rng.randrange(3, 500) for _ in range(4 + 7 * i)), 24)
            for i in range(4)
        ]
        batch, _ = engine.new_batch(1, requests)
        tokens = []
        while batch is not None and len(tokens) < 24:
            output, batch = engine.generate_token(batch)
            tokens.append([(g.request_id, g.token.token_id) for g in output.generations])
        outputs[mode] = tokens
    assert outputs["layers"] == outputs["modules"]


def recorded_forwards(engine: TgisNativeEngine) -> list[torch.Tensor]:
    """Every logits tensor engine.runner.forward returns from now on (steps with prompt tokens)."""
    calls: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(*args, **kwargs):
        logits = forward(*args, **kwargs)
        calls.append(logits.clone())
        return logits

    engine.runner.forward = recording  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "granite", "gpt2", "gpt_bigcode", "gpt_neox"])
def test_steps_with_prompts_match_the_modules(tiny_model, arch, dtype) -> None:
    """Whole prompts, chunks after cached tokens (mistral: past its window) and decode rows in
    one step, a join mid-way, prompt logprobs of one request: the same logits either way."""
    rng = random.Random(5)
    first = [
        GenerationRequest(i + 1, tuple(rng.randrange(3, 500) for _ in range(n)), 12)
        for i, n in enumerate((3, 29, 11))
    ]
    details = RequestedDetails(input_tokens=True, logprobs=True)
    joining = [
        GenerationRequest(10, tuple(rng.randrange(3, 500) for _ in range(23)), 6, details=details),
        GenerationRequest(11, tuple(rng.randrange(3, 500) for _ in range(2)), 6),
    ]
    recorded, inputs = {}, {}
    for mode in ("layers", "modules"):
        engine = TgisNativeEngine(config_for(tiny_model(arch), dtype=dtype, cpu_forward=mode))
        recorded[mode] = recorded_forwards(engine)
        batch, _ = engine.new_batch(1, first)
        details_seen = []
        for step in range(14):
            if step == 4:
                joined, _ = engine.new_batch(2, joining)
                batch = engine.concatenate([batch, joined])
            output, batch = engine.generate_token(batch, token_budget=16)
            details_seen += output.input_tokens
            if batch is None:
                break
        inputs[mode] = details_seen
    assert len(recorded["layers"]) == len(recorded["modules"]) >= 4
    for ours, theirs in zip(recorded["layers"], recorded["modules"], strict=True):
        scale = max(theirs.float().abs().max().item(), 1.0)
        assert (ours.float() - theirs.float()).abs().max().item() <= TOLERANCE[dtype] * scale
    (ours_details,), (their_details,) = inputs["layers"], inputs["modules"]
    assert [t.token_id for t in ours_details.tokens] == [t.token_id for t in their_details.tokens]
    assert len(ours_details.tokens) == 23


LORA_TARGETS = {  # what the adapters of the test below adapt, per architecture
    "llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D in transformers, Linears once laid out
    "gpt_neox": ["query_key_value", "dense_h_to_4h"],
}


@pytest.mark.parametrize("arch", sorted(LORA_TARGETS))
def test_lora_decode_steps_run_in_the_call(tiny_model, tmp_path, monkeypatch, arch) -> None:
    """Decode steps of requests with LoRA adapters (two, and the base model, in one batch) run
    in the C++ call with our LoRA kernel and give the modules' tokens (tests/test_lora.py checks
    both ways against PEFT)."""
    from tests.adapter_helpers import engine_with_store
    from tests.engines.conformance import Runner
    from text_generation_server.testing.tiny_prompts import build_lora

    base = tiny_model(arch)
    targets = LORA_TARGETS[arch]
    for seed, name in ((1, "a"), (2, "b")):
        build_lora(base, tmp_path / name, seed, 4 + seed, targets)
    requests = [
        GenerationRequest(i, (5, 17, 42, 99, 7 + i), 8, adapter_id=adapter)
        for i, adapter in enumerate(("a", "b", "", "a"))
    ]
    with_adapters: list[bool] = []
    decode = CpuDecoder.decode

    def recording(self, *args, **kwargs):
        with_adapters.append(len(args) > 5 and args[5].slots is not None)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(CpuDecoder, "decode", recording)
    outputs = {}
    for mode in ("layers", "modules"):
        engine = engine_with_store("tgis_native", base, tmp_path, cpu_forward=mode)
        outputs[mode] = Runner(engine).run({0: requests})
    assert outputs["layers"] == outputs["modules"]
    assert sum(with_adapters) >= 5  # the decode steps carried the adapters


def layer_scaled_gpt2(tiny_model, tmp_path) -> str:
    """The tiny GPT-2 with its attention scaled by the inverse layer index (not served by the stack)."""
    model = tmp_path / "gpt2-layer-scaled"
    shutil.copytree(tiny_model("gpt2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    return str(model)


def test_layers_refused_with_the_reason(tiny_model, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^CPU_FORWARD=layers: .* its attention scales by layer or upcasts"):
        TgisNativeEngine(config_for(layer_scaled_gpt2(tiny_model, tmp_path), cpu_forward="layers"))
    with pytest.raises(ValueError, match=r"^CPU_FORWARD=layers: .* decode attention runs on sdpa"):
        TgisNativeEngine(config_for(tiny_model("llama"), cpu_forward="layers", cpu_attention="sdpa"))


def test_auto_says_why_the_modules_serve(tiny_model, tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="text_generation_server.engines.tgis_native.cpu_decoder"):
        engine = TgisNativeEngine(config_for(layer_scaled_gpt2(tiny_model, tmp_path)))
    assert engine.runner.decoder is None
    assert "forward: the model's modules, because its attention scales by layer" in caplog.text
    with caplog.at_level(logging.INFO, logger="text_generation_server.engines.tgis_native.cpu_decoder"):
        engine = TgisNativeEngine(config_for(tiny_model("gpt_neox")))
    assert engine.runner.decoder is not None
    assert "forward: the decoder layers in one C++ call" in caplog.text


def test_unsupported_shapes_of_a_model(tiny_model) -> None:
    engine = TgisNativeEngine(config_for(tiny_model("llama"), cpu_forward="modules"))
    assert engine.runner.decoder is None
    config = engine.model.config
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="activation is gelu"):
        build(engine.model, engine.kv, "cpu_kernel", 1, None)
    config.hidden_act = "silu"
    with pytest.raises(ValueError, match="split over 2 shards"):
        build(engine.model, engine.kv, "cpu_kernel", 2, None)
    assert decoder_for("auto", engine.model, engine.kv, "cpu_kernel", 1, None) is not None


def test_unsupported_shapes_of_a_layer_norm_model(tiny_model) -> None:
    engine = TgisNativeEngine(config_for(tiny_model("gpt_bigcode"), cpu_forward="modules"))
    config = engine.model.config
    config.activation_function = "relu"
    with pytest.raises(ValueError, match="activation is relu, not GELU"):
        build(engine.model, engine.kv, "cpu_kernel", 1, None)
    config.activation_function = "gelu_pytorch_tanh"
    decoder = build(engine.model, engine.kv, "cpu_kernel", 1, None)
    assert (decoder.family, decoder.kv_heads, decoder.interleaved) == ("layer_norm", 1, False)
