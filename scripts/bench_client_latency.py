"""Client-observed latency under load: TTFT and inter-token latency at the client beside the engine's.

Starts the OpenAI server (``create_app`` under uvicorn, the engine in a thread of that process,
as ``asymcache serve`` runs it) as a subprocess, then, for each load, runs N concurrent streaming
chat clients in this process, each sending requests back to back. Every SSE frame is
timestamped on arrival (``time.monotonic``, the clock the engine uses; on Linux it is
system-wide, so both processes' times compare directly). The server subprocess records each
request's engine metrics (arrival, first token, every token's time) and hands them over at
``GET /bench/engine``; requests are paired through an ``X-Bench-Id`` header that the bench's
server mode uses as the engine request id.

Per load it reports, client beside engine (mean, p50, p90, p99):

- TTFT: request sent -> first content chunk received, against the engine's arrival -> first
  token sampled;
- inter-token latency: gaps between content chunks, against gaps between token times;
- what the server adds: before the engine (send -> the engine's arrival: HTTP, validation,
  chat template, tokenizing) and after it (a token sampled -> its chunk received: the event
  loop, the GIL it shares with the engine thread, SSE encoding, the socket), per token for the
  requests whose content chunks pair one to one with their tokens.

Usage::

    PYTHONPATH=. python scripts/bench_client_latency.py --clients 1,16,64 --requests-per-client 2 \\
        --max-tokens 32 --json /tmp/latency.json

``--switch-interval`` sets the server's ``sys.setswitchinterval`` and ``--profile-loop`` writes a
cProfile of the server's event-loop thread (the experiments that say where a delay comes from).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# NOTE: run as a file, so the metrics module beside it is on sys.path
from client_latency_metrics import (
    ClientRecord,
    EngineRecord,
    compare,
    markdown_rows,
    server_share,
    step_summary,
    summarize,
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "How do I reverse a list in Python?",
    "Explain what a hash map is.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet.",
]
BENCH_HEADER = "x-bench-id"


# ----------------------------------------------------------------------------------------------
# Server mode (the subprocess)
# ----------------------------------------------------------------------------------------------

_BENCH_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("bench_id", default=None)


def serve(args: argparse.Namespace) -> None:
    """Serve the model with uvicorn, recording every finished request's engine metrics."""
    import uvicorn

    from agent_runtime.runtime import AgentRuntime
    from agent_runtime.server import create_app

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    engine_kwargs: dict[str, Any] = {"max_model_len": args.max_model_len}
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    runtime = AgentRuntime.from_model(args.model, args.policy, **engine_kwargs)
    app = create_app(runtime, args.model, default_max_tokens=args.max_tokens)
    records: dict[str, dict[str, Any]] = {}
    stamps: dict[str, dict[str, float]] = {}
    state = app.state.server
    observe = state.metrics.observe

    def recording_observe(final: Any) -> None:
        m = final.output.metrics
        rid = final.output.request_id
        records[rid] = {"arrival": m.arrival_time, "first_token": m.first_token_time,
                        "token_times": list(m.token_times), **stamps.pop(rid, {})}
        observe(final)

    # NOTE: instance attributes, so only this bench's server records; the server's code is as shipped.
    state.metrics.observe = recording_observe
    submit = runtime.submit

    async def submit_with_bench_id(*a: Any, request_id: str | None = None, **kw: Any) -> Any:
        rid = request_id or _BENCH_ID.get()
        if rid is not None and rid in stamps:
            stamps[rid]["submitted"] = time.monotonic()
        return await submit(*a, request_id=rid, **kw)

    runtime.submit = submit_with_bench_id  # type: ignore[method-assign]
    encoder = runtime._client.encoder
    assert encoder is not None
    encode_async = encoder.encode_async

    async def stamped_encode(text: str) -> list[int]:
        ids = await encode_async(text)
        rid = _BENCH_ID.get()
        if rid is not None and rid in stamps:
            stamps[rid]["encoded"] = time.monotonic()
        return ids

    encoder.encode_async = stamped_encode  # type: ignore[method-assign]
    since = [time.monotonic()]
    lags: list[float] = []

    async def lag_probe() -> None:
        # NOTE: how late the event loop wakes a 5 ms sleep: the wait every callback of the loop
        # (an SSE frame, a new request) sees, whatever holds it up (the GIL, the CPU, other callbacks).
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - t - 0.005)

    def steps(engine: Any) -> list[list[float]]:
        out = [[st.start, st.duration_s, st.num_tokens, st.num_seqs] for st in engine.step_log if st.start >= since[0]]
        since[0] = time.monotonic()
        return out

    async def bench_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/bench/engine":
            body = json.dumps({"requests": records, "steps": await runtime.call(steps), "loop_lag": lags}).encode()
            records.clear()
            lags.clear()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http":
            received = time.monotonic()
            raw = dict(scope["headers"]).get(BENCH_HEADER.encode())
            if raw:
                stamps[raw.decode()] = {"received": received}
            token = _BENCH_ID.set(raw.decode() if raw else None)
            try:
                await app(scope, receive, send)
            finally:
                _BENCH_ID.reset(token)
            return
        if scope["type"] == "lifespan":
            probes.append(asyncio.get_running_loop().create_task(lag_probe()))
        await app(scope, receive, send)

    probes: list[asyncio.Task[None]] = []
    profiler = None
    if args.profile_loop:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        uvicorn.run(bench_app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile_loop)
        runtime.close_sync()


# ----------------------------------------------------------------------------------------------
# Client mode (this process)
# ----------------------------------------------------------------------------------------------


async def _one_stream(client: Any, base: str, model: str, bench_id: str, question: str,
                      max_tokens: int) -> ClientRecord:
    body = {"model": model, "messages": [{"role": "user", "content": f"({bench_id}) {question}"}],
            "max_tokens": max_tokens, "stream": True}
    rec = ClientRecord(bench_id, time.monotonic())
    frames: list[tuple[float, str]] = []

    async def trace(event: str, info: Any) -> None:
        if event == "http11.send_request_body.complete":
            rec.written = time.monotonic()

    async with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                             headers={BENCH_HEADER: bench_id}, extensions={"trace": trace}) as r:
        rec.status = r.status_code
        # NOTE: stamp first, parse after the stream ended: the client does as little as it can
        # while tokens arrive (it shares the machine's cores with the server).
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append((time.monotonic(), line))
    for t, line in frames:
        payload = line[len("data: "):]
        if payload == "[DONE]":
            continue
        choices = json.loads(payload).get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            rec.content_times.append(t)
    return rec


async def run_load(base: str, model: str, clients: int, requests_per_client: int, max_tokens: int,
                   tag: str, prewarm: bool = True) -> list[ClientRecord]:
    """``clients`` concurrent streaming clients, each sending ``requests_per_client`` requests.

    Args:
        base: server URL.
        model: the served model name.
        clients: concurrent clients.
        requests_per_client: requests each sends, one after the other.
        max_tokens: ``max_tokens`` of each request.
        tag: a prefix that makes the ids (and prompts) of this load unique.
        prewarm: open the clients' keep-alive connections first (``GET /health``), so that the
            measured requests do not pay for TCP connects.

    Returns:
        The records.
    """
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if prewarm:
            await asyncio.gather(*(client.get(f"{base}/health") for _ in range(clients)))

        async def one_client(i: int) -> list[ClientRecord]:
            out = []
            for j in range(requests_per_client):
                q = QUESTIONS[(i + j) % len(QUESTIONS)]
                out.append(await _one_stream(client, base, model, f"{tag}-c{i}-r{j}", q, max_tokens))
            return out

        per_client = await asyncio.gather(*(one_client(i) for i in range(clients)))
    return [r for recs in per_client for r in recs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def _engine_records(base: str) -> tuple[dict[str, EngineRecord], list[list[float]], list[float]]:
    import httpx

    raw = httpx.get(f"{base}/bench/engine", timeout=60).json()
    requests = {k: EngineRecord(v["arrival"], v["first_token"], v["token_times"], v.get("received"),
                                v.get("submitted"), v.get("encoded"))
                for k, v in raw["requests"].items()}
    return requests, raw["steps"], raw["loop_lag"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", default="1,16,64", help="comma-separated loads (concurrent clients)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", default="asymcache+continuum")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's step budget")
    parser.add_argument("--switch-interval", type=float, default=None, help="the server's sys.setswitchinterval")
    parser.add_argument("--profile-loop", default=None, help="write a cProfile of the server's event loop here")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--no-prewarm", action="store_true", help="let the measured requests open their connections")
    parser.add_argument("--raw", action="store_true", help="keep every request's timestamps and the steps in --json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    loads = [int(x) for x in args.clients.split(",") if x.strip()]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--port", str(port), "--model", args.model,
           "--policy", args.policy, "--max-model-len", str(args.max_model_len), "--max-tokens", str(args.max_tokens)]
    if args.switch_interval is not None:
        cmd += ["--switch-interval", str(args.switch_interval)]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.profile_loop:
        cmd += ["--profile-loop", args.profile_loop]
    proc = subprocess.Popen(cmd, env={**os.environ})
    results: list[dict[str, Any]] = []
    try:
        _wait_ready(base, proc)
        asyncio.run(run_load(base, args.model, 1, 1, args.max_tokens, "warmup"))
        _engine_records(base)
        for n in loads:
            load_before = os.getloadavg()
            t0 = time.monotonic()
            records = asyncio.run(run_load(base, args.model, n, args.requests_per_client, args.max_tokens, f"L{n}",
                                           prewarm=not args.no_prewarm))
            wall = time.monotonic() - t0
            engine_records, steps, loop_lag = _engine_records(base)
            result = compare(records, engine_records)
            result.update(clients=n, wall_s=wall, loadavg_before=load_before, loadavg_after=os.getloadavg(),
                          share=server_share(result), failed=sum(r.status != 200 for r in records),
                          engine_steps=step_summary(steps), loop_lag=summarize(loop_lag))
            if args.raw:
                result["raw"] = {"clients": [vars(r) for r in records],
                                 "engine": {k: vars(v) for k, v in engine_records.items()}, "steps": steps}
            results.append(result)
            print(f"\n{n} clients: {result['requests']} requests in {wall:.1f} s, load average "
                  f"{load_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}, failed {result['failed']}, "
                  f"paired {result['paired_requests']}")
            print("| clients | metric (ms) | mean | p50 | p90 | p99 | n |\n|---|---|---|---|---|---|---|")
            print("\n".join(markdown_rows(n, result)))
            st = result["engine_steps"]
            print(f"engine steps: {st['steps']}, duration mean {1000 * st['duration']['mean']:.1f} ms "
                  f"p99 {1000 * st['duration']['p99']:.1f} ms; between steps mean {1000 * st['gap']['mean']:.2f} ms "
                  f"p99 {1000 * st['gap']['p99']:.2f} ms")
            lag = result["loop_lag"]
            print(f"server event loop lag (a 5 ms sleep woken late by): mean {1000 * lag['mean']:.2f} ms, "
                  f"p50 {1000 * lag['p50']:.2f}, p90 {1000 * lag['p90']:.2f}, p99 {1000 * lag['p99']:.2f} ms")
            s = result["share"]
            print(f"server share of ITL mean {100 * s['itl_mean_share']:.1f}%, per-token delivery / ITL "
                  f"{100 * s['delivery_share']:.1f}%, TTFT p99 delay {1000 * s['ttft_p99_delay']:.1f} ms, "
                  f"server-added TTFT p99 {1000 * s['server_ttft_p99']:.1f} ms "
                  f"(step ~{1000 * s['step_s']:.1f} ms)")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
