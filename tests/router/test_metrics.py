"""The metrics module: exposition format, counter twins, closed label sets, the README table."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.core.metrics import METRICS, Metrics, markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"


def families(metrics: Metrics) -> dict[str, list]:
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        found.setdefault(family.name, []).append(family)
    return found


def test_every_metric_is_exported_with_its_kind() -> None:
    metrics = Metrics(max_sequence_length=200, max_new_tokens=169, max_batch_size=8)
    text = metrics.exposition().decode()
    parsed = families(metrics)
    for spec in METRICS:
        assert spec.name in parsed, spec.name
        assert all(f.type == spec.kind for f in parsed[spec.name]), spec.name
        if spec.kind == "counter":
            # Both names, as TGIS's exporter: `x` and `x_total`, each with its own TYPE line.
            assert f"# TYPE {spec.name} counter" in text and f"# TYPE {spec.name}_total counter" in text
            assert len(parsed[spec.name]) == 2
    assert "_created" not in text
    assert "process_cpu_seconds_total" in text  # the router process's own (bench: CPU per token)


def test_every_label_combination_starts_at_zero() -> None:
    metrics = Metrics()
    text = metrics.exposition().decode()
    for reason in ("MAX_TOKENS", "EOS_TOKEN", "STOP_SEQUENCE", "TIME_LIMIT", "TOKEN_LIMIT", "CANCELLED"):
        for kind in ("single", "batch", "stream"):
            assert f'tgi_request_success{{stop_reason="{reason}",kind="{kind}"}} 0.0' in text
    (histogram,) = families(metrics)["tgi_batch_inference_duration"]
    counts = {
        (s.labels["method"], s.labels["makeup"]): s.value
        for s in histogram.samples
        if s.name.endswith("_count")
    }
    assert counts == {("prefill", "single_only"): 0.0, ("next_token", "single_only"): 0.0}


def test_a_call_of_several_steps_observes_each_forward_at_their_mean() -> None:
    metrics = Metrics()
    metrics.shard_call_succeeded("next_token", 0.05, 0.03, 0.001, steps=3)
    (histogram,) = families(metrics)["tgi_batch_inference_forward_duration"]
    got = {
        s.name.rsplit("_", 1)[-1]: s.value for s in histogram.samples if s.labels["method"] == "next_token"
    }
    assert got["count"] == 3 and got["sum"] == pytest.approx(0.03)
    (calls,) = families(metrics)["tgi_batch_inference_duration"]
    assert [
        s.value for s in calls.samples if s.name.endswith("_count") and s.labels["method"] == "next_token"
    ] == [1]


def test_counter_twins_move_together() -> None:
    metrics = Metrics()
    metrics.inc("tgi_request_failure", 2, err="validation")
    text = metrics.exposition().decode()
    assert 'tgi_request_failure{err="validation"} 2.0' in text
    assert 'tgi_request_failure_total{err="validation"} 2.0' in text


def test_labels_are_closed_sets() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="not in"):
        metrics.inc("tgi_request_failure", err="bogus")
    with pytest.raises(ValueError, match="not in"):
        metrics.inc("tgi_request_count")


def test_bucket_layouts() -> None:
    text = Metrics(max_sequence_length=256, max_new_tokens=128, max_batch_size=4).exposition().decode()
    input_buckets = re.findall(r'tgi_request_input_length_bucket\{le="([^"]+)"\}', text)
    assert input_buckets[:2] == ["4.0", "8.0"] and len(input_buckets) == 65  # 64 + Inf
    assert re.findall(r'tgi_batch_inference_batch_size_bucket\{le="([^"]+)",method="prefill"\}', text) == [
        "1.0",
        "2.0",
        "3.0",
        "4.0",
        "+Inf",
    ]
    durations = re.findall(r'tgi_request_duration_bucket\{le="([^"]+)"\}', text)
    assert float(durations[0]) == pytest.approx(0.00015) and len(durations) == 36
    tokenize = re.findall(r'tgi_tokenize_request_tokens_bucket\{le="([^"]+)"\}', text)
    assert tokenize[0] == "64.0" and tokenize[-2] == "524288.0"


def test_readme_metrics_table_matches_the_code() -> None:
    readme = README.read_text()
    match = re.search(r"<!-- metrics-table -->\n(.*?)<!-- /metrics-table -->", readme, re.S)
    assert match, "README.md lost its metrics table markers"
    assert match.group(1) == markdown_table(), (
        "README.md's metrics table is out of date: replace it with `python -m router.core.metrics`"
    )


def test_open_labels_export_the_first_values_seen_then_other() -> None:
    metrics = Metrics()
    assert "tgi_adapter_request_count{" not in metrics.exposition().decode()
    for i in range(70):
        metrics.inc("tgi_adapter_request_count", adapter_id=f"a{i % 66}")
    metrics.inc("tgi_adapter_request_count", adapter_id='odd"id')
    text = metrics.exposition().decode()
    assert 'tgi_adapter_request_count_total{adapter_id="a0"} 2.0' in text
    assert 'tgi_adapter_request_count{adapter_id="other"} 3.0' in text  # a64, a65 and odd"id
    assert text.count("tgi_adapter_request_count{") == 65


def test_the_adapters_in_use_are_one_series_read_at_each_scrape() -> None:
    metrics = Metrics()
    assert "tgi_lora_requests_info{" not in metrics.exposition().decode()  # nothing to read yet
    in_use = [({"b", "a"}, {"c"})]
    metrics.adapters_in_use, metrics.max_loras = (lambda: in_use[0]), 4
    metrics.cache_config(16, 257)
    text = metrics.exposition().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("tgi_lora_requests_info{")]
    assert line.startswith(
        'tgi_lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} '
    )
    assert abs(float(line.split()[-1]) - time.time()) < 60
    assert 'tgi_cache_config_info{block_size="16",num_gpu_blocks="257"} 1.0' in text
    in_use[0] = (set(), set())
    (line,) = [
        x for x in metrics.exposition().decode().splitlines() if x.startswith("tgi_lora_requests_info{")
    ]
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in line  # the old series is gone
