"""``scripts/gpu_walk_diag.py``: its stand-alone copies of the decode walk, under the interpreter.

The GPU table compares the variants' times; this checks, on the CPU, what that comparison rests
on: the variants that keep the walk's math give the same partial states bit for bit, and the
partials are attention over the context (float64 reference).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_the_walk_variants_agree_and_are_attention() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_walk_diag.py"), "--check-cpu"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ok: the walk's variants agree" in proc.stdout
