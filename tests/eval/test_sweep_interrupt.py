"""An interrupted parallel sweep (``bench --workers N``) ends its worker processes and exits:
no worker goes on running a point, and none writes one after the interrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Generous bounds, not timings: a worker starting (spawn, torch import) and the parent exiting.
START_BOUND_S = 120.0
EXIT_BOUND_S = 60.0


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # NOTE: the command name (field 2) may hold spaces: the parent pid follows its ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _results_files(out: Path) -> set[Path]:
    return set(out.rglob("results.json"))


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)"
)
def test_an_interrupted_parallel_sweep_ends_its_workers_and_exits(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    # NOTE: points of many jobs: each runs for minutes, far longer than the test waits
    argv = [
        sys.executable,
        "-m",
        "eval.cli",
        "bench",
        "--backend",
        "sim",
        "--model",
        "dummy:llama-3.1-8b",
        "--jobs",
        "3000",
        "--time-scale",
        "1",
        "--concurrency",
        "1,2,3",
        "--policies",
        "vllm-apc",
        "--no-plots",
        "--workers",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + START_BOUND_S
        # NOTE: the spawn context's resource tracker is a child too: wait for it and two workers
        while len(workers) < 3 and time.monotonic() < deadline and proc.poll() is None:
            workers = _children(proc.pid)
            time.sleep(0.2)
        assert len(workers) >= 3, (workers, proc.poll())
        written_before = _results_files(out)
        proc.send_signal(signal.SIGINT)  # the parent only: the workers get no signal of their own
        _, stderr = proc.communicate(timeout=EXIT_BOUND_S)
    finally:
        if proc.poll() is None:
            # NOTE: the workers too: they hold the parent's stdout and stderr open
            for pid in [proc.pid, *workers]:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert stderr.decode().strip().splitlines()[-1] == "error: interrupted"
    assert "Traceback" not in stderr.decode()
    deadline = time.monotonic() + EXIT_BOUND_S
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)]
    assert _results_files(out) == written_before
