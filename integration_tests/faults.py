"""What the tests that break a running server share: long generations, the shard processes,
and the status every call ends with once a shard is broken."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import psutil

from integration_tests.servers import Server
from router.pb import generation_pb2 as pb


def long_params(time_limit_ms: int = 0) -> pb.Parameters:
    """Generate exactly the servers' limit of 169 tokens (or stop at `time_limit_ms`)."""
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=169, min_new_tokens=169, time_limit_millis=time_limit_ms)
    )


def shard_processes(s: Server) -> list[psutil.Process]:
    """The server's shard processes, by rank."""
    found = [p for p in psutil.Process(s.process.pid).children(recursive=True) if "serve" in p.cmdline()]
    return sorted(found, key=lambda p: int(p.environ().get("RANK", "0")))


def outcomes_when(s: Server, requests: int, break_shard: Callable[[], None]) -> list[tuple[str, float]]:
    """Start `requests` long generations, call `break_shard()`, and return each call's status
    code name ("OK" if it succeeded) with how many seconds after the break it ended."""

    async def run() -> list[tuple[str, float]]:
        stub = s.aio_stub()
        generating = asyncio.Event()  # a stream got its first token: the batch is running

        async def one(i: int) -> tuple[str, float]:
            """Unary, batch and stream calls in turn: a failure must look the same in each."""
            texts = [f"x{i}"] if i % 3 == 0 else [f"x{i}", f"y{i}"]
            try:
                if i % 3 == 2:
                    request = pb.SingleGenerationRequest(request={"text": texts[0]}, params=long_params())
                    async for message in stub.GenerateStream(request):
                        if message.generated_token_count:
                            generating.set()
                else:
                    requests = [{"text": t} for t in texts]
                    await stub.Generate(pb.BatchedGenerationRequest(requests=requests, params=long_params()))
            except grpc.aio.AioRpcError as error:
                return error.code().name, time.monotonic()
            return "OK", time.monotonic()

        assert requests >= 3, "the third call is the stream that says when generation runs"
        calls = [asyncio.ensure_future(one(i)) for i in range(requests)]
        # Break it mid-generation, however fast the engine is (a fixed sleep raced 169 tokens).
        await asyncio.wait_for(generating.wait(), 60)
        break_shard()
        broken = time.monotonic()
        return [(code, at - broken) for code, at in await asyncio.gather(*calls)]

    return asyncio.run(run())
