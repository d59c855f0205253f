"""Parameter conversion and validation: TGIS's defaults, check order and exact messages."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from pathlib import Path

import pytest

from router.core.capacity import KVBlockCapacity
from router.core.metrics import Metrics
from router.core.validation import (
    EMPTY_INPUT_MESSAGE,
    STOP_SEQUENCES_MESSAGE,
    PrefixLengths,
    RequestParams,
    ValidationError,
    Validator,
    check_params,
    shard_input_ids,
)
from router.grpc.grpc_params import convert_params
from router.pb import generation_pb2 as pb
from text_generation_common.guided import Grammars
from text_generation_common.messages import (
    GenerationRequest,
    Guided,
    GuidedKind,
    SamplingParams,
    ThinkingMarks,
)
from text_generation_server.batches.inputs import truncated_input_ids

MAX_SEQ = 200
MAX_NEW = 169
VOCAB = 1000


def params(**kwargs) -> pb.Parameters:
    return pb.Parameters(**kwargs)


class GrpcValidator(Validator):
    """Validation as the gRPC door drives it: TGIS's protobuf Parameters converted first."""

    async def validate(self, texts, params, *args, **kwargs):
        return await super().validate(texts, convert_params(params, True), *args, **kwargs)


def sample(**sampling) -> pb.Parameters:
    return pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(**sampling))


async def found(prefix_id: str, adapter: bool = False) -> int:
    if prefix_id == "known":
        return 8
    raise Exception(f'{"adapter" if adapter else "prefix"} id "{prefix_id}" not found')


def make_validator(pool) -> Validator:
    metrics = Metrics(max_sequence_length=MAX_SEQ, max_new_tokens=MAX_NEW)
    return GrpcValidator(
        pool,
        PrefixLengths(found, metrics),
        metrics,
        max_sequence_length=MAX_SEQ,
        max_new_tokens=MAX_NEW,
        vocab_size=pool.tokenizer.get_vocab_size(with_added_tokens=True),
    )


@pytest.fixture
def validator(tokenizer_pool) -> Validator:
    return make_validator(tokenizer_pool)


def test_defaults_without_params() -> None:
    p = convert_params(None, default_include_stop_seqs=True)
    assert p.sampling.greedy and p.stopping.max_new_tokens == 20
    assert p.stopping.include_stop_sequence is False  # no `stopping` message: stays false
    assert p.sampling.repetition_penalty == 1.0 and p.sampling.length_penalty is None


def test_greedy_ignores_sampling_entirely() -> None:
    p = convert_params(
        params(method=pb.GREEDY, sampling=pb.SamplingParameters(temperature=0.01, top_p=-3)), True
    )
    check_params(p, MAX_NEW, VOCAB)  # no error: the nonsense is ignored
    assert p.sampling.greedy and p.sampling.top_p == 1.0


def test_sample_defaults() -> None:
    p = convert_params(params(method=pb.SAMPLE), True)
    assert p.sampling.temperature == 1.0 and p.sampling.top_k == 0 and p.sampling.top_p == 1.0
    assert p.sampling.seed is None


def test_include_stop_sequence_default_comes_from_the_server() -> None:
    with_stopping = params(stopping=pb.StoppingCriteria(stop_sequences=["x"]))
    assert convert_params(with_stopping, True).stopping.include_stop_sequence is True
    assert convert_params(with_stopping, False).stopping.include_stop_sequence is False
    explicit = params(stopping=pb.StoppingCriteria(include_stop_sequence=False))
    assert convert_params(explicit, True).stopping.include_stop_sequence is False


@pytest.mark.parametrize(
    ("p", "message"),
    [
        (sample(temperature=0.02), "temperature must be >= 0.05"),
        (sample(temperature=-1.0), "temperature must be >= 0.05"),
        (sample(top_p=1.5), "top_p must be > 0.0 and <= 1.0"),
        (sample(top_p=-0.5), "top_p must be > 0.0 and <= 1.0"),
        (sample(typical_p=1.01), "typical_p must be <= 1.0"),
        (sample(top_k=2**32 - 1), "top_k must be strictly positive"),
        (params(stopping=pb.StoppingCriteria(max_new_tokens=170)), "max_new_tokens must be <= 169"),
        (params(stopping=pb.StoppingCriteria(min_new_tokens=30)), "min_new_tokens must be <= max_new_tokens"),
        (
            params(stopping=pb.StoppingCriteria(max_new_tokens=10, min_new_tokens=11)),
            "min_new_tokens must be <= max_new_tokens",
        ),
        (params(decoding=pb.DecodingParameters(repetition_penalty=-1)), "repetition_penalty must be > 0.0"),
        (
            params(decoding=pb.DecodingParameters(length_penalty={"start_index": 1, "decay_factor": 0.5})),
            "length_penalty must be >= 1.0 and <= 10.0",
        ),
        (params(stopping=pb.StoppingCriteria(stop_sequences=["a"] * 7)), STOP_SEQUENCES_MESSAGE),
        (params(stopping=pb.StoppingCriteria(stop_sequences=["a", ""])), STOP_SEQUENCES_MESSAGE),
        (params(stopping=pb.StoppingCriteria(stop_sequences=["é" * 121])), STOP_SEQUENCES_MESSAGE),
        (
            params(response=pb.ResponseOptions(token_logprobs=True)),
            "must request input and/or generated tokens to request extra token detail",
        ),
        (
            params(response=pb.ResponseOptions(top_n_tokens=2)),
            "must request input and/or generated tokens to request extra token detail",
        ),
        (sample(temperature=float("nan")), "temperature must be >= 0.05"),
        (sample(temperature=float("inf")), "temperature must be >= 0.05"),
        (sample(top_p=float("nan")), "top_p must be > 0.0 and <= 1.0"),
        (
            params(decoding=pb.DecodingParameters(repetition_penalty=float("inf"))),
            "repetition_penalty must be > 0.0",
        ),
        (
            params(decoding=pb.DecodingParameters(repetition_penalty=float("nan"))),
            "repetition_penalty must be > 0.0",
        ),
        (
            params(
                decoding=pb.DecodingParameters(
                    length_penalty={"start_index": 1, "decay_factor": float("nan")}
                )
            ),
            "length_penalty must be >= 1.0 and <= 10.0",
        ),
        (
            params(response=pb.ResponseOptions(generated_tokens=True, top_n_tokens=11)),
            "top_n_tokens (11) must be <= 10",
        ),
    ],
)
def test_check_messages(p: pb.Parameters, message: str) -> None:
    with pytest.raises(ValidationError) as error:
        check_params(convert_params(p, True), MAX_NEW, VOCAB)
    assert str(error.value) == message


def test_checks_run_in_tgis_order() -> None:
    both = sample(temperature=0.01, top_p=2.0)
    with pytest.raises(ValidationError, match="temperature"):
        check_params(convert_params(both, True), MAX_NEW, VOCAB)
    stops_then_details = params(
        stopping=pb.StoppingCriteria(stop_sequences=[""]), response=pb.ResponseOptions(token_ranks=True)
    )
    with pytest.raises(ValidationError, match="must request input"):
        check_params(convert_params(stops_then_details, True), MAX_NEW, VOCAB)


@pytest.mark.parametrize(
    ("biases", "message"),
    [
        (((VOCAB, 1.0),), f"logit_bias token id {VOCAB} is not in the vocabulary (0 to {VOCAB - 1})"),
        (((-1, 1.0),), f"logit_bias token id -1 is not in the vocabulary (0 to {VOCAB - 1})"),
        (((3, 100.5),), "logit_bias values must be >= -100.0 and <= 100.0"),
        (((3, float("nan")),), "logit_bias values must be >= -100.0 and <= 100.0"),
        (((3, -1e39),), "logit_bias values must be >= -100.0 and <= 100.0"),
    ],
)
def test_logit_bias_ids_are_in_the_vocabulary_and_biases_in_range(biases, message: str) -> None:
    check_params(
        RequestParams(sampling=SamplingParams(logit_bias=((0, -100.0), (VOCAB - 1, 100.0)))), MAX_NEW, VOCAB
    )
    with pytest.raises(ValidationError) as error:
        check_params(RequestParams(sampling=SamplingParams(logit_bias=biases)), MAX_NEW, VOCAB)
    assert str(error.value) == message


def test_stop_token_ids_are_in_the_vocabulary() -> None:
    check_params(RequestParams(sampling=SamplingParams(stop_token_ids=(0, VOCAB - 1))), MAX_NEW, VOCAB)
    with pytest.raises(ValidationError) as error:
        check_params(RequestParams(sampling=SamplingParams(stop_token_ids=(3, VOCAB))), MAX_NEW, VOCAB)
    assert str(error.value) == f"stop_token_ids: {VOCAB} is not in the vocabulary (0 to {VOCAB - 1})"
    with pytest.raises(ValidationError) as error:
        check_params(RequestParams(sampling=SamplingParams(allowed_token_ids=(-1,))), MAX_NEW, VOCAB)
    assert str(error.value) == f"allowed_token_ids: -1 is not in the vocabulary (0 to {VOCAB - 1})"


@pytest.mark.parametrize("min_p", [-0.1, 1.01, float("nan"), float("inf")])
def test_min_p_is_a_share_of_the_likeliest_tokens_probability(min_p: float) -> None:
    for fine in (0.0, 0.05, 1.0):
        check_params(RequestParams(sampling=SamplingParams(temperature=1.0, min_p=fine)), MAX_NEW, VOCAB)
    with pytest.raises(ValidationError) as error:
        check_params(RequestParams(sampling=SamplingParams(temperature=1.0, min_p=min_p)), MAX_NEW, VOCAB)
    assert str(error.value) == "min_p must be >= 0.0 and <= 1.0"


def test_text_format_is_no_constraint() -> None:
    p = convert_params(params(decoding=pb.DecodingParameters(format=pb.DecodingParameters.TEXT)), True)
    check_params(p, MAX_NEW, VOCAB)
    assert p.sampling.guided is None


@pytest.mark.parametrize(
    ("decoding", "guided"),
    [
        (pb.DecodingParameters(format=pb.DecodingParameters.JSON), Guided(GuidedKind.JSON)),
        (
            pb.DecodingParameters(json_schema='{"type": "integer"}'),
            Guided(GuidedKind.JSON_SCHEMA, '{"type": "integer"}'),
        ),
        (pb.DecodingParameters(regex="[a-z]+"), Guided(GuidedKind.REGEX, "[a-z]+")),
        (
            pb.DecodingParameters(choice={"choices": ["a", "b"]}),
            Guided(GuidedKind.CHOICE, choices=("a", "b")),
        ),
        (pb.DecodingParameters(grammar='start: "x"'), Guided(GuidedKind.GRAMMAR, 'start: "x"')),
    ],
    ids=["json", "json_schema", "regex", "choice", "grammar"],
)
def test_the_guided_oneof_becomes_the_constraint(decoding: pb.DecodingParameters, guided: Guided) -> None:
    assert convert_params(params(decoding=decoding), True).sampling.guided == guided


async def test_guided_decoding_is_checked_against_the_tokenizer(tokenizer_pool, tokenizer_dir: Path) -> None:
    validator = make_validator(tokenizer_pool)
    with pytest.raises(ValidationError, match=r"guided decoding needs the model's tokenizer\.json"):
        await validator.validate(["hi"], params(decoding=pb.DecodingParameters(regex="a+")), "", 0.0)
    validator.grammars = Grammars((tokenizer_dir / "tokenizer.json").read_text(), 2000, 2)
    ok = await validator.validate(["hi"], params(decoding=pb.DecodingParameters(regex="a+")), "", 0.0)
    assert ok[0].sampling.guided == Guided(GuidedKind.REGEX, "a+")
    with pytest.raises(ValidationError, match=r"^invalid regex for guided decoding: .*unclosed group"):
        await validator.validate(["hi"], params(decoding=pb.DecodingParameters(regex="(a")), "", 0.0)


def test_max_new_tokens_limit_at_the_boundary() -> None:
    check_params(
        convert_params(params(stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW)), True), MAX_NEW, VOCAB
    )


async def test_length_checks_and_capping(validator: Validator, tokenizer_pool) -> None:
    word = "hello "
    text = word * 60
    n = len(tokenizer_pool.encode_batch_sync([text])[0])
    assert n > 100
    (v,) = await validator.validate([text], params(stopping=pb.StoppingCriteria(max_new_tokens=150)), "", 0.0)
    assert v.input_length == n and v.stopping.max_new_tokens == MAX_SEQ - n and v.stopping.capped
    (v,) = await validator.validate([text], params(stopping=pb.StoppingCriteria(max_new_tokens=5)), "", 0.0)
    assert v.stopping.max_new_tokens == 5 and not v.stopping.capped

    long_text = word * 250
    n_long = len(tokenizer_pool.encode_batch_sync([long_text])[0])
    with pytest.raises(ValidationError) as error:
        await validator.validate([long_text], None, "", 0.0)
    assert str(error.value) == f"input tokens ({n_long}) plus prefix length (0) must be < {MAX_SEQ}"
    # Truncation rescues it.
    (v,) = await validator.validate([long_text], params(truncate_input_tokens=10), "", 0.0)
    assert v.input_length == 10
    # Only what the shard's truncation needs is kept and sent: the last 10 ids and one more.
    full = tokenizer_pool.encode_batch_sync([long_text])[0]
    assert v.input_ids == tuple(full[-11:])

    min_new = params(stopping=pb.StoppingCriteria(min_new_tokens=150, max_new_tokens=160))
    with pytest.raises(ValidationError) as error:
        await validator.validate([text], min_new, "", 0.0)
    assert str(error.value) == (
        f"input tokens ({n}) plus prefix length (0) plus min_new_tokens (150) must be <= {MAX_SEQ}"
    )


async def test_first_failing_input_gives_the_message(validator: Validator, tokenizer_pool) -> None:
    long_text = "hello " * 250
    n_long = len(tokenizer_pool.encode_batch_sync([long_text])[0])
    with pytest.raises(ValidationError, match=rf"input tokens \({n_long}\)"):
        await validator.validate(["short", long_text, "hello " * 300], None, "", 0.0)


async def test_prefix_lookup(validator: Validator) -> None:
    (v,) = await validator.validate(["hi"], None, "known", 0.0)
    assert v.prefix_length == 8 and v.prefix_id == "known"
    with pytest.raises(ValidationError) as error:
        await validator.validate(["hi"], None, "invalid_prefix_id", 0.0)
    assert str(error.value) == (
        "can't retrieve prompt prefix with id 'invalid_prefix_id': prefix id \"invalid_prefix_id\" not found"
    )


async def test_adapter_id_is_looked_up_as_an_adapter(validator: Validator) -> None:
    (v,) = await validator.validate(["hi"], None, "", 0.0, adapter_id="known")
    assert v.prefix_length == 8 and v.adapter_id == "known" and v.prefix_id == ""
    request = v.shard_request(7)
    assert request.adapter_id == "known" and request.prefix_id == ""
    (same,) = await validator.validate(["hi"], None, "known", 0.0, adapter_id="known")
    assert same.adapter_id == "known" and same.prefix_id == ""
    with pytest.raises(ValidationError, match="prefix_id and adapter_id name different adapters"):
        await validator.validate(["hi"], None, "known", 0.0, adapter_id="other")
    with pytest.raises(ValidationError) as error:
        await validator.validate(["hi"], None, "", 0.0, adapter_id="nope")
    assert str(error.value) == "can't retrieve adapter with id 'nope': adapter id \"nope\" not found"


async def test_seeds(validator: Validator) -> None:
    texts = ["same"] * 5
    sampled = await validator.validate(texts, sample(), "", 0.0)
    seeds = [v.seed for v in sampled]
    assert len(set(seeds)) == 5 and all(0 <= s < 2**32 for s in seeds)
    (given,) = await validator.validate(["x"], sample(seed=11), "", 0.0)
    assert given.seed == 11
    (greedy,) = await validator.validate(["x"], params(sampling=pb.SamplingParameters(seed=11)), "", 0.0)
    assert greedy.seed == 0


async def test_deadline_counts_from_receipt(validator: Validator) -> None:
    received = time.monotonic()
    p = params(stopping=pb.StoppingCriteria(time_limit_millis=250))
    (v,) = await validator.validate(["x"], p, "", received)
    assert v.deadline == pytest.approx(received + 0.25)
    (v,) = await validator.validate(["x"], None, "", received)
    assert v.deadline is None


async def test_prefix_lengths_are_cached() -> None:
    calls = []

    async def lookup(prefix_id: str, adapter: bool = False) -> int:
        calls.append(prefix_id)
        return 3

    metrics = Metrics()
    cache = PrefixLengths(lookup, metrics)
    assert await cache.get("a") == 3 and await cache.get("a") == 3 and await cache.get("a", adapter=True) == 3
    assert calls == ["a", "a"]  # a prefix_id and an adapter_id of the same name are looked up apart
    assert metrics.counters["tgi_adapter_lookup_cache_hits"].get() == 1


@pytest.mark.parametrize("bos", [None, 1])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("keep", [0, 1, 2, 3, 4, 8])
def test_shard_input_ids_truncate_like_the_whole_list(length: int, keep: int, bos: int | None) -> None:
    ids = list(range(100, 100 + length))
    sent = shard_input_ids(ids, keep)
    assert len(sent) <= max(keep + 1, 1) or keep == 0
    whole = GenerationRequest(id=1, input_ids=tuple(ids), max_new_tokens=1, truncate_input_tokens=keep)
    short = GenerationRequest(id=1, input_ids=sent, max_new_tokens=1, truncate_input_tokens=keep)
    assert truncated_input_ids(short, bos) == truncated_input_ids(whole, bos)


@pytest.fixture
def no_bos_validator(tmp_path) -> Validator:
    """Validation with a tokenizer that adds no BOS (GPT-2's, BLOOM's): "" has no tokens."""
    from router.core.tokenizer import TokenizerPool, load_tokenizer
    from text_generation_server.testing.tiny_models import ARCHITECTURES, write_tokenizer

    write_tokenizer(tmp_path, ARCHITECTURES["gpt2"])
    pool = TokenizerPool(load_tokenizer(str(tmp_path)), workers=1)
    yield make_validator(pool)
    pool.close()


async def test_an_input_without_tokens_is_invalid(no_bos_validator: Validator) -> None:
    for texts in ([""], ["", "Hello"], ["Hello", ""]):
        with pytest.raises(ValidationError) as error:
            await no_bos_validator.validate(texts, None, "", 0.0)
        assert str(error.value) == EMPTY_INPUT_MESSAGE
    # In request order with the other per-input checks: the too-long first input speaks first.
    with pytest.raises(ValidationError, match=r"^input tokens \(\d+\) plus prefix length"):
        await no_bos_validator.validate(["hello " * 250, ""], None, "", 0.0)
    (v,) = await no_bos_validator.validate(["Hello"], None, "", 0.0)
    assert v.input_length > 0


async def test_surely_too_long_inputs_are_not_tokenized(
    validator: Validator, tokenizer_pool, monkeypatch
) -> None:
    per_token = tokenizer_pool.max_token_bytes
    assert per_token is not None  # byte-level BPE: the bound applies
    huge = "x" * (per_token * (MAX_SEQ + 10))
    seen: list[list[str]] = []
    encode = tokenizer_pool.encode_batch

    async def recording(texts):
        seen.append(list(texts))
        return await encode(texts)

    monkeypatch.setattr(tokenizer_pool, "encode_batch", recording)
    with pytest.raises(ValidationError) as error:
        await validator.validate([huge], None, "", 0.0)
    assert (
        str(error.value)
        == f"input tokens (at least {MAX_SEQ + 10}) plus prefix length (0) must be < {MAX_SEQ}"
    )
    assert seen == [[]]
    # Truncated to at least the limit: the count is then exact, as TGIS would report it.
    with pytest.raises(ValidationError) as error:
        await validator.validate([huge], params(truncate_input_tokens=MAX_SEQ + 5), "", 0.0)
    assert str(error.value) == f"input tokens ({MAX_SEQ + 5}) plus prefix length (0) must be < {MAX_SEQ}"
    # Truncated below the limit: it is tokenized and accepted.
    (v,) = await validator.validate([huge], params(truncate_input_tokens=50), "", 0.0)
    assert v.input_length == 50 and len(v.input_ids) == 51
    # A short input before it keeps request order: the huge one still fails, the short one is
    # tokenized alone.
    seen.clear()
    with pytest.raises(ValidationError, match="at least"):
        await validator.validate(["short", huge], None, "", 0.0)
    assert seen == [["short"]]


async def test_echoed_prefix_ids_are_clipped(validator: Validator) -> None:
    long_id = "p" * 20_000
    with pytest.raises(ValidationError) as error:
        await validator.validate(["hi"], None, long_id, 0.0)
    message = str(error.value)
    assert message.startswith("can't retrieve prompt prefix with id 'ppp")
    assert "(20000 characters)" in message and len(message) < 1000
    # A short id keeps TGIS's exact text.
    with pytest.raises(ValidationError) as error:
        await validator.validate(["hi"], None, "nope", 0.0)
    assert str(error.value) == "can't retrieve prompt prefix with id 'nope': prefix id \"nope\" not found"


async def test_a_request_larger_than_the_whole_kv_cache_is_refused(tokenizer_pool) -> None:
    capacity = KVBlockCapacity(block_size=4, total_blocks=11)  # 10 usable blocks: 40 tokens
    metrics = Metrics(max_sequence_length=MAX_SEQ, max_new_tokens=MAX_NEW)
    validator = GrpcValidator(
        tokenizer_pool,
        PrefixLengths(found, metrics),
        metrics,
        max_sequence_length=MAX_SEQ,
        max_new_tokens=MAX_NEW,
        vocab_size=tokenizer_pool.tokenizer.get_vocab_size(with_added_tokens=True),
        capacity=capacity,
    )
    text = "hello " * 10
    n = len(tokenizer_pool.encode_batch_sync([text])[0])
    fits = params(stopping=pb.StoppingCriteria(max_new_tokens=40 - n))
    (v,) = await validator.validate([text], fits, "", 0.0)
    assert v.stopping.max_new_tokens == 40 - n
    too_long = params(stopping=pb.StoppingCriteria(max_new_tokens=41 - n))
    with pytest.raises(ValidationError) as error:
        await validator.validate([text], too_long, "", 0.0)
    assert str(error.value) == (
        f"input tokens plus max_new_tokens ({n} + {41 - n}) need 11 KV-cache blocks of 4 tokens; "
        "the whole cache holds 10"
    )


async def test_a_priority_needs_the_priority_policy_and_a_bounded_value(validator: Validator) -> None:
    from router.core.validation import PRIORITY_OFF_MESSAGE

    async def priority_of(value: int | None) -> int:
        params = RequestParams(priority=value)  # past the gRPC-converting wrapper
        (v,) = await Validator.validate(validator, ["hi"], params, "", time.monotonic())
        return v.priority

    assert await priority_of(None) == 0 and await priority_of(0) == 0
    with pytest.raises(ValidationError, match=re.escape(PRIORITY_OFF_MESSAGE)):
        await priority_of(3)
    validator.by_priority = True
    assert await priority_of(-7) == -7 and await priority_of(2**31 - 1) == 2**31 - 1
    with pytest.raises(ValidationError, match=r"^priority must be > -2147483648 and < 2147483648$"):
        await priority_of(2**31)


async def test_a_thinking_budget_needs_a_reasoning_format_and_holds_free_answers(
    validator: Validator,
) -> None:
    from router.core.thinking import ThinkingBudget, ThinkingMarkers
    from router.core.validation import THINKING_OFF_MESSAGE

    async def thinking_of(budget: int | None, guided: Guided | None = None) -> ThinkingBudget | None:
        params = RequestParams(sampling=SamplingParams(guided=guided), thinking_budget=budget)
        (v,) = await Validator.validate(validator, ["hi"], params, "", time.monotonic())
        return v.thinking

    assert await thinking_of(None) is None
    with pytest.raises(ValidationError, match=re.escape(THINKING_OFF_MESSAGE)):
        await thinking_of(5)
    markers = ThinkingMarkers(True, ((1,),), ((2,),))
    validator.thinking = markers
    assert await thinking_of(5) == ThinkingBudget(5, markers)
    validator._check_guided = lambda guided: asyncio.sleep(0)  # type: ignore[method-assign]
    assert await thinking_of(5, Guided(GuidedKind.JSON)) is None  # a constrained output thinks not
    after = Guided(GuidedKind.JSON, after_thinking=ThinkingMarks(True, ("<think>",), ("</think>",)))
    assert await thinking_of(5, after) == ThinkingBudget(5, markers)  # a constrained answer after it
    with pytest.raises(ValidationError, match=r"^thinking_token_budget must be >= 1, got 0$"):
        await thinking_of(0)
    counted = RequestParams(reads_thinking=True)  # a chat read for thinking: counted, no limit
    (v,) = await Validator.validate(validator, ["hi"], counted, "", time.monotonic())
    assert v.thinking == ThinkingBudget(None, markers)
    validator.thinking = None
    (v,) = await Validator.validate(validator, ["hi"], counted, "", time.monotonic())
    assert v.thinking is None


async def test_bad_words_become_the_token_sequences_vllm_bans(validator: Validator, tokenizer_pool) -> None:
    """Each word as written (leading spaces dropped) and, where the tokenizer begins it with
    another token after a space, that form too; refusals name the word."""
    raw = tokenizer_pool.tokenizer

    def ids(text: str) -> tuple[int, ...]:
        return tuple(raw.encode(text, add_special_tokens=False).ids)

    words = ("hello world", "  print", "x")
    validate = functools.partial(Validator.validate, validator)  # with the door-neutral params
    (done,) = await validate(["hi"], RequestParams(bad_words=words), "", 0.0)
    want = []
    for word in ("hello world", "print", "x"):
        plain, spaced = ids(word), ids(" " + word)
        want += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    assert done.sampling.bad_words == tuple(want) and len(want) > 3
    assert done.shard_request(1).params.bad_words == tuple(want)
    for bad, message in [
        (("ok", " "), "bad_words may not hold an empty word"),
        (("a",) * 129, "bad_words may hold at most 128 words, got 129"),
        (("x" * 400,), "bad_words: 'xxx"),
    ]:
        with pytest.raises(ValidationError) as error:
            await validate(["hi"], RequestParams(bad_words=bad), "", 0.0)
        assert str(error.value).startswith(message)
