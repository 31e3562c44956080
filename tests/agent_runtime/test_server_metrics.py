"""/metrics series: ours and vLLM's names for the same quantities, one registry per app."""

from __future__ import annotations

from dataclasses import fields

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.types import StreamEvent, TurnMetrics
from asymcache_core import EngineStats
from asymcache_core.request import RequestMetrics, RequestOutput


def _stats(**values: int) -> EngineStats:
    base = {f.name: 0 for f in fields(EngineStats)}
    return EngineStats(**{**base, **values})


def _final(prompt: int, completion: int, cached: int, token_times: list[float], reason: str = "length",
           recomputed: int = 0) -> StreamEvent:
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.1, first_token_time=token_times[0],
                       finish_time=token_times[-1], cached_tokens=cached, token_times=token_times)
    out = RequestOutput("r", [], list(range(completion)), "", True, reason, m, prompt)
    tm = TurnMetrics(m.ttft, m.tpot, 0.1, cached, recomputed, prompt, completion, 0, 10.0, m.finish_time)
    return StreamEvent(out, metrics=tm)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_ours_and_vllms_names_report_the_same_quantities():
    metrics = ServerMetrics("tiny")
    metrics.count("/v1/completions", 200)
    metrics.count("/v1/completions", 200)
    metrics.count("/v1/chat/completions", 400)
    # ids and strangers' paths are no labels of their own: the series stay bounded
    for path in ("/v1/responses/resp_1", "/v1/responses/resp_2", "/v1/models/org/model", "/random/1", "/random/2"):
        metrics.count(path, 404)
    metrics.observe(_final(40, 3, 32, [10.5, 10.55, 10.8], recomputed=5))
    metrics.observe(_final(20, 2, 0, [11.0, 11.2]))
    # aborts: their tokens count (vLLM counts them step by step), their latencies do not
    metrics.observe(_final(8, 1, 0, [12.0], reason="abort"))
    metrics.count_abort(_final(4, 2, 0, [12.0, 12.1]))  # a client gone mid-stream, its last event
    metrics.count_abort()  # gone before it ran
    stats = _stats(kv_blocks_total=64, kv_blocks_in_use=16, kv_blocks_peak_in_use=40, requests_running=2,
                   requests_waiting=3, pinned_blocks=5, evictions_total=7, preemptions_total=4, requests_total=9)
    text = metrics.render(stats).decode()
    s = _samples(text)
    model = (("engine", "0"), ("model_name", "tiny"))

    assert s[("asymcache_requests_total", (("endpoint", "/v1/completions"), ("model", "tiny"), ("status", "200")))] == 2
    assert s[("asymcache_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "tiny"),
                                           ("status", "400")))] == 1
    assert s[("asymcache_requests_total", (("endpoint", "/v1/responses/{response_id}"), ("model", "tiny"),
                                           ("status", "404")))] == 2
    assert s[("asymcache_requests_total", (("endpoint", "other"), ("model", "tiny"), ("status", "404")))] == 2
    assert s[("asymcache_requests_total", (("endpoint", "/v1/models/{model}"), ("model", "tiny"),
                                           ("status", "404")))] == 1
    assert not any(name == "asymcache_requests_total" and "resp_1" in str(labels) for name, labels in s)
    # token counters: ours and vLLM's agree
    assert s[("asymcache_prompt_tokens_total", ())] == s[("vllm:prompt_tokens_total", model)] == 72
    assert s[("vllm:prefix_cache_queries_total", model)] == 72
    assert s[("asymcache_cache_hit_tokens_total", ())] == s[("vllm:prefix_cache_hits_total", model)] == 32
    assert s[("asymcache_completion_tokens_total", ())] == s[("vllm:generation_tokens_total", model)] == 8
    assert s[("asymcache_recomputed_tokens_total", ())] == 5
    assert s[("asymcache_aborted_requests_total", ())] == 3
    # TTFT: one observation per finished request
    assert s[("asymcache_time_to_first_token_seconds_count", ())] == 2
    assert s[("asymcache_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5 + 1.0)
    # TPOT: one mean per request (vLLM's latency histograms come from the engine's records:
    # test_metrics_vllm_names.py; without that snapshot they are left out)
    assert s[("asymcache_time_per_output_token_seconds_count", ())] == 2
    assert s[("asymcache_time_per_output_token_seconds_sum", ())] == pytest.approx(0.15 + 0.2)
    assert not any(name.startswith(("vllm:time_to_first_token", "vllm:request_success")) for name, _ in s)
    # engine series from the snapshot
    assert s[("asymcache_kv_blocks_in_use", ())] == 16 and s[("asymcache_pinned_blocks", ())] == 5
    assert s[("asymcache_evictions_total", ())] == 7 and s[("asymcache_preemptions_total", ())] == 4
    assert s[("vllm:num_requests_running", model)] == 2 and s[("vllm:num_requests_waiting", model)] == 3
    assert s[("vllm:kv_cache_usage_perc", model)] == pytest.approx(0.25)
    assert s[("vllm:num_preemptions_total", model)] == 4
    assert ("asymcache_kv_blocks_peak_in_use", ()) not in s and ("asymcache_requests_total", ()) not in s
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["asymcache_evictions"] == "counter" and types["asymcache_kv_blocks_total"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge" and types["vllm:num_preemptions"] == "counter"
    # a later snapshot replaces the earlier one
    s2 = _samples(metrics.render(_stats(kv_blocks_total=64, kv_blocks_in_use=64)).decode())
    assert s2[("vllm:kv_cache_usage_perc", model)] == 1.0 and s2[("asymcache_pinned_blocks", ())] == 0


def test_each_app_has_its_own_registry():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.count("/v1/models", 200)
    a.observe(_final(10, 2, 0, [1.0, 1.1]))
    sb = _samples(b.render(_stats(kv_blocks_total=1)).decode())
    assert ("asymcache_requests_total", (("endpoint", "/v1/models"), ("model", "b"), ("status", "200"))) not in sb
    assert sb[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "b")))] == 0
    sa = _samples(a.render(_stats(kv_blocks_total=1)).decode())
    assert sa[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "a")))] == 10
    assert sa[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "a")))] == 0.0
    # an engine without blocks reads as 0 % used, not a division error
    empty = _samples(a.render(_stats()).decode())
    assert empty[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "a")))] == 0.0


def test_the_host_tier_series():
    stats = _stats(host_kv_blocks_total=4096, host_kv_blocks_cached=100, host_offloaded_blocks_total=300,
                   host_reloaded_blocks_total=120, host_prefetched_blocks_total=7,
                   host_recompute_chosen_blocks_total=3, host_bytes_to_device_total=120 * 2**21,
                   engine_reload_tokens_total=1808)
    text = ServerMetrics("tiny").render(stats).decode()
    s = _samples(text)
    assert s[("asymcache_host_kv_blocks_total", ())] == 4096  # a size: a gauge although named _total
    assert "# TYPE asymcache_host_kv_blocks_total gauge" in text
    assert s[("asymcache_host_kv_blocks_cached", ())] == 100
    assert s[("asymcache_host_offloaded_blocks_total", ())] == 300
    assert s[("asymcache_host_reloaded_blocks_total", ())] == 120
    assert s[("asymcache_host_prefetched_blocks_total", ())] == 7
    assert s[("asymcache_host_recompute_chosen_blocks_total", ())] == 3
    assert s[("asymcache_host_bytes_to_device_total", ())] == 120 * 2**21
    assert s[("asymcache_engine_reload_tokens_total", ())] == 1808


def test_the_order_slack_gauge():
    # a stated time-to-first-token target: the slack program order has now
    s = _samples(ServerMetrics("tiny").render(_stats(order_slack_seconds=2.5)).decode())
    assert s[("asymcache_order_slack_seconds", ())] == 2.5
    # none stated: no bound, exported as +Inf
    s = _samples(ServerMetrics("tiny").render(_stats(order_slack_seconds=float("inf"))).decode())
    assert s[("asymcache_order_slack_seconds", ())] == float("inf")


def test_the_job_gate_capacity_gauge():
    # what job-level admission admits jobs against now (it grows with a host tier as jobs pause)
    text = ServerMetrics("tiny").render(_stats(job_gate_capacity_tokens=1250)).decode()
    assert _samples(text)[("asymcache_job_gate_capacity_tokens", ())] == 1250
    assert "# TYPE asymcache_job_gate_capacity_tokens gauge" in text
