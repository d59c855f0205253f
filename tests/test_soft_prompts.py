"""Tuned soft prompts (prefix_id / adapter_id) against PEFT's prompt tuning, on every engine that
takes them, alone and in mixed batches; the store's checks with TGIS's messages."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.adapter_helpers import engine_with_store, peft_generate
from tests.engines.conformance import Runner, alone
from tests.test_speculation import Replay
from text_generation_common.messages import GenerationRequest
from text_generation_server.adapters import AdapterSet
from text_generation_server.errors import PrefixNotFoundError
from text_generation_server.lora import AdapterError
from text_generation_server.prompts import PromptError, PromptSpec, PromptStore

PROMPT = (5, 17, 42, 99, 7, 300, 12)
OTHER = (1, 250, 251, 252)
VIRTUAL = 6
pytestmark = [
    pytest.mark.filterwarnings("ignore:Position ids are not supported"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]


def peft_prompt(base_dir: Path, out: Path, seed: int, virtual: int = VIRTUAL) -> Path:
    """A PEFT prompt-tuning adapter of the model in `base_dir`, saved the way PEFT saves it."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=virtual)
    tuned = peft.get_peft_model(model, config)
    with torch.no_grad():
        weight = tuned.prompt_encoder["default"].embedding.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    tuned.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def store(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    base = tiny_model("llama")
    peft_prompt(base, root / "sentiment", seed=1)
    peft_prompt(base, root / "nested" / "deeper" / "style", seed=2)
    saved = (root / "sentiment" / "adapter_model.safetensors").exists()
    assert saved, "PEFT saves safetensors"
    from safetensors.torch import load_file

    tensor = load_file(str(root / "sentiment" / "adapter_model.safetensors"))["prompt_embeddings"]
    (root / "as-pt").mkdir()
    torch.save(tensor.clone(), root / "as-pt" / "decoder.pt")
    return root


ENGINES = ["hf_transformers", "tgis_native"]


@pytest.mark.parametrize("name", ENGINES)
def test_soft_prompts_equal_peft_alone_and_mixed(name: str, tiny_model, store: Path) -> None:
    base = tiny_model("llama")
    e = engine_with_store(name, base, store)
    want = {
        "sentiment": peft_generate(base, store / "sentiment", PROMPT, 12),
        "nested/deeper/style": peft_generate(base, store / "nested" / "deeper" / "style", OTHER, 12),
        "": peft_generate(base, None, PROMPT, 12),
    }
    assert want["sentiment"] != want[""], "the soft prompt must change the output"
    requests = [
        GenerationRequest(1, PROMPT, 12, prefix_id="sentiment"),
        GenerationRequest(2, OTHER, 12, prefix_id="nested/deeper/style"),
        GenerationRequest(3, PROMPT, 12),
        GenerationRequest(4, PROMPT, 12, prefix_id="as-pt"),  # the same tensor as decoder.pt
        GenerationRequest(5, PROMPT, 12, adapter_id="sentiment"),  # PEFT type from adapter_config.json
    ]
    expected = {1: want["sentiment"], 2: want["nested/deeper/style"], 3: want[""], 4: want["sentiment"]}
    expected[5] = want["sentiment"]
    assert {r.id: alone(e, r) for r in requests} == expected
    assert Runner(e).run({0: requests[:3], 2: requests[3:]}) == expected  # mixed, with a join
    if name == "tgis_native":  # chunked prefill across the virtual tokens; prefix-cache hits
        assert Runner(e, token_budget=4).run({0: requests}) == expected
        assert Runner(e).run({0: requests}) == expected
        e.pipelined = True  # steps launched before the one before is read back (a GPU's default)
        assert Runner(e, token_budget=4).run({0: requests[:3], 2: requests[3:]}) == expected
        e.pipelined = False
        # speculative decoding: candidates verified behind each request's soft prompt
        e = engine_with_store(name, base, store, speculate=3)
        e.speculator = Replay([[*r.input_ids, *expected[r.id]] for r in requests], wrong_every=4)
        assert Runner(e, token_budget=4).run({0: requests[:3], 2: requests[3:]}) == expected


@pytest.mark.parametrize("name", ENGINES)
def test_a_missing_prompt_fails_its_request_alone(name: str, tiny_model, store: Path) -> None:
    e = engine_with_store(name, tiny_model("llama"), store)
    runner = Runner(e)
    requests = [GenerationRequest(1, PROMPT, 4, prefix_id="nope"), GenerationRequest(2, PROMPT, 4)]
    out = runner.run({0: requests})
    assert runner.errors == {1: "Error retrieving prompt prefix 'nope'"}
    assert len(out[2]) == 4


def spec(**overrides) -> PromptSpec:
    fields = {"hidden_size": 8, "dtype": torch.float32, "device": torch.device("cpu"), "seq2seq": False}
    return PromptSpec(**{**fields, "max_length": 4, **overrides})


def save(root: Path, prefix_id: str, tensor: object, name: str = "decoder.pt") -> None:
    (root / prefix_id).mkdir(parents=True, exist_ok=True)
    torch.save(tensor, root / prefix_id / name)


@pytest.mark.parametrize(
    ("prefix_id", "content", "error", "message"),
    [
        ("nope", None, PrefixNotFoundError, 'prefix id "nope" not found'),
        ("../x", None, PromptError, "Invalid prefix id ../x"),
        ("a b", None, PromptError, "Invalid prefix id a b, must contain only alphanumeric, _ and - and /"),
        ("one-d", torch.zeros(8), PromptError, "Invalid prefix embedding tensor"),
        ("long", torch.zeros(5, 8), PromptError, "Invalid prefix embedding length of 5"),
        ("wide", torch.zeros(2, 9), PromptError, "Prefix embedding tensor dim 9 does not match model (8)"),
        ("nan", torch.tensor([[float("nan")] * 8]), PromptError, "Prefix contains non-finite elements"),
        ("corrupt", b"not a tensor", PromptError, "Prefix corrupt could not be read from decoder.pt"),
    ],
)
def test_bad_prompts_get_tgis_messages(tmp_path: Path, prefix_id, content, error, message) -> None:
    if content is not None:
        (tmp_path / prefix_id).mkdir()
        if isinstance(content, bytes):
            (tmp_path / prefix_id / "decoder.pt").write_bytes(content)
        else:
            torch.save(content, tmp_path / prefix_id / "decoder.pt")
    with pytest.raises(error) as info:
        PromptStore(str(tmp_path), spec(), 2**20).get(prefix_id)
    assert str(info.value).startswith(message)


def test_overflow_after_the_cast_and_the_cache_bound(tmp_path: Path) -> None:
    save(tmp_path, "huge", torch.full((2, 8), 1e30))
    with pytest.raises(PromptError, match=r"after conversion from torch\.float32 to torch\.float16"):
        PromptStore(str(tmp_path), spec(dtype=torch.float16), 2**20).get("huge")
    for name in ("a", "b", "c"):
        save(tmp_path, name, torch.ones(4, 8))  # 128 bytes -> 512 in the cache
    store = PromptStore(str(tmp_path), spec(), 1024)
    first = store.get("a")
    store.get("b")
    assert store.get("a") is first  # cached
    store.get("c")  # evicts b, the least recently used
    assert store.get("a") is first and store.get("b") is not None
    with pytest.raises(PromptError, match="Prefix ID object a exceeds the allowed cache size"):
        PromptStore(str(tmp_path), spec(), 256).get("a")


def test_adapter_ids_resolve_by_their_peft_type(tmp_path: Path) -> None:
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    adapters = AdapterSet(PromptStore(str(tmp_path), spec(), 2**20), None)
    with pytest.raises(
        AdapterError, match="adapter lora is a LoRA adapter, which this engine does not apply"
    ):
        adapters.lookup(adapter_id="lora")
    with pytest.raises(AdapterError, match="adapter ia3 is a IA3 adapter: PROMPT_TUNING and LORA are served"):
        adapters.lookup(adapter_id="ia3")
    with pytest.raises(PrefixNotFoundError, match='adapter id "gone" not found'):
        adapters.lookup(adapter_id="gone")
    with pytest.raises(PrefixNotFoundError):
        PromptStore(None, spec(), 2**20).get("any")  # no store configured


def by_hand_seq2seq(base_dir: Path, encoder, decoder, ids: tuple[int, ...], max_new: int) -> list[int]:
    """Greedy T5 with the soft prompts prepended to the embeddings by hand: the encoder's in front
    of the input, the decoder's in front of the start token; no cache, no batching."""
    import transformers

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    embed = model.get_input_embeddings()
    start = model.config.decoder_start_token_id
    with torch.inference_mode():
        enc = embed(torch.tensor([ids]))
        if encoder is not None:
            enc = torch.cat([encoder[None], enc], dim=1)
        new: list[int] = []
        for _ in range(max_new):
            dec = embed(torch.tensor([[start, *new]]))
            if decoder is not None:
                dec = torch.cat([decoder[None], dec], dim=1)
            logits = model(inputs_embeds=enc, decoder_inputs_embeds=dec).logits
            new.append(int(logits[0, -1].argmax()))
            if new[-1] == model.config.eos_token_id:
                break
    return new


def test_encoder_and_decoder_prompts_of_seq2seq_models(tiny_model, tmp_path: Path) -> None:
    base = tiny_model("t5")
    hidden = 64
    tensors = {
        name: torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5
        for name, rows, seed in (("enc", 4, 11), ("dec", 3, 12))
    }
    save(tmp_path, "both", tensors["enc"], "encoder.pt")
    save(tmp_path, "both", tensors["dec"], "decoder.pt")
    save(tmp_path, "enc-only", tensors["enc"], "encoder.pt")
    save(tmp_path, "dec-only", tensors["dec"], "decoder.pt")
    e = engine_with_store("hf_transformers", base, tmp_path)
    cases = {"both": ("enc", "dec"), "enc-only": ("enc", None), "dec-only": (None, "dec"), "": (None, None)}
    requests, expected = [], {}
    for i, (prefix, (enc, dec)) in enumerate(cases.items()):
        ids = PROMPT if i % 2 else OTHER
        requests.append(GenerationRequest(i, ids, 10, prefix_id=prefix))
        expected[i] = by_hand_seq2seq(base, tensors.get(enc or ""), tensors.get(dec or ""), ids, 10)
    assert expected[0] != by_hand_seq2seq(base, None, None, OTHER, 10) != expected[2]  # the prompts matter
    assert {r.id: alone(e, r) for r in requests} == expected
    assert Runner(e).run({0: requests[:2], 2: requests[2:]}) == expected  # mixed, with a join
