"""``scripts/gpu_tp.py`` on the CPU: the script the two-GPU machine runs, end to end over gloo.

Its figures belong to the GPU run; here it must run through every engine (one rank with and
without graphs, two ranks) and find two ranks' greedy tokens equal to one rank's (float32).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tp_script_runs_on_the_cpu_and_two_ranks_match_one() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_tp.py"), "--device", "cpu", "--model", "dummy:tiny",
         "--cases", "1x64,2x64", "--prefill", "128", "--tokens", "8"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| tp")}
    assert set(rows) == {"tp1", "tp1-eager", "tp2"}
    assert all("| 4 of 4 |" in row for row in rows.values()), proc.stdout
