"""TGIS's protobuf Parameters -> RequestParams (tgis-api §3): defaults, unset vs zero, and the
fields that GREEDY ignores. Protobuf stops here and in grpc_server.py."""

from __future__ import annotations

from dataclasses import replace

from router.core.validation import DEFAULT_MAX_NEW_TOKENS, RequestParams, ResponseSpec, StoppingSpec
from router.pb import generation_pb2 as pb
from text_generation_common.messages import Guided, GuidedKind, LengthPenalty, SamplingParams


def _signed32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def convert_params(params: pb.Parameters | None, default_include_stop_seqs: bool) -> RequestParams:
    if params is None:
        return RequestParams()
    stopping = StoppingSpec(DEFAULT_MAX_NEW_TOKENS)
    if params.HasField("stopping"):
        st = params.stopping
        stopping = StoppingSpec(
            max_new_tokens=st.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            min_new_tokens=st.min_new_tokens,
            stop_sequences=tuple(st.stop_sequences),
            include_stop_sequence=(
                st.include_stop_sequence
                if st.HasField("include_stop_sequence")
                else default_include_stop_seqs
            ),
            time_limit_ms=st.time_limit_millis,
        )
    d = params.decoding
    sampling = SamplingParams(
        min_new_tokens=stopping.min_new_tokens,
        repetition_penalty=d.repetition_penalty if d.repetition_penalty != 0.0 else 1.0,
        length_penalty=(
            LengthPenalty(d.length_penalty.start_index, d.length_penalty.decay_factor)
            if d.HasField("length_penalty")
            else None
        ),
    )
    if params.method == pb.SAMPLE:  # GREEDY ignores the sampling message entirely
        s = params.sampling
        temperature = s.temperature if s.HasField("temperature") else 0.0
        sampling = replace(
            sampling,
            temperature=temperature if temperature != 0.0 else 1.0,
            top_k=_signed32(s.top_k),
            top_p=s.top_p if s.top_p != 0.0 else 1.0,
            typical_p=s.typical_p if s.typical_p > 0.0 else 1.0,  # negative acts as off
            seed=s.seed if s.HasField("seed") else None,
        )
    r = params.response
    return RequestParams(
        sampling=replace(sampling, guided=convert_guided(d)),
        stopping=stopping,
        response=ResponseSpec(
            input_text=r.input_text,
            generated_tokens=r.generated_tokens,
            input_tokens=r.input_tokens,
            token_logprobs=r.token_logprobs,
            token_ranks=r.token_ranks,
            top_n_tokens=r.top_n_tokens,
        ),
        truncate_input_tokens=params.truncate_input_tokens,
    )


def convert_guided(d: pb.DecodingParameters) -> Guided | None:
    """vllm-tgis-adapter's `guided` oneof; format TEXT (or nothing) = free text."""
    which = d.WhichOneof("guided")
    if which == "format":
        return Guided(GuidedKind.JSON) if d.format == pb.DecodingParameters.JSON else None
    if which == "json_schema":
        return Guided(GuidedKind.JSON_SCHEMA, d.json_schema)
    if which == "regex":
        return Guided(GuidedKind.REGEX, d.regex)
    if which == "choice":
        return Guided(GuidedKind.CHOICE, choices=tuple(d.choice.choices))
    if which == "grammar":
        return Guided(GuidedKind.GRAMMAR, d.grammar)
    return None
