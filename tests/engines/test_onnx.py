"""The `hf_optimum_ort` engine beyond the conformance suite: the exporter and its CLI, the other
I/O names it reads (transformers' exporter, optimum's merged decoder), and the models it refuses
with one line each (missing KV outputs, an unsupported opset, a corrupt file, a dtype it cannot
run, a read-only directory without an export, an encoder-decoder)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.engines.conformance import Runner, alone, transformers_oracle
from text_generation_common.messages import GenerationRequest
from text_generation_server.config import ServerConfig
from text_generation_server.engines import get_engine_class, hf_optimum_ort

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")

PROMPTS = (
    (5, 17, 42, 99, 7, 300, 12),
    (1, 250, 251, 252),
    (9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15),
)


def ort_engine(model_dir: Path, **overrides):
    config = ServerConfig(
        model_name=str(model_dir),
        deployment_framework="hf_optimum_ort",
        max_batch_size=8,
        max_sequence_length=256,
        max_new_tokens=16,
        **overrides,
    )
    return get_engine_class("hf_optimum_ort")(config)


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama exported by the CLI into a directory of its own."""
    target = tmp_path_factory.mktemp("llama-onnx")
    from text_generation_server.cli import app

    result = CliRunner().invoke(app, ["convert-to-onnx", str(tiny_model("llama")), str(target)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("model.onnx")
    return target


def copy_with(exported: Path, dest: Path, name: str = "model.onnx") -> Path:
    """A model directory like `exported` whose ONNX file is written by the caller as `name`."""
    shutil.copytree(exported, dest, ignore=shutil.ignore_patterns("*.onnx", "*.onnx.data"))
    return dest / name


def test_the_cli_export_is_a_servable_model_directory(exported: Path, tiny_model) -> None:
    names = {p.name for p in exported.iterdir()}
    assert {"model.onnx", "config.json", "tokenizer.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # the ONNX file holds the weights
    graph = onnx.load(str(exported / "model.onnx"))
    inputs = [i.name for i in graph.graph.input]
    outputs = [o.name for o in graph.graph.output]
    assert {"input_ids", "attention_mask", "position_ids", "logits_to_keep", "past_key_values.0.key"} <= set(
        inputs
    )
    assert "present.1.value" in outputs and outputs[0] == "logits"
    engine = ort_engine(exported)
    oracle = transformers_oracle(tiny_model("llama"))
    requests = [GenerationRequest(i, p, 10) for i, p in enumerate(PROMPTS)]
    assert {r.id: alone(engine, r) for r in requests} == {r.id: oracle(r.input_ids, 10) for r in requests}


def rename(graph, renames: dict[str, str]) -> None:
    """Rename graph inputs/outputs and every reference to them."""
    for value in (*graph.input, *graph.output):
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]


def test_the_names_of_transformers_exporter_and_optimums_merged_decoder_load(
    exported: Path, tiny_model, tmp_path: Path
) -> None:
    oracle = transformers_oracle(tiny_model("llama"))
    requests = [GenerationRequest(i, p, 8) for i, p in enumerate(PROMPTS)]
    want = {r.id: oracle(r.input_ids, 8) for r in requests}

    # transformers' exporter: input./output. prefixes, past_key_values.layers.N.keys/values
    model = onnx.load(str(exported / "model.onnx"))
    renames = {}
    for value in (*model.graph.input, *model.graph.output):
        name = value.name
        if name.startswith("past_key_values."):
            _, layer, part = name.split(".")
            renames[name] = f"input.past_key_values.layers.{layer}.{part}s"
        elif name.startswith("present."):
            _, layer, part = name.split(".")
            renames[name] = f"output.past_key_values.layers.{layer}.{part}s"
        else:
            renames[name] = ("output." if name == "logits" else "input.") + name
    rename(model.graph, renames)
    onnx.save(model, str(copy_with(exported, tmp_path / "transformers")))
    assert Runner(ort_engine(tmp_path / "transformers")).run({0: requests[:2], 2: requests[2:]}) == want

    # optimum's older merged decoder: decoder_model_merged.onnx with a use_cache_branch flag
    model = onnx.load(str(exported / "model.onnx"))
    model.graph.input.append(
        onnx.helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1])
    )
    onnx.save(model, str(copy_with(exported, tmp_path / "merged", "decoder_model_merged.onnx")))
    assert Runner(ort_engine(tmp_path / "merged")).run({0: requests}) == want


def test_bad_models_are_refused_with_one_line(exported: Path, tmp_path: Path) -> None:
    # no KV outputs: a decoder exported without its cache
    model = onnx.load(str(exported / "model.onnx"))
    kept = [o for o in model.graph.output if not o.name.startswith("present.")]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    onnx.save(model, str(copy_with(exported, tmp_path / "no-kv")))
    with pytest.raises(
        ValueError, match=r"^model.onnx has no past_key_values inputs / present outputs: export"
    ):
        ort_engine(tmp_path / "no-kv")

    # an opset this ONNX Runtime does not implement
    model = onnx.load(str(exported / "model.onnx"))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 99
    onnx.save(model, str(copy_with(exported, tmp_path / "opset")))
    with pytest.raises(ValueError, match=r"^ONNX Runtime cannot load model.onnx: .*opset") as error:
        ort_engine(tmp_path / "opset")
    assert "\n" not in str(error.value)

    # a corrupt file
    copy_with(exported, tmp_path / "corrupt").write_bytes(b"\x08\x07not a protobuf" * 50)
    with pytest.raises(ValueError, match=r"^ONNX Runtime cannot load model.onnx: ") as error:
        ort_engine(tmp_path / "corrupt")
    assert "\n" not in str(error.value)

    # a dtype the export does not compute in
    with pytest.raises(ValueError, match=r"computes in float32, DTYPE_STR asks for bfloat16"):
        ort_engine(exported, dtype="bfloat16")


def test_a_model_without_export_is_exported_on_first_load_or_refused(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writable = tmp_path / "writable"
    shutil.copytree(tiny_model("gpt2"), writable)
    engine = ort_engine(writable)  # exports into the directory
    assert (writable / "model.onnx").is_file()
    assert alone(engine, GenerationRequest(1, PROMPTS[0], 6)) == transformers_oracle(writable)(PROMPTS[0], 6)

    # a directory the server may not write (a read-only volume): the error names the command
    read_only = tmp_path / "read-only"
    shutil.copytree(tiny_model("gpt2"), read_only, ignore=shutil.ignore_patterns("*.onnx"))
    monkeypatch.setattr(hf_optimum_ort.os, "access", lambda path, mode: False)
    with pytest.raises(
        ValueError, match=r"holds no ONNX model and is not writable: run `text-generation-server"
    ):
        ort_engine(read_only)


def test_encoder_decoders_are_refused(tiny_model, tmp_path: Path) -> None:
    from text_generation_server.onnx.onnx_export import ExportError, export

    with pytest.raises(ExportError, match="t5 is an encoder-decoder model: only decoder-only models export"):
        export(tiny_model("t5"), tmp_path / "t5")
    with pytest.raises(ValueError, match="hf_optimum_ort serves decoder-only models"):
        ort_engine(tiny_model("t5"))


def test_prefill_past_and_logits_shapes(exported: Path) -> None:
    """One session call: an empty past in, presents of past + new positions out."""
    from text_generation_server.onnx.onnx_session import DecoderSession

    session = DecoderSession(exported / "model.onnx", torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, present = session.run(ids, mask, positions, session.empty_past(2))
    assert logits.shape == (2, 3, session.vocab_size)
    last, _ = session.run(ids, mask, positions, session.empty_past(2), all_logits=False)  # logits_to_keep
    assert last.shape == (2, 1, session.vocab_size)
    assert torch.allclose(last[:, 0], logits[:, -1], atol=1e-5)
    assert len(present) == 2 * session.io.layers
    assert present[0].shape == (2, session.io.kv_heads, 3, session.io.head_dim)
    step, present = session.run(
        torch.tensor([[3], [4]]),
        torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
        positions[:, -1:] + 1,
        present,
    )
    assert step.shape == (2, 1, session.vocab_size) and present[0].shape[2] == 4


def test_a_gpu_without_the_cuda_provider_runs_on_the_cpu_with_a_warning(monkeypatch, caplog) -> None:
    from text_generation_server.onnx import onnx_session

    monkeypatch.setattr(onnx_session, "has_cuda_provider", lambda: False)
    with caplog.at_level("WARNING", logger=onnx_session.__name__):
        assert onnx_session.session_device(torch.device("cuda", 0)) == torch.device("cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "a GPU is visible but this onnxruntime has no CUDA provider (install onnxruntime-gpu): "
        "hf_optimum_ort runs on the CPU"
    ]
    monkeypatch.setattr(onnx_session, "has_cuda_provider", lambda: True)
    assert onnx_session.session_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert onnx_session.session_device(torch.device("cpu")) == torch.device("cpu")
