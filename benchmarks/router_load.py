"""`python -m benchmarks.router_load`: what the router costs per streamed token, without a model.

On a fast device the router, not the engine, sets the pace at high concurrency (README, "GPU"):
one Python event loop validates, decodes, checks stops and writes a gRPC message per token for
every stream. This measures that ceiling on any machine: the real router process (`python -m
router.cli`) over a real shard server whose engine is the fake one (text_generation_server/
testing/fake_engine.py: a random table, no weights), each decode step padded to `--step-ms` of
sleep as a device's step would be, and `--concurrency` closed-loop gRPC streams (the benchmark
client of `python -m benchmarks`, 16-token prompts, every answer `--output-len` tokens long).

Per concurrency it prints the output tokens per second, the streamed messages per token, the
router's and the shard's CPU time per output token (from /proc, over the measured requests) and
the share of the engine's pace that the server reaches: the fake engine alone would deliver
c / step tokens per second. `--router-env KEY=VALUE` (repeatable) sets the router's environment,
e.g. `MAX_STREAM_INTERVAL=4`; to compare settings, run the command once per setting on the same
machine, one after the other.

    .venv/bin/python -m benchmarks.router_load --concurrency 1,32,128 --step-ms 4
    .venv/bin/python -m benchmarks.router_load --concurrency 128 --router-env MAX_STREAM_INTERVAL=4
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.arguments import concurrency_list, env_pair
from benchmarks.clients import GrpcClient
from benchmarks.loadgen import closed_loop
from benchmarks.server import free_port
from benchmarks.workload import Prompt

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
    router_cpu_s: float
    shard_cpu_s: float
    errors: int

    def row(self, step_s: float) -> str:
        tok_s = self.tokens / self.seconds
        pace = tok_s / (self.concurrency / step_s)
        per_token = 1e6 / self.tokens
        return (
            f"| {self.concurrency} | {tok_s:,.0f} | {pace:.2f} | {self.messages / self.tokens:.2f} | "
            f"{self.router_cpu_s * per_token:.1f} | {self.shard_cpu_s * per_token:.1f} | {self.errors} |"
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
        with grpc.insecure_channel(address) as channel:
            ready = grpc.channel_ready_future(channel)
            while not ready.done():
                if router.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text()[-2000:]
                    raise RuntimeError(f"the router did not start (exit code {router.returncode}):\n{tail}")
                time.sleep(0.1)
        assert shard.pid is not None
        yield address, router.pid, shard.pid
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        shard.terminate()
        shard.join(30)


def measure(args: argparse.Namespace) -> list[LoadPoint]:
    points = []
    with tempfile.TemporaryDirectory(prefix="router-load-") as tmp, _servers(args, Path(tmp)) as servers:
        address, router_pid, shard_pid = servers
        asyncio.run(_load(address, 4, WARMUP_REQUESTS, 8))
        for concurrency in args.concurrency:
            router_0, shard_0 = _cpu_seconds(router_pid), _cpu_seconds(shard_pid)
            requests = concurrency * args.requests_per_stream
            tokens, messages, seconds, errors = asyncio.run(
                _load(address, concurrency, requests, args.output_len)
            )
            points.append(
                LoadPoint(
                    concurrency,
                    tokens,
                    messages,
                    seconds,
                    _cpu_seconds(router_pid) - router_0,
                    _cpu_seconds(shard_pid) - shard_0,
                    errors,
                )
            )
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
    args = parser.parse_args(argv)
    points = measure(args)
    setting = " ".join(f"{k}={v}" for k, v in args.router_env) or "the router's defaults"
    header = (
        "c", "out tok/s", "share of the engine's pace", "messages / token",
        "router CPU µs / token", "shard CPU µs / token", "errors",
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
