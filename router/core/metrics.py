"""Every Prometheus metric of the router, TGIS's `tgi_*` set plus a few of ours.

The only module that creates metric objects. Other modules call the event methods of `Metrics`
(or hand it plain values); `exposition()` renders GET /metrics. Names, kinds, labels and bucket
layouts are TGIS's (tgis-internals §9). Counters are exported twice, as `name` and `name_total`,
like TGIS's Rust exporter, which prometheus_client cannot do, hence TwinCounter. Every label has
a closed set of values and every combination is exported from the start (at 0), so dashboards
and rate() work before the first event.

`METRICS` below is the documentation table; the README's metrics table is checked against it by
tests/router/test_metrics.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from router.core.stopping import StopReason
from text_generation_common.messages import AdapterCacheState, KvCacheState, Speculation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))  # 0.00015 s ... about 145.6 s
TOKENIZE_BUCKETS = tuple(float(2**k) for k in range(6, 20))
# gRPC calls; TGI REST (tgi_rest.py); OpenAI (openai_api.py)
KINDS = (
    "single",
    "batch",
    "stream",
    "rest",
    "rest_stream",
    "openai",
    "openai_stream",
    "anthropic",
    "anthropic_stream",
)
METHODS = ("prefill", "next_token")
MAKEUPS = ("single_only",)
FAILURES = ("conc_limit", "queue_full", "validation", "generate", "cancelled", "timeout", "unknown")
CALL_FAILURES = ("oom", "connection", "error")
STOP_REASONS = tuple(r.name for r in StopReason)
REJECTIONS = ("conc_limit", "tenant_limit", "draining", "tokenizer_busy")
PHASES = ("queued", "running")
ADAPTER_KINDS = ("prompt", "lora")
OPEN: tuple[str, ...] = ()  # a label whose values come from clients (adapter ids): see TwinCounter
MAX_OPEN_VALUES = 64  # distinct values an open label exports; later ones count as "other"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: str  # counter | histogram | gauge
    labels: Mapping[str, tuple[str, ...]]
    description: str
    buckets: str = ""  # how the histogram's buckets are laid out
    tgis: bool = True  # False: ours, beyond TGIS


def _spec(
    name: str,
    metric_type: str,
    description: str,
    buckets: str = "",
    tgis: bool = True,
    /,
    **labels: tuple[str, ...],
) -> MetricSpec:
    return MetricSpec(name, metric_type, labels, description, buckets, tgis)


DURATION = "duration: 0.0001 * 1.5^k s, k = 1..35"
METRICS: tuple[MetricSpec, ...] = (
    _spec("tgi_request_count", "counter", "Generate calls (a batch counts once)", kind=KINDS),
    _spec("tgi_request_input_count", "counter", "Generate inputs (a batch of n counts n)"),
    _spec("tgi_request_failure", "counter", "Failed requests by cause", err=FAILURES),
    _spec("tgi_request_success", "counter", "Requests that finished with an answer", stop_reason=STOP_REASONS, kind=KINDS),
    _spec("tgi_request_max_new_tokens", "histogram", "Requested max_new_tokens (after defaulting)", "max_new_tokens/64 * 1..64"),
    _spec("tgi_request_input_length", "histogram", "Input tokens of accepted inputs", "max_sequence_length/64 * 1..64"),
    _spec("tgi_request_raw_input_length", "histogram", "Input tokens before length validation (rejected ones too)", "default"),
    _spec("tgi_request_mean_time_per_token_duration", "histogram", "Inference time / generated tokens per request (s)", DURATION),
    _spec("tgi_request_validation_duration", "histogram", "Receipt to validated (s)", DURATION),
    _spec("tgi_request_queue_duration", "histogram", "Time waiting in the queue (s)", DURATION),
    _spec("tgi_request_generated_tokens", "histogram", "Tokens generated per request", "max_new_tokens/64 * 1..64"),
    _spec("tgi_request_total_tokens", "histogram", "Input + generated tokens per request", "max_sequence_length/64 * 1..64"),
    _spec("tgi_request_duration", "histogram", "End-to-end request time (s)", DURATION),
    _spec("tgi_request_inference_duration", "histogram", "First scheduled to finished (s)", DURATION),
    _spec("tgi_batch_concatenation_count", "counter", "New batches merged into a running one"),
    _spec("tgi_batch_inference_count", "counter", "Shard calls started", method=METHODS),
    _spec("tgi_batch_inference_success", "counter", "Shard calls that succeeded", method=METHODS),
    _spec("tgi_batch_inference_failure", "counter", "Shard calls that failed", method=METHODS, reason=CALL_FAILURES),
    _spec("tgi_batch_inference_batch_size", "histogram", "Requests per shard call", "1 .. max_batch_size", method=METHODS),
    _spec("tgi_batch_inference_duration", "histogram", "Whole shard call incl. RPC (s)", DURATION, method=METHODS, makeup=MAKEUPS),
    _spec("tgi_batch_inference_forward_duration", "histogram", "Model forward time reported by the shard (s), one observation per forward (a call of several steps: each at their mean)", DURATION, method=METHODS, makeup=MAKEUPS),
    _spec("tgi_batch_inference_guided_mask_duration", "histogram", "Guided-decoding mask and matcher time of a call with constrained requests, reported by the shard (s)", DURATION, method=METHODS),
    _spec("tgi_batch_inference_tokproc_duration", "histogram", "Router token processing per call (s)", DURATION, method=METHODS, makeup=MAKEUPS),
    _spec("tgi_batch_next_tokens", "histogram", "Tokens of each prefill batch incl. padding", "default"),
    _spec("tgi_batch_current_size", "gauge", "Requests in the running batch"),
    _spec("tgi_batch_input_tokens", "gauge", "Tokens in the running batch incl. padding"),
    _spec("tgi_batch_max_remaining_tokens", "gauge", "Sum of the tokens the running requests may still generate (TGIS's name)"),
    _spec("tgi_queue_size", "gauge", "Requests waiting in the queue"),
    _spec("tgi_queue_jump", "counter", "Requests admitted ahead of an older one that did not fit"),
    _spec(
        "tgi_request_thinking_ended",
        "counter",
        "Requests whose thinking reached its token budget and was ended for them (thinking_token_budget)",
    ),
    _spec(
        "tgi_request_preemption",
        "counter",
        "Running requests sent back to the queue for a waiting one of a lower priority value "
        "(`SCHEDULING_POLICY=priority`)",
    ),
    _spec("tgi_granular_batch_addition", "counter", "Admissions that passed only the exact peak-weight check"),
    _spec("tgi_prefill_weight_limit_exceeded", "counter", "Candidates skipped for prefill weight"),
    _spec("tgi_prefill_padding_limit_exceeded", "counter", "Candidates skipped for prefill padding"),
    _spec("tgi_prompt_load_failure", "counter", "Failed soft-prompt loads"),
    _spec("tgi_prompt_load_duration", "histogram", "Soft-prompt load time (s)", DURATION),
    _spec("tgi_tokenize_request_count", "counter", "Tokenize calls"),
    _spec("tgi_tokenize_request_input_count", "counter", "Tokenize inputs"),
    _spec("tgi_tokenize_request_tokens", "histogram", "Tokens returned per Tokenize call", "2^6 .. 2^19"),
    _spec("tgi_tokenize_request_duration", "histogram", "Tokenize call time (s)", DURATION),
    # ---- ours ----
    _spec("tgi_request_time_to_first_token_duration", "histogram", "Receipt to first generated token (s)", DURATION, False),
    _spec("tgi_request_inter_token_duration", "histogram", "Time between consecutive tokens of a request (s); tokens taken in one step (speculative decoding) arrive together, 0 s apart", DURATION, False),
    _spec("tgi_batch_capacity_usage", "gauge", "Used share of the running batch's tighter limit: weight (memory) or size", "", False),
    _spec("tgi_stream_interval", "gauge", "Tokens per message of the gRPC and OpenAI streams now: STREAM_INTERVAL, or up to MAX_STREAM_INTERVAL while the router's event loop is saturated (or, sharing a CPU shard's CPUs, its CPU time is more than 5 % of a core)", "", False),
    _spec("tgi_queue_rejected", "counter", "Requests refused before queueing: over the concurrency limit (or a tenant over its own), draining, or too much text waiting for tokenization", "", False, reason=REJECTIONS),
    _spec("tgi_request_cancellation", "counter", "Requests whose client went away, by where they were", "", False, phase=PHASES),
    _spec("tgi_kv_cache_usage", "gauge", "Share of the paged KV cache's blocks that live requests hold (tgis_native)", "", False),
    _spec("tgi_kv_cache_blocks_total", "gauge", "Blocks of the paged KV cache (tgis_native)", "", False),
    _spec("tgi_kv_cache_blocks_used", "gauge", "KV-cache blocks live requests hold; a shared prefix block counts once (tgis_native)", "", False),
    _spec("tgi_kv_cache_blocks_reserved", "gauge", "KV-cache blocks live requests may still take, each at its longest (tgis_native)", "", False),
    _spec("tgi_kv_cache_blocks_cached", "gauge", "Prefix-cache blocks no live request holds, reclaimable (tgis_native)", "", False),
    _spec("tgi_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache (tgis_native)", "", False),
    _spec("tgi_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache, their prefill skipped (tgis_native)", "", False),
    _spec("tgi_lora_requests_info", "gauge", "The adapters of the running and the waiting requests, comma-separated, and MAX_LORAS; its value is the time it was read (what the Gateway API Inference Extension reads, as vLLM's vllm:lora_requests_info)", "", False, max_lora=OPEN, running_lora_adapters=OPEN, waiting_lora_adapters=OPEN),
    _spec("tgi_cache_config_info", "gauge", "The paged KV cache's block size (tokens) and blocks, as labels (tgis_native; vLLM's vllm:cache_config_info)", "", False, block_size=OPEN, num_gpu_blocks=OPEN),
    _spec("tgi_adapters_resident", "gauge", "Adapters loaded in the shard, by kind (soft prompts: PROMPT_CACHE_SIZE_MB; LoRA: MAX_LORAS)", "", False, kind=ADAPTER_KINDS),
    _spec("tgi_adapter_loads", "counter", "Adapters loaded into the shard's caches, by kind", "", False, kind=ADAPTER_KINDS),
    _spec("tgi_adapter_evictions", "counter", "Adapters evicted from the shard's caches (least recently used), by kind", "", False, kind=ADAPTER_KINDS),
    _spec("tgi_adapter_lookup_cache_hits", "counter", "prefix_id / adapter_id lookups the router answered from its own cache (no shard call)", "", False),
    _spec("tgi_adapter_request_count", "counter", "Requests that finished with an answer, per adapter (prefix_id or adapter_id); the first 64 ids, then \"other\"", "", False, adapter_id=OPEN),
    _spec("tgi_adapter_generated_tokens", "counter", "Tokens generated for those requests, per adapter", "", False, adapter_id=OPEN),
    _spec("tgi_spec_proposed_tokens", "counter", "Speculative decoding: candidate tokens verified in the shard's forwards (SPECULATE)", "", False),
    _spec("tgi_spec_accepted_tokens", "counter", "Speculative decoding: candidate tokens the model agreed with and that were taken", "", False),
    _spec("tgi_spec_step_accepted_tokens", "histogram", "Speculative decoding: candidates taken per row and step (a row that speculated takes this many + 1 tokens)", "0 .. 16", False),
)  # fmt: skip


class TwinCounter:
    """A labelled counter exported as both `name` and `name_total` (same labels and values).
    A counter with one OPEN label (values from clients) exports the first MAX_OPEN_VALUES
    values it sees, each from its first event, and counts later ones as "other"."""

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self._labels = tuple(spec.labels)
        self._open = len(self._labels) == 1 and next(iter(spec.labels.values())) == OPEN
        self._values = {} if self._open else dict.fromkeys(itertools.product(*spec.labels.values()), 0.0)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(labels.get(name, "") for name in self._labels)
        if self._open and key not in self._values and len(labels) == 1:
            key = key if len(self._values) < MAX_OPEN_VALUES else ("other",)
            self._values.setdefault(key, 0.0)
        if key not in self._values or len(labels) != len(self._labels):
            raise ValueError(f"{self.spec.name}: labels {labels} are not in {dict(self.spec.labels)}")
        self._values[key] += amount

    def get(self, **labels: str) -> float:
        return self._values.get(tuple(labels[name] for name in self._labels), 0.0)

    def expose(self) -> str:
        lines = []
        for name in (self.spec.name, f"{self.spec.name}_total"):
            lines.append(f"# HELP {name} {self.spec.description}")
            lines.append(f"# TYPE {name} counter")
            for key, value in self._values.items():
                labels = ",".join(f'{n}="{_escaped(v)}"' for n, v in zip(self._labels, key, strict=True))
                lines.append(f"{name}{{{labels}}} {value!r}" if labels else f"{name} {value!r}")
        return "\n".join(lines) + "\n"


def _escaped(value: str) -> str:
    """A label value in the text exposition format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _linear(limit: int, count: int = 64) -> tuple[float, ...]:
    """TGIS's token buckets: limit/count * (1..count)."""
    return tuple(limit / count * k for k in range(1, count + 1))


class Metrics:
    def __init__(
        self, *, max_sequence_length: int = 2048, max_new_tokens: int = 1024, max_batch_size: int = 12
    ) -> None:
        disable_created_metrics()  # no *_created samples: TGIS has none
        self.registry = CollectorRegistry()
        # the router process's own CPU seconds, memory and file descriptors (process_*; Linux)
        ProcessCollector(registry=self.registry)
        self.counters: dict[str, TwinCounter] = {}
        self.histograms: dict[str, Histogram] = {}
        self.gauges: dict[str, Gauge] = {}
        self._shard_totals: dict[str, int] = {}  # the shard's running totals, as last reported
        # the adapters of the running and the waiting requests, read at each scrape (set by the
        # router: the batcher's and the queue's), and the label values last exported
        self.adapters_in_use: Callable[[], tuple[Collection[str], Collection[str]]] | None = None
        self.max_loras = 0
        self._lora_labels: tuple[str, str, str] | None = None
        buckets = {
            "max_new_tokens/64 * 1..64": _linear(max_new_tokens),
            "max_sequence_length/64 * 1..64": _linear(max_sequence_length),
            "1 .. max_batch_size": tuple(float(k) for k in range(1, max_batch_size + 1)),
            "2^6 .. 2^19": TOKENIZE_BUCKETS,
            "0 .. 16": tuple(float(k) for k in range(17)),
            DURATION: DURATION_BUCKETS,
            "default": Histogram.DEFAULT_BUCKETS,
        }
        for spec in METRICS:
            if spec.kind == "counter":
                self.counters[spec.name] = TwinCounter(spec)
            elif spec.kind == "histogram":
                h = Histogram(
                    spec.name,
                    spec.description,
                    list(spec.labels),
                    registry=self.registry,
                    buckets=buckets[spec.buckets],
                )
                if spec.labels:  # export every label combination from the start
                    for combination in itertools.product(*spec.labels.values()):
                        h.labels(*combination)
                self.histograms[spec.name] = h
            else:
                gauge = Gauge(spec.name, spec.description, list(spec.labels), registry=self.registry)
                for combination in itertools.product(*spec.labels.values()) if spec.labels else ():
                    gauge.labels(*combination)
                self.gauges[spec.name] = gauge

    def exposition(self) -> bytes:
        self._lora_requests_info()
        twins = "".join(c.expose() for c in self.counters.values())
        return twins.encode() + generate_latest(self.registry)

    def _lora_requests_info(self) -> None:
        """One series (the previous one removed): the adapters in use now, as of now."""
        if self.adapters_in_use is None:
            return
        running, waiting = self.adapters_in_use()
        labels = (str(self.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting)))
        gauge = self.gauges["tgi_lora_requests_info"]
        if self._lora_labels is not None and self._lora_labels != labels:
            gauge.remove(*self._lora_labels)
        gauge.labels(*labels).set(time.time())
        self._lora_labels = labels

    def cache_config(self, block_size: int, blocks: int) -> None:
        self.gauges["tgi_cache_config_info"].labels(str(block_size), str(blocks)).set(1)

    # ---- shorthands ------------------------------------------------------------------------

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self.counters[name].inc(amount, **labels)

    def observe(self, name: str, value: float, **labels: str) -> None:
        h = self.histograms[name]
        (h.labels(**labels) if labels else h).observe(value)

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(value)

    # ---- events ----------------------------------------------------------------------------

    def batch_state(self, size: int, input_tokens: int, remaining: int, capacity_usage: float) -> None:
        self.set("tgi_batch_current_size", size)
        self.set("tgi_batch_input_tokens", input_tokens)
        self.set("tgi_batch_max_remaining_tokens", remaining)
        self.set("tgi_batch_capacity_usage", capacity_usage)

    def shard_call(self, method: str, batch_size: int, prefill_tokens: int | None = None) -> None:
        self.inc("tgi_batch_inference_count", method=method)
        self.observe("tgi_batch_inference_batch_size", batch_size, method=method)
        if prefill_tokens is not None:
            self.observe("tgi_batch_next_tokens", prefill_tokens)

    def shard_call_succeeded(
        self,
        method: str,
        duration_s: float,
        forward_s: float,
        tokproc_s: float,
        guided_s: float = 0.0,
        steps: int = 1,
    ) -> None:
        """A call that ran `steps` forwards in `forward_s` (observed once per forward, each
        at their mean)."""
        self.inc("tgi_batch_inference_success", method=method)
        labels = {"method": method, "makeup": "single_only"}
        self.observe("tgi_batch_inference_duration", duration_s, **labels)
        forwards = max(1, steps)
        for _ in range(forwards):
            self.observe("tgi_batch_inference_forward_duration", forward_s / forwards, **labels)
        self.observe("tgi_batch_inference_tokproc_duration", tokproc_s, **labels)
        if guided_s > 0:
            self.observe("tgi_batch_inference_guided_mask_duration", guided_s, method=method)

    def shard_call_failed(self, method: str, reason: str) -> None:
        self.inc("tgi_batch_inference_failure", method=method, reason=reason)

    def adapter_cache(self, state: AdapterCacheState) -> None:
        """The shard's adapter caches as its last PrefixLookup left them; totals become steps."""
        for kind in ADAPTER_KINDS:
            resident = state.resident_prompts if kind == "prompt" else state.resident_loras
            self.gauges["tgi_adapters_resident"].labels(kind=kind).set(resident)
            for name, field in (("tgi_adapter_loads", "loads"), ("tgi_adapter_evictions", "evictions")):
                total = getattr(state, f"{kind}_{field}")
                seen = self._shard_totals.get(f"{name}:{kind}", 0)
                self.inc(name, total - seen if total >= seen else total, kind=kind)  # below: a restart
                self._shard_totals[f"{name}:{kind}"] = total

    def speculation(self, rows: Sequence[Speculation]) -> None:
        """The rows of a step that verified candidate tokens."""
        if not rows:
            return
        self.inc("tgi_spec_proposed_tokens", sum(r.proposed for r in rows))
        self.inc("tgi_spec_accepted_tokens", sum(r.accepted for r in rows))
        for row in rows:
            self.observe("tgi_spec_step_accepted_tokens", row.accepted)

    def kv_cache(self, state: KvCacheState) -> None:
        """The paged KV cache as a step left it; its prefix-cache totals become counter steps."""
        self.set("tgi_kv_cache_blocks_total", state.total_blocks)
        self.set("tgi_kv_cache_blocks_used", state.used_blocks)
        self.set("tgi_kv_cache_blocks_reserved", state.reserved_blocks)
        self.set("tgi_kv_cache_blocks_cached", state.cached_blocks)
        self.set("tgi_kv_cache_usage", state.used_blocks / state.total_blocks if state.total_blocks else 0.0)
        for name, total in (
            ("tgi_prefix_cache_queries", state.prefix_query_tokens),
            ("tgi_prefix_cache_hits", state.prefix_hit_tokens),
        ):
            seen = self._shard_totals.get(name, 0)
            self.inc(name, total - seen if total >= seen else total)  # below: the shard restarted
            self._shard_totals[name] = total


def markdown_table() -> str:
    """The README's metrics table (tests/router/test_metrics.py keeps the README equal to it)."""
    rows = ["| metric | kind | labels | meaning | buckets |", "|---|---|---|---|---|"]
    for spec in METRICS:
        labels = (
            ", ".join(
                f"`{name}`" + (f"={'/'.join(values)}" if values else "")
                for name, values in spec.labels.items()
            )
            or "—"
        )
        name = f"`{spec.name}`" + ("" if spec.tgis else " (ours)")
        rows.append(f"| {name} | {spec.kind} | {labels} | {spec.description} | {spec.buckets or '—'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_table())
