"""Error of the ``sim`` backend against a ``real`` run of the same small workload.

``python -m eval.sim_check [--profile profile.json]`` runs the same workload and policies on
both backends (same seed, pool and arrivals) and prints, per policy, the real and simulated mean
JCT, TTFT and TPOT with their relative errors, and whether the policy ranking agrees (the way
Vidur validates its simulator).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from eval.bench import BenchConfig, run_bench


def compare(cfg: BenchConfig, out: Path) -> list[tuple[str, str, float, float]]:
    """Runs both backends; returns ``(policy, metric, real, sim)`` rows (also printed)."""
    real, _ = run_bench(replace(cfg, backend="real", out=out / "real"))
    sim, _ = run_bench(replace(cfg, backend="sim", out=out / "sim", check_lossless=False))
    rows = []
    print(f"{'policy':<22}{'metric':<6}{'real s':>10}{'sim s':>10}{'error':>9}")
    for name in cfg.policies:
        for metric in ("jct", "ttft", "tpot"):
            r = getattr(real.policies[name], metric).mean or 0.0
            s = getattr(sim.policies[name], metric).mean or 0.0
            rows.append((name, metric, r, s))
            err = (s - r) / r if r else float("nan")
            print(f"{name:<22}{metric:<6}{r:>10.3f}{s:>10.3f}{err:>+9.1%}")
    for metric in ("jct", "ttft"):
        rank_real = sorted(cfg.policies, key=lambda p: getattr(real.policies[p], metric).mean or 0.0)
        rank_sim = sorted(cfg.policies, key=lambda p: getattr(sim.policies[p], metric).mean or 0.0)
        print(f"{metric} ranking real {rank_real} sim {rank_sim} -> {'agree' if rank_real == rank_sim else 'differ'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--policies", default="vllm-apc,lru,asymcache")
    ap.add_argument("--profile", default=None, help="latency profile for both backends")
    ap.add_argument("--out", type=Path, default=Path("runs/sim_check"))
    args = ap.parse_args()
    cfg = BenchConfig(
        workload=args.workload, jobs=args.jobs, concurrency=3, token_scale=0.5, time_scale=0.02,
        num_kv_blocks=40, max_model_len=320, seed=3, policies=tuple(args.policies.split(",")),
        latency_profile=args.profile, check_lossless=False,
    )
    compare(cfg, args.out)


if __name__ == "__main__":
    main()
