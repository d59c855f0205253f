"""A hostile client for the external API: random requests at and beyond every bound, and raw
garbage bytes, over the four RPCs, concurrently.

`run(address, seed=..., structured=..., raw=...)` returns a Tally: how many calls of each RPC
ended with which status, and the calls that ended in a status outside ALLOWED (UNKNOWN,
INTERNAL, a hang past CALL_TIMEOUT_S, ...). The requests come from a seeded generator, so a run
is reproducible up to the server's own scheduling. Used by integration_tests/test_hardening.py
(about a minute in `make test`) and, for a longer soak against a server it starts itself, by

    python -m integration_tests.fuzz --seconds 600     # or: make fuzz-soak FUZZ_SECONDS=600
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import math
import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from router.pb import generation_pb2 as pb

logger = logging.getLogger(__name__)

ALLOWED = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})
CALL_TIMEOUT_S = 120.0  # a call still running after this is a hang
SERVICE = "/fmaas.GenerationService/"
RPCS = ("Generate", "GenerateStream", "Tokenize", "ModelInfo")
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

USUAL_TEXTS: tuple[Callable[[random.Random], str], ...] = (
    lambda r: "Hello",
    lambda r: "def hello(world):\n    return world",
    lambda r: "é€😀 ünïcödé\u200b\ufeff",
    lambda r: "\x00\x01 control \x7f",
    lambda r: "word " * r.randint(1, 60),
    lambda r: "".join(chr(r.randint(32, 0x2FFF)) for _ in range(r.randint(1, 40))),
    lambda r: "<s></s><pad><unk>",
)
EDGE_TEXTS: tuple[Callable[[random.Random], str], ...] = (
    lambda r: "",  # no tokens with this tokenizer (no BOS)
    lambda r: " " * r.randint(1, 3000),
    lambda r: "word " * r.randint(150, 400),  # around max_sequence_length
    lambda r: "x" * r.randint(10_000, 70_000),  # far beyond it
)


BEYOND = 0.07  # chance that a field takes a value at or beyond its bound


def _pick(r: random.Random, *values: Any) -> Any:
    return r.choice(values)


def _field(r: random.Random, usual: tuple[Any, ...], edge: tuple[Any, ...]) -> Any:
    """A usual value mostly; now and then one at or beyond the field's bound."""
    return r.choice(edge if r.random() < BEYOND else usual)


def _text(r: random.Random) -> str:
    return _field(r, USUAL_TEXTS, EDGE_TEXTS)(r)


def _stop_sequences(r: random.Random) -> list[str]:
    usual, edge = ("a", "\n", "def", "é", "stop", "o"), ("", "😀" * 60, "x" * 241)
    return [_field(r, usual, edge) for _ in range(_field(r, (0, 0, 1, 2), (6, 7)))]


def parameters(r: random.Random) -> pb.Parameters | None:
    """Random Parameters: each field absent, ordinary, at its bound, or beyond it."""
    if r.random() < 0.1:
        return None
    p = pb.Parameters(method=_field(r, (pb.GREEDY, pb.SAMPLE), (7,)))  # 7: an unknown enum value
    if r.random() < 0.7:
        s = p.sampling
        if r.random() < 0.8:
            s.temperature = _field(r, (0.0, 0.05, 0.7, 1.0, 100.0), (0.049, -1.0, math.nan, math.inf, 1e-30))
        s.top_k = _field(r, (0, 1, 5, 50), (2**31, U32_MAX))
        s.top_p = _field(r, (0.0, 0.5, 1.0), (-0.1, 1.01, math.nan))
        s.typical_p = _field(r, (0.0, -0.5, 0.5, 1.0), (1.5, math.nan))
        if r.random() < 0.5:
            s.seed = _field(r, (0, 1, 42), (U64_MAX,))
    if r.random() < 0.8:
        st = p.stopping
        st.max_new_tokens = _field(r, (0, 1, 5, 20, 40), (169, 170, U32_MAX))
        st.min_new_tokens = _field(r, (0, 0, 1, 5), (169, 170, U32_MAX))
        st.stop_sequences.extend(_stop_sequences(r))
        if r.random() < 0.5:
            st.include_stop_sequence = r.random() < 0.5
        st.time_limit_millis = _field(r, (0, 0, 50, 5000), (1, U32_MAX))
    if r.random() < 0.6:
        d = p.decoding
        d.repetition_penalty = _field(r, (0.0, 0.5, 1.0, 2.0), (-1.0, math.nan, math.inf))
        if r.random() < 0.4:
            d.length_penalty.start_index = _field(r, (0, 3), (U32_MAX,))
            d.length_penalty.decay_factor = _field(r, (1.0, 1.5, 10.0), (0.9, 10.1, math.nan))
        guided = r.random()
        if guided < 0.05:
            d.format = _pick(r, pb.DecodingParameters.TEXT, pb.DecodingParameters.JSON)
        elif guided < 0.08:
            d.regex = _pick(r, "[a-z]+", "(a")
        elif guided < 0.1:
            d.choice.choices.extend(_pick(r, ["a", "b"], []))
    if r.random() < 0.6:
        o = p.response
        o.input_text, o.generated_tokens, o.input_tokens = (r.random() < 0.4 for _ in range(3))
        o.token_logprobs, o.token_ranks = (r.random() < 0.4 for _ in range(2))
        o.top_n_tokens = _field(r, (0, 0, 1, 5, 10), (11, U32_MAX))
    p.truncate_input_tokens = _field(r, (0, 0, 0, 1, 5, 100), (199, 200, U32_MAX))
    return p


def _ids(r: random.Random, request: Any) -> None:
    if "prefix_id" in type(request).DESCRIPTOR.fields_by_name:
        if r.random() < 0.1:
            request.prefix_id = _pick(r, "", "missing", "../../etc/passwd", "p" * r.randint(300, 20_000))
        if r.random() < 0.05:
            request.adapter_id = _pick(r, "lora-1", "é" * 40)
    if r.random() < 0.1:
        request.model_id = _pick(r, "", "some-model", "m" * 5000)


def structured_request(r: random.Random) -> tuple[str, Any]:
    rpc = r.choices(RPCS, weights=(5, 4, 2, 1))[0]
    if rpc == "Generate":
        count = _field(r, (1, 1, 2, 3, 8), (0, 17))  # 17 > --max-concurrent-requests 16
        request: Any = pb.BatchedGenerationRequest(requests=[{"text": _text(r)} for _ in range(count)])
        if (params := parameters(r)) is not None:
            request.params.CopyFrom(params)
    elif rpc == "GenerateStream":
        request = pb.SingleGenerationRequest()
        if r.random() < 0.95:
            request.request.text = _text(r)
        if (params := parameters(r)) is not None:
            request.params.CopyFrom(params)
    elif rpc == "Tokenize":
        request = pb.BatchedTokenizeRequest(
            requests=[{"text": _text(r)} for _ in range(_pick(r, 0, 1, 3, 10))],
            return_tokens=r.random() < 0.5,
            return_offsets=r.random() < 0.5,
            truncate_input_tokens=_pick(r, 0, 1, 10, U32_MAX),
        )
    else:
        request = pb.ModelInfoRequest()
    _ids(r, request)
    return rpc, request


def raw_request(r: random.Random) -> tuple[str, bytes]:
    """Bytes that are not a valid message of the method, or only by chance."""
    rpc = r.choice(RPCS)
    kind = r.random()
    if kind < 0.3:
        return rpc, r.randbytes(r.randint(0, 200))
    _, valid = structured_request(r)
    body = bytearray(valid.SerializeToString() or b"\x0a\x00")
    if kind < 0.6:  # flipped bits
        for _ in range(r.randint(1, 4)):
            body[r.randrange(len(body))] ^= 1 << r.randrange(8)
    elif kind < 0.8:  # truncated
        body = body[: r.randrange(len(body))]
    else:  # a string field holding invalid UTF-8
        body = bytearray(b"\x1a\x05\x12\x03\xed\xa0\x80") + body
    return rpc, bytes(body)


@dataclass
class Tally:
    statuses: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)  # calls that ended outside ALLOWED
    messages: collections.Counter[str] = field(default_factory=collections.Counter)  # error messages

    @property
    def calls(self) -> int:
        return sum(self.statuses.values())

    def record(self, rpc: str, raw: bool, status: str, details: str) -> None:
        self.statuses[(f"{rpc}{' (raw)' if raw else ''}", status)] += 1
        if details:
            self.messages[f"{status}: {re.sub(r'[0-9]+', 'N', details)[:70]}"] += 1
        if status not in ALLOWED:
            self.bad.append(f"{rpc}{' raw' if raw else ''}: {status} {details[:300]}")

    def summary(self) -> str:
        rows = [f"{calls:6d}  {rpc:22s} {status}" for (rpc, status), calls in sorted(self.statuses.items())]
        common = [f"{calls:6d}  {message}" for message, calls in self.messages.most_common(12)]
        return "\n".join([f"{self.calls} calls", *rows, "most common errors:", *common])


async def _call(channel: grpc.aio.Channel, rpc: str, body: Any, raw: bool) -> tuple[str, str]:
    serializer = None if raw else type(body).SerializeToString
    try:
        if rpc == "GenerateStream":
            stream = channel.unary_stream(SERVICE + rpc, request_serializer=serializer)
            async for _ in stream(body, timeout=CALL_TIMEOUT_S):
                pass
        else:
            await channel.unary_unary(SERVICE + rpc, request_serializer=serializer)(
                body, timeout=CALL_TIMEOUT_S
            )
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    return "OK", ""


async def _run(address: str, seed: int, structured: int, raw: int, concurrency: int, seconds: float) -> Tally:
    rng = random.Random(seed)
    # Generated up front, so the sequence does not depend on the order calls finish in.
    work = [(*structured_request(rng), False) for _ in range(structured)]
    work += [(*raw_request(rng), True) for _ in range(raw)]
    rng.shuffle(work)
    tally = Tally()
    ends = time.monotonic() + seconds if seconds else math.inf
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        queue: asyncio.Queue[tuple[str, Any, bool]] = asyncio.Queue()
        for item in work:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty() and time.monotonic() < ends:
                rpc, body, is_raw = queue.get_nowait()
                tally.record(rpc, is_raw, *await _call(channel, rpc, body, is_raw))
                if seconds and queue.empty():  # soak: keep going with fresh requests
                    queue.put_nowait((*structured_request(rng), False))
                    queue.put_nowait((*raw_request(rng), True))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


def run(
    address: str,
    *,
    seed: int = 20261123,
    structured: int = 8_000,
    raw: int = 2_000,
    concurrency: int = 6,
    seconds: float = 0.0,
) -> Tally:
    """Fuzz the server at `address`; with `seconds`, keep going for that long (soak)."""
    return asyncio.run(_run(address, seed, structured, raw, concurrency, seconds))


def main() -> None:
    from integration_tests.servers import launch

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to keep going")
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--address", help="fuzz a running server instead of starting one")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = None
    address = args.address
    if address is None:
        root = Path(tempfile.mkdtemp(prefix="fuzz-"))
        server = launch("gpt2", root, *HARDENING_FLAGS)
        address = server.address
        logger.info("server log: %s", server.log_path)
    try:
        tally = run(address, seed=args.seed, concurrency=args.concurrency, seconds=args.seconds)
    finally:
        if server is not None:
            server.stop()
    logger.info("%s", tally.summary())
    for line in tally.bad:
        logger.error("%s", line)
    raise SystemExit(1 if tally.bad else 0)


# The configuration the fuzz runs against: small limits so that overload paths are reached.
HARDENING_FLAGS = ("--max-batch-size", "8", "--max-concurrent-requests", "16")

if __name__ == "__main__":
    main()
