"""Which Triton specializations a benchmark compiles after the harness's warm-up. GPU machine only.

``python scripts/gpu_compile_check.py [bench options...]`` runs ``asymcache bench`` with the
given options (``--backend real --device cuda`` and a workload) and prints, per kernel, the
specialization keys compiled after ``eval.harness.warm_up`` returned: each is a compile (about
a second) that landed inside some policy's latencies, i.e. a shape the warm-up should cover.
"""

from __future__ import annotations

import sys
from typing import Any

import eval.bench as bench
from eval.cli import app
from kernels import msa_triton


def keys() -> dict[str, set[str]]:
    """Specialization keys compiled so far, per kernel."""
    return msa_triton.compiled_keys() or {}


def main() -> None:
    after_warm_up: dict[str, set[str]] = {}
    original = bench.warm_up

    def warm_up(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        after_warm_up.update(keys())
        print("after warm-up:", {k: len(v) for k, v in after_warm_up.items()}, flush=True)

    bench.warm_up = warm_up
    sys.argv = ["asymcache", "bench", *sys.argv[1:]]
    try:
        app()
    except SystemExit:
        pass
    for name, now in keys().items():
        new = sorted(now - after_warm_up.get(name, set()))
        print(f"{name}: {len(now)} compiled, {len(new)} after the warm-up")
        for key in new:
            print("   new:", key[:600])
        if new:
            print("   one warm-up key for comparison:", sorted(after_warm_up.get(name, {""}))[0][:600])


if __name__ == "__main__":
    main()
