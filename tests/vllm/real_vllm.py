"""Helpers of the real-vLLM tests: run a scenario of ``scenarios.py`` in a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_scenario(
    name: str, model: Path, mode: str, profile: Path | None = None, timeout: int = 400,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs ``scenarios.py`` in a fresh interpreter (one vLLM engine per process).

    Args:
        name: scenario (``agent`` or ``load``).
        model: model folder.
        mode: ``plugin``, ``baseline`` or ``entrypoint``.
        profile: latency profile for the plugin.
        timeout: seconds.
        env: extra environment variables (e.g. ``ASYMCACHE_VLLM_OPTIONS``).

    Returns:
        The scenario's JSON report.
    """
    # NOTE: this tree first on the path: the vLLM venv's editable install points at the checkout
    # that built it, which from a worktree is another tree's code.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc_env = dict(
        os.environ, PYTHONPATH=path, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", **(env or {})
    )
    cmd = [sys.executable, str(HERE / "scenarios.py"), name, str(model), mode]
    if profile is not None:
        cmd.append(str(profile))
    proc = subprocess.run(cmd, cwd=ROOT, env=proc_env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise AssertionError(f"scenario {name}/{mode} failed (rc {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path, timeout: float = 240) -> None:
    """Waits until the server at ``base`` answers ``/health``; fails with its log's tail if it
    exits first or does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(2)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stops a server started in a session of its own: SIGTERM to its process group, SIGKILL
    if it is still there after 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
