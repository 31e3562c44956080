"""``/metrics``: Prometheus exposition through ``prometheus_client``, one registry per app.

Two families of names for the same quantities:

- ``asymcache_*``: ours (request counts by endpoint and status, TTFT / TPOT histograms, token
  counters including recomputed history, aborts, and every gauge and counter of
  :class:`~asymcache_core.EngineStats`);
- ``vllm:*``: vLLM's names with its ``model_name`` label, so dashboards built for vLLM read this
  server unchanged (running / waiting requests, KV usage, prompt and generation tokens, TTFT,
  TPOT, end-to-end latency, prefix-cache queries and hits, preemptions).

The ``vllm:*`` gauges include what the Gateway API inference extension's endpoint picker scrapes
from a model server (its model-server protocol; ``docs/kv-events.md`` has the table): queued and
running requests, KV-cache utilization (under vLLM's current and earlier names), the block size
and pool size as ``vllm:cache_config_info`` labels, and ``vllm:lora_requests_info`` (no adapters:
this server serves no LoRA, and the picker reads an empty list as such).

Request-level series are updated when a request finishes (:meth:`ServerMetrics.observe`).
Engine series come from an :class:`~asymcache_core.EngineStats` snapshot that the ``/metrics``
handler takes on the engine thread and hands to :meth:`ServerMetrics.render`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from agent_runtime.types import StreamEvent
from asymcache_core import EngineStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: EngineStats fields not exported (the peak is a run statistic; requests are counted per endpoint).
_UNEXPORTED = frozenset({"kv_blocks_peak_in_use", "requests_total"})
#: Gauges although their names end in ``_total`` (a size, not a count of events).
_GAUGES_NAMED_TOTAL = frozenset({"kv_blocks_total", "host_kv_blocks_total"})


class EngineCollector(Collector):
    """Engine series from the last :class:`EngineStats` snapshot given to :meth:`update`.

    Args:
        model_name: the ``model_name`` label of the vLLM series.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def update(self, stats: EngineStats) -> None:
        """Set the snapshot the next collection reports.

        Args:
            stats: the engine's stats, read on the engine thread.
        """
        self.stats = stats

    def describe(self) -> list[Metric]:
        # NOTE: nothing to describe before the first scrape; returning [] keeps the registry from
        # calling collect() at registration.
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for f in fields(stats):
            if f.name in _UNEXPORTED:
                continue
            value = getattr(stats, f.name)
            name = f"asymcache_{f.name}"
            doc = f"Engine {f.name.replace('_', ' ')}."
            if f.name.endswith("_total") and f.name not in _GAUGES_NAMED_TOTAL:
                yield CounterMetricFamily(name, doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)
        labels = [self.model_name]
        usage = stats.kv_blocks_in_use / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            # NOTE: vLLM's earlier name of the same gauge; endpoint pickers configured for it scrape it.
            ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (earlier name).", usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache config (the value is 1).",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching"],
        )
        config.add_metric(
            [str(stats.kv_block_size), str(stats.kv_blocks_total), str(stats.host_kv_blocks_total), "True"], 1.0
        )
        yield config
        # NOTE: the picker's LoRA-affinity scorer takes the sample with the latest timestamp
        # (the value); without the series it logs a scrape error every time.
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running and waiting LoRA adapters (the value is the update time).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions_total", "Cumulative number of preemptions.", labels=["model_name"]
        )
        preemptions.add_metric(labels, stats.preemptions_total)
        yield preemptions


#: The routes whose path is their own label; others are their template or ``other``.
_STATIC_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/models", "/tokenize", "/detokenize", "/health", "/ping", "/metrics", "/version", "/reset_prefix_cache",
    "/flush_cache", "/openapi.json", "/docs",
})
#: Routes with an id in their path, by prefix: ``(prefix, suffix, template, the id may hold a
#: slash)`` (a model's name may: ``org/model``).
_ID_ROUTES = (
    ("/v1/responses/", "/input_items", "/v1/responses/{response_id}/input_items", False),
    ("/v1/responses/", "", "/v1/responses/{response_id}", False),
    ("/v1/models/", "", "/v1/models/{model}", True),
)


def endpoint_label(path: str) -> str:
    """A request's ``endpoint`` label: its route, never its raw path (a response id, a model
    name or a stranger's path in each label would grow the series without bound).

    Args:
        path: the request's path.

    Returns:
        The path of a fixed route, an id route's template, or ``other``.
    """
    if path in _STATIC_ROUTES:
        return path
    for prefix, suffix, template, slashes in _ID_ROUTES:
        name = path[len(prefix) : len(path) - len(suffix)] if path.startswith(prefix) and path.endswith(suffix) else ""
        if name and (slashes or "/" not in name):
            return template
    return "other"


class ServerMetrics:
    """The series of one app, in its own :class:`CollectorRegistry` (no process-global state).

    Args:
        model_name: the served model's name (the ``model`` / ``model_name`` label).

    Attributes:
        registry: the registry ``/metrics`` renders.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, model = self.registry, ["model_name"]
        self._requests = Counter(
            "asymcache_requests_total", "HTTP requests by endpoint and status.",
            ["endpoint", "status", "model"], registry=r,
        )
        self._ttft = Histogram(
            "asymcache_time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self._tpot = Histogram(
            "asymcache_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=TPOT_BUCKETS, registry=r,
        )
        self._prompt = Counter("asymcache_prompt_tokens_total", "Prompt tokens of finished requests.", registry=r)
        self._hits = Counter("asymcache_cache_hit_tokens_total", "Prompt tokens served from the KV cache.", registry=r)
        self._recomputed = Counter(
            "asymcache_recomputed_tokens_total", "Tokens computed again (evicted history, holes, preemption).",
            registry=r,
        )
        self._completion = Counter("asymcache_completion_tokens_total", "Generated tokens.", registry=r)
        self._aborted = Counter(
            "asymcache_aborted_requests_total", "Requests aborted (client disconnects included).", registry=r
        )
        # NOTE: vLLM's series carry a ``model_name`` label; this app serves one model, so each
        # is kept as its one labelled child.
        def vllm_histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, model, buckets=buckets, registry=r).labels(model_name)

        def vllm_counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, model, registry=r).labels(model_name)

        self._vllm_ttft = vllm_histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._vllm_tpot = vllm_histogram(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT_BUCKETS
        )
        self._vllm_e2e = vllm_histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", E2E_BUCKETS
        )
        self._vllm_prompt = vllm_counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self._vllm_generation = vllm_counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed."
        )
        self._vllm_queries = vllm_counter("vllm:prefix_cache_queries_total", "Prefix-cache queries, in tokens.")
        self._vllm_hits = vllm_counter("vllm:prefix_cache_hits_total", "Prefix-cache hits, in tokens.")
        self.engine = EngineCollector(model_name)
        r.register(self.engine)

    def count(self, endpoint: str, status: int) -> None:
        """Count one answered HTTP request.

        Args:
            endpoint: the path (labelled as its route: :func:`endpoint_label`).
            status: the HTTP status.
        """
        self._requests.labels(endpoint_label(endpoint), str(status), self.model_name).inc()

    def count_abort(self, last: StreamEvent | None = None) -> None:
        """Count a request aborted before it finished (its client went away).

        Args:
            last: its latest event, if any: the tokens it had computed and generated count, as
                vLLM counts them step by step (None: it never ran).
        """
        self._aborted.inc()
        if last is not None:
            self._count_tokens(last)

    def observe(self, final: StreamEvent) -> None:
        """Account for a finished request.

        Args:
            final: its final event.
        """
        out = final.output
        if out.finish_reason == "abort":
            self.count_abort(final)
            return
        m = out.metrics
        if m.ttft is not None and math.isfinite(m.ttft):
            self._ttft.observe(m.ttft)
            self._vllm_ttft.observe(m.ttft)
        if m.tpot is not None and math.isfinite(m.tpot):
            # NOTE: ours is one observation per request (its mean); vLLM's observes every
            # inter-token interval, which the engine's token timestamps give.
            self._tpot.observe(m.tpot)
            for prev, cur in itertools.pairwise(m.token_times):
                self._vllm_tpot.observe(max(0.0, cur - prev))
        if m.finish_time is not None and math.isfinite(m.finish_time - m.arrival_time):
            self._vllm_e2e.observe(max(0.0, m.finish_time - m.arrival_time))
        self._count_tokens(final)

    def _count_tokens(self, event: StreamEvent) -> None:
        """The token counters of a request's ``event`` (its last: finished or cut short)."""
        out, m = event.output, event.output.metrics
        completion = len(out.token_ids)
        for counter, value in (
            (self._prompt, out.num_prompt_tokens), (self._vllm_prompt, out.num_prompt_tokens),
            (self._vllm_queries, out.num_prompt_tokens),
            (self._hits, m.cached_tokens), (self._vllm_hits, m.cached_tokens),
            (self._completion, completion), (self._vllm_generation, completion),
        ):
            counter.inc(value)
        if event.metrics is not None:
            self._recomputed.inc(event.metrics.recomputed_tokens)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition.

        Args:
            stats: the engine's stats, read on the engine thread just before.

        Returns:
            The text (``CONTENT_TYPE``).
        """
        # NOTE: update and generate run without an await between them, so concurrent scrapes on
        # one event loop cannot interleave snapshots.
        self.engine.update(stats)
        return generate_latest(self.registry)


class _Families(Collector):
    """Prometheus families given whole (the merged exposition)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self.families = families

    def collect(self) -> Any:
        yield from self.families


def merge_expositions(texts: dict[str, str], extra: Sequence[Metric] = ()) -> bytes:
    """Several replicas' Prometheus texts as one, every sample labelled with its ``replica``.

    Args:
        texts: replica id -> its ``/metrics`` text.
        extra: further families (the gateway's own).

    Returns:
        The exposition (``CONTENT_TYPE``).
    """
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                into.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry()
    registry.register(_Families([*merged.values(), *extra]))
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "EngineCollector", "ServerMetrics", "endpoint_label", "merge_expositions"]
