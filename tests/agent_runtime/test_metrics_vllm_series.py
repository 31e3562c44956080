"""/metrics: vLLM 0.32's per-request series of request parameters and prefill work
(``vllm:request_params_n``, ``vllm:request_max_num_generation_tokens``,
``vllm:request_params_max_tokens``, ``vllm:request_prefill_kv_computed_tokens``) and its rule
for ``vllm:request_success_total{finished_reason}``: the reason its output processor settles
on after detokenizing. Every check is a delta of the live server's scrape around real requests
on the real SmolLM2 (the module's ``live`` server, ``max_model_len`` 1024)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asymcache_core.serving_stats import REQUEST_PARAMS_N_BUCKETS, request_tokens_buckets
from tests.agent_runtime.live_server import MODEL, Live

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LABELS = (("engine", "0"), ("model_name", MODEL))
MAX_MODEL_LEN = 1024  # the live fixture's
TOKENS_BUCKETS = request_tokens_buckets(MAX_MODEL_LEN)
NEW_SERIES = {
    "vllm:request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "vllm:request_max_num_generation_tokens": TOKENS_BUCKETS,
    "vllm:request_params_max_tokens": TOKENS_BUCKETS,
    "vllm:request_prefill_kv_computed_tokens": TOKENS_BUCKETS,
}


def _scrape(live: Live) -> tuple[Samples, dict[str, str]]:
    """Samples by (name, sorted labels), and each family's type."""
    r = httpx.get(f"{live.base}/metrics", timeout=30)
    assert r.status_code == 200
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


class Delta:
    """What changed in the scrape between :meth:`start` and :meth:`stop`."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.before: Samples = {}
        self.after: Samples = {}

    def start(self) -> None:
        _wait_idle(self.live)
        self.before = _scrape(self.live)[0]

    def stop(self) -> None:
        _wait_idle(self.live)
        self.after = _scrape(self.live)[0]

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted((*LABELS, *labels.items()))))
        return self.after[key] - self.before.get(key, 0.0)

    def observed(self, name: str) -> tuple[int, float, dict[float, int]]:
        """The count, sum and per-bucket counts (not cumulative) a histogram gained."""
        cumulative = {float(le): self(f"{name}_bucket", le=le) for le in _le_labels(self.after, name)}
        bounds = sorted(cumulative)
        per_bucket = {b: int(cumulative[b] - (cumulative[bounds[i - 1]] if i else 0)) for i, b in enumerate(bounds)}
        return int(self(f"{name}_count")), self(f"{name}_sum"), per_bucket


def _le_labels(samples: Samples, name: str) -> list[str]:
    return [dict(labels)["le"] for (sample, labels), _ in samples.items()
            if sample == f"{name}_bucket" and dict(labels).get("model_name") == MODEL]


def _bucket_of(value: float, bounds: tuple[float, ...]) -> float:
    """The ``le`` bound a value is counted under (Prometheus's ``value <= le``)."""
    return float(next((b for b in bounds if value <= b), float("inf")))


def _expect(delta: Delta, name: str, values: list[float]) -> None:
    """The histogram gained exactly ``values``: count, sum and each one's bucket."""
    count, total, per_bucket = delta.observed(name)
    assert count == len(values), (name, count, values)
    assert total == pytest.approx(sum(values)), (name, total, values)
    want: dict[float, int] = {}
    for v in values:
        le = _bucket_of(v, NEW_SERIES[name])
        want[le] = want.get(le, 0) + 1
    assert {le: n for le, n in per_bucket.items() if n} == want, name


def _wait_idle(live: Live) -> None:
    deadline = time.monotonic() + 60
    while live.engine(lambda e: e.has_unfinished()):
        assert time.monotonic() < deadline, "requests kept running"
        time.sleep(0.05)


def _post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.base}{path}", json={"model": MODEL, **body}, timeout=120)


@pytest.fixture
def delta(live: Live) -> Iterator[Delta]:
    yield Delta(live)
    live.check()


def test_the_series_have_vllms_names_types_labels_and_buckets(live):
    # NOTE: before any request: vLLM exports them from the start, empty
    samples, types = _scrape(live)
    for name, bounds in NEW_SERIES.items():
        assert types[name] == "histogram", name
        assert sorted(float(le) for le in _le_labels(samples, name)) == [*map(float, bounds), float("inf")], name
        assert (f"{name}_count", LABELS) in samples, name
    assert REQUEST_PARAMS_N_BUCKETS == (1, 2, 5, 10, 20)  # vllm/v1/metrics/buckets.py


def test_per_choice_series_of_completions(live, delta):
    """``request_params_max_tokens`` and ``request_prefill_kv_computed_tokens``: one observation
    per finished choice (vLLM's finished requests): its max_tokens, and its prompt less its cache
    hits; a repeated prompt computes only what the cache did not hold."""
    prompt = list(range(6000, 6040))
    delta.start()
    first = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
    again = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 7, "ignore_eos": True})
    delta.stop()
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again)]
    assert cached[0] == 0 and 0 < cached[1] < len(prompt)  # the second reused the first's full blocks
    _expect(delta, "vllm:request_params_max_tokens", [5, 7])
    _expect(delta, "vllm:request_prefill_kv_computed_tokens", [len(prompt) - c for c in cached])
    # one choice each: n 1, and the tokens it generated
    _expect(delta, "vllm:request_params_n", [1, 1])
    _expect(delta, "vllm:request_max_num_generation_tokens", [5, 7])


def test_a_chat_without_max_tokens_observes_the_rest_of_the_context(live, delta):
    """vLLM's server states a chat's default ``max_tokens``: the rest of the context."""
    delta.start()
    r = _post(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0, "stop": [" ", ".", "\n", ","]})
    delta.stop()
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    _expect(delta, "vllm:request_params_max_tokens", [MAX_MODEL_LEN - prompt_tokens])
    _expect(delta, "vllm:request_params_n", [1])


def test_n_and_the_longest_choice_once_per_prompt(live, delta):
    """``n`` choices of each prompt are one of vLLM's parent requests: ``request_params_n``
    observes n once, ``request_max_num_generation_tokens`` the longest of its choices (random
    lengths here: sampled at temperature 1 with stop strings); the per-choice series count each."""
    prompts = [list(range(7000, 7020)), list(range(7100, 7130))]
    delta.start()
    r = _post(live, "/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 7,
                                         "stop": [".", "\n"], "return_token_ids": True})
    delta.stop()
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    lengths = [len(c["token_ids"]) for c in choices]
    assert len(lengths) == 6
    _expect(delta, "vllm:request_params_n", [3, 3])
    _expect(delta, "vllm:request_max_num_generation_tokens", [max(lengths[:3]), max(lengths[3:])])
    _expect(delta, "vllm:request_params_max_tokens", [12] * 6)
    assert delta("vllm:request_success_total", finished_reason="stop") + delta(
        "vllm:request_success_total", finished_reason="length") == 6


def test_streamed_choices_and_one_choice_routes(live, delta):
    """A streamed chat with n 2 is one parent; /v1/messages and /v1/responses requests are
    parents of one choice each."""
    delta.start()
    body = {"messages": [{"role": "user", "content": "Count."}], "n": 2, "max_tokens": 4, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120) as s:
        assert s.status_code == 200
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"
    msg = _post(live, "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    resp = _post(live, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "store": False})
    delta.stop()
    assert msg.status_code == 200 and resp.status_code == 200, (msg.text, resp.text)
    generated = [msg.json()["usage"]["output_tokens"], resp.json()["usage"]["output_tokens"]]
    _expect(delta, "vllm:request_params_n", [2, 1, 1])
    _expect(delta, "vllm:request_max_num_generation_tokens", [4, *generated])


def test_a_client_gone_is_no_parent_request(live, delta):
    """A streamed request the client leaves is aborted: no finished request, no parent."""
    delta.start()
    body = {"model": MODEL, "prompt": list(range(8000, 8020)), "n": 2, "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/completions", json=body, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break
    delta.stop()
    for name in NEW_SERIES:
        assert delta.observed(name)[0] == 0, name
    assert delta("vllm:request_success_total", finished_reason="abort") == 0


def _greedy(live: Live, prompt: list[int], n: int) -> list[int]:
    r = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_stop_string_in_the_last_tokens_text_counts_as_stop(live, delta):
    """The scheduler finishes a request at its max_tokens before its last token is decoded; a
    stop string in that token's text makes it a ``stop`` (vLLM's output processor settles the
    reason after detokenizing), in the counter as in the response."""
    tokenizer = live.engine(lambda e: e.tokenizer)
    for start in range(9000, 9400, 40):
        prompt = list(range(start, start + 20))
        ids = _greedy(live, prompt, 4)
        head, text = tokenizer.decode(ids[:3]), tokenizer.decode(ids)
        stop = text[len(head):].strip() if text.startswith(head) else ""
        if stop and stop not in head:
            break
    else:
        pytest.fail("no prompt whose 4th greedy token's text is a fresh stop string")
    live.engine(lambda e: e.reset_prefix_cache())  # the same numbers as the probe's
    delta.start()
    r = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                         "stop": [stop]})
    delta.stop()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 0


class _FailingDecode:
    """The engine's tokenizer, whose decode fails on one token (a detokenizer fault); it offers
    no Rust backend, so that every step decodes through :meth:`decode`."""

    backend_tokenizer = None

    def __init__(self, tokenizer: Any, token: int) -> None:
        self._tokenizer = tokenizer
        self._token = token

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        if self._token in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_a_request_that_fails_after_it_stopped_counts_as_error(live, delta):
    """A request the scheduler finished at its max_tokens whose last token then fails to
    decode: its client gets the error (a 500), so it is vLLM's ``error`` (its documented reason
    of a request-level failure, always a 500), not the ``length`` it was first counted under."""
    for start in range(10_000, 10_400, 40):
        prompt = list(range(start, start + 20))
        ids = _greedy(live, prompt, 3)
        if len(ids) == 3 and ids[2] not in ids[:2]:
            break
    else:
        pytest.fail("no prompt whose 3rd greedy token is new")
    live.engine(lambda e: e.reset_prefix_cache())
    real = live.engine(lambda e: e.tokenizer)

    def install(engine: Any) -> None:
        engine.tokenizer = _FailingDecode(real, ids[2])

    live.engine(install)
    try:
        delta.start()
        r = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        delta.stop()
    finally:
        live.engine(lambda e: setattr(e, "tokenizer", real))
    assert r.status_code == 500, r.text
    assert "detokenizing failed" in json.dumps(r.json())
    assert delta("vllm:request_success_total", finished_reason="error") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 0
    # a finished request of vLLM's all the same: its per-request series count it
    _expect(delta, "vllm:request_params_max_tokens", [3])
    _expect(delta, "vllm:request_prefill_kv_computed_tokens", [len(prompt)])
