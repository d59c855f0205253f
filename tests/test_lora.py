"""LoRA adapters (adapter_id) against PEFT: each engine's greedy output with an adapter equals
`PeftModel.generate` (and the merged model), batches mixing adapters and the base model equal
each request alone, the resident set is bounded, bad adapters fail alone with a clear line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.adapter_helpers import engine_with_store, peft_generate
from tests.engines.conformance import Runner, alone
from tests.test_speculation import Replay
from text_generation_common.messages import GenerationRequest
from text_generation_server import lora as lora_layers
from text_generation_server.lora import AdapterError
from text_generation_server.testing.tiny_prompts import build_lora

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

PROMPTS = (
    (5, 17, 42, 99, 7, 300, 12),
    (1, 250, 251, 252),
    (9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17),
)
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "t5": ["q", "v", "o", "wi", "wo"],
    "gpt_neox": ["query_key_value", "dense_4h_to_h"],
}


def seq2seq(arch: str) -> bool:
    return arch == "t5"


def auto(arch: str):
    import transformers

    return transformers.AutoModelForSeq2SeqLM if seq2seq(arch) else transformers.AutoModelForCausalLM


def peft_lora(base_dir: Path, arch: str, out: Path, seed: int, rank: int = 4) -> Path:
    return build_lora(base_dir, out, seed, rank, TARGETS[arch])


@pytest.fixture(scope="module")
def store(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for arch in ("llama", "t5"):
        for seed, name in ((1, "a"), (2, "b"), (3, "c")):
            peft_lora(tiny_model(arch), arch, root / arch / name, seed, rank=4 + seed)
    peft_lora(tiny_model("gpt_neox"), "gpt_neox", root / "llama" / "other-base", 4)
    return root


CASES = [("hf_transformers", "llama"), ("tgis_native", "llama"), ("hf_transformers", "t5")]


@pytest.mark.parametrize("path", ["kernel", "matmul"])
@pytest.mark.parametrize(("name", "arch"), CASES, ids=lambda v: v)
def test_lora_equals_peft_alone_and_in_mixed_batches(
    name: str, arch: str, path: str, tiny_model, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step on one of the two ways a step applies LoRA (lora.py): the CPU kernel, or the
    adapters side by side with a mask."""
    base = tiny_model(arch)
    e = engine_with_store(name, base, store / arch)
    assert e.adapters is not None and e.adapters.lora is not None
    if path == "kernel" and not e.adapters.lora.kernel:
        pytest.skip("the CPU kernels cannot be built here")
    monkeypatch.setattr(lora_layers, "KERNEL_MAX_WORK", 10**9 if path == "kernel" else -1)
    want = {
        (adapter, p): peft_generate(base, store / arch / adapter if adapter else None, PROMPTS[p], 10)
        for adapter in ("a", "b", "")
        for p in range(len(PROMPTS))
    }
    assert want[("a", 0)] != want[("", 0)] and want[("a", 0)] != want[("b", 0)], "adapters must matter"
    assert want[("a", 1)] == peft_generate(base, store / arch / "a", PROMPTS[1], 10, merged=True)
    requests, expected = [], {}
    for i, (adapter, p) in enumerate(want):
        requests.append(GenerationRequest(i, PROMPTS[p], 10, adapter_id=adapter))
        expected[i] = want[(adapter, p)]
    assert {r.id: alone(e, r) for r in requests} == expected
    assert Runner(e).run({0: requests[:4], 3: requests[4:]}) == expected  # mixed, with a join
    if name == "tgis_native":  # chunked prompts; prefix-cache keys apart per adapter
        assert Runner(e, token_budget=5).run({0: requests}) == expected
        assert Runner(e).run({0: requests}) == expected
        e.pipelined = True  # steps launched before the one before is read back (a GPU's default)
        assert Runner(e, token_budget=5).run({0: requests[:4], 3: requests[4:]}) == expected
        e.pipelined = False
        # speculative decoding: each row's candidates verified through its own adapter
        e = engine_with_store(name, base, store / arch, speculate=3)
        e.speculator = Replay([[*PROMPTS[p], *want[(a, p)]] for a, p in want], wrong_every=4)
        assert Runner(e).run({0: requests[:4], 3: requests[4:]}) == expected


@pytest.mark.parametrize("name", ["hf_transformers", "tgis_native"])
def test_at_most_max_loras_stay_resident(name: str, tiny_model, store: Path) -> None:
    e = engine_with_store(name, tiny_model("llama"), store / "llama", max_loras=2)
    lora = e.adapters.lora
    for adapter in ("a", "b", "a", "c"):  # c evicts b, the least recently used
        Runner(e).run({0: [GenerationRequest(1, PROMPTS[0], 2, adapter_id=adapter)]})
    assert lora.cache.keys() == ["a", "c"] and lora.evictions == 1
    # a running request keeps its adapter even when it is evicted meanwhile
    out = Runner(e).run(
        {
            0: [GenerationRequest(1, PROMPTS[0], 6, adapter_id="b")],
            1: [
                GenerationRequest(2, PROMPTS[1], 2, adapter_id="a"),
                GenerationRequest(3, PROMPTS[1], 2, adapter_id="c"),
            ],
        }
    )
    assert out[1] == alone(
        engine_with_store(name, tiny_model("llama"), store / "llama"),
        GenerationRequest(1, PROMPTS[0], 6, adapter_id="b"),
    )


def write_adapter(root: Path, name: str, config: dict, tensors: dict | bytes) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    if isinstance(tensors, bytes):
        (root / name / "adapter_model.safetensors").write_bytes(tensors)
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(root / name / "adapter_model.safetensors"))


def test_bad_adapters_fail_alone_with_a_clear_line(tiny_model, store: Path, tmp_path: Path) -> None:
    shutil.copytree(store / "llama", tmp_path / "llama")
    root = tmp_path / "llama"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    good = {key + "A.weight": torch.randn(4, 64), key + "B.weight": torch.randn(64, 4)}
    write_adapter(root, "nan", {}, {**good, key + "A.weight": torch.full((4, 64), float("nan"))})
    write_adapter(root, "corrupt", {}, b"not safetensors")
    write_adapter(root, "dora", {"use_dora": True}, good)
    write_adapter(
        root,
        "nowhere",
        {},
        {
            "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.randn(4, 64),
            "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.randn(128, 4),
        },
    )
    e = engine_with_store("hf_transformers", tiny_model("llama"), root)
    messages = {
        "other-base": "adapter other-base does not fit this model: it has no module",
        "nan": "adapter nan contains non-finite weights (model.layers.0.self_attn.q_proj)",
        "corrupt": "adapter corrupt could not be read from adapter_model.safetensors",
        "dora": "adapter dora uses DoRA, which this server does not apply",
        "nowhere": "adapter nowhere does not fit this model: it has no module model.layers.9.mlp.up_proj",
        "../x": "Invalid prefix id ../x",
        "gone": 'adapter id "gone" not found',
    }
    for adapter, message in messages.items():
        with pytest.raises(Exception) as info:
            e.adapters.lookup(adapter_id=adapter)
        assert str(info.value).startswith(message), (adapter, str(info.value))
    with pytest.raises(AdapterError):  # INVALID_ARGUMENT at the shard's edge
        e.adapters.lookup(adapter_id="nan")
    runner = Runner(e)
    out = runner.run(
        {
            0: [
                GenerationRequest(1, PROMPTS[0], 3, adapter_id="nan"),
                GenerationRequest(2, PROMPTS[0], 3, adapter_id="a"),
            ]
        }
    )
    assert runner.errors == {1: "Error retrieving adapter 'nan'"} and len(out[2]) == 3


def test_the_store_lists_the_adapters_requests_may_name(tiny_model, tmp_path: Path, monkeypatch) -> None:
    from text_generation_server import adapters

    root = tmp_path / "store"

    def stored(name: str, kind: str | None) -> None:
        (root / name).mkdir(parents=True)
        if kind is not None:
            (root / name / "adapter_config.json").write_text(json.dumps({"peft_type": kind}))

    for name in ("b-lora", "a_lora", "team/one", "team/two/deep", "x/y/z/w"):
        stored(name, "LORA")
    stored("prompt", "PROMPT_TUNING")
    stored("ia3", "IA3")  # a kind no request can use
    stored("legacy", None)  # TGIS's decoder.pt soft prompts: prefix_id, not adapter_id
    (root / "legacy" / "decoder.pt").write_bytes(b"")
    stored(".hidden", "LORA")  # not a valid id
    stored("x/y/z/w/v", "LORA")  # deeper than a listing looks
    stored("lora/inner", "LORA")  # below an adapter's own directory
    (root / "lora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    stored("broken", "LORA")
    (root / "broken" / "adapter_config.json").write_text("{")
    outside = tmp_path / "outside"
    (outside / "adapter").mkdir(parents=True)
    (outside / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (root / "link-out").symlink_to(outside / "adapter")
    (root / "link-in").symlink_to(root / "team" / "one")
    e = engine_with_store("hf_transformers", tiny_model("llama"), root)
    want = ["a_lora", "b-lora", "link-in", "lora", "prompt", "team/one", "team/two/deep", "x/y/z/w"]
    assert e.adapters.listed() == (want, False)
    assert e.adapters.listed(limit=3) == (want[:3], True)
    for adapter_id in want:  # each is what a request may name
        assert e.adapters.kind(adapter_id) in ("LORA", "PROMPT_TUNING")
    monkeypatch.setattr(adapters, "MAX_LIST_DEPTH", 3)
    assert "x/y/z/w" not in e.adapters.listed()[0]
    e.adapters.lora = None  # an engine that cannot apply LoRA lists its soft prompts only
    assert e.adapters.listed() == (["prompt"], False)


def test_adapters_added_by_name_from_any_directory(tiny_model, store: Path, tmp_path: Path) -> None:
    from text_generation_server.adapters import AdapterExists
    from text_generation_server.errors import PrefixNotFoundError

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store / "llama" / "a", elsewhere / "a")
    shutil.copytree(store / "llama" / "b", elsewhere / "b")
    (elsewhere / "empty").mkdir()
    shutil.copytree(store / "llama" / "a", elsewhere / "broken")
    (elsewhere / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    e = engine_with_store("tgis_native", tiny_model("llama"), store / "llama")
    assert e.adapters.add("team/hot", str(elsewhere / "a")) == 0
    assert e.adapters.listed()[0][:2] == ["a", "b"] and "team/hot" in e.adapters.listed()[0]
    want = alone(e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="a"))
    assert alone(e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="team/hot")) == want
    with pytest.raises(AdapterExists, match=r"The lora adapter 'team/hot' has already been loaded\."):
        e.adapters.add("team/hot", str(elsewhere / "b"))
    e.adapters.add("team/hot", str(elsewhere / "b"), replace=True)  # load_inplace: b's weights now
    assert alone(e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="team/hot")) == alone(
        e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="b")
    )
    with pytest.raises(PrefixNotFoundError):
        e.adapters.add("none", str(elsewhere / "empty"))
    with pytest.raises(AdapterError, match="could not be read"):
        e.adapters.add("broken", str(elsewhere / "broken"))
    with pytest.raises(AdapterError, match="Invalid adapter name"):
        e.adapters.add("../x", str(elsewhere / "a"))
    assert "broken" not in e.adapters.added and "none" not in e.adapters.added
    e.adapters.add("a", str(elsewhere / "b"))  # shadows the store's "a"
    assert alone(e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="a")) != want
    assert e.adapters.remove("a") and not e.adapters.remove("a")
    assert alone(e, GenerationRequest(1, PROMPTS[0], 6, adapter_id="a")) == want  # the store's again
    assert e.adapters.remove("team/hot")
    with pytest.raises(PrefixNotFoundError):
        e.adapters.lookup(adapter_id="team/hot")
