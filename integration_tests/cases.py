"""Integration cases as data: YAML files of requests and the answers TGIS gives.

A case is a map:
    name:          unique within its file
    request:       protobuf JSON of a BatchedGenerationRequest (or BatchedTokenizeRequest with
                   request_type: tokenize)
    response:      protobuf JSON of the expected answer  | error: {code: NAME, message: "..."}
    skip_check:    optional: only inputTokenCount / inputTokens are compared
    stream:        optional (default true): replay a single-input generate case as GenerateStream
All cases of a file are sent concurrently (shuffled, staggered) so that they batch together;
every single-input generate case is also streamed and checked against the same expectation
plus the stream invariants (tgis-api §5). Floats compare with relative tolerance 5e-4.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format

from router.pb import generation_pb2 as pb

CASES_DIR = Path(__file__).parent / "cases"
REL_TOLERANCE = 5e-4
STAGGER_S = 0.03
MAX_IN_FLIGHT = 24  # cases in flight; their inputs stay below TGIS_TEST_FLAGS' 64 concurrent


@dataclass
class Case:
    name: str
    request: dict[str, Any]
    response: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    request_type: str = "generate"
    skip_check: bool = False
    stream: bool = True

    @property
    def single(self) -> bool:
        return self.request_type == "generate" and len(self.request.get("requests", [])) == 1


@dataclass
class Outcome:
    """What the server answered: a response as protobuf JSON, or an error."""

    response: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    problems: list[str] = field(default_factory=list)  # stream invariant violations


def load(path: Path) -> list[Case]:
    raw = yaml.safe_load(path.read_text()) or []
    cases = [Case(**item) for item in raw]
    names = [c.name for c in cases]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"{path.name}: duplicate case names {sorted(duplicates)}")
    return cases


class _Dumper(yaml.SafeDumper):
    """YAML with strings that contain line breaks in double quotes (readable prompts)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = '"' if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump(items: list[dict[str, Any]]) -> str:
    return yaml.dump(items, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100_000)


def to_json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message)


def _error(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {"code": error.code().name, "message": error.details() or ""}


async def run_unary(stub: Any, case: Case) -> Outcome:
    try:
        if case.request_type == "tokenize":
            reply = await stub.Tokenize(json_format.ParseDict(case.request, pb.BatchedTokenizeRequest()))
        else:
            reply = await stub.Generate(json_format.ParseDict(case.request, pb.BatchedGenerationRequest()))
    except grpc.aio.AioRpcError as error:
        return Outcome(error=_error(error))
    return Outcome(response=to_json(reply))


async def run_stream(stub: Any, case: Case, seq2seq: bool) -> Outcome:
    """Stream the single input and rebuild the unary-shaped answer from the messages."""
    request = json_format.ParseDict(case.request, pb.BatchedGenerationRequest())
    single = pb.SingleGenerationRequest(model_id=request.model_id, request=request.requests[0])
    if request.HasField("params"):
        single.params.CopyFrom(request.params)
    if request.HasField("prefix_id"):
        single.prefix_id = request.prefix_id
    if request.HasField("adapter_id"):
        single.adapter_id = request.adapter_id
    messages = []
    try:
        async for message in stub.GenerateStream(single):
            messages.append(message)
    except grpc.aio.AioRpcError as error:
        return Outcome(error=_error(error))
    return assemble_stream(messages, request, seq2seq)


def assemble_stream(
    messages: list[pb.GenerationResponse], request: pb.BatchedGenerationRequest, seq2seq: bool
) -> Outcome:
    problems: list[str] = []
    params = request.params
    want_input_tokens = params.response.input_tokens
    sampling = params.method == pb.SAMPLE
    if not messages:
        return Outcome(problems=["no stream messages"])
    first, rest = messages[0], messages[1:]
    if first.generated_token_count or first.stop_reason or first.tokens:
        problems.append("message 1 carries generated output")
    if (first.text != "") != params.response.input_text:
        problems.append("message 1 text must be the prompt iff input_text")
    if bool(first.seed) != sampling:
        problems.append("message 1 seed must be set iff sampling")
    input_tokens: list[pb.TokenInfo] = []
    if want_input_tokens and rest and rest[0].input_tokens:
        second, rest = rest[0], rest[1:]
        input_tokens = list(second.input_tokens)
        if second.input_token_count != len(input_tokens):
            problems.append("message 2 input_token_count must equal its input_tokens")
    elif want_input_tokens and rest and rest[-1].stop_reason != pb.TIME_LIMIT:
        problems.append("missing the input-tokens message")
    text, tokens, last_count = "", [], 0
    for index, message in enumerate(rest):
        final = index == len(rest) - 1
        if message.input_token_count:
            problems.append("input_token_count after message 2")
        if final != bool(message.stop_reason):
            problems.append("only the last message carries a stop reason")
        if message.seed and not final:
            problems.append("seed on an intermediate message")
        if not final and message.generated_token_count <= last_count:
            problems.append("generated_token_count must strictly increase")
        if not final and not message.text and not message.tokens:
            problems.append("an empty intermediate message was sent")
        last_count = message.generated_token_count
        text += message.text
        tokens.extend(message.tokens)
    if not rest or not rest[-1].stop_reason:
        problems.append("the stream ended without a stop reason")
    last = rest[-1] if rest else pb.GenerationResponse()
    if sampling and last.seed != first.seed:
        problems.append("final seed differs from message 1")
    prefix = (first.text + ("\n\n" if seq2seq else "")) if params.response.input_text else ""
    rebuilt = pb.GenerationResponse(
        input_token_count=first.input_token_count,
        generated_token_count=last.generated_token_count,
        text=prefix + text,
        stop_reason=last.stop_reason,
        stop_sequence=last.stop_sequence,
        seed=last.seed,
        tokens=tokens,
        input_tokens=input_tokens,
    )
    return Outcome(response=to_json(pb.BatchedGenerationResponse(responses=[rebuilt])), problems=problems)


async def run_file(
    stub: Any, cases: list[Case], seq2seq: bool, seed: int = 0
) -> dict[tuple[str, str], Outcome]:
    """Every case unary, and single-input generate cases streamed too, all at once (at most
    MAX_IN_FLIGHT cases at a time: on a slow machine they would otherwise pile up past the
    server's --max-concurrent-requests and get 'Model is overloaded')."""
    jobs: list[tuple[tuple[str, str], Any]] = []
    for case in cases:
        jobs.append(((case.name, "unary"), lambda c=case: run_unary(stub, c)))
        if case.single and case.stream:
            jobs.append(((case.name, "stream"), lambda c=case: run_stream(stub, c, seq2seq)))
    random.Random(seed).shuffle(jobs)

    in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def staggered(position: int, job: Any) -> Outcome:
        await asyncio.sleep(position * STAGGER_S)
        async with in_flight:
            return await job()

    outcomes = await asyncio.gather(*(staggered(i, job) for i, (_, job) in enumerate(jobs)))
    return {key: outcome for (key, _), outcome in zip(jobs, outcomes, strict=True)}


def compare(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Differences between expected and actual protobuf JSON (floats approximately)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        diffs = []
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                diffs.append(f"{path}.{key}: missing (expected {expected[key]!r})")
            elif key not in expected:
                diffs.append(f"{path}.{key}: unexpected {actual[key]!r}")
            else:
                diffs.extend(compare(expected[key], actual[key], f"{path}.{key}"))
        return diffs
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(actual)} items, expected {len(expected)}"]
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for d in compare(e, a, f"{path}[{i}]")
        ]
    if isinstance(expected, float) or isinstance(actual, float) or expected == "NaN" or actual == "NaN":
        if _close(expected, actual):
            return []
    elif expected == actual:
        return []
    return [f"{path}: {actual!r}, expected {expected!r}"]


def _close(expected: Any, actual: Any) -> bool:
    try:
        e, a = float(expected), float(actual)
    except (TypeError, ValueError):
        return False
    if math.isnan(e) or math.isnan(a):
        return math.isnan(e) and math.isnan(a)
    return math.isclose(e, a, rel_tol=REL_TOLERANCE, abs_tol=1e-6)


def only_input_fields(response: dict[str, Any]) -> dict[str, Any]:
    """skip_check: keep inputTokenCount / inputTokens of each response."""
    keep = ("inputTokenCount", "inputTokens")
    return {"responses": [{k: r[k] for k in keep if k in r} for r in response.get("responses", [])]}


def check(case: Case, outcome: Outcome) -> list[str]:
    problems = list(outcome.problems)
    if case.error is not None:
        if outcome.error != case.error:
            problems.append(f"expected error {case.error}, got {outcome.error or outcome.response}")
        return problems
    if outcome.error is not None:
        return [*problems, f"unexpected error {outcome.error}"]
    expected, actual = case.response or {}, outcome.response or {}
    if case.skip_check:
        expected, actual = only_input_fields(expected), only_input_fields(actual)
    return problems + compare(expected, actual)
