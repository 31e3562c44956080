"""Hostile-input and disconnect fuzzing of the OpenAI-compatible server (SmolLM2 on the CPU).

Starts uvicorn in this process over the packaged SmolLM2 (with an API key), then:

1. sends a seeded corpus of hostile bodies (wrong types, huge values, NaN/inf, invalid UTF-8,
   bodies past the size cap, deep nesting, out-of-vocabulary token ids, prompts past the
   context, schemas xgrammar cannot compile, unknown tools, unsupported fields, bad keys) and
   checks that each is answered with a 4xx and an OpenAI-style error body (or a 200 where the
   body is in fact valid), never a 5xx, a hang or a dropped connection;
2. runs concurrent streaming clients that disconnect at random points;
3. checks that nothing is left: no request in flight, no block referenced, ``check_integrity``
   clean, and that a reference request still gets the same greedy answer as before.

Prints one JSON summary line (the counts RELIABILITY.md quotes); exits 1 on any violation.

Usage: ``PYTHONPATH=. python scripts/fuzz_server.py [--seed 0] [--random 200] [--streams 64]``
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import torch
import uvicorn

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from asymcache_core import Engine
from asymcache_core.loaders import load_model
from tests.agent_runtime.hostile_bodies import CHAT, KEY, MODEL, Case, corpus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(client: httpx.Client, base: str, case: Case) -> tuple[str, int | None]:
    """One case: the verdict (``ok`` or what went wrong) and the status."""
    name, path, body, headers = case
    # NOTE: bytes, so that a non-ASCII key reaches the server as the client sent it.
    hdrs = {k: v.encode("utf-8") for k, v in
            {"Authorization": f"Bearer {KEY}", "content-type": "application/json", **headers}.items()}
    try:
        if body is None:
            r = client.get(f"{base}{path}", headers=hdrs, timeout=120)
        elif isinstance(body, bytes):
            r = client.post(f"{base}{path}", content=body, headers=hdrs, timeout=120)
        else:
            r = client.post(f"{base}{path}", content=json.dumps(body).encode("utf-8", "surrogatepass"),
                            headers=hdrs, timeout=120)
    except httpx.TimeoutException:
        return "hang", None
    except httpx.TransportError as e:
        return f"transport:{type(e).__name__}", None
    if r.status_code >= 500:
        return "5xx", r.status_code
    if r.status_code == 200:
        return "ok", 200
    try:
        err = r.json()["error"]
        good = set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    except (ValueError, KeyError, TypeError):
        good = False
    return ("ok" if good else "bad-body"), r.status_code


def stream_with_disconnect(base: str, rng: random.Random, results: Counter[str]) -> None:
    stop_after = rng.randint(0, 40)
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {rng.random()}"}],
            "max_tokens": 32, "ignore_eos": True, "stream": True, "temperature": rng.choice([0, 0.7, 1.5])}
    try:
        with httpx.stream("POST", f"{base}{CHAT}", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=300) as r:
            if r.status_code != 200:
                results[f"stream-status-{r.status_code}"] += 1
                return
            seen = 0
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    seen += 1
                if seen >= stop_after:
                    results["disconnected"] += 1
                    return
            results["completed" if lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1 else "bad-end"] += 1
    except httpx.HTTPError as e:
        results[f"stream-error-{type(e).__name__}"] += 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", type=int, default=200)
    ap.add_argument("--streams", type=int, default=64)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    loaded = load_model(MODEL, torch.device("cpu"), torch.float32, seed=0)
    engine = Engine(model=MODEL, loaded=loaded, num_kv_blocks=512, max_model_len=2048, eviction_policy="vllm-apc")
    runtime = AgentRuntime(engine, policy="vllm-apc")
    app = create_app(runtime, MODEL, api_key=KEY)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def on_engine(fn: Any) -> Any:
        return runtime.call_threadsafe(fn).result(timeout=60)

    ref_body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12}
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.post(f"{base}{CHAT}", json=ref_body, headers=auth, timeout=120).json()["choices"][0]["message"]

    cases = corpus(rng, args.random)
    verdicts: Counter[str] = Counter()
    statuses: Counter[int | None] = Counter()
    failures: list[str] = []
    began = time.monotonic()
    with httpx.Client() as client:  # one keep-alive connection: an error must not cost it
        for case in cases:
            verdict, status = run_case(client, base, case)
            verdicts[verdict] += 1
            statuses[status] += 1
            if verdict != "ok":
                failures.append(f"{case[0]}: {verdict} {status}")
    corpus_s = time.monotonic() - began

    streams: Counter[str] = Counter()
    threads = [threading.Thread(target=stream_with_disconnect, args=(base, random.Random(args.seed * 1000 + i), streams))
               for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)

    deadline = time.monotonic() + 60
    while on_engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = on_engine(lambda e: sum(b.ref_cnt for b in e.pool.blocks))
    unfinished = on_engine(lambda e: e.has_unfinished())
    integrity = "clean"
    try:
        on_engine(lambda e: e.check_integrity())
    except AssertionError as e:
        integrity = f"violated: {e}"
    after = httpx.post(f"{base}{CHAT}", json=ref_body, headers=auth, timeout=120).json()["choices"][0]["message"]
    server.should_exit = True
    thread.join(timeout=30)
    runtime.close_sync()

    summary = {
        "cases": len(cases), "verdicts": dict(verdicts), "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "corpus_s": round(corpus_s, 1), "streams": args.streams, "stream_outcomes": dict(streams),
        "leaked_block_refs": leaked, "unfinished": unfinished, "integrity": integrity,
        "reference_answer_unchanged": before == after, "failures": failures[:20],
    }
    print(json.dumps(summary))
    ok = (verdicts["ok"] == len(cases) and leaked == 0 and not unfinished and integrity == "clean"
          and before == after and not any(k.startswith(("bad", "stream-error", "stream-status")) for k in streams))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
