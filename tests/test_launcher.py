"""text-generation-launcher: configuration resolution (pure functions), the supervisor with stand-in
children, and the real launcher running a tiny model with the real shard and router processes."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher import config as lc
from launcher import supervisor as sv
from launcher.cli import tokenizer_dir
from launcher.config import LaunchError, LaunchFlags
from text_generation_common.engines import EngineCapabilities, EngineSpec
from text_generation_common.model_config import SEQUENCE_LENGTH_KEYS
from text_generation_server.testing.ports import free_ports

SHA_MAIN = "a" * 40
SHA_V2 = "b" * 40


# --- helpers --------------------------------------------------------------------------------------


def hf_cache_with(model_dir: Path, cache: Path, repo: str = "acme/tiny") -> Path:
    """A hand-made HF cache layout: refs/main -> snapshots/SHA_MAIN (the model), refs/v2 ->
    snapshots/SHA_V2 (config.json only)."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    shutil.copytree(model_dir, repo_dir / "snapshots" / SHA_MAIN)
    (repo_dir / "snapshots" / SHA_V2).mkdir()
    shutil.copy(model_dir / "config.json", repo_dir / "snapshots" / SHA_V2)
    (repo_dir / "refs" / "main").write_text(SHA_MAIN)
    (repo_dir / "refs" / "v2").write_text(SHA_V2)
    return cache


def model_with_config(path: Path, **config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def config_for(model_dir: Path, env: Mapping[str, str] | None = None, **flags: Any) -> lc.LaunchConfig:
    return lc.resolve_config(LaunchFlags(model_name=str(model_dir), **flags), env or {})


# --- configuration resolution ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HOME": "/h"}, "/h/.cache/huggingface/hub"),
        ({"HOME": "/h", "HF_HOME": "/hf"}, "/hf/hub"),
        ({"HF_HOME": "/hf", "TRANSFORMERS_CACHE": "/tc"}, "/tc"),
        ({"HF_HOME": "/hf", "HUGGINGFACE_HUB_CACHE": "/hhc"}, "/hhc"),
        (
            {
                "HF_HOME": "/hf",
                "HF_HUB_CACHE": "/c",
                "TRANSFORMERS_CACHE": "/c/",
                "HUGGINGFACE_HUB_CACHE": "",
            },
            "/c",
        ),
    ],
)
def test_cache_dir_precedence(env: dict[str, str], expected: str) -> None:
    assert lc.resolve_cache_dir(env) == expected


def test_cache_dirs_that_disagree_fail() -> None:
    with pytest.raises(LaunchError, match=r"HF_HUB_CACHE=/a, TRANSFORMERS_CACHE=/b\): set only HF_HUB_CACHE"):
        lc.resolve_cache_dir({"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/b"})


def test_model_lookup_local_dir(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    assert lc.resolve_model_dir(str(tiny_model("llama")), None, str(tmp_path)) == tiny_model("llama")
    with pytest.raises(LaunchError, match=r"has no config\.json"):
        lc.resolve_model_dir(str(tmp_path), None, str(tmp_path))
    with pytest.raises(LaunchError, match="does not exist"):
        lc.resolve_model_dir(str(tmp_path / "nope"), None, str(tmp_path))


def test_model_lookup_in_hf_cache(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    cache = str(hf_cache_with(tiny_model("llama"), tmp_path / "hub"))
    snapshots = Path(cache) / "models--acme--tiny" / "snapshots"
    assert lc.resolve_model_dir("acme/tiny", None, cache) == snapshots / SHA_MAIN
    assert lc.resolve_model_dir("acme/tiny", "v2", cache) == snapshots / SHA_V2
    assert lc.resolve_model_dir("acme/tiny", SHA_V2, cache) == snapshots / SHA_V2
    with pytest.raises(LaunchError, match=r"model 'acme/tiny' \(revision v3\) not found"):
        lc.resolve_model_dir("acme/tiny", "v3", cache)
    with pytest.raises(LaunchError, match=r"model 'acme/other' \(revision main\) not found.* cache at "):
        lc.resolve_model_dir("acme/other", None, cache)


@pytest.mark.parametrize("key", SEQUENCE_LENGTH_KEYS)
def test_max_sequence_length_from_each_config_key(tmp_path: Path, key: str) -> None:
    assert lc.model_sequence_length(model_with_config(tmp_path, **{key: 777})) == 777


def test_max_sequence_length_key_order_and_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    both = model_with_config(tmp_path / "a", n_positions=100, max_position_embeddings=300)
    assert lc.model_sequence_length(both) == 300
    none = model_with_config(tmp_path / "b", hidden_size=8)
    assert lc.model_sequence_length(none) is None
    assert lc.resolve_max_sequence_length(None, None) == 2048
    assert lc.resolve_max_sequence_length(None, 300) == 300
    assert lc.resolve_max_sequence_length(200, 300) == 200 and not caplog.records
    with caplog.at_level(logging.WARNING):
        assert lc.resolve_max_sequence_length(400, 300) == 400
    assert "above the model's own limit of 300" in caplog.text


def test_max_new_tokens_lowered_below_max_sequence_length(caplog: pytest.LogCaptureFixture) -> None:
    assert lc.resolve_max_new_tokens(99, 100) == 99 and not caplog.records
    with caplog.at_level(logging.WARNING):
        assert lc.resolve_max_new_tokens(100, 100) == 99
    assert "lowering it to 99" in caplog.text


def test_resolve_config_of_tiny_model(tiny_model: Callable[..., Path]) -> None:
    config = config_for(tiny_model("llama"), {"HF_HUB_CACHE": "/c"}, dtype_str="bfloat16")
    assert (config.max_sequence_length, config.max_new_tokens) == (512, 511)  # max_position_embeddings
    assert (config.dtype, config.num_shard, config.cache_dir) == ("bfloat16", 1, "/c")
    assert config.socket_path(0).endswith("text-generation-server-0")


def test_dtype_and_dtype_str_must_agree() -> None:
    assert lc.resolve_dtype(None, None) is None
    assert lc.resolve_dtype("float16", None) == lc.resolve_dtype(None, "float16") == "float16"
    assert lc.resolve_dtype("bfloat16", "bfloat16") == "bfloat16"
    with pytest.raises(LaunchError, match=r"--dtype \(float16\) and --dtype-str \(float32\) disagree"):
        lc.resolve_dtype("float16", "float32")
    with pytest.raises(
        LaunchError, match="unsupported dtype 'int8'; choose one of: float16, bfloat16, float32"
    ):
        lc.resolve_dtype("int8", None)


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, {}, 1),
        (2, {}, 2),
        (None, {"NUM_GPUS": "3"}, 3),
        (2, {"NUM_GPUS": "2"}, 2),
        (None, {"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "0"}, 2),
        (None, {"NVIDIA_VISIBLE_DEVICES": "2,5,7"}, 3),
        (None, {"NVIDIA_VISIBLE_DEVICES": "all"}, 1),
        (None, {"CUDA_VISIBLE_DEVICES": ""}, 1),
        (1, {"CUDA_VISIBLE_DEVICES": "0,1"}, 1),
    ],
)
def test_num_shard(flag: int | None, env: dict[str, str], expected: int) -> None:
    assert lc.resolve_num_shard(flag, env) == expected


def test_num_shard_and_num_gpus_must_agree() -> None:
    with pytest.raises(LaunchError, match=r"--num-shard/NUM_SHARD \(1\) and NUM_GPUS \(2\) disagree"):
        lc.resolve_num_shard(1, {"NUM_GPUS": "2"})
    with pytest.raises(LaunchError, match="NUM_GPUS must be a positive integer"):
        lc.resolve_num_shard(None, {"NUM_GPUS": "two"})
    with pytest.raises(LaunchError, match=r"^4 shards need 4 GPUs, but CUDA_VISIBLE_DEVICES lists 2: set"):
        lc.resolve_num_shard(4, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(LaunchError, match=r"^2 shards need 2 GPUs, but NVIDIA_VISIBLE_DEVICES lists 1"):
        lc.resolve_num_shard(None, {"NUM_GPUS": "2", "NVIDIA_VISIBLE_DEVICES": "3"})
    assert lc.resolve_num_shard(2, {"CUDA_VISIBLE_DEVICES": "all"}) == 2  # not a list: nothing to check


def test_more_than_one_shard_needs_tensor_parallel_engine(tiny_model: Callable[..., Path]) -> None:
    lc.check_num_shard(1, "hf_transformers")
    sharding = {"tp": spec("tp", tensor_parallel=True)}
    lc.check_num_shard(2, "tp", sharding)
    with pytest.raises(LaunchError, match="2 shards need tensor parallelism, which engine 'hf_accelerate'"):
        config_for(tiny_model("llama"), {"CUDA_VISIBLE_DEVICES": "0,1"}, deployment_framework="hf_accelerate")
    assert config_for(tiny_model("llama"), {"CUDA_VISIBLE_DEVICES": "0,1"}).num_shard == 2


def spec(name: str, **capabilities: Any) -> EngineSpec:
    return EngineSpec(name, "m:C", EngineCapabilities(**capabilities), "")


def test_an_encoder_decoder_model_needs_a_seq2seq_engine(tiny_model: Callable[..., Path]) -> None:
    engines = {"decoder_only": spec("decoder_only"), "both": spec("both", seq2seq=True)}
    lc.check_model_kind(tiny_model("llama"), "decoder_only", engines)
    lc.check_model_kind(tiny_model("t5"), "both", engines)
    with pytest.raises(LaunchError, match=r"serves decoder-only models .* choose one of both"):
        lc.check_model_kind(tiny_model("t5"), "decoder_only", engines)


def test_an_engine_of_an_optional_extra_needs_it_installed() -> None:
    engines = {
        "extra": spec("extra", requires=("no_such_module_here",), install_hint="pip install 'x[extra]'"),
        "core": spec("core", requires=("json",)),
    }
    lc.check_engine_installed("core", engines)
    missing = r"engine 'extra' needs no_such_module_here, which is not installed: pip install 'x\[extra\]'"
    with pytest.raises(LaunchError, match=missing):
        lc.check_engine_installed("extra", engines)
    lc.check_engine_installed("hf_optimum_ort")  # the onnx extra is part of the dev install


def test_unknown_engine_lists_the_choices() -> None:
    engines = {
        name: EngineSpec(name, "m:A", EngineCapabilities(), "") for name in ("hf_transformers", "onnx")
    }
    assert lc.resolve_engine("onnx", engines) == "onnx"
    with pytest.raises(
        LaunchError, match="unknown deployment framework 'nope'; choose one of: hf_transformers, onnx"
    ):
        lc.resolve_engine("nope", engines)
    with pytest.raises(LaunchError, match="unknown deployment framework 'hf_custom_tp'; choose one of"):
        lc.resolve_engine("hf_custom_tp", engines)
    assert (
        lc.resolve_engine(
            "hf_custom_tp",
            {**engines, "tgis_native": spec("tgis_native")},
        )
        == "tgis_native"
    )


def test_quantize_schemes_and_refusals() -> None:
    lc.check_quantize(None, "hf_optimum_ort", 2)
    lc.check_quantize("int8", "tgis_native", 1)
    lc.check_quantize("int8", "hf_transformers", 1)
    for scheme in (
        "gptq",
        "awq",
        "compressed-tensors",
        "bitsandbytes",
        "bitsandbytes-nf4",
        "bitsandbytes-fp4",
        "fp8",
    ):
        lc.check_quantize(scheme, "tgis_native", 1)
    refused = {
        ("fp8", "tgis_native", 2): r"^QUANTIZE=fp8 is not served on 2 shards yet \(NUM_SHARD=1\)$",
        (
            "int4",
            "tgis_native",
            1,
        ): r"^unknown QUANTIZE 'int4'; choose one of int8, fp8, gptq, awq, compressed-tensors, ",
        ("gptq", "hf_optimum_ort", 1): r"^QUANTIZE=gptq is served by tgis_native and hf_transformers, not ",
        (
            "int8",
            "hf_optimum_ort",
            1,
        ): r"^QUANTIZE=int8 is served by tgis_native and hf_transformers, not hf_optimum_ort$",
        ("int8", "tgis_native", 2): r"^QUANTIZE=int8 is not served on 2 shards yet \(NUM_SHARD=1\)$",
    }
    for (scheme, engine, shards), line in refused.items():
        with pytest.raises(LaunchError, match=line):
            lc.check_quantize(scheme, engine, shards)


def test_tgis_switches_we_lack_are_refused() -> None:
    for off in ("", "false", "False", "0"):
        lc.check_switches({"PT2_COMPILE": off}, "hf_transformers")
    for on in ("true", "TRUE", "1"):
        with pytest.raises(LaunchError, match=rf"^PT2_COMPILE={on} asks for .*: unset PT2_COMPILE$"):
            lc.check_switches({"PT2_COMPILE": on}, "tgis_native")


@pytest.mark.parametrize("var", ["FLASH_ATTENTION", "PAGED_ATTENTION"])
def test_flash_and_paged_attention_mean_the_paged_engine(var: str) -> None:
    lc.check_switches({var: "true"}, "tgis_native")
    lc.check_switches({var: "false"}, "hf_transformers")
    with pytest.raises(LaunchError, match=rf"^{var}=true asks for the tgis_native engine's paged attention"):
        lc.check_switches({var: "true"}, "hf_transformers")


def test_shard_command_and_env_are_accepted_by_the_shard_cli(tiny_model: Callable[..., Path]) -> None:
    from text_generation_server.cli import serve

    config = config_for(
        tiny_model("llama"), {"HF_HUB_CACHE": "/c"}, dtype="float32", revision="r1", quantize="int8"
    )
    argv = lc.shard_command(config)
    params = serve.make_context("serve", argv[argv.index("serve") + 1 :]).params
    assert params["model_name"] == str(tiny_model("llama")) and params["dtype"] == "float32"
    assert params["quantize"] == "int8"
    assert (params["max_sequence_length"], params["max_new_tokens"], params["revision"]) == (512, 511, "r1")
    assert params["uds_path"] == config.shard_uds_path
    env = lc.shard_env(config, 0, {"KEEP": "1", "PYTORCH_CUDA_ALLOC_CONF": ""})
    expected = {"KEEP": "1", "RANK": "0", "WORLD_SIZE": "1", "CROSS_SIZE": "1", "CROSS_RANK": "0"}
    expected |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/c", "BATCH_SAFETY_MARGIN": "20"}
    assert expected.items() <= env.items() and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["CUDA_PROCESS_MEMORY_FRACTION"] == "1.0" and env["MASTER_PORT"] == "29500"
    assert lc.shard_env(config, 0, {})["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_candidate_tree_flags_reach_the_shard_and_need_a_speculator(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    from text_generation_server.cli import serve

    speculator = model_with_config(tmp_path / "spec", model_type="mlp_speculator")
    native = {"deployment_framework": "tgis_native"}
    config = config_for(
        tiny_model("llama"),
        **native,
        speculator_name=str(speculator),
        speculator_n_candidates=3,
        speculator_top_k_tokens_per_head=(3, 2, 1),
    )
    argv = lc.shard_command(config)
    params = serve.make_context("serve", argv[argv.index("serve") + 1 :]).params
    assert params["speculator_n_candidates"] == 3 and params["speculator_top_k_tokens_per_head"] == (3, 2, 1)
    plain = lc.shard_command(config_for(tiny_model("llama"), **native, speculator_name=str(speculator)))
    assert "--speculator-n-candidates" not in plain and "--speculator-top-k-tokens-per-head" not in plain
    with pytest.raises(LaunchError, match=r"shape an MLP speculator's candidates: set SPECULATOR_NAME$"):
        config_for(tiny_model("llama"), **native, speculate=2, speculator_top_k_tokens_per_head=(2, 2))
    with pytest.raises(Exception, match="comma-separated list of integers"):
        serve.make_context("serve", ["m", "--speculator-top-k-tokens-per-head", "3;2"])


def test_router_command_is_accepted_by_the_router_cli(tiny_model: Callable[..., Path]) -> None:
    from router.cli import main as router_main

    config = config_for(
        tiny_model("llama"),
        max_waiting_tokens=7,
        max_batch_prefill_tokens=99,
        port=1234,
        grpc_port=4321,
        stream_interval=3,
        max_stream_interval=6,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    argv = lc.router_command(config, "/tok")
    params = router_main.make_context("router", argv[argv.index("--tokenizer-path") :]).params
    assert params["tokenizer_path"] == "/tok" and params["master_shard_uds_path"] == config.socket_path(0)
    assert params["tool_call_parser"] == "hermes" and params["reasoning_parser"] == "qwen3"
    plain = lc.router_command(config_for(tiny_model("llama")), "/tok")
    assert (
        router_main.make_context("router", plain[plain.index("--tokenizer-path") :]).params[
            "tool_call_parser"
        ]
        is None
    )
    assert (params["max_waiting_tokens"], params["port"], params["grpc_port"]) == (7, 1234, 4321)
    assert params["max_batch_prefill_tokens"] == 99 and params["stream_interval"] == 3
    assert params["max_stream_interval"] == 6
    with pytest.raises(
        LaunchError, match=r"^--max-stream-interval \(2\) must be 0 or at least --stream-interval \(3\)$"
    ):
        config_for(tiny_model("llama"), stream_interval=3, max_stream_interval=2)
    assert (params["max_sequence_length"], params["max_new_tokens"]) == (512, 511)
    assert params["default_include_stop_seqs"] is True and params["output_special_tokens"] is False


def slow_tokenizer_model(src: Path, dst: Path) -> Path:
    """config.json + the tiny gpt2 tokenizer as slow GPT-2 files only (vocab.json, merges.txt)."""
    from tokenizers import Tokenizer

    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst)
    Tokenizer.from_file(str(src / "tokenizer.json")).model.save(str(dst))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>", "unk_token": "<unk>"}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_tokenizer_is_the_model_dir_or_a_converted_one(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    config = config_for(tiny_model("llama"))
    assert tokenizer_dir(config, dict(os.environ), str(tmp_path / "unused")) == tiny_model("llama")
    slow = config_for(slow_tokenizer_model(tiny_model("gpt2"), tmp_path / "slow"))
    scratch = tmp_path / "scratch"
    assert tokenizer_dir(slow, dict(os.environ), str(scratch)) == scratch
    assert (scratch / "tokenizer.json").is_file()


# --- supervisor with stand-in children (fast) -------------------------------------------------------


def python_child(name: str, code: str, prefix: str = "") -> sv.ChildSpec:
    return sv.ChildSpec(name, [sys.executable, "-c", textwrap.dedent(code)], dict(os.environ), prefix)


def fake_shard(socket_path: Path, delay_s: float = 0.0) -> sv.ChildSpec:
    code = f"""
        import pathlib, sys, time
        print("loading", flush=True)
        print("no newline at the end", end="", file=sys.stderr, flush=True)
        time.sleep({delay_s})
        pathlib.Path({str(socket_path)!r}).touch()
        time.sleep(60)
    """
    return python_child("Shard 0", code, "Shard 0: ")


def test_router_crash_stops_the_shards_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sv, "WAITING_LOG_INTERVAL_S", 0.2)
    caplog.set_level(logging.INFO)
    out, term = io.BytesIO(), tmp_path / "termination-log"
    sock = tmp_path / "uds-0"
    router = python_child(
        "Router", "import time; print('router up', flush=True); time.sleep(0.3); raise SystemExit(3)"
    )
    supervisor = sv.Supervisor(out, str(term), shard_grace_s=5)
    started = time.monotonic()
    assert supervisor.run([fake_shard(sock, delay_s=0.5)], [str(sock)], router) == 1
    assert time.monotonic() - started < 10
    assert term.read_text() == "Router exited with code 3\n"
    lines = out.getvalue().decode().splitlines()
    assert lines[0] == "Shard 0: loading" and "router up" in lines
    assert lines[-1] == "Shard 0: no newline at the end", "a last partial line is forwarded at EOF"
    assert "waiting for shard 0 to be ready" in caplog.text


def test_shard_exit_during_startup_exits_1_without_router(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    term = tmp_path / "termination-log"
    shard = python_child("Shard 0", "raise SystemExit(5)", "Shard 0: ")
    router = python_child("Router", "raise AssertionError('never started')")
    with caplog.at_level(logging.INFO):
        assert sv.Supervisor(io.BytesIO(), str(term)).run([shard], [str(tmp_path / "s-0")], router) == 1
    assert term.read_text() == "Shard 0 exited with code 5\n"

    assert "starting the router" not in caplog.text


# --- the real launcher --------------------------------------------------------------------------


class LauncherProcess:
    """`python -m launcher.cli` with its stderr collected line by line."""

    def __init__(self, args: list[str], env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", *args],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for_line(self, match: Callable[[str], bool], timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((line for line in self.lines if match(line)), None)
                if found is not None:
                    return found
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("no such line; the launcher said:\n" + "\n".join(self.lines))
                self._changed.wait(0.2)

    def wait(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def index(self, match: Callable[[str], bool]) -> int:
        return next(i for i, line in enumerate(self.lines) if match(line))

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self) -> None:
        for child in self.children():
            child.kill()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def launcher_env(tmp_path: Path) -> dict[str, str]:
    http_port, grpc_port = free_ports(2)
    return {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "TERMINATION_LOG_PATH": str(tmp_path / "termination-log"),
        "SHARD_UDS_PATH": str(tmp_path / "uds"),
        "PORT": str(http_port),
        "GRPC_PORT": str(grpc_port),
        "LOG_LEVEL": "info",
        "MAX_NEW_TOKENS": "100",  # below the tiny model's 512 positions: no warning
    }


@pytest.fixture
def launch(launcher_env: dict[str, str]) -> Iterator[Callable[..., LauncherProcess]]:
    started: list[LauncherProcess] = []

    def start(*args: str, **env: str) -> LauncherProcess:
        started.append(LauncherProcess(list(args), {**launcher_env, **env}))
        return started[-1]

    yield start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.stop()


@pytest.mark.parametrize(
    "fatal",
    [
        "2026-01-01 00:00:00,000 CRITICAL text_generation_server.distributed: shard 0: a step failed",
        '{"level": "CRITICAL", "message": "shard 0: a step failed"}',
        "Error: gpt_bigcode models cannot be sharded",
    ],
)
def test_the_reason_a_child_gives_goes_to_the_termination_log(tmp_path: Path, fatal: str) -> None:
    term = tmp_path / "termination-log"
    script = f"print('loading'); print({fatal!r}); print('INFO after it'); raise SystemExit(1)"
    shard = python_child("Shard 0", script, "Shard 0: ")
    router = python_child("Router", "raise AssertionError('never started')")
    assert sv.Supervisor(io.BytesIO(), str(term)).run([shard], [str(tmp_path / "s-0")], router) == 1
    assert term.read_text() == f"Shard 0 exited with code 1: {fatal}\n"


def run_launcher(args: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "launcher.cli", *args]
    return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("case", "extra_env", "message"),
    [
        ("missing model", {"MODEL_NAME": "acme/missing"}, "model 'acme/missing' (revision main) not found"),
        (
            "unknown engine",
            {"DEPLOYMENT_FRAMEWORK": "nope"},
            "unknown deployment framework 'nope'; choose one",
        ),
        (
            "dtypes disagree",
            {"DTYPE": "float16", "DTYPE_STR": "float32"},
            "and --dtype-str (float32) disagree",
        ),
        (
            "num gpus",
            {"NUM_SHARD": "1", "NUM_GPUS": "2"},
            "--num-shard/NUM_SHARD (1) and NUM_GPUS (2) disagree",
        ),
        ("bad flag value", {"MAX_BATCH_SIZE": "zero"}, "Invalid value for '--max-batch-size'"),
        ("tgis switch", {"PT2_COMPILE": "true"}, "PT2_COMPILE=true asks for torch.compile"),
        ("port in use", {}, "is not available: Address already in use"),
    ],
)
def test_bad_configuration_fails_fast_with_one_line(
    tiny_model: Callable[..., Path],
    launcher_env: dict[str, str],
    case: str,
    extra_env: dict[str, str],
    message: str,
) -> None:
    env = {**launcher_env, "MODEL_NAME": str(tiny_model("llama")), **extra_env}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        if case == "port in use":
            busy.bind(("0.0.0.0", int(env["GRPC_PORT"])))
            busy.listen()
        started = time.monotonic()
        result = run_launcher([], env)
    assert time.monotonic() - started < 15
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and " ERROR " in lines[0], result.stderr
    assert message in Path(env["TERMINATION_LOG_PATH"]).read_text()


def test_missing_fast_tokenizer_fails_with_one_line(
    tiny_model: Callable[..., Path], launcher_env: dict[str, str], tmp_path: Path
) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    shutil.copy(tiny_model("llama") / "config.json", model)
    result = run_launcher(["--model-name", str(model)], launcher_env)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "No existing fast tokenizer (tokenizer.json) found" in errors[0]
    assert "Traceback" not in result.stderr and "starting Shard" not in result.stderr


def is_router_serving(line: str) -> bool:
    return "serving" in line and not line.startswith("Shard ")


def wait_until_healthy(port: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("/health never answered 200")
        time.sleep(0.2)


def test_sigterm_stops_the_router_before_the_shards(
    tiny_model: Callable[..., Path], launch: Callable[..., LauncherProcess], launcher_env: dict[str, str]
) -> None:
    launcher = launch("--model-name", str(tiny_model("llama")), "--max-batch-size", "4")
    launcher.wait_for_line(is_router_serving)
    wait_until_healthy(launcher_env["PORT"])
    assert launcher.index(lambda line: line.startswith("Shard 0: ") and "shard 0/1 serving on" in line) >= 0
    children = launcher.children()
    assert len([c for c in children if "serve" in c.cmdline()]) == 1
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait() == 0, "\n".join(launcher.lines)
    router_stopped = launcher.index(lambda line: "Router stopped with code" in line)
    shard_stopping = launcher.index(lambda line: line.startswith("Shard 0: ") and "shard 0 stopping" in line)
    assert router_stopped < shard_stopping
    assert not psutil.wait_procs(children, timeout=5)[1], "no child outlives the launcher"
    assert not Path(f"{launcher_env['SHARD_UDS_PATH']}-0").exists()
    assert not Path(launcher_env["TERMINATION_LOG_PATH"]).exists()


def test_a_dead_shard_stops_everything_and_exits_1(
    tiny_model: Callable[..., Path], launch: Callable[..., LauncherProcess], launcher_env: dict[str, str]
) -> None:
    launcher = launch("--model-name", str(tiny_model("llama")))
    launcher.wait_for_line(is_router_serving)
    children = launcher.children()
    (shard,) = [c for c in children if "serve" in c.cmdline()]
    shard.kill()
    assert launcher.wait() == 1
    assert Path(launcher_env["TERMINATION_LOG_PATH"]).read_text() == "Shard 0 exited with code -9\n"
    assert launcher.index(lambda line: "ERROR" in line and "Shard 0 exited with code -9" in line) >= 0
    assert not psutil.wait_procs(children, timeout=5)[1], "no child outlives the launcher"
