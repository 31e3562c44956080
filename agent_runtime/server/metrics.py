"""``/metrics``: Prometheus exposition through ``prometheus_client``, one registry per app.

Two families of names for the same quantities:

- ``asymcache_*``: ours (request counts by endpoint and status, TTFT / TPOT histograms, token
  counters including recomputed history, aborts, and every gauge and counter of
  :class:`~asymcache_core.EngineStats`);
- ``vllm:*``: vLLM 0.32's names, types, labels (``model_name`` and ``engine``, always ``"0"``:
  one engine per server) and bucket boundaries, so dashboards built for vLLM (its Grafana
  dashboard included) read this server unchanged: running / waiting requests, KV usage, prompt
  and generation tokens, prefix-cache queries and hits, preemptions, finished requests by
  ``finished_reason``, and the histograms of TTFT, inter-token latency, end-to-end, queue,
  prefill, decode and inference times, time per output token, prompt and generation tokens per
  request, prompt tokens computed per request (its cache hits left out), its ``max_tokens``,
  preemptions per request and tokens per engine step; and, once per request whose every choice
  finished, its ``n`` and the most tokens one choice generated.

Deprecated aliases, kept so that existing dashboards do not break (vLLM 0.32 no longer exports
them): ``vllm:gpu_cache_usage_perc`` (now ``vllm:kv_cache_usage_perc``) and
``vllm:time_per_output_token_seconds`` (now ``vllm:inter_token_latency_seconds``, the same
observations); both keep their earlier ``model_name``-only labels.

The ``vllm:*`` gauges include what the Gateway API inference extension's endpoint picker scrapes
from a model server (its model-server protocol; ``docs/kv-events.md`` has the table): queued and
running requests, KV-cache utilization (under vLLM's current and earlier names), the block size
and pool size as ``vllm:cache_config_info`` labels, and ``vllm:lora_requests_info`` (no adapters:
this server serves no LoRA, and the picker reads an empty list as such).

The ``asymcache_*`` request series and vLLM's token counters are updated when a handler sees
its request finish (:meth:`ServerMetrics.observe`). Engine series come from an
:class:`~asymcache_core.EngineStats` snapshot, and vLLM's per-request and per-step histograms
and finish reasons from a :class:`~asymcache_core.serving_stats.ServingStatsSnapshot` (the
engine's own records of every request and step, :mod:`asymcache_core.serving_stats`), both
taken by the ``/metrics`` handler on the engine thread and handed to :meth:`ServerMetrics.render`.
"""

from __future__ import annotations

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
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from agent_runtime.types import StreamEvent
from asymcache_core import EngineStats
from asymcache_core.serving_stats import HistogramSnapshot, ParentRequestStats, ServingStatsSnapshot

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: EngineStats fields not exported (the peak is a run statistic; requests are counted per endpoint).
_UNEXPORTED = frozenset({"kv_blocks_peak_in_use", "requests_total"})
#: Gauges although their names end in ``_total`` (a size, not a count of events).
_GAUGES_NAMED_TOTAL = frozenset({"kv_blocks_total", "host_kv_blocks_total"})
#: vLLM's per-engine labels; the ``engine`` label is the engine's index (one engine a server).
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"


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
        labels = [self.model_name, ENGINE_INDEX]
        usage = stats.kv_blocks_in_use / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=list(VLLM_LABELS))
            gauge.add_metric(labels, value)
            yield gauge
        # NOTE: deprecated alias: vLLM's earlier name of the same gauge (gone in 0.32), with its
        # earlier labels; endpoint pickers and dashboards configured for it scrape it.
        earlier = GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (deprecated: vllm:kv_cache_usage_perc).",
            labels=["model_name"],
        )
        earlier.add_metric([self.model_name], usage)
        yield earlier
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache config (the value is 1).",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching", "engine"],
        )
        config.add_metric(
            [str(stats.kv_block_size), str(stats.kv_blocks_total), str(stats.host_kv_blocks_total), "True",
             ENGINE_INDEX], 1.0
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
            "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", labels=list(VLLM_LABELS)
        )
        preemptions.add_metric(labels, stats.preemptions_total)
        yield preemptions
        if stats.spec_decode_num_speculative_tokens:
            # NOTE: vLLM registers these with a speculative config only (v1/spec_decode/metrics.py)
            for name, doc, value in (
                ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", stats.spec_decode_num_drafts_total),
                ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                 stats.spec_decode_num_draft_tokens_total),
                ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                 stats.spec_decode_num_accepted_tokens_total),
            ):
                counter = CounterMetricFamily(name, doc, labels=list(VLLM_LABELS))
                counter.add_metric(labels, value)
                yield counter


#: vLLM's histograms: (name, documentation, the :class:`ServingStatsSnapshot` field).
_VLLM_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "time_to_first_token"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token_latency"),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     "time_per_output_token"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e_latency"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue_time"),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     "inference_time"),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "prefill_time"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "decode_time"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.", "num_preemptions"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "params_max_tokens"),
    ("vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "prefill_kv_computed"),
)
#: vLLM's histograms of parent requests: (name, documentation, the :class:`ParentRequestStats` field).
_VLLM_PARENT_HISTOGRAMS = (
    ("vllm:request_params_n", "Histogram of the n request parameter.", "params_n"),
    ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
     "max_num_generation_tokens"),
)


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snap: HistogramSnapshot) -> None:
    """Adds one labelled histogram (cumulative ``le`` buckets, as prometheus_client writes them)."""
    running = 0
    buckets: list[tuple[str, float]] = []
    for bound, count in zip((*snap.bounds, math.inf), snap.counts, strict=True):
        running += count
        buckets.append((floatToGoString(bound), running))
    family.add_metric(labels, buckets, snap.total)


class ServingCollector(Collector):
    """vLLM's finish-reason counter and histograms from the last :class:`ServingStatsSnapshot`.

    Args:
        model_name: the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: ServingStatsSnapshot | None = None
        self.parents: ParentRequestStats | None = None

    def update(self, snapshot: ServingStatsSnapshot | None) -> None:
        """Set the snapshot the next collection reports (None: none of these series)."""
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # as EngineCollector's: nothing before the first scrape

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        labels = [self.model_name, ENGINE_INDEX]
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=[*VLLM_LABELS, "finished_reason"],
        )
        for reason, count in snap.finished.items():
            success.add_metric([*labels, reason], count)
        yield success
        for name, doc, attr in _VLLM_HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=list(VLLM_LABELS))
            _add_histogram(family, labels, getattr(snap, attr))
            yield family
        # NOTE: deprecated alias: vLLM renamed it inter_token_latency_seconds (the same
        # observations); kept, with its earlier labels, for dashboards that query it.
        alias = HistogramMetricFamily(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (deprecated: vllm:inter_token_latency_seconds).",
            labels=["model_name"],
        )
        _add_histogram(alias, [self.model_name], snap.inter_token_latency)
        yield alias
        if self.parents is not None:
            for name, doc, attr in _VLLM_PARENT_HISTOGRAMS:
                family = HistogramMetricFamily(name, doc, labels=list(VLLM_LABELS))
                _add_histogram(family, labels, getattr(self.parents, attr).snapshot())
                yield family


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
        r, model = self.registry, list(VLLM_LABELS)
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
        # NOTE: vLLM's series carry ``model_name`` and ``engine`` labels; this app serves one
        # model on one engine, so each is kept as its one labelled child.
        def vllm_counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, model, registry=r).labels(model_name, ENGINE_INDEX)

        self._vllm_prompt = vllm_counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self._vllm_generation = vllm_counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed."
        )
        self._vllm_queries = vllm_counter("vllm:prefix_cache_queries_total", "Prefix-cache queries, in tokens.")
        self._vllm_hits = vllm_counter("vllm:prefix_cache_hits_total", "Prefix-cache hits, in tokens.")
        self.engine = EngineCollector(model_name)
        r.register(self.engine)
        self.serving = ServingCollector(model_name)
        r.register(self.serving)

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

    def set_context_limit(self, max_model_len: int) -> None:
        """Start vLLM's parent-request series (their token buckets end at the context limit),
        once the served engine is known.

        Args:
            max_model_len: the engine's context limit.
        """
        if self.serving.parents is None:
            self.serving.parents = ParentRequestStats(max_model_len)

    def observe_choices(self, finals: Sequence[StreamEvent], n: int) -> None:
        """Account for the parent requests of a request whose choices all finished: each
        prompt's ``n`` consecutive choices are one of vLLM's parent requests (its
        ``request_params_n`` and ``request_max_num_generation_tokens``); one with a choice
        aborted is none, as in vLLM.

        Args:
            finals: the final event of every choice, each prompt's ``n`` together.
            n: the choices of each prompt.
        """
        parents = self.serving.parents
        if parents is None:
            return
        for start in range(0, len(finals), n):
            group = finals[start : start + n]
            if all(f.output.finish_reason != "abort" for f in group):
                parents.on_finished([len(f.output.token_ids) for f in group])

    def observe(self, final: StreamEvent, one_choice: bool = True) -> None:
        """Account for a finished request.

        Args:
            final: its final event.
            one_choice: the request had this one choice (it is its own parent request); False:
                one of several, whose request :meth:`observe_choices` accounts for.
        """
        out = final.output
        if out.finish_reason == "abort":
            self.count_abort(final)
            return
        if one_choice:
            self.observe_choices([final], 1)
        m = out.metrics
        # NOTE: vLLM's latency histograms come from the engine's records (render's snapshot),
        # which also hold the requests no handler saw finish (errors, clients gone).
        if m.ttft is not None and math.isfinite(m.ttft):
            self._ttft.observe(m.ttft)
        if m.tpot is not None and math.isfinite(m.tpot):
            self._tpot.observe(m.tpot)  # one observation per request (its mean)
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

    def render(self, stats: EngineStats, serving: ServingStatsSnapshot | None = None) -> bytes:
        """The Prometheus text exposition.

        Args:
            stats: the engine's stats, read on the engine thread just before.
            serving: the engine's :class:`~asymcache_core.serving_stats.ServingStats`, read with
                them (None: vLLM's finish-reason counter and histograms are left out).

        Returns:
            The text (``CONTENT_TYPE``).
        """
        # NOTE: update and generate run without an await between them, so concurrent scrapes on
        # one event loop cannot interleave snapshots.
        self.engine.update(stats)
        self.serving.update(serving)
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


__all__ = [
    "CONTENT_TYPE", "EngineCollector", "ServerMetrics", "ServingCollector", "endpoint_label", "merge_expositions",
]
