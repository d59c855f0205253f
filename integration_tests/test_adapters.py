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
    # the Gateway API Inference Extension's view: MAX_LORAS, and no adapter in use once all ended
    info = re.findall(r"^tgi_lora_requests_info\{(.*)\} \S+$", metrics, re.M)
    assert info == ['max_lora="8",running_lora_adapters="",waiting_lora_adapters=""'], info
    if name.endswith("tgis_native"):
        assert re.search(
            r'^tgi_cache_config_info\{block_size="\d+",num_gpu_blocks="\d+"\} 1.0$', metrics, re.M
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_openai_door_serves_the_stores_adapters_by_model_name(server) -> None:
    import json

    s: Server = server("llama@tgis_native")
    base = f"http://127.0.0.1:{s.http_port}/v1"

    def call(path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, models = call("/models")
    served = models["data"][0]["id"]
    assert status == 200 and [(m["id"], m["parent"]) for m in models["data"]] == [
        (served, None),
        ("lora", served),  # the store's PEFT adapters; its decoder.pt soft prompts are prefix_ids
        ("sentiment", served),
    ]
    prompt = PROMPTS[1]
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=8))

    async def grpc_text(adapter: str) -> str:  # equal to PEFT's (the test above)
        request = pb.BatchedGenerationRequest(requests=[{"text": prompt}], params=params, adapter_id=adapter)
        return (await s.aio_stub().Generate(request)).responses[0].text

    want = {adapter: asyncio.run(grpc_text(adapter)) for adapter in ("lora", "")}
    assert want["lora"] != want[""]
    for model in ("lora", served):
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "min_tokens": 8}
        status, answer = call("/completions", body)
        assert status == 200 and answer["model"] == model
        assert answer["choices"][0]["text"] == want["lora" if model == "lora" else ""], model
    status, answer = call("/completions", {"model": "gone", "prompt": prompt})
    assert (status, answer["error"]["message"]) == (404, "The model `gone` does not exist.")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_adapter_added_and_removed_while_serving(tmp_path: Path, server) -> None:
    """ALLOW_RUNTIME_ADAPTER_LOADING: vLLM's /v1/load_lora_adapter serves a PEFT save from a
    directory outside the store by a name, on the OpenAI and gRPC doors alike (its answer is the
    store copy's), and /v1/unload_lora_adapter takes it away; servers without it lack the routes."""
    import json
    import shutil

    from integration_tests.servers import launch

    shared: Server = server("llama")
    outside = tmp_path / "outside" / "lora"
    shutil.copytree(shared.model_dir.parent.parent / "prompts" / shared.model_dir.name / "lora", outside)
    s = launch("llama", tmp_path, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:

        def post(port: int, route: str, body: dict) -> tuple[int, str]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/{route}",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        hot = {"lora_name": "hot/lora", "lora_path": str(outside)}
        assert post(shared.http_port, "load_lora_adapter", hot)[0] == 404  # not allowed there
        assert post(s.http_port, "load_lora_adapter", hot) == (
            200,
            "Success: LoRA adapter 'hot/lora' added successfully.",
        )
        completion = {"prompt": PROMPTS[0], "max_tokens": 6, "min_tokens": 6, "temperature": 0}
        status, by_name = post(s.http_port, "completions", {**completion, "model": "hot/lora"})
        status_store, by_store = post(s.http_port, "completions", {**completion, "model": "lora"})
        assert status == status_store == 200
        assert json.loads(by_name)["choices"][0]["text"] == json.loads(by_store)["choices"][0]["text"]
        params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=6, min_new_tokens=6))
        reply = s.stub().Generate(
            pb.BatchedGenerationRequest(requests=[{"text": PROMPTS[0]}], params=params, adapter_id="hot/lora")
        )
        assert reply.responses[0].text == json.loads(by_name)["choices"][0]["text"]
        assert post(s.http_port, "unload_lora_adapter", {"lora_name": "hot/lora"})[0] == 200
        status, answer = post(s.http_port, "completions", {**completion, "model": "hot/lora"})
        assert status == 404 and "does not exist" in answer
    finally:
        s.stop()
