"""Column-major linear weights: same model outputs, fast strides, tied embeddings left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from text_generation_server.engines.weight_layout import column_major_linears


def _load(path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "bloom", "gpt_neox"])
def test_same_logits_and_column_major_strides(tiny_model, arch: str) -> None:
    model = _load(tiny_model(arch))
    relaid = copy.deepcopy(model)
    changed = column_major_linears(relaid)
    linears = [m for m in relaid.modules() if isinstance(m, torch.nn.Linear)]
    embeddings = [m.weight for m in relaid.modules() if isinstance(m, torch.nn.Embedding)]
    assert changed > 0
    for module in linears:
        if module.weight.is_contiguous():  # only a weight tied to an embedding stays row-major
            assert any(module.weight is e for e in embeddings)
        else:
            assert module.weight.t().is_contiguous()
    ids = torch.randint(3, 100, (4, 9))
    with torch.inference_mode():
        torch.testing.assert_close(relaid(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_tied_embedding_keeps_row_major(tiny_model) -> None:
    model = _load(tiny_model("bloom"))  # BLOOM ties lm_head to the word embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    column_major_linears(model)
    assert model.get_input_embeddings().weight.is_contiguous()


def test_other_dtypes_untouched(tiny_model) -> None:
    model = _load(tiny_model("llama")).to(torch.bfloat16)
    assert column_major_linears(model) == 0
    assert all(p.is_contiguous() for p in model.parameters())
