"""Weight management: `download-weights`, `convert-to-safetensors`, `convert-to-fast-tokenizer`
(cli.py -> utils/hub.py, utils/weights.py).

The hub is tests/fake_hub.py serving the tiny test models; the CLI runs as a subprocess pointed
at it (HF_ENDPOINT) with a fresh HF cache per test. CPU only, offline.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.fake_hub import FakeHub
from text_generation_server.utils import hub, weights
from text_generation_server.utils.hub import WeightsNotFoundError, resolve_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
INPUT_IDS = torch.tensor([[5, 17, 99, 1000, 3, 42]])
SAMPLE_TEXT = "def f(x):\n    return {'a': x + 1}  # héllo wörld </s>"

GPT2 = "tiny/gpt2"  # safetensors
LLAMA_BIN = "tiny/llama-bin"  # pytorch_model.bin only
LLAMA_SHARDED = "tiny/llama-sharded"  # two .bin shards + index
BIN_REVISION = "dev"  # LLAMA_BIN at this revision also holds non-weight extras
TOP_LEVEL_EXTRAS = {"README.md": "# tiny\n", "training_args.bin": "not weights", "nested/extra.json": "{}"}


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_hub(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    llama_bin = tiny_model("llama", safetensors=False)
    with FakeHub() as server:
        server.add_repo(GPT2, tiny_model("gpt2"))
        server.add_repo(LLAMA_BIN, llama_bin)
        server.add_repo(LLAMA_BIN, _with_extras(llama_bin, tmp_path_factory.mktemp("dev")), BIN_REVISION)
        server.add_repo(LLAMA_SHARDED, _sharded_copy(llama_bin, tmp_path_factory.mktemp("sharded")))
        yield server


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture
def cli(fake_hub: FakeHub, hf_home: Path, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """cli(*args, log_level="info", endpoint=None, offline=False) runs `text-generation-server *args`
    against the fake hub, with the HF cache in tmp_path/cache."""

    def run(
        *args: str, log_level: str = "info", endpoint: str | None = None, offline: bool = False
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in _HUB_ENV_TO_DROP}
        env.update(
            HF_ENDPOINT=endpoint or fake_hub.url,
            HF_HUB_CACHE=str(tmp_path / "cache"),
            HF_HOME=str(hf_home),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        )
        if offline:
            env["HF_HUB_OFFLINE"] = "1"
        command = [sys.executable, "-m", "text_generation_server.cli", "--log-level", log_level, *args]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    return run


_HUB_ENV_TO_DROP = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@pytest.fixture(scope="module")
def reference_logits(tiny_model: Callable[..., Path]) -> Callable[[str], torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in cache:
            cache[arch] = _logits(tiny_model(arch, safetensors=False))
        return cache[arch]

    return get


def _logits(model_dir: Path, **kwargs: object) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


def _with_extras(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name, text in TOP_LEVEL_EXTRAS.items():
        (dst / name).parent.mkdir(exist_ok=True)
        (dst / name).write_text(text)
    return dst


def _sharded_copy(src: Path, dst: Path) -> Path:
    """`src` with its pytorch_model.bin split into two shards plus pytorch_model.bin.index.json."""
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns(weights.PT_WEIGHTS))
    state = torch.load(src / weights.PT_WEIGHTS, map_location="cpu", weights_only=True)
    names = sorted(state)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map: dict[str, str] = {}
    for i, half in enumerate(halves, start=1):
        shard = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({n: state[n] for n in half}, dst / shard)
        weight_map.update(dict.fromkeys(half, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / weights.PT_INDEX).write_text(json.dumps(index))
    return dst


def _slow_tokenizer_copy(src: Path, dst: Path) -> Path:
    """The tokenizer of tiny gpt2 (`src`) as slow GPT-2 files only: vocab.json, merges.txt, config."""
    from tokenizers import Tokenizer

    dst.mkdir(parents=True, exist_ok=True)
    Tokenizer.from_file(str(src / "tokenizer.json")).model.save(str(dst))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_prefix_space": False,
        "model_max_length": 512,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _encode(tokenizer_dir: Path, text: str = SAMPLE_TEXT) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"])


def _snapshot_of(result: subprocess.CompletedProcess[str]) -> Path:
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# --- download-weights from the hub ----------------------------------------------------------------


def test_download_safetensors_repo_into_cache(
    cli: Callable[..., subprocess.CompletedProcess[str]],
    tiny_model: Callable[..., Path],
    tmp_path: Path,
    reference_logits: Callable[[str], torch.Tensor],
) -> None:
    snapshot = _snapshot_of(cli("download-weights", GPT2))

    assert snapshot == resolve_model_dir(GPT2, cache_dir=tmp_path / "cache")
    assert snapshot.is_relative_to(tmp_path / "cache")
    assert sorted(os.listdir(snapshot)) == sorted(os.listdir(tiny_model("gpt2")))
    assert torch.equal(_logits(snapshot), reference_logits("gpt2"))


def test_bin_only_repo_is_converted_to_safetensors(
    cli: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
    reference_logits: Callable[[str], torch.Tensor],
) -> None:
    snapshot = _snapshot_of(cli("download-weights", LLAMA_BIN))

    assert snapshot == resolve_model_dir(LLAMA_BIN, cache_dir=tmp_path / "cache")
    assert (snapshot / weights.PT_WEIGHTS).is_file()  # kept
    with safe_open(str(snapshot / weights.ST_WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert torch.equal(_logits(snapshot, use_safetensors=True), reference_logits("llama"))


def test_no_auto_convert_on_bin_only_repo_fails_clearly(
    cli: Callable[..., subprocess.CompletedProcess[str]], fake_hub: FakeHub, tmp_path: Path
) -> None:
    before = len(fake_hub.downloads())

    result = cli("download-weights", LLAMA_BIN, "--no-auto-convert", log_level="warning")

    _assert_one_line_error(result, repr(LLAMA_BIN), ".safetensors", ".bin")
    assert len(fake_hub.downloads()) == before


def test_bin_extension_downloads_bin_weights_at_revision(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    snapshot = _snapshot_of(
        cli("download-weights", LLAMA_BIN, "--extension", ".bin", "--revision", BIN_REVISION)
    )

    assert snapshot == resolve_model_dir(LLAMA_BIN, BIN_REVISION, cache_dir=tmp_path / "cache")
    files = set(os.listdir(snapshot))
    assert {weights.PT_WEIGHTS, "config.json", "tokenizer.json", "README.md"} <= files
    assert not any(f.endswith(".safetensors") for f in files)
    assert "training_args.bin" not in files and "nested" not in files


def test_sharded_bin_repo_is_converted_to_sharded_safetensors(
    cli: Callable[..., subprocess.CompletedProcess[str]], reference_logits: Callable[[str], torch.Tensor]
) -> None:
    snapshot = _snapshot_of(cli("download-weights", LLAMA_SHARDED))

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == shards
    index = json.loads((snapshot / weights.ST_INDEX).read_text())
    bin_map = json.loads((snapshot / weights.PT_INDEX).read_text())["weight_map"]
    assert sorted(index["weight_map"]) == sorted(bin_map)
    total = 0
    for shard, bin_shard in zip(shards, sorted(set(bin_map.values())), strict=True):
        saved = load_file(snapshot / shard)
        source = torch.load(snapshot / bin_shard, map_location="cpu", weights_only=True)
        assert (
            sorted(saved) == sorted(source) == sorted(n for n, f in index["weight_map"].items() if f == shard)
        )
        assert all(torch.equal(saved[n], source[n]) for n in saved)
        total += sum(t.numel() * t.element_size() for t in saved.values())
    assert index["metadata"]["total_size"] == total
    assert torch.equal(_logits(snapshot, use_safetensors=True), reference_logits("llama"))


def test_unknown_repo_fails_with_one_line(cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = cli("download-weights", "tiny/missing", log_level="warning")

    _assert_one_line_error(result, "'tiny/missing'", "not found")


def test_unknown_revision_fails_with_one_line(cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = cli("download-weights", GPT2, "--revision", "no-such-branch", log_level="warning")

    _assert_one_line_error(result, "'no-such-branch'", repr(GPT2), "not found")


def test_unreachable_hub_fails_with_one_line(cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    result = cli("download-weights", GPT2, log_level="warning", endpoint=f"http://127.0.0.1:{port}")

    _assert_one_line_error(result, repr(GPT2), f"127.0.0.1:{port}")


def test_offline_download_weights_uses_only_the_cache(
    cli: Callable[..., subprocess.CompletedProcess[str]], fake_hub: FakeHub
) -> None:
    _assert_one_line_error(
        cli("download-weights", GPT2, offline=True, log_level="warning"), repr(GPT2), "HF_HUB_OFFLINE"
    )
    snapshot = _snapshot_of(cli("download-weights", GPT2))
    before = len(fake_hub.requests)

    assert _snapshot_of(cli("download-weights", GPT2, offline=True)) == snapshot
    assert len(fake_hub.requests) == before


# --- local directories ----------------------------------------------------------------------------


def test_download_weights_on_local_dir_downloads_nothing(
    cli: Callable[..., subprocess.CompletedProcess[str]], fake_hub: FakeHub, tiny_model: Callable[..., Path]
) -> None:
    model_dir = tiny_model("gpt2")
    before = list(os.listdir(model_dir)), len(fake_hub.requests)

    assert _snapshot_of(cli("download-weights", str(model_dir))) == model_dir
    assert (list(os.listdir(model_dir)), len(fake_hub.requests)) == before


def test_download_weights_on_local_bin_dir_converts_in_place(
    tiny_model: Callable[..., Path], tmp_path: Path, reference_logits: Callable[[str], torch.Tensor]
) -> None:
    model_dir = Path(shutil.copytree(tiny_model("llama", safetensors=False), tmp_path / "llama"))

    with pytest.raises(WeightsNotFoundError, match=r"no \.safetensors weights in local directory"):
        hub.download_weights(str(model_dir), auto_convert=False)
    assert hub.download_weights(str(model_dir)) == model_dir

    assert (model_dir / weights.ST_WEIGHTS).is_file()
    assert torch.equal(_logits(model_dir, use_safetensors=True), reference_logits("llama"))


def test_convert_to_safetensors_cli_on_tied_gpt2_bin_dir(
    cli: Callable[..., subprocess.CompletedProcess[str]],
    tiny_model: Callable[..., Path],
    tmp_path: Path,
    reference_logits: Callable[[str], torch.Tensor],
) -> None:
    model_dir = Path(shutil.copytree(tiny_model("gpt2", safetensors=False), tmp_path / "gpt2"))

    result = cli("convert-to-safetensors", str(model_dir))

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(model_dir / weights.ST_WEIGHTS)]
    saved = load_file(model_dir / weights.ST_WEIGHTS)
    source = torch.load(model_dir / weights.PT_WEIGHTS, map_location="cpu", weights_only=True)
    # lm_head.weight is GPT-2's tied-weights target: saved once, under the embedding's name
    assert "transformer.wte.weight" in saved and "lm_head.weight" not in saved
    assert sorted(saved) == sorted(set(source) - {"lm_head.weight"})
    assert torch.equal(_logits(model_dir, use_safetensors=True), reference_logits("gpt2"))


def test_convert_keeps_distinct_views_of_one_tensor(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"whole": base, "alias": base, "tail": base[1:], "transposed": base.t()}
    torch.save(state, tmp_path / weights.PT_WEIGHTS)

    assert weights.convert_to_safetensors(tmp_path) == [tmp_path / weights.ST_WEIGHTS]

    saved = load_file(tmp_path / weights.ST_WEIGHTS)
    assert sorted(saved) == ["alias", "tail", "transposed"]  # "whole" is the same tensor as "alias"
    for name, tensor in saved.items():
        assert torch.equal(tensor, state[name])


def test_convert_without_bin_weights_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no PyTorch weights to convert"):
        weights.convert_to_safetensors(tmp_path)


# --- fast tokenizers ------------------------------------------------------------------------------


def test_convert_to_fast_tokenizer_cli_writes_output_path(
    cli: Callable[..., subprocess.CompletedProcess[str]], tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    slow = _slow_tokenizer_copy(tiny_model("gpt2"), tmp_path / "slow")
    out = tmp_path / "fast"

    result = cli("convert-to-fast-tokenizer", str(slow), "--output-path", str(out))

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert (out / "tokenizer.json").is_file() and not (slow / "tokenizer.json").exists()
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    assert _encode(out) == _encode(slow) == _encode(tiny_model("gpt2"))


def test_convert_to_fast_tokenizer_writes_a_portable_config(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    out = weights.convert_to_fast_tokenizer(tiny_model("llama"), tmp_path / "out")

    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # not transformers 5's TokenizersBackend
    assert not set(weights.LOAD_TIME_TOKENIZER_KEYS) & set(config)
    assert _encode(out) == _encode(tiny_model("llama"))


def test_download_weights_adds_fast_tokenizer_without_touching_linked_files(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """As in an HF cache snapshot, tokenizer_config.json is a symlink to a blob that must not change."""
    model_dir = _slow_tokenizer_copy(tiny_model("gpt2"), tmp_path / "model")
    shutil.copy(tiny_model("gpt2") / "config.json", model_dir)
    shutil.copy(tiny_model("gpt2") / weights.ST_WEIGHTS, model_dir)
    blob = tmp_path / "blob"
    (model_dir / "tokenizer_config.json").rename(blob)
    (model_dir / "tokenizer_config.json").symlink_to(blob)
    blob_bytes = blob.read_bytes()

    assert hub.download_weights(str(model_dir)) == model_dir

    assert (model_dir / "tokenizer.json").is_file()
    assert (model_dir / "tokenizer_config.json").is_symlink() and blob.read_bytes() == blob_bytes
    assert _encode(model_dir) == _encode(tiny_model("gpt2"))
