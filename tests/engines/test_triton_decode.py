"""The Triton paged-decode kernel (kernels/paged_decode_triton.py) against a slow torch reference.

Interpreter mode: Triton decides it once per process, when `triton` is first imported
(TRITON_INTERPRET=1 then jits triton.language's own helpers for the interpreter, and compiled
kernels can no longer use them). Setting the flag inside this pytest process would therefore
either come too late or switch Triton to the interpreter for every later test (and break any
compiled kernel on a GPU host). So the CPU cases run in one child pytest process of this file
with TRITON_INTERPRET=1 in its environment only (`test_interpreted_on_the_cpu`); in that child
the `device` parameter is "cpu", in this process it is "cuda": the same checks, compiled, on a
GPU host (marked `gpu`, skipped without one), plus a CUDA-graph capture and replay.

Scenario: 5 rows of lengths 1 (one key), 16 (exactly one block), 0 (padding), 83 (six blocks,
the last partial) and 40, tables one block wider than needed, their tails garbage.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from text_generation_server.kernels import paged_decode_triton

LENGTHS = (1, 16, 0, 83, 40)
GARBAGE = 1 << 30  # table entries past a row's blocks: never read
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}  # atol = rtol

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the child process of test_interpreted_on_the_cpu
REPO = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device of a case: "cpu" under Triton's interpreter (child process), "cuda" compiled."""
    pytest.importorskip("triton")
    return str(request.param)


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: the same cases run compiled on it ([cuda])"
)
def test_interpreted_on_the_cpu() -> None:
    """Every case of this file on the CPU, in a child process that imports triton interpreted."""
    pytest.importorskip("triton")
    here = Path(__file__).resolve().relative_to(REPO)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-m", "not gpu"]
    command += [
        f"--deselect={here}::{name}"
        for name in (
            "test_interpreted_on_the_cpu",
            "test_imports_without_triton",
            "test_cpu_tensors_need_the_interpreter",
        )
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0 and " passed" in summary, child.stdout[-20000:] + child.stderr[-5000:]
    assert "skipped" not in summary, child.stdout[-20000:]


@dataclass
class Case:
    query: torch.Tensor  # [rows, heads, dim]
    cache: torch.Tensor  # [2, kv_heads, num_blocks, block_size * dim]
    tables: torch.Tensor  # [rows, width] int64
    lengths: torch.Tensor  # [rows] int64
    block_size: int

    def run(self, window: int | None, num_splits: int) -> torch.Tensor:
        scale = self.query.shape[-1] ** -0.5
        args = (self.query, self.cache, self.tables, self.lengths, self.block_size, scale, window)
        return paged_decode_triton.paged_decode(*args, num_splits)

    def check(self, window: int | None, num_splits: int) -> None:
        out = self.run(window, num_splits)
        expected = reference(self.query, self.cache, self.tables, self.lengths, self.block_size, window)
        assert out.dtype == self.query.dtype and out.shape == self.query.shape
        assert not out.isnan().any()
        tolerance = TOLERANCE[self.query.dtype]
        torch.testing.assert_close(out.float().cpu(), expected, atol=tolerance, rtol=tolerance)


def make_case(
    device: str,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    lengths: tuple[int, ...] = LENGTHS,
) -> Case:
    generator = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim + block_size)
    rows = len(lengths)
    width = max(math.ceil(n / block_size) for n in lengths) + 1
    num_blocks = rows * width + 3
    physical = torch.randperm(num_blocks, generator=generator)[: rows * width].view(rows, width)
    tables = torch.full((rows, width), GARBAGE, dtype=torch.int64)
    for row, n in enumerate(lengths):
        used = math.ceil(n / block_size)
        tables[row, :used] = physical[row, :used]
    cache = torch.randn(2, kv_heads, num_blocks, block_size * dim, generator=generator)
    query = torch.randn(rows, heads, dim, generator=generator)
    return Case(
        query.to(device, dtype),
        cache.to(device, dtype),
        tables.to(device),
        torch.tensor(lengths, dtype=torch.int64, device=device),
        block_size,
    )


def reference(
    query: torch.Tensor,  # [rows, heads, dim]
    cache: torch.Tensor,  # [2, kv_heads, num_blocks, block_size * dim]
    tables: torch.Tensor,  # [rows, width]
    lengths: torch.Tensor,  # [rows]
    block_size: int,
    window: int | None,
) -> torch.Tensor:  # [rows, heads, dim] float32 on the CPU
    """Per row: gather its blocks, keep its first `length` keys (the last `window` of them),
    softmax(q·Kᵀ·scale)·V per head, query head h reading KV head h // (heads // kv_heads)."""
    query, cache, tables = query.cpu().float(), cache.cpu().float(), tables.cpu()
    rows, heads, dim = query.shape
    kv_heads = cache.shape[1]
    out = torch.zeros(rows, heads, dim)
    for row, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        blocks = tables[row, : math.ceil(length / block_size)]
        keys, values = (cache[i][:, blocks].reshape(kv_heads, -1, dim)[:, :length] for i in (0, 1))
        start = max(0, length - window) if window is not None else 0
        keys = keys[:, start:].repeat_interleave(heads // kv_heads, 0)  # [heads, n, dim]
        values = values[:, start:].repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", query[row], keys) * dim**-0.5
        out[row] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(8, 2, 64), (4, 4, 64), (4, 1, 64), (8, 2, 128), (4, 2, 32)],
    ids=["gqa", "mha", "mqa", "gqa-d128", "gqa-d32"],
)
def test_matches_the_reference(device: str, heads: int, kv_heads: int, dim: int, num_splits: int) -> None:
    make_case(device, heads, kv_heads, dim).check(None, num_splits)


def test_more_splits_than_blocks(device: str) -> None:
    """16 splits of a 7-block table: splits past a row's blocks (or the table) add nothing."""
    make_case(device, 8, 2, 64).check(None, 16)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 20, 200])
def test_sliding_window(device: str, window: int, num_splits: int) -> None:
    """Only the last `window` keys count; a window longer than every row changes nothing."""
    make_case(device, 8, 2, 64).check(window, num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(device: str, dtype: torch.dtype, num_splits: int) -> None:
    case = make_case(device, 8, 2, 64, dtype)
    case.check(None, num_splits)
    case.check(20, num_splits)


@pytest.mark.parametrize("block_size", [8, 24])
def test_other_block_sizes(device: str, block_size: int) -> None:
    """Tiles are looked up token by token: blocks smaller than a tile, or not a power of two."""
    make_case(device, 8, 2, 64, block_size=block_size).check(None, 3)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_rows_give_zeros(device: str, num_splits: int) -> None:
    out = make_case(device, 8, 2, 64, lengths=(0, 0, 0)).run(None, num_splits)
    assert torch.equal(out.cpu(), torch.zeros(3, 8, 64))


def test_a_strided_query(device: str) -> None:
    """The attention hook passes a transposed view of its query: strides are honoured."""
    case = make_case(device, 8, 2, 64)
    case.query = case.query.transpose(0, 1).contiguous().transpose(0, 1)  # [rows, heads, dim], strided
    assert not case.query.is_contiguous()
    case.check(None, 2)


def test_reads_no_tensor_value_on_the_host(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA graph needs: the launch depends on shapes only (no .item(), .tolist(), bool())."""
    case = make_case(device, 8, 2, 64)
    expected = reference(case.query, case.cache, case.tables, case.lengths, case.block_size, 20)

    def host_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("paged_decode read a tensor value on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = case.run(20, 4)
    monkeypatch.undo()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_shapes(device: str) -> None:
    case = make_case(device, 8, 2, 64)
    with pytest.raises(ValueError, match="kv_heads"):
        paged_decode_triton.paged_decode(case.query, case.cache, case.tables, case.lengths, 32, 1.0, None, 1)
    with pytest.raises(ValueError, match="share"):
        query = case.query[:, :3]
        paged_decode_triton.paged_decode(query, case.cache, case.tables, case.lengths, 16, 1.0, None, 1)
    with pytest.raises(ValueError, match="positive"):
        case.run(None, 0)


def test_imports_without_triton() -> None:
    """Where triton is missing the module imports, says so, and fails at call time with a reason."""
    code = textwrap.dedent(
        """
        import sys; sys.modules["triton"] = None
        import torch
        from text_generation_server.kernels import paged_decode_triton as m
        assert not m.available()
        n = torch.ones(1, dtype=torch.long)
        try:
            m.paged_decode(torch.zeros(1, 1, 16), torch.zeros(2, 1, 1, 256), n[None], n, 16, 1.0, None, 1)
        except ImportError as error:
            assert "triton" in str(error)
        else:
            raise AssertionError("no ImportError")
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.skipif(INTERPRETED, reason="this process interprets")
def test_cpu_tensors_need_the_interpreter() -> None:
    """Compiled kernels cannot read CPU memory: a clear error instead of Triton's."""
    pytest.importorskip("triton")
    case = make_case("cpu", 8, 2, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        case.run(None, 1)


@pytest.mark.gpu
@CUDA
@pytest.mark.skipif(INTERPRETED, reason="compiled kernels only")
def test_cuda_graph_replays_new_tables_and_lengths() -> None:
    """Captured once, replayed after the tables and lengths change in place (values, not shapes)."""
    pytest.importorskip("triton")
    case = make_case("cuda", 8, 2, 64, torch.float16)
    case.run(None, 4)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run(None, 4)
    other = make_case("cuda", 8, 2, 64, torch.float16, lengths=(83, 0, 17, 1, 64))
    case.tables.copy_(other.tables[:, : case.tables.shape[1]])
    case.lengths.copy_(other.lengths)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference(case.query, case.cache, case.tables, case.lengths, case.block_size, None)
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-3, rtol=2e-3)


def test_the_engine_on_this_kernel_gives_the_tokens_of_generate(device: str, tiny_model) -> None:
    """tgis_native with decode attention on this kernel, steps through replayed graphs (on a GPU
    every step, prompt tokens as rows of this kernel too; on the CPU decode steps only, closures
    captured once per batch size, test_runner.Replays: interpreting the kernel over every
    prompt token takes minutes), batches joining mid-way with chunked prompts and a
    sliding-window model: greedy equals generate alone."""
    from tests.engines.conformance import Runner, transformers_oracle
    from tests.engines.test_runner import Replays
    from tests.engines.test_tgis_native import config_for, prompt
    from text_generation_common.messages import GenerationRequest
    from text_generation_server.attention.triton import TritonBackend
    from text_generation_server.engines.tgis_native import TgisNativeEngine

    # interpreted on the CPU an architecture takes about a minute (two on an AVX2-only EPYC):
    # there Mistral alone, whose sliding window runs the kernel's whole path and Llama's too
    for arch in ("llama", "mistral") if device == "cuda" else ("mistral",):
        path = tiny_model(arch)
        engine = TgisNativeEngine(config_for(path, cpu_attention="sdpa", max_batch_size=4))
        assert engine.device.type == device
        if device == "cpu":  # SDPA's cache layout is this kernel's: swap the backend in
            engine.backend = engine.runner.backend = TritonBackend()
            engine.capture_graphs(4, Replays())
        assert engine.backend.name == "triton" and engine.runner.graphs is not None
        requests = [GenerationRequest(i, prompt(i, 3 + 7 * i), 3 + i) for i in range(1, 6)]
        got = Runner(engine, token_budget=12).run({0: requests[:2], 2: requests[2:4], 3: requests[4:]})
        oracle = transformers_oracle(path, device)
        for request in requests:
            assert got[request.id] == oracle(request.input_ids, request.max_new_tokens), (arch, request.id)
