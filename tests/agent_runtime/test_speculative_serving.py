"""A server whose engine speculates (``asymcache serve --speculative-config``): chat replies,
streamed and not, are those of a server without drafts, and /metrics counts the drafts under
vLLM's names."""

from __future__ import annotations

import json

import httpx

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, serving
from tests.conftest import make_engine

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
ASK = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _serve(smollm, spec: dict | None) -> tuple[str, str, str]:
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024, speculative_config=spec))
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0}
    try:
        with serving(create_app(runtime, MODEL)) as base:
            whole = httpx.post(f"{base}/v1/chat/completions", timeout=60, json=body).json()
            streamed = ""
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            streamed += choice["delta"].get("content") or ""
            metrics = httpx.get(f"{base}/metrics", timeout=60).text
    finally:
        runtime.close_sync()
        runtime.engine.close()
    return whole["choices"][0]["message"]["content"], streamed, metrics


def test_a_speculating_server_replies_as_one_without_drafts(smollm):
    plain, plain_streamed, plain_metrics = _serve(smollm, None)
    content, streamed, metrics = _serve(smollm, SPEC)
    assert content == plain == streamed == plain_streamed and "def add" in content
    accepted = next(line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert float(accepted.rsplit(" ", 1)[1]) > 0
    assert "vllm:spec_decode" not in plain_metrics
