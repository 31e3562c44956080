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
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
# Metric computation (pure; unit-tested on synthetic timestamps)
# ----------------------------------------------------------------------------------------------


@dataclass
class ClientRecord:
    """One streamed request as the client saw it.

    Attributes:
        bench_id: the id sent in ``X-Bench-Id`` (the engine request id).
        sent: when the client began the request.
        content_times: arrival time of each SSE chunk that carried content.
        status: the HTTP status.
        written: when the client's HTTP stack had written the whole request (None: not known).
    """

    bench_id: str
    sent: float
    content_times: list[float] = field(default_factory=list)
    status: int = 0
    written: float | None = None


@dataclass
class EngineRecord:
    """One request as the engine recorded it (engine clock).

    Attributes:
        arrival: when ``add_request`` took it.
        first_token: when its first token was sampled.
        token_times: when each token was sampled.
        received: when the server's ASGI app was called for it (None: not recorded).
        submitted: when the runtime's ``submit`` was called, the chat template rendered
            (None: not recorded); the prompt is tokenized and queued for the engine thread next.
        encoded: when the prompt's tokens came back from the tokenizer thread (None: not
            recorded); the command is queued for the engine thread right after.
    """

    arrival: float
    first_token: float | None
    token_times: list[float]
    received: float | None = None
    submitted: float | None = None
    encoded: float | None = None


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles (linear interpolation between closest ranks).

    Args:
        values: the samples (seconds).

    Returns:
        ``{"n", "mean", "p50", "p90", "p99"}``; NaN statistics for no samples.
    """
    xs = sorted(values)
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def compare(clients: Sequence[ClientRecord], engine: dict[str, EngineRecord]) -> dict[str, Any]:
    """Client-observed against engine-recorded latency for one load.

    Only requests answered 200 with at least one content chunk and an engine record count.

    Args:
        clients: the client's records.
        engine: the engine's records by request id.

    Returns:
        Summaries (:func:`summarize`) of ``client_ttft``, ``engine_ttft``, ``client_itl``,
        ``engine_itl``, ``before_engine`` (send -> arrival), ``first_delivery`` (first token
        sampled -> its chunk received) and ``token_delivery`` (every token of the requests
        whose content chunks pair one to one with their tokens), the parts of ``before_engine``
        when the server stamped them (``to_app``: send -> the ASGI app called; ``app_to_submit``:
        validation and the chat template; ``submit_to_arrival``: tokenizing and the wait for the
        engine thread, which takes commands between steps; split into ``tokenize`` and
        ``engine_queue`` when the encoder was stamped; ``client_write``: the client's own HTTP
        stack, ``written_to_app``), ``server_ttft`` (per request: the client's TTFT counted from
        the written request, less the engine's TTFT), plus ``requests``,
        ``paired_requests`` (those one-to-one requests) and ``unmatched`` (no engine record).
    """
    keys = ("client_ttft", "engine_ttft", "client_itl", "engine_itl", "before_engine", "first_delivery",
            "token_delivery", "to_app", "app_to_submit", "submit_to_arrival", "tokenize", "engine_queue",
            "client_write", "written_to_app", "server_ttft")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    used = paired = unmatched = 0
    for c in clients:
        e = engine.get(c.bench_id)
        if c.status != 200 or not c.content_times:
            continue
        if e is None or e.first_token is None or not e.token_times:
            unmatched += 1
            continue
        used += 1
        samples["client_ttft"].append(c.content_times[0] - c.sent)
        samples["engine_ttft"].append(e.first_token - e.arrival)
        samples["before_engine"].append(e.arrival - c.sent)
        if e.received is not None and e.submitted is not None:
            samples["to_app"].append(e.received - c.sent)
            if c.written is not None:
                samples["client_write"].append(c.written - c.sent)
                samples["written_to_app"].append(e.received - c.written)
            samples["app_to_submit"].append(e.submitted - e.received)
            samples["submit_to_arrival"].append(e.arrival - e.submitted)
            if e.encoded is not None:
                samples["tokenize"].append(e.encoded - e.submitted)
                samples["engine_queue"].append(e.arrival - e.encoded)
        samples["first_delivery"].append(c.content_times[0] - e.first_token)
        # what the server adds to this request's TTFT beyond the engine's own, from the moment
        # the client's HTTP stack had written it (the client's own overhead left out)
        start = c.written if c.written is not None else c.sent
        samples["server_ttft"].append((c.content_times[0] - start) - (e.first_token - e.arrival))
        samples["client_itl"].extend(b - a for a, b in zip(c.content_times, c.content_times[1:], strict=False))
        samples["engine_itl"].extend(b - a for a, b in zip(e.token_times, e.token_times[1:], strict=False))
        if len(c.content_times) == len(e.token_times):
            paired += 1
            samples["token_delivery"].extend(r - s for s, r in zip(e.token_times, c.content_times, strict=True))
    out: dict[str, Any] = {k: summarize(v) for k, v in samples.items()}
    out.update(requests=used, paired_requests=paired, unmatched=unmatched)
    return out


def server_share(result: dict[str, Any]) -> dict[str, float]:
    """How much of what the client sees the server adds.

    Args:
        result: one load's :func:`compare` output.

    Returns:
        ``itl_mean_share``: (client ITL mean - engine ITL mean) / client ITL mean;
        ``delivery_share``: mean per-token delivery delay / client ITL mean;
        ``ttft_p99_delay``: client TTFT p99 - engine TTFT p99 (seconds);
        ``server_ttft_p99``: p99 of the per-request TTFT the server adds (``server_ttft``);
        ``step_s``: the engine's mean inter-token gap (about one step).
    """
    c_itl, e_itl = result["client_itl"]["mean"], result["engine_itl"]["mean"]
    return {
        "itl_mean_share": (c_itl - e_itl) / c_itl if c_itl else math.nan,
        "delivery_share": result["token_delivery"]["mean"] / c_itl if c_itl else math.nan,
        "ttft_p99_delay": result["client_ttft"]["p99"] - result["engine_ttft"]["p99"],
        "server_ttft_p99": result["server_ttft"]["p99"],
        "step_s": e_itl,
    }


def markdown_rows(clients: int, result: dict[str, Any]) -> list[str]:
    """Table rows (milliseconds) for one load.

    Args:
        clients: concurrent clients.
        result: :func:`compare` output.

    Returns:
        Markdown rows: ``| clients | metric | mean | p50 | p90 | p99 | n |``.
    """
    names = [("client_ttft", "TTFT, client"), ("engine_ttft", "TTFT, engine"),
             ("before_engine", "send -> engine arrival"), ("to_app", "  send -> ASGI app"),
             ("client_write", "    send -> written (client)"), ("written_to_app", "    written -> ASGI app"),
             ("app_to_submit", "  app -> submit (validate, render)"),
             ("submit_to_arrival", "  submit -> arrival"), ("tokenize", "    tokenize"),
             ("engine_queue", "    queued -> engine arrival"),
             ("first_delivery", "first token -> client"),
             ("server_ttft", "TTFT added by the server (from written)"),
             ("client_itl", "ITL, client"), ("engine_itl", "ITL, engine"),
             ("token_delivery", "token sampled -> client")]
    rows = []
    for key, label in names:
        s = result[key]
        cells = " | ".join(f"{1000 * s[q]:.1f}" for q in ("mean", "p50", "p90", "p99"))
        rows.append(f"| {clients} | {label} | {cells} | {s['n']} |")
    return rows


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


def step_summary(steps: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The engine's steps of one load: their durations, and the engine thread's time between them.

    Args:
        steps: ``[start, duration_s, num_tokens, num_seqs]`` per step, in order.

    Returns:
        ``duration`` and ``gap`` (the end of one step to the start of the next while requests
        were running: commands, output dispatch, waiting for the GIL) summaries, and ``steps``.
    """
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(steps, steps[1:], strict=False)]
    # NOTE: a gap longer than a second is the engine idling between requests, not overhead.
    return {"steps": len(steps), "duration": summarize([st[1] for st in steps]),
            "gap": summarize([g for g in gaps if g < 1.0])}


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
