"""Greedy parity and seeded sampling through the shard's gRPC service.

Oracle: `model.generate` of transformers on each prompt alone. The engine runs behind the
real grpc.aio shard server and is driven like the router drives it: batches of mixed-length
prompts, a second batch joining mid-generation, finished requests pruned.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ARCHS
from tests.engines.conformance import Oracle, transformers_oracle
from tests.shard_harness import Driver, make_request, running_shard
from text_generation_server.config import ServerConfig
from text_generation_server.engines.hf_transformers import HFTransformersEngine

PROMPTS = [
    "def hello(world):\n    return",
    "import os",
    "class Foo(object):\n    '''A docstring for this class that is long'''\n",
    "x = [1, 2, 3]\nfor i in x:\n    print(i)",
    "#",
]


class Shard:
    def __init__(self, engine: HFTransformersEngine, stub, tokenizer, reference: Oracle) -> None:
        self.engine, self.stub, self.tokenizer = engine, stub, tokenizer
        self.reference = reference  # transformers generate (greedy), new tokens up to and including EOS

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def driver(self, stop_at_eos: bool = True) -> Driver:
        return Driver(self.stub, self.engine.info.eos_token_id, stop_at_eos=stop_at_eos)


@pytest.fixture(scope="module", params=ARCHS)
def shard(request, tiny_model, tmp_path_factory) -> Iterator[Shard]:
    import transformers

    path = tiny_model(request.param)
    socket_dir = tmp_path_factory.mktemp("sock")
    # float32: the oracle's exactness (the CPU default may be bfloat16, utils/cpu.py)
    config = ServerConfig(
        model_name=str(path), uds_path=str(socket_dir / "shard"), max_batch_size=8, dtype="float32"
    )
    engine = HFTransformersEngine(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with running_shard(engine, config) as stub:
        yield Shard(engine, stub, tokenizer, transformers_oracle(path))


def test_single_request(shard: Shard) -> None:
    ids = shard.encode(PROMPTS[0])
    driver = shard.driver()
    driver.prefill([make_request(1, ids, 16)])
    driver.run()
    assert driver.ids(1) == shard.reference(ids, 16)


def test_batch_of_mixed_lengths(shard: Shard) -> None:
    prompts = [shard.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must differ in length"
    driver = shard.driver()
    driver.prefill([make_request(i, ids, 12) for i, ids in enumerate(prompts)])
    driver.run()
    for i, ids in enumerate(prompts):
        assert driver.ids(i) == shard.reference(ids, 12), f"request {i}"


def test_join_mid_generation_and_prune(shard: Shard) -> None:
    prompts = [shard.encode(p) for p in PROMPTS]
    max_new = [3, 14, 9, 5, 11]
    driver = shard.driver()
    driver.prefill([make_request(i, prompts[i], max_new[i]) for i in (0, 1)])
    driver.run(steps=4)  # request 0 finishes and is pruned by the next prefill
    driver.prefill([make_request(i, prompts[i], max_new[i]) for i in (2, 3)])
    driver.run(steps=2)
    driver.prefill([make_request(4, prompts[4], max_new[4])])
    driver.run()
    for i, ids in enumerate(prompts):
        assert driver.ids(i) == shard.reference(ids, max_new[i]), f"request {i}"


# (repetition_penalty, length_penalty (start, decay), min_new_tokens) per request
PENALTIES = [(1.3, None, 0), (1.0, (2, 3.0), 0), (2.0, (1, 1.5), 4), (1.0, None, 6), (0.7, None, 0)]


def _penalised(i: int, ids: list[int], max_new: int):
    rep, lp, min_new = PENALTIES[i]
    return make_request(i, ids, max_new, repetition_penalty=rep, length_penalty=lp, min_new_tokens=min_new)


def _penalised_reference(shard: Shard, i: int, ids: list[int], max_new: int) -> list[int]:
    rep, lp, min_new = PENALTIES[i]
    kwargs = {"repetition_penalty": rep, "min_new_tokens": min_new}
    if lp is not None:
        kwargs["exponential_decay_length_penalty"] = lp
    return shard.reference(ids, max_new, **kwargs)


def test_penalties_in_a_padded_batch(shard: Shard) -> None:
    """Repetition / length penalties and min_new_tokens, heterogeneous in one padded batch, give
    what transformers gives each prompt alone (EOS included: the length penalty forces it)."""
    prompts = [shard.encode(p) for p in PROMPTS]
    driver = shard.driver()
    driver.prefill([_penalised(i, ids, 16) for i, ids in enumerate(prompts)])
    driver.run()
    for i, ids in enumerate(prompts):
        assert driver.ids(i) == _penalised_reference(shard, i, ids, 16), f"request {i}"
    assert driver.ids(1)[-1] == shard.engine.info.eos_token_id, "the length penalty should force EOS"


def test_penalty_state_survives_joins_and_prunes(shard: Shard) -> None:
    """Token history, generated counts and penalties carried through concatenate and prune."""
    prompts = [shard.encode(p) for p in PROMPTS]
    max_new = [4, 16, 12, 9, 10]
    driver = shard.driver()
    driver.prefill([_penalised(i, prompts[i], max_new[i]) for i in (0, 3)])
    driver.run(steps=5)
    driver.prefill([_penalised(i, prompts[i], max_new[i]) for i in (1, 2)])
    driver.run(steps=3)
    driver.prefill([_penalised(4, prompts[4], max_new[4])])
    driver.run()
    for i, ids in enumerate(prompts):
        assert driver.ids(i) == _penalised_reference(shard, i, ids, max_new[i]), f"request {i}"


def test_truncation_keeps_last_tokens(shard: Shard) -> None:
    ids = shard.encode(PROMPTS[3])
    keep = 5
    expected_input = ids[-keep:]
    if shard.engine.context.bos_token_id is not None:
        expected_input[0] = shard.engine.context.bos_token_id
    driver = shard.driver()
    driver.prefill([make_request(1, ids, 8, truncate=keep, input_tokens=True)])
    driver.run()
    assert [t.token_id for t in driver.input_tokens[1]] == expected_input
    assert driver.ids(1) == shard.reference(expected_input, 8)


def _sampled(i: int, ids: list[int], max_new: int, seed: int):
    return make_request(i, ids, max_new, temperature=0.8, top_k=40, top_p=0.9, seed=seed)


def test_seeded_sampling_is_batch_invariant(shard: Shard) -> None:
    prompts = [shard.encode(p) for p in PROMPTS]
    alone = shard.driver(stop_at_eos=False)
    alone.prefill([_sampled(1, prompts[1], 10, seed=1234)])
    alone.run()
    expected = alone.ids(1)
    assert len(expected) == 10

    # Same request in a batch with greedy and other sampled rows, joined mid-way, with
    # neighbours pruned around it.
    mixed = shard.driver(stop_at_eos=False)
    mixed.prefill([make_request(10, prompts[0], 3), _sampled(11, prompts[2], 12, seed=7)])
    mixed.run(steps=2)
    mixed.prefill([_sampled(1, prompts[1], 10, seed=1234), make_request(12, prompts[3], 4)])
    mixed.run(steps=3)
    mixed.prefill([_sampled(13, prompts[4], 6, seed=99)])
    mixed.run()
    assert mixed.ids(1) == expected

    # A different seed gives a different sequence (10 draws from ~2000 tokens).
    other = shard.driver(stop_at_eos=False)
    other.prefill([_sampled(1, prompts[1], 10, seed=4321)])
    other.run()
    assert other.ids(1) != expected


# Half precision: a greedy choice may flip at a near tie between a batched step and generate
# alone; every chosen token must be within this much logprob of the best one the same-dtype
# model gives after the same prefix (teacher forcing).
HALF_TOLERANCE = {"float16": 0.1, "bfloat16": 0.25}  # on CPU: 0 and 0.06 at most


def half_precision_gaps(
    model_dir, device: str, dtype: str, prompt: list[int], chosen: list[int]
) -> list[float]:
    """Per chosen token: the same-dtype model's best next-token logprob minus the chosen one's,
    after the prompt and the tokens chosen before it (one forward over the whole sequence)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ids = torch.tensor([prompt + chosen[:-1]], device=device)
    with torch.inference_mode():
        logprobs = model(input_ids=ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
    best = logprobs.max(-1).values
    picked = logprobs.gather(-1, torch.tensor(chosen, device=device)[:, None])[:, 0]
    return (best - picked).tolist()


def run_joined_batches(shard: Shard, prompts: list[list[int]], max_new: int) -> Driver:
    """Three prompts, then two more joining after two steps; every request runs max_new tokens."""
    driver = shard.driver(stop_at_eos=False)
    driver.prefill([make_request(i, ids, max_new) for i, ids in enumerate(prompts[:3])])
    driver.run(steps=2)
    driver.prefill([make_request(i, ids, max_new) for i, ids in enumerate(prompts[3:], start=3)])
    driver.run()
    assert not driver.errors
    return driver


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("engine_name", ["hf_transformers", "tgis_native"])
def test_cuda(tiny_model, tmp_path, engine_name: str, dtype: str) -> None:
    """Each engine on CUDA, batches with a join: in float32 greedy output equals generate on the
    same GPU; in float16 and bfloat16 every token is the same-dtype model's best within
    HALF_TOLERANCE (near ties may flip between batched and alone)."""
    import transformers

    from text_generation_server.engines import get_engine_class

    path = tiny_model("llama")
    config = ServerConfig(
        model_name=str(path),
        deployment_framework=engine_name,
        uds_path=str(tmp_path / "shard"),
        dtype=dtype,
        max_batch_size=8,
        max_sequence_length=256,
        kv_cache_blocks=8 * 256 // 16 + 1,
    )
    engine = get_engine_class(engine_name)(config)
    assert engine.device.type == "cuda"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = transformers_oracle(path, "cuda", "float32")
    with running_shard(engine, config) as stub:
        shard = Shard(engine, stub, tokenizer, reference)
        prompts = [shard.encode(p) for p in PROMPTS]
        driver = run_joined_batches(shard, prompts, 10)
    for i, ids in enumerate(prompts):
        assert len(driver.ids(i)) == 10, f"request {i}"
        if dtype == "float32":
            assert driver.ids(i) == reference(ids, 10), f"request {i}"
        else:
            gaps = half_precision_gaps(path, "cuda", dtype, ids, driver.ids(i))
            assert max(gaps) <= HALF_TOLERANCE[dtype], f"request {i}: {gaps}"
