"""`python -m benchmarks.router_load`: what the router costs per streamed token, without a model.

On a fast device the router, not the engine, sets the pace at high concurrency (README, "GPU"):
one Python event loop validates, decodes, checks stops and writes a gRPC message per token for
every stream. This measures that ceiling on any machine: the real router process (`python -m
router.cli`) over a real shard server whose engine is the fake one (text_generation_server/
testing/fake_engine.py: a random table, no weights), each decode step padded to `--step-ms` of
sleep as a device's step would be, and `--concurrency` closed-loop gRPC streams (the benchmark
client of `python -m benchmarks`, 16-token prompts, every answer `--output-len` tokens long).

Per concurrency it prints the output tokens per second, the streamed messages per token, the
server's, the shard's and the load client's CPU time per output token (from /proc and the client's
process time, over the measured requests) and the share of the engine's pace that the server
reaches: the fake engine alone would deliver c / step tokens per second. `--router-env KEY=VALUE`
(repeatable) sets the router's environment, e.g. `MAX_STREAM_INTERVAL=4`; to compare settings,
run the command once per setting on the same machine, one after the other.

`--bare` adds, per concurrency, the same load against a bare grpc.aio GenerationService in its own
process: no validation, batching, shard, detokenizing or metrics, just the router's message layout
(the input-count message, then one message per token) for every stream at each tick of one
`--step-ms` clock. Its CPU per token is what Python's gRPC alone costs to stream a token; the
router's figure above it is the rest of the router's work.

    .venv/bin/python -m benchmarks.router_load --concurrency 1,32,128 --step-ms 4
    .venv/bin/python -m benchmarks.router_load --concurrency 128 --router-env MAX_STREAM_INTERVAL=4
    .venv/bin/python -m benchmarks.router_load --concurrency 32 --step-ms 8 --bare
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.arguments import concurrency_list, env_pair
from benchmarks.clients import GrpcClient
from benchmarks.loadgen import closed_loop
from benchmarks.workload import Prompt
from text_generation_server.testing.ports import free_port

PROMPT_IDS = tuple(range(16))  # the prompt's length: what the client reports as input tokens
PROMPT_TEXT = "hello world " * 8
WARMUP_REQUESTS = 16
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class LoadPoint:
    concurrency: int
    tokens: int
    messages: int
    seconds: float
    server_cpu_s: float  # the router's, or the bare gRPC server's
    shard_cpu_s: float | None  # None: no shard (the bare server)
    errors: int
    client_cpu_s: float = 0.0
    server: str = "router"

    def row(self, step_s: float) -> str:
        tok_s = self.tokens / self.seconds
        pace = tok_s / (self.concurrency / step_s)
        per_token = 1e6 / max(self.tokens, 1)
        shard = "–" if self.shard_cpu_s is None else f"{self.shard_cpu_s * per_token:.1f}"
        return (
            f"| {self.concurrency} | {self.server} | {tok_s:,.0f} | {pace:.2f} | "
            f"{self.messages / max(self.tokens, 1):.2f} | {self.server_cpu_s * per_token:.1f} | {shard} | "
            f"{self.client_cpu_s * per_token:.1f} | {self.errors} |"
        )


def _shard_main(model_dir: str, uds_path: str, step_ms: float, max_batch_size: int) -> None:
    """The shard process: the real shard server over the fake engine, steps padded to step_ms."""
    import torch

    from text_generation_common.messages import StepOutput
    from text_generation_server.batches.batch import Batch
    from text_generation_server.batches.ragged import RaggedBatch
    from text_generation_server.config import ServerConfig
    from text_generation_server.server import start_server
    from text_generation_server.testing.fake_engine import FakeEngine

    torch.set_num_threads(1)

    class PacedEngine(FakeEngine):
        def generate_token(
            self, batch: Batch, token_budget: int = 0
        ) -> tuple[StepOutput, RaggedBatch | None]:
            start = time.perf_counter()
            result = super().generate_token(batch, token_budget)
            left = step_ms / 1e3 - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
            return result

    config = ServerConfig(model_name=model_dir, uds_path=uds_path, max_batch_size=max_batch_size)

    async def serve() -> None:
        server, _ = await start_server(PacedEngine(config), config)  # served while referenced
        await server.wait_for_termination()

    asyncio.run(serve())


def _bare_main(port: int, step_ms: float) -> None:
    """The bare server's process: GenerateStream answers as the router lays out a stream (the
    input-count message, then one message per token, the last with its stop reason), every
    stream's next token at the next tick of one step_ms clock, as a batch's step hands them out."""
    from router.pb import generation_pb2 as pb
    from router.pb import generation_pb2_grpc

    class Bare(generation_pb2_grpc.GenerationServiceServicer):
        def __init__(self) -> None:
            self.tick = asyncio.Event()

        async def clock(self) -> None:
            while True:
                await asyncio.sleep(step_ms / 1e3)
                tick, self.tick = self.tick, asyncio.Event()
                tick.set()

        async def GenerateStream(
            self, request: pb.SingleGenerationRequest, context: object
        ) -> AsyncIterator[pb.GenerationResponse]:
            yield pb.GenerationResponse(input_token_count=len(PROMPT_IDS))
            count = request.params.stopping.max_new_tokens
            for generated in range(1, count + 1):
                await self.tick.wait()
                message = pb.GenerationResponse(generated_token_count=generated, text=" tok")
                if generated == count:
                    message.stop_reason = pb.StopReason.MAX_TOKENS
                yield message

    async def serve() -> None:
        bare = Bare()
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(bare, server)
        server.add_insecure_port(f"localhost:{port}")
        await server.start()
        clock = asyncio.create_task(bare.clock())
        try:
            await server.wait_for_termination()
        finally:
            clock.cancel()

    asyncio.run(serve())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    address: str, concurrency: int, requests: int, output_len: int
) -> tuple[int, int, float, int]:
    client = GrpcClient(address, timeout_s=600)
    try:
        prompts = [Prompt(PROMPT_TEXT, PROMPT_IDS, output_len) for _ in range(requests)]
        results, seconds = await closed_loop(client, prompts, concurrency, progress=False)
    finally:
        await client.close()
    tokens = sum(r.output_len for r in results)
    return tokens, sum(r.messages for r in results), seconds, sum(1 for r in results if r.error)


def _point(
    server: str,
    address: str,
    server_pid: int,
    shard_pid: int | None,
    concurrency: int,
    args: argparse.Namespace,
) -> LoadPoint:
    """One closed-loop load at `concurrency`, with the CPU its server, shard and client spent."""
    server_0 = _cpu_seconds(server_pid)
    shard_0 = _cpu_seconds(shard_pid) if shard_pid is not None else 0.0
    client_0 = time.process_time()
    requests = concurrency * args.requests_per_stream
    tokens, messages, seconds, errors = asyncio.run(_load(address, concurrency, requests, args.output_len))
    client_s = time.process_time() - client_0
    shard_s = _cpu_seconds(shard_pid) - shard_0 if shard_pid is not None else None
    return LoadPoint(
        concurrency,
        tokens,
        messages,
        seconds,
        _cpu_seconds(server_pid) - server_0,
        shard_s,
        errors,
        client_s,
        server,
    )


def _wait_ready(address: str, alive: Callable[[], bool], deadline: float, what: Callable[[], str]) -> None:
    with grpc.insecure_channel(address) as channel:
        ready = grpc.channel_ready_future(channel)
        while not ready.done():
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(what())
            time.sleep(0.1)


@contextlib.contextmanager
def _bare_server(step_ms: float) -> Iterator[tuple[str, int]]:
    """The bare gRPC server running; yields its address and pid."""
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(
        target=_bare_main, args=(port, step_ms), daemon=True
    )
    process.start()
    try:
        address = f"localhost:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        _wait_ready(
            address, process.is_alive, deadline, lambda: f"the bare server did not start ({process.exitcode})"
        )
        assert process.pid is not None
        yield address, process.pid
    finally:
        process.terminate()
        process.join(30)


@contextlib.contextmanager
def _servers(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, int, int]]:
    """Shard and router running; yields the router's gRPC address and both pids."""
    from text_generation_server.testing.tiny_models import build_tiny_model

    model = build_tiny_model("llama", workdir / "model")
    uds = str(workdir / "shard")
    shard = multiprocessing.get_context("spawn").Process(
        target=_shard_main, args=(str(model), uds, args.step_ms, args.max_batch_size), daemon=True
    )
    shard.start()
    router = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not Path(f"{uds}-0").exists():
            if time.monotonic() > deadline or not shard.is_alive():
                raise RuntimeError(f"the shard server did not start (exit code {shard.exitcode})")
            time.sleep(0.1)
        env = {**os.environ, **dict(args.router_env)}
        grpc_port = args.grpc_port or free_port()
        command = [
            sys.executable, "-m", "router.cli",
            "--tokenizer-path", str(model),
            "--master-shard-uds-path", f"{uds}-0",
            "--grpc-port", str(grpc_port),
            "--port", str(args.http_port or free_port()),
            "--max-batch-size", str(args.max_batch_size),
            "--max-concurrent-requests", str(4 * args.max_batch_size),
            "--max-sequence-length", str(len(PROMPT_IDS) + args.output_len + 64),
            "--max-new-tokens", str(args.output_len),
        ]  # fmt: skip
        log_path = workdir / "router.log"
        with log_path.open("w") as log:
            router = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        address = f"localhost:{grpc_port}"
        started = router

        def failure() -> str:
            return (
                f"the router did not start (exit code {started.returncode}):\n{log_path.read_text()[-2000:]}"
            )

        _wait_ready(address, lambda: started.poll() is None, deadline, failure)
        assert shard.pid is not None
        yield address, router.pid, shard.pid
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        shard.terminate()
        shard.join(30)


def measure(args: argparse.Namespace) -> list[LoadPoint]:
    """The router's points, then (with --bare) the bare server's, in --concurrency order each."""
    points = []
    with tempfile.TemporaryDirectory(prefix="router-load-") as tmp, _servers(args, Path(tmp)) as servers:
        address, router_pid, shard_pid = servers
        asyncio.run(_load(address, 4, WARMUP_REQUESTS, 8))
        points += [_point("router", address, router_pid, shard_pid, c, args) for c in args.concurrency]
    if args.bare:
        with _bare_server(args.step_ms) as (address, pid):
            asyncio.run(_load(address, 4, WARMUP_REQUESTS, 8))
            points += [_point("bare gRPC", address, pid, None, c, args) for c in args.concurrency]
    return points


def main(argv: list[str] | None = None) -> list[LoadPoint]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_load", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=(1, 32, 128),
        help="streams in flight, comma-separated",
    )
    parser.add_argument(
        "--requests-per-stream", type=int, default=4, help="requests each stream sends in turn"
    )
    parser.add_argument("--output-len", type=int, default=128, help="tokens of every answer")
    parser.add_argument(
        "--step-ms", type=float, default=4.0, help="the fake engine's decode step (its floor)"
    )
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--router-env", type=env_pair, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--grpc-port", type=int, default=0, help="the router's gRPC port (0: a free one)")
    parser.add_argument("--http-port", type=int, default=0, help="the router's HTTP port (0: a free one)")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also load a bare grpc.aio server streaming the same messages at the same pace: gRPC's own cost",
    )
    args = parser.parse_args(argv)
    points = measure(args)
    setting = " ".join(f"{k}={v}" for k, v in args.router_env) or "the router's defaults"
    header = (
        "c", "server", "out tok/s", "share of the engine's pace", "messages / token",
        "server CPU µs / token", "shard CPU µs / token", "client CPU µs / token", "errors",
    )  # fmt: skip
    lines = [
        f"router over the fake engine, {args.step_ms:g} ms steps, {args.output_len} tokens per answer, "
        f"{setting}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *(p.row(args.step_ms / 1e3) for p in points),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return points


if __name__ == "__main__":
    main()
