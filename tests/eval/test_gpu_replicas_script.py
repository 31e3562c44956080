"""``scripts/gpu_replicas.py`` on the CPU: replicas on virtual clocks and, in threads, real engines.

Its figures belong to the GPU machine (two H200s); here it must run both backends through, keep
every job on one replica, and pool the replicas' records into one outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eval.harness import RequestRecord, RunOutcome  # noqa: E402
from scripts.gpu_replicas import merge  # noqa: E402


def _rows(stdout: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]


def _script(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_replicas.py"), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_two_simulated_replicas_serve_half_the_load_each() -> None:
    rows = _rows(_script("--backend", "sim", "--workload", "toolloop", "--jobs", "24", "--concurrency", "12",
                   "--num-kv-blocks", "3000", "--slo", "jct:30"))
    assert [(r[0], r[1]) for r in rows] == [("12", "1"), ("12", "2")]
    one, two = (float(r[2]) for r in rows)
    # the same jobs, half of them on each of two engines of the same size: no job waits longer
    assert 0 < two <= one


def test_real_replicas_run_in_threads_on_the_cpu() -> None:
    rows = _rows(_script("--backend", "real", "--device", "cpu", "--model", "dummy:tiny", "--workload", "toolloop",
                   "--jobs", "6", "--concurrency", "2", "--token-scale", "0.05", "--time-scale", "0.001",
                   "--num-kv-blocks", "400", "--max-model-len", "4096", "--max-num-batched-tokens", "2048",
                   "--slo", ""))
    assert [(r[0], r[1]) for r in rows] == [("2", "1"), ("2", "2")]
    assert all(float(r[6]) > 0 for r in rows)  # jobs per hour: every job finished


def _record(job: str, turn: int) -> RequestRecord:
    return RequestRecord(job, turn, 0.0, 0.0, 0.1, 1.0, 10, 0, [1, 2], 0.1, 0.01)


def test_merge_pools_the_replicas_records_jobs_and_counters() -> None:
    a = RunOutcome("p", [_record("a", 0), _record("a", 1)], {"a": 3.0}, 10.0, {"hit_tokens": 5}, pinned_peak=2)
    b = RunOutcome("p", [_record("b", 0)], {"b": 4.0}, 12.0, {"hit_tokens": 7, "evictions": 1}, pinned_peak=3)
    merged = merge([a, b])
    assert merged.jct == {"a": 3.0, "b": 4.0} and len(merged.records) == 3
    assert merged.duration_s == 12.0 and merged.pinned_peak == 5
    assert merged.engine_stats == {"hit_tokens": 12, "evictions": 1}
