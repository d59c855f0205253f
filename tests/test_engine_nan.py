"""A model that produces NaN logits for one row fails that request alone, with TGIS's message."""

from __future__ import annotations

import torch

from text_generation_common.messages import GenerationRequest
from text_generation_server.config import ServerConfig
from text_generation_server.engines.hf_transformers import HFTransformersEngine
from text_generation_server.engines.step import NAN_LOGITS_MESSAGE


def test_nan_row_fails_alone_and_inf_is_not_nan(tiny_model) -> None:
    config = ServerConfig(model_name=str(tiny_model("llama")), max_batch_size=4, dtype="float32")
    engine = HFTransformersEngine(config)
    poisoned: dict[int, float] = {}

    def poison(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        for row, value in poisoned.items():
            output[row, -1, 7] = value
        return output

    engine.model.get_output_embeddings().register_forward_hook(poison)
    requests = [GenerationRequest(id=i, input_ids=(1, 5 + i, 9, 11), max_new_tokens=4) for i in range(3)]
    batch, errors = engine.new_batch(1, requests)
    assert batch is not None and not errors
    out, batch = engine.generate_token(batch)
    assert [g.request_id for g in out.generations] == [0, 1, 2] and not out.errors

    poisoned.update({0: float("inf"), 1: float("nan")})
    out, batch = engine.generate_token(batch)
    assert [(e.request_id, e.message) for e in out.errors] == [(1, NAN_LOGITS_MESSAGE)]
    assert [g.request_id for g in out.generations] == [0, 2]
    assert batch is not None and batch.request_ids == [0, 2]
    assert out.generations[0].token.token_id == 7  # an infinite logit is a valid (certain) choice
