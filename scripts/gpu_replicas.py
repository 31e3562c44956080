"""Replicas against one engine on an agent workload: N engines (one per GPU), jobs kept on their replica.

``python scripts/gpu_replicas.py [--backend sim|real] [--device cuda] [--replicas 2]
[--workload swe] [--jobs 96] [--concurrency 32,64] [--time-scale 1.0] [--num-kv-blocks N |
--gpu-memory-utilization U] [--policy asymcache+continuum/reserve-prompt] [--slo jct:155.5]``

For each closed-loop concurrency ``C`` it runs the workload twice: on one engine with ``C`` jobs
in flight, and on ``N`` replicas with ``C`` in flight together, each replica running ``--jobs``
jobs (``N`` times the jobs in all). Every job stays on one replica
from its first turn to its last (the job affinity of ``asymcache serve --replicas``: its KV and
Continuum pins are there), so the replicas' affinity hit rate is 100% by construction; jobs
are dealt round robin, each replica running a closed loop of ``C / N`` (a new job starts on
the replica where one finished). Prints mean / p90 / p99 JCT, TTFT p99, jobs per hour and
jobs per hour within the JCT target of both, side by side: agents per GPU-pair at the JCT
target is the largest ``C`` whose replicas' JCT p90 meets it.

Backends: ``sim`` runs the engines on virtual clocks with the latency model (each replica its
own clock: they run in parallel), ``real`` runs each replica in a thread of its own on
``cuda:i`` (``--device cpu``: every replica on the CPU, a check of the script). NOTE: this is
the bench harness's driver per replica, not Ray Serve (which does not travel to the GPU
machine); its router's shortest-queue choice for new jobs is replaced by the round robin of
closed loops of equal size.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from asymcache_core import EngineConfig
from eval.bench import (
    ENGINE_FIELDS,
    BenchConfig,
    BenchVariant,
    engine_dtype,
    load_workload,
    memory_pool_plan,
    pool_blocks,
)
from eval.harness import RunOutcome, drive, make_engine, serving_metrics
from eval.results import SLO


def merge(outcomes: list[RunOutcome]) -> RunOutcome:
    """One outcome of replicas that ran side by side (records and jobs pooled, the longest
    duration, engine counters summed)."""
    stats: dict[str, Any] = {}
    for o in outcomes:
        for key, value in o.engine_stats.items():
            stats[key] = stats.get(key, 0) + value
    return RunOutcome(
        outcomes[0].policy, [r for o in outcomes for r in o.records], {k: v for o in outcomes for k, v in o.jct.items()},
        max(o.duration_s for o in outcomes), stats, pinned_peak=sum(o.pinned_peak for o in outcomes),
    )


def run(cfg: BenchConfig, variant: BenchVariant, replicas: int, concurrency: int) -> RunOutcome:
    """The workload on ``replicas`` engines with ``concurrency`` jobs in flight together.

    NOTE: each replica runs ``cfg.jobs`` jobs (the trace has ``replicas`` times as many): a
    closed loop drains at its end, and over fewer jobs a larger share of them would run in the
    drain's lighter load."""
    trace = load_workload(replace(cfg, jobs=cfg.jobs * replicas))
    base = EngineConfig(**{name: getattr(cfg, name) for name in ENGINE_FIELDS})
    base = replace(base, dtype=engine_dtype(cfg), seed=cfg.seed, num_kv_blocks=cfg.num_kv_blocks, **variant.engine_overrides)
    parts = [trace.model_copy(update={"jobs": trace.jobs[i::replicas]}) for i in range(replicas)]
    loops = [concurrency // replicas + (1 if i < concurrency % replicas else 0) for i in range(replicas)]
    outcomes: list[RunOutcome | None] = [None] * replicas
    errors: list[BaseException] = []
    engines = []
    for i in range(replicas):
        # NOTE: built one after the other: a CUDA graph captured while another thread launches
        # work fails the capture
        config, loaded = base, None
        if cfg.backend == "real":
            from asymcache_core.loaders import load_model

            config = replace(base, device=cfg.device if cfg.device == "cpu" else f"cuda:{i}")
            if config.torch_device.type == "cuda":
                torch.cuda.set_device(config.torch_device)
            loaded = load_model(cfg.model, config.torch_device, config.torch_dtype, cfg.seed)
        engines.append(make_engine(config, cfg.backend, loaded))

    def one(i: int) -> None:
        try:
            if engines[i].config.torch_device.type == "cuda":
                torch.cuda.set_device(engines[i].config.torch_device)
            outcomes[i] = drive(
                engines[i], parts[i], variant, time_scale=cfg.time_scale, seed=cfg.seed,
                concurrency=max(1, loops[i]), sleep=None if cfg.backend == "sim" else time.sleep,
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
        finally:
            engines[i].close()

    if cfg.backend == "sim" or replicas == 1:
        for i in range(replicas):
            one(i)
    else:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return merge([o for o in outcomes if o is not None])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sim", choices=("sim", "real"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workload", default="swe")
    ap.add_argument("--jobs", type=int, default=96)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--latency-profile", default="bench_traces/profile_h200_llama8b_live_async_2026_12_03.json")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--policy", default="asymcache+continuum/reserve-prompt")
    ap.add_argument("--slo", default="jct:155.5")
    args = ap.parse_args()
    if args.replicas < 1:
        raise SystemExit("replicas: must be >= 1")
    cfg = BenchConfig(
        workload=args.workload, model=args.model, device=args.device if args.backend == "real" else "cpu",
        backend=args.backend, jobs=args.jobs, seed=args.seed, time_scale=args.time_scale,
        token_scale=args.token_scale, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        latency_profile=args.latency_profile if args.backend == "sim" else None,
    )
    plan = memory_pool_plan(cfg) if cfg.num_kv_blocks is None and cfg.gpu_memory_utilization is not None else None
    cfg = replace(cfg, num_kv_blocks=pool_blocks(cfg, load_workload(cfg), plan))
    variant = BenchVariant.parse(args.policy)
    slo = SLO.parse(args.slo) if args.slo else None
    print(f"# {args.workload}, {args.jobs} jobs an engine, seed {args.seed}, {cfg.num_kv_blocks} blocks an engine, "
          f"{args.policy}, backend {args.backend}, time scale {args.time_scale}")
    print("| agents | engines | JCT mean s | JCT p90 s | JCT p99 s | TTFT p99 s | jobs/h | jobs/h within SLO |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for replicas in (1, args.replicas):
            outcome = run(cfg, variant, replicas, concurrency)
            serving, goodput = serving_metrics(outcome, slo)
            print(f"| {concurrency} | {replicas} | {serving['mean_jct_ms'] / 1e3:.1f} | {serving['p90_jct_ms'] / 1e3:.1f} | "
                  f"{serving['p99_jct_ms'] / 1e3:.1f} | {serving['p99_ttft_ms'] / 1e3:.2f} | "
                  f"{serving['job_throughput'] * 3600:.0f} | {goodput if goodput is not None else float('nan'):.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
