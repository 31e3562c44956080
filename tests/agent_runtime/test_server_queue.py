"""The server under load and at its end: the bounded queue (a 429 with Retry-After, a
completion of n choices counting n) and the shutdown drain, against uvicorn over the real SmolLM2."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.request_guard import RequestGuard
from agent_runtime.server.state import AppState
from tests.agent_runtime.uvicorn_server import Server
from tests.conftest import make_engine

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"


def test_full_queue_is_a_429_with_retry_after():
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        if scope["path"] == CHAT:
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    state = AppState("m")  # no runtime: the running batch counts 0, so max_queue_len bounds alone
    guard = RequestGuard(slow_app, state, max_body_bytes=1024, max_queue_len=2)

    async def main():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = [asyncio.create_task(c.post(CHAT, json={})) for _ in range(2)]
            await asyncio.sleep(0.05)
            third = await c.post(CHAT, json={})
            health = await c.get("/health")  # not a completion: never queued
            release.set()
            done = await asyncio.gather(*first)
            after = await c.post(CHAT, json={})
            return third, health, done, after

    third, health, done, after = asyncio.run(main())
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "queue_full" and third.json()["error"]["type"] == "rate_limit_error"
    assert health.status_code == 200 and [r.status_code for r in done] == [200, 200]
    assert after.status_code == 200 and guard.in_flight == 0


def test_a_completion_of_n_choices_counts_n_in_the_queue():
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = RequestGuard(slow_app, AppState("m"), max_body_bytes=4096, max_queue_len=4)

    async def main():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            # alone, a request of more choices than the bound still runs
            big = asyncio.create_task(c.post(CHAT, json={"n": 16}))
            await asyncio.sleep(0.05)
            held = guard.in_flight
            refused = await c.post(CHAT, json={"n": 1})
            release.set()
            await big
            release.clear()
            three = asyncio.create_task(c.post(CHAT, json={"n": 3}))
            await asyncio.sleep(0.05)
            two = await c.post(CHAT, json={"n": 2})  # 3 + 2 > 4
            one = asyncio.create_task(c.post(CHAT, json={"model": "x", "n": True}))  # not a valid n: 1
            await asyncio.sleep(0.05)
            full = guard.in_flight
            release.set()
            await asyncio.gather(three, one)
            release.clear()
            # a batch of prompts is prompts x n engine requests (token-id prompts too)
            batches = []
            for prompt in (["a", "b", "c"], [[1, 2], [3]], [1, 2, 3]):
                task = asyncio.create_task(c.post("/v1/completions", json={"prompt": prompt, "n": 2}))
                await asyncio.sleep(0.05)
                batches.append(guard.in_flight)
                release.set()
                await task
                release.clear()
            return held, refused, two, full, batches

    held, refused, two, full, batches = asyncio.run(main())
    assert held == 16 and refused.status_code == 429
    assert two.status_code == 429 and full == 4 and guard.in_flight == 0
    assert batches == [6, 4, 2]


def test_shutdown_drains_up_to_the_timeout_then_aborts(smollm):
    engine = make_engine(smollm, max_model_len=2048)
    runtime = AgentRuntime(engine)
    server = Server(create_app(runtime, MODEL), runtime, shutdown_s=1.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    lines: list[str] = []

    def client() -> None:
        # NOTE: past the timeout the stream is cut (uvicorn cancels the response task).
        with contextlib.suppress(httpx.RemoteProtocolError), \
                httpx.stream("POST", f"{server.base}{CHAT}", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 60
    while not any('"content"' in x for x in lines[1:]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    began = time.monotonic()
    server.stop()  # what uvicorn's SIGTERM handler does: should_exit
    elapsed = time.monotonic() - began
    t.join(timeout=30)
    try:
        assert not server.thread.is_alive() and elapsed < 30  # 1500 tokens take minutes on a CPU
        deadline = time.monotonic() + 30
        while server.engine(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline, "the request kept running after shutdown"
            time.sleep(0.05)
        assert server.engine(lambda e: sum(b.ref_cnt for b in e.pool.blocks)) == 0
        server.engine(lambda e: e.check_integrity())
    finally:
        runtime.close_sync()
