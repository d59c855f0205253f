"""A real Prometheus server scrapes the running launcher's GET /metrics and answers queries on
our series: proof that real scraping works, not just our own parser.

Prometheus comes from the Debian package `prometheus`, installed by integration_tests/prometheus.py
when missing (root + apt-get); where it cannot be had, the test is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from integration_tests.prometheus import (
    PrometheusServer,
    PrometheusUnavailable,
    ensure_prometheus,
    prometheus_version,
)
from integration_tests.servers import Server
from router.core.metrics import KINDS
from router.pb import generation_pb2 as pb


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    try:
        return ensure_prometheus()
    except PrometheusUnavailable as exc:
        pytest.skip(f"no Prometheus server to scrape with: {exc}")


def labels(series: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [s["metric"] for s in series]


def value(series: dict[str, Any]) -> float:
    return float(series["value"][1])


def test_real_prometheus_scrapes_metrics(server: Callable[[str], Server], prometheus_binary: str) -> None:
    s = server("llama")
    stub = s.stub()
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=4))
    stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "Hello there"}], params=params))
    stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "import os"}] * 2, params=params))

    target = f"127.0.0.1:{s.http_port}"
    with PrometheusServer([target], binary=prometheus_binary) as prometheus:

        def context() -> str:
            version = prometheus_version(prometheus_binary)
            return f"{version}\n{prometheus.describe_targets()}\n{prometheus.log()[-2000:]}"

        # Counters, under both names (TGIS's Rust exporter writes `name` and `name_total`).
        prometheus.wait_for('tgi_request_count{kind="batch"} >= 1', timeout=20)
        counts = prometheus.query("tgi_request_count")
        by_kind = {series["metric"].get("kind"): value(series) for series in counts}
        assert by_kind.keys() == set(KINDS), f"{labels(counts)}\n{context()}"
        assert by_kind["single"] >= 1 and by_kind["batch"] >= 1, f"{by_kind}\n{context()}"
        for series in counts:
            assert series["metric"]["job"] == PrometheusServer.JOB, series
            assert series["metric"]["instance"] == target, series
        totals = prometheus.query("tgi_request_count_total")
        assert {series["metric"]["kind"]: value(series) for series in totals} == by_kind, context()

        # A histogram: every bucket of a labelled family, cumulative, ending in +Inf.
        buckets = prometheus.query("tgi_request_duration_bucket")
        les = {series["metric"]["le"]: value(series) for series in buckets}
        assert "+Inf" in les and len(les) > 10, f"{sorted(les)}\n{context()}"
        duration_count = prometheus.query("tgi_request_duration_count")
        assert duration_count and value(duration_count[0]) == les["+Inf"] >= 2, context()
        quantile = prometheus.query("histogram_quantile(0.5, sum by (le) (tgi_request_duration_bucket))")
        assert quantile and value(quantile[0]) > 0, f"{quantile}\n{context()}"
        batch_sizes = prometheus.query('tgi_batch_inference_batch_size_bucket{method="prefill"}')
        assert batch_sizes, context()

        # A gauge.
        queue = prometheus.query("tgi_queue_size")
        assert len(queue) == 1 and value(queue[0]) >= 0, f"{queue}\n{context()}"

        # The target is healthy and Prometheus refused none of our samples.
        up = prometheus.query(f'up{{job="{PrometheusServer.JOB}"}}')
        assert [value(series) for series in up] == [1.0], context()
        (scraped,) = prometheus.targets()
        assert scraped["health"] == "up" and scraped["lastError"] == "", context()
        samples = prometheus.query(f'scrape_samples_post_metric_relabeling{{job="{PrometheusServer.JOB}"}}')
        assert samples and value(samples[0]) > 100, context()
        assert prometheus.scrape_problems() == {}, context()
