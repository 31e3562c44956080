"""/metrics under vLLM 0.32's names: finished requests by ``finished_reason``, and the histograms
of TTFT, inter-token latency, queue time, prompt and generation tokens per request and tokens
per engine step (with the deprecated aliases of the earlier names), checked against the
engine's own records of the requests and steps that ran: on a simulated engine (exact virtual
times) and over HTTP on the real SmolLM2 (a stop, lengths, an error and a client gone)."""

from __future__ import annotations

import ast
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.metrics import ServerMetrics
from asymcache_core import Engine, SamplingParams
from asymcache_core.jump_forward import PositionForcing
from asymcache_core.request import RequestOutput
from asymcache_core.serving_stats import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    request_tokens_buckets,
)
from tests.agent_runtime.live_server import MODEL, serving
from tests.conftest import StepClock, make_engine

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LABELS = (("engine", "0"), ("model_name", "tiny"))
REASONS = ("stop", "length", "abort", "error", "repetition")


def _parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Samples by (name, sorted labels), and each family's type by its name."""
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def _buckets(s: Samples, name: str, labels: tuple[tuple[str, str], ...]) -> dict[float, float]:
    """``le`` -> cumulative count of one histogram."""
    out = {}
    for (sample, sample_labels), value in s.items():
        if sample == f"{name}_bucket":
            rest = tuple(kv for kv in sample_labels if kv[0] != "le")
            if rest == labels:
                out[float(dict(sample_labels)["le"])] = value
    return out


def _check_histogram(s: Samples, name: str, values: list[float], bounds: tuple[float, ...],
                     labels: tuple[tuple[str, str], ...] = LABELS) -> None:
    """The histogram holds exactly ``values``: count, sum, and each bucket's ``value <= le`` count."""
    assert s[(f"{name}_count", labels)] == len(values), name
    assert s[(f"{name}_sum", labels)] == pytest.approx(sum(values), abs=1e-9), name
    got = _buckets(s, name, labels)
    assert sorted(got) == [*map(float, bounds), float("inf")], name
    for le, cumulative in got.items():
        assert cumulative == sum(1 for v in values if v <= le), (name, le)


def _run(engine: Engine, finals: dict[str, RequestOutput], until: Callable[[], bool]) -> None:
    """Steps the engine until ``until()``, keeping the final outputs by request id in ``finals``."""
    for _ in range(10_000):
        if until():
            return
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not get there")


def test_vllm_series_hold_the_engines_requests_and_steps():
    """Simulated engine (virtual clock, two running at a time so that three wait): three length
    finishes, a stop, and a client abort mid-stream; every value is the engine's own record's."""
    probe = Engine.simulated(model="dummy:tiny", num_kv_blocks=400, block_size=8)
    stop_prompt = list(range(300, 317))
    (first,) = probe.generate([stop_prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=400, block_size=8, max_num_seqs=2)
    # distinct first tokens: no prompt is a cache hit of another (every step's tokens are computed)
    prompts = {"a": list(range(10, 34)), "b": list(range(40, 53)), "c": list(range(60, 91)),
               "stop": stop_prompt, "gone": list(range(200, 220))}
    max_tokens = {"a": 5, "b": 7, "c": 3, "gone": 50}
    rids = {}
    for key, prompt in prompts.items():
        params = (SamplingParams(max_tokens=10, stop_token_ids=(first.token_ids[0],)) if key == "stop"
                  else SamplingParams(max_tokens=max_tokens[key], ignore_eos=True))
        rids[key] = engine.add_request(prompt, params, request_id=key)
    # the client of "gone" leaves once it has 4 tokens
    finals: dict[str, RequestOutput] = {}
    _run(engine, finals, lambda: len(engine.requests["gone"].output_token_ids) >= 4)
    assert engine.abort("gone")
    _run(engine, finals, lambda: len(finals) == len(prompts))
    assert {k: finals[k].finish_reason for k in prompts} == {
        "a": "length", "b": "length", "c": "length", "stop": "stop", "gone": "abort"}
    assert len(finals["stop"].token_ids) == 1
    finished = [finals[k] for k in ("a", "b", "c", "stop")]
    everyone = [*finished, finals["gone"]]
    assert any(o.metrics.first_scheduled_time > o.metrics.arrival_time for o in finished)  # some waited

    text = ServerMetrics("tiny").render(engine.stats(), engine.serving_stats.snapshot()).decode()
    s, types = _parse(text)
    # finished requests by reason: the client's abort is none of vLLM's finished requests
    for reason in REASONS:
        want = {"length": 3, "stop": 1}.get(reason, 0)
        key = ("vllm:request_success_total", (*LABELS[:1], ("finished_reason", reason), *LABELS[1:]))
        assert s[key] == want, reason
    assert types["vllm:request_success"] == "counter"
    # iteration-level series count every request (the aborted one too, as vLLM's step by step)
    _check_histogram(s, "vllm:time_to_first_token_seconds",
                     [o.metrics.first_token_time - o.metrics.arrival_time for o in everyone],
                     TIME_TO_FIRST_TOKEN_BUCKETS)
    itl = [b - a for o in everyone for a, b in itertools.pairwise(o.metrics.token_times)]
    assert len(itl) == sum(len(o.token_ids) - 1 for o in everyone)
    _check_histogram(s, "vllm:inter_token_latency_seconds", itl, INTER_TOKEN_LATENCY_BUCKETS)
    # the deprecated alias: the same observations under the earlier name and labels
    _check_histogram(s, "vllm:time_per_output_token_seconds", itl, INTER_TOKEN_LATENCY_BUCKETS,
                     labels=(("model_name", "tiny"),))
    # request-level series count the finished ones
    m = [o.metrics for o in finished]
    _check_histogram(s, "vllm:e2e_request_latency_seconds", [x.finish_time - x.arrival_time for x in m],
                     REQUEST_LATENCY_BUCKETS)
    _check_histogram(s, "vllm:request_queue_time_seconds",
                     [x.first_scheduled_time - x.arrival_time for x in m], REQUEST_LATENCY_BUCKETS)
    _check_histogram(s, "vllm:request_prefill_time_seconds",
                     [x.first_token_time - x.first_scheduled_time for x in m], REQUEST_LATENCY_BUCKETS)
    _check_histogram(s, "vllm:request_decode_time_seconds",
                     [x.token_times[-1] - x.first_token_time for x in m], REQUEST_LATENCY_BUCKETS)
    _check_histogram(s, "vllm:request_inference_time_seconds",
                     [x.token_times[-1] - x.first_scheduled_time for x in m], REQUEST_LATENCY_BUCKETS)
    _check_histogram(s, "vllm:request_time_per_output_token_seconds",
                     [(x.token_times[-1] - x.first_token_time) / (len(x.token_times) - 1) if len(x.token_times) > 1
                      else 0.0 for x in m], INTER_TOKEN_LATENCY_BUCKETS)
    tokens = request_tokens_buckets(engine.max_model_len)
    _check_histogram(s, "vllm:request_prompt_tokens", [len(prompts[k]) for k in ("a", "b", "c", "stop")], tokens)
    _check_histogram(s, "vllm:request_generation_tokens", [5, 7, 3, 1], tokens)
    _check_histogram(s, "vllm:request_num_preemptions", [0, 0, 0, 0], (1, 2, 3, 4, 5, 10, 20))
    # tokens per step: every step the engine logged; in all, each request's prompt and every
    # generated token but its last (never fed back), nothing cached
    steps = [st.num_tokens for st in engine.step_log]
    _check_histogram(s, "vllm:iteration_tokens_total", steps, ITERATION_TOKENS_BUCKETS)
    assert sum(steps) == sum(len(prompts[k]) + len(finals[k].token_ids) - 1 for k in prompts)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
                 "vllm:time_per_output_token_seconds"):
        assert types[name] == "histogram", name


def test_kv_usage_and_the_deprecated_gauge():
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=64, block_size=8)
    engine.add_request(list(range(40)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    s, types = _parse(ServerMetrics("tiny").render(engine.stats(), engine.serving_stats.snapshot()).decode())
    used = engine.stats().kv_blocks_in_use / 64
    assert used > 0
    earlier = s[("vllm:gpu_cache_usage_perc", (("model_name", "tiny"),))]
    assert s[("vllm:kv_cache_usage_perc", LABELS)] == earlier == used
    assert s[("vllm:num_requests_running", LABELS)] == 1
    assert types["vllm:kv_cache_usage_perc"] == types["vllm:gpu_cache_usage_perc"] == "gauge"


def _vllm_buckets() -> dict[str, tuple[float, ...]]:
    """vLLM 0.32's default bucket constants, read from its source beside this checkout."""
    root = Path(__file__).resolve().parents[2]
    found = sorted(root.glob(".venv-vllm/lib/python3*/site-packages/vllm/v1/metrics/buckets.py"))
    if not found:
        pytest.skip("no vLLM beside this checkout (.venv-vllm) to compare with")
    out = {}
    for node in ast.parse(found[0].read_text()).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            if node.target.id.endswith("_BUCKETS"):
                out[node.target.id] = tuple(ast.literal_eval(node.value))
    return out


def test_bucket_boundaries_are_vllms():
    theirs = _vllm_buckets()
    assert theirs["REQUEST_LATENCY_BUCKETS"] == REQUEST_LATENCY_BUCKETS
    assert theirs["TIME_TO_FIRST_TOKEN_BUCKETS"] == TIME_TO_FIRST_TOKEN_BUCKETS
    assert theirs["INTER_TOKEN_LATENCY_BUCKETS"] == INTER_TOKEN_LATENCY_BUCKETS
    assert theirs["ITERATION_TOKENS_BUCKETS"] == ITERATION_TOKENS_BUCKETS
    assert theirs["REQUEST_NUM_PREEMPTIONS_BUCKETS"] == (1, 2, 3, 4, 5, 10, 20)
    # vLLM's build_1_2_5_buckets(max_model_len)
    assert request_tokens_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert request_tokens_buckets(1) == (1,)


class ForcedRuns(PositionForcing):
    """Forces output positions 1-3 and 6-8 to fixed tokens (a grammar's fixed text)."""

    def forced_at(self, position: int) -> int | None:
        return 1000 + position if position % 5 in (1, 2, 3) and position < 10 else None


def test_forced_tokens_are_no_inter_token_interval_of_their_own(smollm):
    """Jump-forward appends a run of forced tokens in the step that sampled the token before
    them: vLLM observes one inter-token latency per step that gave a request tokens, not one
    per token (a zero interval each)."""
    engine = make_engine(smollm, clock=StepClock())
    (out,) = engine.generate([list(range(300, 340))], SamplingParams(
        max_tokens=12, ignore_eos=True, logits_processors=(ForcedRuns(),)))
    assert engine.stats().engine_jump_forward_tokens_total == 6 and len(out.token_ids) == 12
    steps = sorted(set(out.metrics.token_times))
    assert len(steps) == 12 - 6  # the forced runs came with their steps
    snap = engine.serving_stats.snapshot()
    assert snap.inter_token_latency.count == len(steps) - 1
    assert snap.inter_token_latency.total == pytest.approx(steps[-1] - steps[0])
    assert snap.time_per_output_token.total == pytest.approx((steps[-1] - steps[0]) / 11)
    assert snap.generation_tokens.total == 12 and snap.finished["length"] == 1
    # every step computed its tokens: the prompt, then each sampled token with the run after it
    assert snap.iteration_tokens.count == len(engine.step_log)
    assert snap.iteration_tokens.total == 40 + 12 - 1


def _raise_on_third_token(output_ids: list[int], logits):
    """A logits processor that fails the request when it samples its third token."""
    if len(output_ids) == 2:
        raise RuntimeError("processor failed")
    return logits


def test_over_http_on_the_real_model(smollm):
    """Live server over SmolLM2: two length finishes, a stop and a request that failed alone
    (an error) change the finish-reason counter and the per-request histograms by exactly
    them; a client gone mid-stream counts its time to first token only."""
    engine = make_engine(smollm, max_model_len=1024)
    prompts = {"len1": list(range(1000, 1030)), "len2": list(range(2000, 2017)), "stop": list(range(3000, 3021)),
               "error": list(range(4000, 4012)), "gone": list(range(5000, 5025))}
    # the stop request ends on its greedy first token (read off a probe, whose blocks are then dropped)
    (probe,) = engine.generate([prompts["stop"]], SamplingParams(max_tokens=1, temperature=0.0))
    engine.reset_prefix_cache()
    runtime = AgentRuntime(engine)

    def on_engine(fn):
        return runtime.call_threadsafe(fn).result(timeout=60)

    def wait_idle() -> None:
        deadline = time.monotonic() + 120
        while on_engine(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline, "requests kept running"
            time.sleep(0.05)

    try:
        with serving(create_app(runtime, MODEL)) as base:
            def scrape() -> Samples:
                return _parse(httpx.get(f"{base}/metrics", timeout=30).text)[0]

            labels = (("engine", "0"), ("model_name", MODEL))
            before, steps_before = scrape(), on_engine(lambda e: len(e.step_log))
            usage = {}
            for key, extra in (("len1", {"max_tokens": 4, "ignore_eos": True}),
                               ("len2", {"max_tokens": 6, "ignore_eos": True}),
                               ("stop", {"max_tokens": 8, "temperature": 0.0,
                                         "stop_token_ids": [probe.token_ids[0]]})):
                r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompts[key], **extra},
                               timeout=120)
                assert r.status_code == 200, r.text
                usage[key] = r.json()["usage"]
                assert r.json()["choices"][0]["finish_reason"] == ("stop" if key == "stop" else "length")
            assert usage["stop"]["completion_tokens"] == 1
            # a request that fails alone in the engine (its sampler raised): vLLM's "error"
            on_engine(lambda e: e.add_request(prompts["error"], SamplingParams(
                max_tokens=10, ignore_eos=True, logits_processors=(_raise_on_third_token,)), request_id="err"))
            wait_idle()
            after, steps_after = scrape(), on_engine(lambda e: len(e.step_log))

            def delta(name: str, extra: tuple[tuple[str, str], ...] = ()) -> float:
                key = (name, tuple(sorted((*labels, *extra))))
                return after[key] - before[key]

            want = {"length": 2, "stop": 1, "error": 1}
            for reason in REASONS:
                assert delta("vllm:request_success_total", (("finished_reason", reason),)) == want.get(reason, 0)
            generated = {k: u["completion_tokens"] for k, u in usage.items()} | {"error": 2}
            assert generated == {"len1": 4, "len2": 6, "stop": 1, "error": 2}
            done = ("len1", "len2", "stop", "error")
            assert delta("vllm:request_prompt_tokens_count") == 4
            assert delta("vllm:request_prompt_tokens_sum") == sum(len(prompts[k]) for k in done)
            assert sum(usage[k]["prompt_tokens"] for k in usage) == sum(len(prompts[k]) for k in usage)
            assert delta("vllm:request_generation_tokens_sum") == sum(generated.values())
            for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                         "vllm:request_queue_time_seconds", "vllm:request_generation_tokens"):
                assert delta(f"{name}_count") == 4, name
            assert delta("vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in generated.values())
            old = (("model_name", MODEL),)
            assert (after[("vllm:time_per_output_token_seconds_count", old)]
                    == after[("vllm:inter_token_latency_seconds_count", labels)])
            # steps: one observation each; tokens: each prompt and every token fed back (the
            # failed request's third step ran before its sampler raised)
            assert delta("vllm:iteration_tokens_total_count") == steps_after - steps_before > 0
            assert delta("vllm:iteration_tokens_total_sum") == (
                sum(len(prompts[k]) + generated[k] - 1 for k in ("len1", "len2", "stop"))
                + len(prompts["error"]) + generated["error"])

            # a client gone mid-stream: its TTFT counts (vLLM observes it when it comes), it is
            # no finished request
            body = {"model": MODEL, "prompt": prompts["gone"], "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        break  # leaving the block closes the connection mid-stream
            wait_idle()
            before, after = after, scrape()
            for reason in REASONS:
                assert delta("vllm:request_success_total", (("finished_reason", reason),)) == 0
            assert delta("vllm:request_prompt_tokens_count") == delta("vllm:e2e_request_latency_seconds_count") == 0
            assert delta("vllm:time_to_first_token_seconds_count") == 1
    finally:
        runtime.close_sync()
