"""Prometheus metrics, named and meant as vLLM's (`vllm:` becomes `specserve:`).

Engine-wide counters and gauges come from each `StepStats` (a step listener); request latencies come
from each request's `RequestOutput.times` and `step_time`. With `metrics_compat: vllm` the series
that routers and autoscalers read (production-stack router, KEDA, the Gateway API Inference
Extension's endpoint picker) are also exported under vLLM's own names, read from the same children
at scrape time so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput, StepStats

PREFIX = "specserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

_COUNTERS = {
    "spec_decode_num_drafts": "Verify passes that carried at least one draft token.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the target.",
    "prompt_tokens": "Prompt tokens computed (prefill).",
    "generation_tokens": "Tokens generated.",
    "num_preemptions": "Requests preempted for lack of KV blocks.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "spec_decode_sampling_steps": "Engine steps that sampled tokens for at least one request.",
    "spec_decode_drafting_steps": "Of those, steps in which at least one request verified drafts.",
}
_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting for admission.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0..1).",
}
_HISTOGRAMS = {
    "time_to_first_token_seconds": ("Arrival to first token.", _LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Time between a request's successive outputs.", _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to finish.", _LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Arrival to first scheduled.", _LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("First scheduled to first token.", _LATENCY_BUCKETS),
    "request_decode_time_seconds": ("First token to finish.", _LATENCY_BUCKETS),
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
# Beside it the verify passes that offered a draft at each position (a tree's: its depth), so
# acceptance per position is the ratio; and the tokens a pass yields on average, 1 + accepted /
# passes (what vLLM logs as the mean acceptance length), since the server started.
_DRAFTS_PER_POS = "spec_decode_num_drafts_per_pos"
_MEAN_LENGTH = "spec_decode_mean_acceptance_length"
_BY_PROPOSER = {
    "spec_decode_proposer_draft_tokens": "Draft tokens proposed, by proposer (draft, ngram).",
    "spec_decode_proposer_accepted_tokens": "Draft tokens accepted, by proposer (draft, ngram).",
}
_K_CHOSEN = "spec_decode_k_per_request"
_K_BUCKETS = tuple(float(k) for k in range(0, 17))
_SUCCESS = "request_success"
_REFUSED = "request_refused"
_RETRY_AFTER = "retry_after_seconds"
_RETRY_AFTER_BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
_GOODPUT = "goodput_tokens"
# Why a request got 429 (server/admission.py): a fixed cap on waiting requests, the memory the
# waiting queue may hold, or a wait beyond the bound at the measured completion rate.
REFUSAL_REASONS = ("requests", "memory", "wait")
_BY_ENDPOINT = "api_requests"
_CACHE_CONFIG = "cache_config_info"

METRIC_NAMES: tuple[str, ...] = (
    *(
        f"{PREFIX}{name}_total"
        for name in (
            *_COUNTERS,
            _PER_POS,
            _DRAFTS_PER_POS,
            _SUCCESS,
            *_BY_PROPOSER,
            _BY_ENDPOINT,
            _REFUSED,
            _GOODPUT,
        )
    ),
    *(
        f"{PREFIX}{name}"
        for name in (*_HISTOGRAMS, *_GAUGES, _MEAN_LENGTH, _K_CHOSEN, _CACHE_CONFIG, _RETRY_AFTER)
    ),
)

MetricsCompat = Literal["vllm", "none"]

# specserve name -> vLLM names; the `gpu_` forms are what older routers and dashboards query.
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    _CACHE_CONFIG: ("vllm:cache_config_info",),
}

# `_created` series double every counter and no dashboard reads them.
disable_created_metrics()


class Metrics:
    """One registry per server; thread-safe (the step listener may run on the engine's thread)."""

    def __init__(self, model_name: str, compat: MetricsCompat = "vllm") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        counters = {
            n: Counter(PREFIX + n, doc, labels, registry=reg) for n, doc in _COUNTERS.items()
        }
        gauges = {n: Gauge(PREFIX + n, doc, labels, registry=reg) for n, doc in _GAUGES.items()}
        self.counters = {n: c.labels(model_name) for n, c in counters.items()}
        self.gauges = {n: g.labels(model_name) for n, g in gauges.items()}
        self.histograms = {
            n: Histogram(PREFIX + n, doc, labels, buckets=b, registry=reg).labels(model_name)
            for n, (doc, b) in _HISTOGRAMS.items()
        }
        self._per_pos = Counter(
            PREFIX + _PER_POS, "Accepted draft tokens by draft position.",
            ["model_name", "position"], registry=reg,
        )  # fmt: skip
        self._drafts_per_pos = Counter(
            PREFIX + _DRAFTS_PER_POS, "Verify passes that offered a draft at this position (a "
            "draft tree's: depth).", ["model_name", "position"], registry=reg,
        )  # fmt: skip
        self._mean_length = Gauge(
            PREFIX + _MEAN_LENGTH, "Tokens a verify pass with drafts yields on average "
            "(1 + accepted / passes), since start.", labels, registry=reg,
        ).labels(model_name)  # fmt: skip
        self._passes_and_accepted = [0, 0]
        self._success = Counter(
            PREFIX + _SUCCESS, "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )  # fmt: skip
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self._add_admission_metrics()
        self._by_endpoint = Counter(
            PREFIX + _BY_ENDPOINT, "Requests admitted, by API endpoint.",
            ["model_name", "endpoint"], registry=reg,
        )  # fmt: skip
        self._by_proposer = {
            n: Counter(PREFIX + n, doc, ["model_name", "proposer"], registry=reg)
            for n, doc in _BY_PROPOSER.items()
        }
        self._k_chosen = Histogram(
            PREFIX + _K_CHOSEN, "Drafts each sampling request was given per step (0: plain).",
            labels, buckets=_K_BUCKETS, registry=reg,
        ).labels(model_name)  # fmt: skip
        self._cache_config = Gauge(
            PREFIX + _CACHE_CONFIG, "KV cache configuration (the labels; the value is 1).",
            ["model_name", "block_size", "num_gpu_blocks"], registry=reg,
        )  # fmt: skip
        if compat == "vllm":
            sources = counters | gauges | {_CACHE_CONFIG: self._cache_config}
            reg.register(VllmAliases({n: sources[n] for n in VLLM_ALIASES}))

    def _add_admission_metrics(self) -> None:
        reg, name = self.registry, self.model_name
        self._refused = Counter(
            PREFIX + _REFUSED, "Requests refused with 429, by reason (requests, memory, wait).",
            ["model_name", "reason"], registry=reg,
        )  # fmt: skip
        for reason in REFUSAL_REASONS:
            self._refused.labels(name, reason)
        self._retry_after = Histogram(
            PREFIX + _RETRY_AFTER, "Retry-After advised, by status (429 queue full, 503 loading "
            "or draining).", ["model_name", "status"], buckets=_RETRY_AFTER_BUCKETS, registry=reg,
        )  # fmt: skip
        self._goodput = Counter(
            PREFIX + _GOODPUT, "Output tokens of requests that ran to their end (stop or length): "
            "what clients got; its rate is the goodput.", ["model_name"], registry=reg,
        ).labels(name)  # fmt: skip

    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        """Once the engine has sized its KV pool (the endpoint picker reads it for prefix scoring)."""
        self._cache_config.clear()
        self._cache_config.labels(self.model_name, str(block_size), str(num_gpu_blocks)).set(1)

    def on_step(self, stats: StepStats) -> None:
        c = self.counters
        c["spec_decode_num_drafts"].inc(stats.spec.num_drafts)
        c["spec_decode_num_draft_tokens"].inc(stats.spec.num_draft_tokens)
        c["spec_decode_num_accepted_tokens"].inc(stats.spec.num_accepted_tokens)
        for pos, n in enumerate(stats.spec.accepted_per_pos):
            self._per_pos.labels(self.model_name, str(pos)).inc(n)
        self._on_spec_positions(stats)
        self._on_spec_step(stats)
        c["prompt_tokens"].inc(stats.num_prompt_tokens)
        c["generation_tokens"].inc(stats.num_generation_tokens)
        c["num_preemptions"].inc(stats.num_preemptions)
        c["prefix_cache_queries"].inc(stats.prefix_cache_queries)
        c["prefix_cache_hits"].inc(stats.prefix_cache_hits)
        self.gauges["num_requests_running"].set(stats.num_running)
        self.gauges["num_requests_waiting"].set(stats.num_waiting)
        self.gauges["kv_cache_usage_perc"].set(stats.kv_cache_usage)

    def _on_spec_positions(self, stats: StepStats) -> None:
        for pos, n in enumerate(stats.spec.drafted_per_pos):
            self._drafts_per_pos.labels(self.model_name, str(pos)).inc(n)
        totals = self._passes_and_accepted
        totals[0] += stats.spec.num_drafts
        totals[1] += stats.spec.num_accepted_tokens
        if totals[0]:
            self._mean_length.set(1 + totals[1] / totals[0])

    def _on_spec_step(self, stats: StepStats) -> None:
        if stats.spec_k_chosen:
            self.counters["spec_decode_sampling_steps"].inc()
            self.counters["spec_decode_drafting_steps"].inc(int(stats.spec.num_drafts > 0))
        for k in stats.spec_k_chosen:
            self._k_chosen.observe(k)
        for proposer, (drafted, accepted) in stats.spec.by_proposer.items():
            labels = (self.model_name, proposer)
            self._by_proposer["spec_decode_proposer_draft_tokens"].labels(*labels).inc(drafted)
            self._by_proposer["spec_decode_proposer_accepted_tokens"].labels(*labels).inc(accepted)

    def refresh_from(self, engine: Any) -> None:
        """At scrape time: an idle engine takes no steps, so its last StepStats may be stale."""
        self.gauges["num_requests_running"].set(engine.num_running)
        self.gauges["num_requests_waiting"].set(engine.num_waiting)
        usage = getattr(engine, "kv_cache_usage", None)
        if isinstance(usage, int | float):
            self.gauges["kv_cache_usage_perc"].set(usage)

    def track(self) -> RequestMetrics:
        """A per-request observer: feed it every output of one request."""
        return RequestMetrics(self)

    def on_finished(self, out: RequestOutput) -> None:
        t = out.times
        end = t.finished or out.step_time
        self._success.labels(self.model_name, out.finish_reason or "abort").inc()
        if out.finish_reason in ("stop", "length"):
            self._goodput.inc(out.num_output_tokens)
        self.observe_interval("e2e_request_latency_seconds", t.arrival, end)
        self.observe_interval("request_queue_time_seconds", t.arrival, t.first_scheduled)
        self.observe_interval("request_prefill_time_seconds", t.first_scheduled, t.prefill_done)
        self.observe_interval("request_decode_time_seconds", t.first_token, end)

    def count_request(self, endpoint: str) -> None:
        """A request admitted (validated, its engine requests about to start) at `endpoint`."""
        self._by_endpoint.labels(self.model_name, endpoint).inc()

    def count_refused(self, reason: str) -> None:
        """A 429: the request was valid but the waiting queue could not take it."""
        self._refused.labels(self.model_name, reason).inc()

    def observe_retry_after(self, seconds: float, status: int) -> None:
        self._retry_after.labels(self.model_name, str(status)).observe(seconds)

    def count_aborted(self) -> None:
        """A request the client left: the engine's final output went to no one."""
        self._success.labels(self.model_name, "abort").inc()

    def observe_interval(self, name: str, start: float | None, end: float | None) -> None:
        if start is not None and end is not None:
            self.histograms[name].observe(max(0.0, end - start))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmAliases(Collector):
    """Each source family again under its vLLM names, same labels and values, at every scrape."""

    def __init__(self, sources: dict[str, MetricWrapperBase]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for name, source in self.sources.items():
            for family in source.collect():
                for alias in VLLM_ALIASES[name]:
                    yield renamed(family, alias)


def renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` called `name`; sample suffixes (`_total`, `_bucket`) are kept."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(family.name) :]) for s in family.samples]
    return copy


class RequestMetrics:
    """TTFT at the first token, one inter-token latency per later output, the rest at finish."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        if out.new_token_ids:
            if self.last_token_time is None:
                first = out.times.first_token or out.step_time
                self.metrics.observe_interval(
                    "time_to_first_token_seconds", out.times.arrival, first
                )
            else:
                self.metrics.observe_interval(
                    "inter_token_latency_seconds", self.last_token_time, out.step_time
                )
            self.last_token_time = out.step_time
        if out.finished:
            self.metrics.on_finished(out)
