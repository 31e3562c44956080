"""/metrics carries what the Gateway API inference extension's endpoint picker scrapes (its
model-server protocol, under vLLM's names), read here the way the picker reads them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.metrics import ServerMetrics
from asymcache_core import Engine, EngineStats, SamplingParams


def picker_view(text: str) -> dict[str, object]:
    """What the endpoint picker takes from one scrape: the gauges by name (their type checked),
    the block size and pool size from ``vllm:cache_config_info``'s labels, and the LoRA
    adapters from the ``vllm:lora_requests_info`` sample with the latest timestamp."""
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def gauge(name: str) -> float:
        family = families[name]
        assert family.type == "gauge", f"{name} is a {family.type}"
        (sample,) = family.samples
        return sample.value

    (config,) = families["vllm:cache_config_info"].samples
    lora = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value)
    assert families["vllm:lora_requests_info"].type == "gauge"

    def adapters(label: str) -> list[str]:
        return [a.strip() for a in lora.labels[label].split(",") if a.strip()]

    return {
        "queued": gauge("vllm:num_requests_waiting"),
        "running": gauge("vllm:num_requests_running"),
        "kv_usage": gauge("vllm:kv_cache_usage_perc"),
        "kv_usage_earlier_name": gauge("vllm:gpu_cache_usage_perc"),
        "block_size": int(config.labels["block_size"]),
        "num_gpu_blocks": int(config.labels["num_gpu_blocks"]),
        "max_lora": int(lora.labels["max_lora"]),
        "running_lora": adapters("running_lora_adapters"),
        "waiting_lora": adapters("waiting_lora_adapters"),
        "lora_updated": lora.value,
    }


def test_the_pickers_metrics_from_a_stats_snapshot():
    base = {f.name: 0 for f in fields(EngineStats)}
    stats = EngineStats(**{**base, "kv_blocks_total": 64, "kv_blocks_in_use": 16, "requests_running": 2,
                           "requests_waiting": 3, "kv_block_size": 16, "host_kv_blocks_total": 128})
    before = time.time()
    view = picker_view(ServerMetrics("tiny").render(stats).decode())
    assert before <= view.pop("lora_updated") <= time.time()
    assert view == {"queued": 3, "running": 2, "kv_usage": 0.25, "kv_usage_earlier_name": 0.25, "block_size": 16,
                    "num_gpu_blocks": 64, "max_lora": 0, "running_lora": [], "waiting_lora": []}


def test_the_pickers_metrics_on_a_live_app():
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=400, block_size=8, max_num_seqs=1)
    runtime = AgentRuntime(engine)
    app = create_app(runtime, "tiny")
    long = SamplingParams(max_tokens=2000, ignore_eos=True)

    def queue_two() -> list[str]:
        # one request runs (max_num_seqs=1) for the next 2,000 steps, the other waits behind it
        ids = [engine.add_request(list(range(24)), long), engine.add_request(list(range(40, 64)), long)]
        engine.step()
        return ids

    async def scrape() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            response = await client.get("/metrics")
            assert response.status_code == 200
            return response.text

    try:
        idle = picker_view(asyncio.run(scrape()))
        assert (idle["queued"], idle["running"], idle["kv_usage"]) == (0, 0, 0.0)
        assert (idle["block_size"], idle["num_gpu_blocks"]) == (8, 400)
        ids = runtime.call_threadsafe(lambda e: queue_two()).result(timeout=30)
        busy = picker_view(asyncio.run(scrape()))
        runtime.call_threadsafe(lambda e: [e.abort(i) for i in ids]).result(timeout=30)
        assert (busy["queued"], busy["running"]) == (1, 1)
        # the running request's blocks (its prompt's 3 and those of what it has generated so far)
        assert busy["kv_usage"] == busy["kv_usage_earlier_name"] >= 3 / 400
    finally:
        runtime.close_sync()
