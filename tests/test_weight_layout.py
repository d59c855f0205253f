"""Linear weight layouts on CPU: every layout gives the model's outputs, tied embeddings are left
alone, the measured choice follows its rule, and a pinned layout that cannot apply is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from text_generation_server.kernels import weight_layout
from text_generation_server.kernels.weight_layout import (
    LinearLayout,
    OneDnnLinear,
    PanelLinear,
    choose_linear_layouts,
    panels_offered,
    pick,
)


def _load(path, dtype=torch.float32) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


FP32_LAYOUTS = [LinearLayout.COLUMN_MAJOR, LinearLayout.ONEDNN, LinearLayout.PANELS, LinearLayout.AUTO]
PANELS_HERE = panels_offered(torch.float32, 16)


@pytest.mark.parametrize("layout", FP32_LAYOUTS, ids=lambda layout: layout.value)
@pytest.mark.parametrize("arch", ["llama", "bloom", "gpt_neox", "gpt2"])
def test_every_layout_gives_the_same_logits(tiny_model, arch: str, layout: LinearLayout) -> None:
    """GPT-2's Conv1D projections too: each becomes the Linear it equals, then laid out."""
    if layout is LinearLayout.PANELS and not PANELS_HERE:
        pytest.skip("no panels layout here (it needs AVX2, FMA and our C++ kernels)")
    model = _load(tiny_model(arch))
    relaid = copy.deepcopy(model)
    choices = choose_linear_layouts(relaid, max_batch_size=8, layout=layout)
    assert not any(type(m).__name__ == "Conv1D" for m in relaid.modules())
    assert choices and all(
        c.layout in (layout, LinearLayout.PLAIN) or layout is LinearLayout.AUTO for c in choices
    )
    linears = [m for m in relaid.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in relaid.modules() if isinstance(m, OneDnnLinear)]
    embeddings = [m.weight for m in relaid.modules() if isinstance(m, torch.nn.Embedding)]
    if layout is LinearLayout.COLUMN_MAJOR:
        for module in linears:  # only a weight tied to an embedding stays row-major
            assert module.weight.t().is_contiguous() or any(module.weight is e for e in embeddings)
    if layout is LinearLayout.ONEDNN:
        assert packed and all(any(m.weight is e for e in embeddings) for m in linears)
    if layout is LinearLayout.PANELS:
        assert any(isinstance(m, PanelLinear) for m in relaid.modules())
        assert all(any(m.weight is e for e in embeddings) for m in linears)
    ids = torch.randint(3, 100, (4, 9))
    with torch.inference_mode():
        torch.testing.assert_close(relaid(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_onednn_in_a_seq2seq_model(tiny_model) -> None:
    """T5 reads its Linear weights' dtype in forward: packed modules must still answer it."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tiny_model("t5"), dtype=torch.float32).eval()
    relaid = copy.deepcopy(model)
    choose_linear_layouts(relaid, max_batch_size=8, layout=LinearLayout.ONEDNN)
    assert any(isinstance(m, OneDnnLinear) for m in relaid.modules())
    ids = torch.randint(3, 100, (2, 7))
    decoder = torch.zeros((2, 3), dtype=torch.long)
    with torch.inference_mode():
        got = relaid(input_ids=ids, decoder_input_ids=decoder).logits
        torch.testing.assert_close(
            got, model(input_ids=ids, decoder_input_ids=decoder).logits, rtol=1e-4, atol=1e-4
        )


BF16_LAYOUTS = {
    LinearLayout.ONEDNN: (
        OneDnnLinear,
        torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "oneDNN has no bfloat16 linears",
    ),
    LinearLayout.PANELS: (
        PanelLinear,
        PANELS_HERE,
        "no panels layout (it needs AVX2, FMA and our C++ kernels)",
    ),
}


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS), ids=lambda layout: layout.value)
def test_packed_layouts_in_bfloat16(tiny_model, layout: LinearLayout) -> None:
    module_type, here, why_not = BF16_LAYOUTS[layout]
    if not here:
        pytest.skip(f"{why_not} on this CPU")
    model = _load(tiny_model("llama"), torch.bfloat16)
    relaid = copy.deepcopy(model)
    choose_linear_layouts(relaid, max_batch_size=8, layout=layout)
    assert any(isinstance(m, module_type) for m in relaid.modules())
    ids = torch.randint(3, 100, (2, 7))
    with torch.inference_mode():
        torch.testing.assert_close(relaid(ids).logits, model(ids).logits, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has bfloat16 linears on this CPU"
)
def test_onednn_in_bfloat16_is_refused_where_the_cpu_lacks_it(tiny_model) -> None:
    model = _load(tiny_model("llama"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"onednn is not available for torch\.bfloat16"):
        choose_linear_layouts(model, 8, LinearLayout.ONEDNN)


def test_tied_embedding_keeps_its_layout(tiny_model) -> None:
    model = _load(tiny_model("bloom"))  # BLOOM ties lm_head to the word embeddings
    for layout in (LinearLayout.COLUMN_MAJOR, LinearLayout.ONEDNN):
        choose_linear_layouts(model, 8, layout)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert model.get_input_embeddings().weight.is_contiguous()


def test_a_pinned_layout_that_cannot_apply_is_refused(tiny_model) -> None:
    model = _load(tiny_model("llama"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"column-major is not available for torch\.bfloat16"):
        choose_linear_layouts(model, 8, LinearLayout.COLUMN_MAJOR)
    with pytest.raises(ValueError, match=r"panels is not available for torch\.float16 \d+x\d+"):
        choose_linear_layouts(_load(tiny_model("llama"), torch.float16), 8, LinearLayout.PANELS)
    if PANELS_HERE:  # outputs that do not fill whole panels
        odd = torch.nn.Sequential(torch.nn.Linear(64, 40))
        with pytest.raises(ValueError, match=r"panels is not available for torch\.float32 40x64"):
            choose_linear_layouts(odd, 8, LinearLayout.PANELS)


def test_a_pinned_layout_other_than_panels_does_not_build_our_kernels(tiny_model, monkeypatch) -> None:
    """hf_transformers needs none of our C++ kernels: pinning plain must not build them."""
    monkeypatch.setattr(
        weight_layout, "_panel_kernel_here", lambda: pytest.fail("our kernels were consulted")
    )
    choices = choose_linear_layouts(_load(tiny_model("llama")), 8, LinearLayout.PLAIN)
    assert choices and all(c.layout is LinearLayout.PLAIN for c in choices)


def test_the_measured_choice_needs_a_clear_win() -> None:
    plain, column, onednn = LinearLayout.PLAIN, LinearLayout.COLUMN_MAJOR, LinearLayout.ONEDNN
    # Faster at both sizes: taken.
    assert pick({plain: (40, 280), column: (38, 270), onednn: (36, 120)}) is onednn
    # Slower at M = 1 but much faster at M = 32: the geometric mean decides.
    assert pick({plain: (15, 103), onednn: (19, 50)}) is onednn
    # Within noise of the loaded layout: stays plain.
    assert pick({plain: (40, 100), column: (39, 98)}) is plain
    assert pick({plain: (10, 50), onednn: (30, 60)}) is plain
