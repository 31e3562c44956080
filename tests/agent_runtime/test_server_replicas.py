"""Two SmolLM2 engine replicas on a local Ray Serve cluster behind one endpoint: the single
server's routes and error bodies, job affinity under a multi-turn agent load (with cache hits
on the job's replica), new jobs spread, and a replica killed mid-request (replaced; its request
retried elsewhere, its jobs' next turns served)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from agent_runtime.server.app import ServeOptions  # noqa: E402
from agent_runtime.server.metrics import merge_expositions  # noqa: E402
from agent_runtime.server.replicas import (  # noqa: E402
    APP_NAME,
    ENGINE_DEPLOYMENT,
    REPLICA_HEADER,
    Gateway,
    ReplicaSettings,
    build_app,
    failed_stream_tail,
)

MODEL = "smollm2-135m"
SYSTEM = "You are a terse agent. Answer in a few words."
#: Tokens of the turn in flight when its replica is killed: a few seconds of decode steps on
#: this CPU, long enough for the kill to land mid-turn (the test waits until it runs).
LONG_TURN = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    """One local Ray cluster for the module, serving two replicas."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ServeOptions(model=MODEL, num_kv_blocks=96, max_model_len=1024)
        settings = ReplicaSettings(num_replicas=2, routing_stats_period_s=0.5, health_check_period_s=1.0,
                                   health_check_timeout_s=20.0)
        serve.run(build_app(options, settings), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, timeout=120) as c:
        yield c


def _replica_metrics(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(response.text) for s in f.samples}


def _per_replica(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["replica"]: v for (n, labels), v in samples.items() if n == name and "replica" in dict(labels)}


def _chat(client: httpx.Client, messages: list[dict[str, Any]], job: str | None, max_tokens: int = 6,
          **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}
    if job is not None:
        body["job_id"] = job
    return client.post("/v1/chat/completions", json=body)


def _run_job(client: httpx.Client, job: str | None, task: str, turns: int = 3) -> list[tuple[str, int]]:
    """One agent job: ``turns`` turns, each adding the reply and a tool result; (replica, cached) per turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    seen = []
    for turn in range(turns):
        response = _chat(client, messages, job, is_last_step=turn == turns - 1)
        assert response.status_code == 200, response.text
        body = response.json()
        seen.append((response.headers[REPLICA_HEADER], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        messages += [body["choices"][0]["message"], {"role": "user", "content": f"Tool output {turn}: ok."}]
    return seen


def test_routes_and_error_bodies_are_the_single_servers(client: httpx.Client):
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    wrong = _chat(client, [{"role": "user", "content": "hi"}], None, model="other")
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    bad = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    text = client.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is", "max_tokens": 4})
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] == 4
    with client.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 5,
        "stream": True, "stream_options": {"include_usage": True},
    }) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and '"completion_tokens": 5' in frames[-2]


def test_request_ids_through_ray_serve_s_proxy(client: httpx.Client):
    # the proxy adds an x-request-id to a request without one: it must not replace the body's
    # request_id, while a client's header still names the completion (vLLM's order)
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 2, "request_id": "body-7"}
    named = client.post("/v1/completions", json=body)
    assert named.status_code == 200 and named.json()["id"] == "cmpl-body-7", named.text
    assert len(named.headers.get_list("x-request-id")) == 1  # the proxy's, not a second one
    headed = client.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr-7"})
    assert headed.json()["id"] == "cmpl-hdr-7"
    assert headed.headers.get_list("x-request-id") == ["hdr-7"]
    bare = client.post("/v1/completions", json={k: v for k, v in body.items() if k != "request_id"})
    assert bare.json()["id"] == "cmpl-" + bare.headers["x-request-id"]  # the proxy's names it


def test_jobs_keep_their_replica_and_hit_its_cache(client: httpx.Client):
    tasks = {f"job-{i}": f"Task {i}: name a {word}." for i, word in enumerate(("color", "fruit", "planet", "tree"))}
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = dict(zip(tasks, pool.map(lambda kv: _run_job(client, *kv), tasks.items()), strict=True))
    # a conversation without a job id is kept by its prefix
    runs["no-job-id"] = _run_job(client, None, "Task 9: name a river.")
    for job, turns in runs.items():
        replicas = {replica for replica, _ in turns}
        assert len(replicas) == 1, (job, turns)
        assert all(cached > 0 for _, cached in turns[1:]), (job, turns)
    homes = {turns[0][0] for job, turns in runs.items() if job.startswith("job-")}
    assert len(homes) == 2, runs  # new jobs spread over both replicas
    samples = _replica_metrics(client)
    hits = _per_replica(samples, "asymcache_cache_hit_tokens_total")
    assert set(hits) == homes and all(hits[r] > 0 for r in homes), hits
    assert samples[("asymcache_replicas", ())] == 2
    assert samples[("asymcache_router_decisions_total", (("reason", "affinity"),))] >= 10


def _run_chain(client: httpx.Client, task: str, turns: int = 3) -> list[tuple[str, int]]:
    """One Responses API chain: each turn continues the last stored response by its id only;
    (replica, cached) per turn, and each response read back by id."""
    seen, previous = [], None
    for turn in range(turns):
        body: dict[str, Any] = {"model": MODEL, "instructions": SYSTEM, "max_output_tokens": 6,
                                "input": task if previous is None else f"Tool output {turn}: ok."}
        if previous is not None:
            body["previous_response_id"] = previous
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        previous = response.json()["id"]
        seen.append((response.headers[REPLICA_HEADER], response.json()["usage"]["input_tokens_details"]["cached_tokens"]))
        read = client.get(f"/v1/responses/{previous}")
        assert read.status_code == 200 and read.json()["id"] == previous, read.text
        assert read.headers[REPLICA_HEADER] == seen[-1][0]
    return seen


def test_stored_response_chains_stay_where_they_are_stored(client: httpx.Client):
    tasks = [f"Task {i}: name a {word}." for i, word in enumerate(("bird", "metal", "river", "city"))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(lambda task: _run_chain(client, task), tasks))
    for turns in runs:
        assert len({replica for replica, _ in turns}) == 1, runs
        assert all(cached > 0 for _, cached in turns[1:]), runs
    assert len({turns[0][0] for turns in runs}) == 2, runs  # new chains spread over both replicas


def test_a_cache_reset_reaches_every_replica(client: httpx.Client):
    # NOTE: after the chains above both replicas hold cached blocks; the gateway sums their answers
    reset = client.post("/reset_prefix_cache")
    assert reset.status_code == 200, reset.text
    body = reset.json()
    assert body["success"] is True and body["replicas"] == 2 and body["device_blocks"] > 0
    again = client.post("/flush_cache").json()
    assert again["replicas"] == 2 and again["device_blocks"] == 0
    bad = client.post("/reset_prefix_cache?reset_external=perhaps")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_external", bad.text


def _kill(replica: str) -> None:
    from ray.serve._private.common import DeploymentID

    name = ReplicaID(replica, DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP_NAME)).to_full_id_str()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _engine_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


def test_a_killed_replica_is_replaced_and_its_jobs_continue(client: httpx.Client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task K: list some numbers."}]
    first = _chat(client, messages, "job-k")
    assert first.status_code == 200
    victim = first.headers[REPLICA_HEADER]
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Continue the list."}]
    # a long turn in flight on the victim when it is killed: retried on another replica, not lost
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "r", _chat(client, messages, "job-k", max_tokens=LONG_TURN, ignore_eos=True)))
    worker.start()
    deadline = time.monotonic() + 30
    while _per_replica(_replica_metrics(client), "vllm:num_requests_running").get(victim, 0) < 1:
        assert time.monotonic() < deadline and worker.is_alive(), "the long turn never ran on its replica"
        time.sleep(0.05)
    _kill(victim)
    worker.join(timeout=120)
    retried = result["r"]
    assert retried.status_code == 200, retried.text
    assert retried.headers[REPLICA_HEADER] != victim
    assert retried.json()["usage"]["completion_tokens"] == LONG_TURN
    assert _replica_metrics(client)[("asymcache_gateway_retries_total", ())] >= 1  # it was sent twice
    # the job's next turn is served, on a live replica
    messages += [retried.json()["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
    after = _chat(client, messages, "job-k")
    assert after.status_code == 200 and after.headers[REPLICA_HEADER] != victim
    # Ray Serve brings the deployment back to two replicas, and the endpoint keeps answering
    # NOTE: a liveness bound, not a speed check: a replacement is Ray's health-check period, an
    # actor start and an engine load, past 60 s on a 2-core machine busy with other work
    deadline = time.monotonic() + 180
    while _engine_replicas() < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    assert client.get("/health").json() == {"status": "ok"}


def test_a_job_whose_replica_is_gone_is_counted_as_such(client: httpx.Client):
    gone_key = ("asymcache_router_decisions_total", (("reason", "replica_gone"),))
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Task G: name a river."},
    ]
    first = _chat(client, messages, "job-g")
    assert first.status_code == 200
    victim = first.headers[REPLICA_HEADER]
    before = _replica_metrics(client)[gone_key]
    _kill(victim)
    deadline = time.monotonic() + 60
    while victim in _per_replica(_replica_metrics(client), "vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the killed replica still answers the scrape"
        time.sleep(0.2)
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Another."}]
    after = _chat(client, messages, "job-g")
    assert after.status_code == 200 and after.headers[REPLICA_HEADER] != victim
    assert _replica_metrics(client)[gone_key] == before + 1  # the move, counted once


# ---- the gateway's own paths, with no cluster ------------------------------------------------


def test_no_live_replica_is_an_openai_503():
    import asyncio

    from agent_runtime.server.replicas import ForwardedRequest

    gateway = Gateway(engine=None, live_replicas=lambda: ())  # type: ignore[arg-type]
    response = asyncio.run(gateway._send(ForwardedRequest("POST", "/v1/chat/completions")))
    assert response.status_code == 503
    assert b'"code":"no_replica"' in response.body and b'"type":"server_error"' in response.body


def test_a_body_past_the_limit_is_a_413_before_it_is_read_whole():
    """The one gateway refuses a body past the replicas' limit (by its content-length, or as it
    streams past it) in the route's error form, never holding it all."""
    import asyncio

    from starlette.requests import Request

    gateway = Gateway(engine=None, live_replicas=lambda: (), max_body_bytes=1000)  # type: ignore[arg-type]

    def request(path: str, chunks: list[bytes], length: int | None) -> Request:
        sent = iter(chunks)
        pulled = []

        async def receive() -> dict[str, Any]:
            chunk = next(sent, None)
            pulled.append(chunk)
            return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

        headers = [(b"content-length", str(length).encode())] if length is not None else []
        req = Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""},
                      receive)
        req.pulled = pulled  # type: ignore[attr-defined]
        return req

    declared = request("/v1/chat/completions", [b"x" * 10], 10**9)
    response = asyncio.run(gateway(declared))
    assert response.status_code == 413 and b'"code":"request_too_large"' in response.body
    assert declared.pulled == []  # type: ignore[attr-defined] # refused on its header, nothing read
    streamed = request("/v1/messages", [b"x" * 600] * 100, None)
    response = asyncio.run(gateway(streamed))
    assert response.status_code == 413 and json.loads(response.body)["error"]["type"] == "request_too_large"
    assert len(streamed.pulled) == 2  # type: ignore[attr-defined] # read up to the limit, no further


class _FakeStream:
    """A replica's streamed answer as the handle gives it: a JSON 200, one body message."""

    def __init__(self, body: bytes) -> None:
        self.messages = [{"type": "http.response.start", "status": 200, "headers": []},
                         {"type": "http.response.body", "body": body, "more_body": False}]

    def __aiter__(self) -> _FakeStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.messages:
            raise StopAsyncIteration
        return self.messages.pop(0)

    def cancel(self) -> None:
        self.messages = []


class _FakeHandle:
    """The engine deployment's handle: records what it forwards (and to which replica)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str | None]] = []

    def options(self, **_: Any) -> _FakeHandle:
        return self

    @property
    def forward(self) -> _FakeHandle:
        return self

    def remote(self, forwarded: Any, **routing: Any) -> _FakeStream:
        self.sent.append((forwarded.method, forwarded.path, routing.get("replica")))
        return _FakeStream(b'{"success": true, "device_blocks": 3, "host_blocks": 1}')


def test_a_reset_through_a_fresh_gateway_reaches_each_replica_once():
    # NOTE: the router knows no replica until a request went through the handle: the gateway
    # sends a health check first, never the reset itself (which would run twice on a replica)
    import asyncio

    from agent_runtime.server.replicas import ForwardedRequest

    handle = _FakeHandle()
    gateway = Gateway(engine=handle, live_replicas=lambda: ("r1", "r2") if handle.sent else None)  # type: ignore[arg-type]
    response = asyncio.run(gateway._reset(ForwardedRequest("POST", "/reset_prefix_cache")))
    assert response.status_code == 200
    assert json.loads(response.body) == {"success": True, "replicas": 2, "device_blocks": 6, "host_blocks": 2}
    assert handle.sent == [("GET", "/health", None), ("POST", "/reset_prefix_cache", "r1"),
                           ("POST", "/reset_prefix_cache", "r2")]


def test_expositions_merge_with_a_replica_label():
    one = "# HELP x_total Things.\n# TYPE x_total counter\nx_total{model=\"m\"} 2.0\n"
    two = "# HELP x_total Things.\n# TYPE x_total counter\nx_total{model=\"m\"} 5.0\n"
    text = merge_expositions({"a": one, "b": two}).decode()
    assert text.count("# TYPE x_total counter") == 1
    samples = {tuple(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples if s.name == "x_total"}
    assert samples == {(("model", "m"), ("replica", "a")): 2.0, (("model", "m"), ("replica", "b")): 5.0}


def test_a_stream_that_loses_its_replica_ends_in_its_routes_form():
    exc = RuntimeError("replica died")
    chat = failed_stream_tail("/v1/chat/completions", exc)
    assert chat.endswith("data: [DONE]\n\n") and '"error"' in chat
    for path, kind in (("/v1/responses", '"sequence_number": 0'), ("/v1/messages", '"api_error"')):
        tail = failed_stream_tail(path, exc)
        assert tail.startswith("event: error\ndata: {") and kind in tail and "[DONE]" not in tail
        assert json.loads(tail.split("data: ", 1)[1])["type"] == "error"
