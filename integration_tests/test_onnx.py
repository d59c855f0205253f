"""hf_optimum_ort through the launcher when the model cannot be served: the server stops at
start-up and says why in one line, in the termination log as in its own log. (The Llama YAML
cases replay on this engine in test_cases.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration_tests.servers import launch, model_dir

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")


def test_a_corrupt_onnx_file_stops_the_server_with_one_line(tmp_path: Path) -> None:
    path = model_dir("llama", tmp_path / "models")
    (path / "model.onnx").write_bytes(b"\x08\x07not a protobuf" * 50)
    with pytest.raises(RuntimeError, match="exited with 1") as failed:
        launch("llama@hf_optimum_ort", tmp_path)
    termination = (tmp_path / "llama-hf_optimum_ort-termination.log").read_text()
    assert termination.startswith("Shard 0 exited with code 1: "), termination
    assert "ONNX Runtime cannot load model.onnx: " in termination
    assert len(termination.strip().splitlines()) == 1, termination
    assert "ONNX Runtime cannot load model.onnx" in str(failed.value)
