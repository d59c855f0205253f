"""Adapters through the real launcher: a LoRA adapter and a PEFT soft prompt of the servers'
store (testing/tiny_prompts.py) give PEFT's own greedy tokens on both engines, in one busy batch
with requests for the other adapter and for none; the router counts requests per adapter."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from functools import cache
from pathlib import Path

import pytest
import torch

from integration_tests.servers import Server
from router.pb import generation_pb2 as pb

PROMPTS = ["A very long story:\n", "def hello(world):", "import os"]


@cache
def peft_tokens(model_dir: str, adapter: str, prompt: str, max_new: int) -> list[str]:
    """PeftModel.generate with the stored adapter (none: the base model): the token pieces."""
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    store = Path(model_dir).parent.parent / "prompts" / Path(model_dir).name
    if adapter:
        model = peft.PeftModel.from_pretrained(model, store / adapter).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    return [tokenizer.convert_ids_to_tokens(i) for i in out[0, -max_new:].tolist()]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["llama", "llama@tgis_native"])
def test_adapters_equal_peft_in_one_busy_batch(server, name: str) -> None:
    s: Server = server(name)
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=8),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    calls = [(adapter, prompt) for adapter in ("lora", "sentiment", "") for prompt in PROMPTS]

    async def run() -> list[pb.BatchedGenerationResponse]:
        stub = s.aio_stub()
        return await asyncio.gather(
            *(
                stub.Generate(
                    pb.BatchedGenerationRequest(
                        requests=[{"text": prompt}], params=params, **({"adapter_id": a} if a else {})
                    )
                )
                for a, prompt in calls
            )
        )

    for (adapter, prompt), reply in zip(calls, asyncio.run(run()), strict=True):
        got = [t.text for t in reply.responses[0].tokens]
        assert got == peft_tokens(str(s.model_dir), adapter, prompt, 8), (adapter, prompt)
    with urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/metrics", timeout=10) as response:
        metrics = response.read().decode()

    def value(sample: str) -> float:  # the servers are shared: other tests load adapters too
        return float(re.search(rf"^{re.escape(sample)} (\S+)$", metrics, re.M).group(1))

    assert value('tgi_adapter_request_count_total{adapter_id="lora"}') >= 3
    assert value('tgi_adapters_resident{kind="lora"}') == 1 == value('tgi_adapter_loads_total{kind="lora"}')
    assert value('tgi_adapters_resident{kind="prompt"}') >= 1
    assert value("tgi_adapter_lookup_cache_hits_total") >= 0
