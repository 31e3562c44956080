"""``asymcache bench``: a workload through a grid of policies, reported side by side."""

from __future__ import annotations

import datetime as dt
import gc
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eval.harness import (
    BenchPolicy,
    drive,
    largest_request_blocks,
    machine_description,
    make_engine,
    policy_result,
    repeated_result,
    resolve_bench_policy,
    warm_up,
    working_set_blocks,
)
from eval.results import Results, RunInfo, save_results

DEFAULT_POLICIES = ("vllm-apc", "continuum", "asymcache", "asymcache+continuum")


@dataclass
class BenchConfig:
    """What ``asymcache bench`` runs (CLI options map one to one).

    Attributes:
        workload: ``swe``, ``toolloop``, ``chat`` or ``trace:PATH`` (or an importer spec).
        policies: policy names (``name`` or ``name/ablation``).
        model: engine model spec.
        device: ``cpu`` or ``cuda``.
        backend: ``real``, ``sim`` or ``http``.
        url: server base URL for ``http``.
        jobs: jobs in the workload.
        rate: Poisson arrivals (jobs/s); ``None`` runs a closed loop.
        concurrency: jobs in flight in the closed loop.
        time_scale: multiplies tool pauses and arrivals.
        token_scale: multiplies the generators' token lengths (small models, CPU runs).
        kv_blocks: pool size in blocks (overrides ``kv_fraction``).
        kv_fraction: pool as a fraction of the workload's working set; ``None``: 0.5, raised to
            what the largest job needs (an explicit fraction that cannot hold it is an error).
        block_size: tokens per block.
        max_context: jobs are cut to turns whose context fits (the model's limit by default).
        seed: workload and token seed.
        out: run folder (``runs/<timestamp>`` by default).
        check_lossless: also run an unbounded pool and compare every policy's tokens (real).
        latency_profile: JSON profile for the latency model (default: analytic).
        tpot_slo_ms: adaptive chunking's target.
        max_num_batched_tokens: per-step token cap.
        step_log: also write every engine step (``StepStats``, with the latency model's
            prediction) to ``steps/<policy>.jsonl`` in the run folder.
        repeats: runs of each policy, in rounds over all policies (policy A, B, A, B...), so
            that slow drift of the machine hits every policy alike; the report pools them and
            keeps each run's means.
    """

    workload: str = "swe"
    policies: tuple[str, ...] = DEFAULT_POLICIES
    model: str = "smollm2-135m"
    device: str = "cpu"
    backend: str = "real"
    url: str | None = None
    jobs: int = 6
    rate: float | None = None
    concurrency: int = 6
    time_scale: float = 0.05
    token_scale: float = 0.05
    kv_blocks: int | None = None
    kv_fraction: float | None = None
    block_size: int = 16
    max_context: int | None = 512
    seed: int = 0
    out: Path | None = None
    check_lossless: bool = True
    latency_profile: str | None = None
    tpot_slo_ms: float = 100.0
    max_num_batched_tokens: int = 512
    step_log: bool = False
    repeats: int = 1
    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in sys.argv))


def step_log_name(policy: str) -> str:
    """A file name for ``policy`` (``asymcache/fixed:256`` -> ``asymcache_fixed-256``)."""
    return policy.replace("/", "_").replace(":", "-").replace("+", "-")


def write_step_log(steps: list[Any], path: Path) -> Path:
    """Writes one JSON object per engine step (the fields of ``StepStats``).

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step in steps:
            f.write(json.dumps(asdict(step)) + "\n")
    return path


def run_order(policies: list[BenchPolicy], repeats: int) -> list[tuple[BenchPolicy, int]]:
    """``(policy, repeat)`` in the order they run: rounds over the policies, each round's order
    rotated by one.

    NOTE: rounds spread the machine's drift over all policies alike. The rotation is there
    because on the GPU the policy that ran first in its round had the lower chat TTFT in 6 of
    8 pairs (BENCHMARKS.md, session 5). Rotating puts every policy first equally often when
    ``repeats`` is a multiple of the number of policies.
    """
    runs: list[tuple[BenchPolicy, int]] = []
    for r in range(repeats):
        shift = r % max(1, len(policies))
        runs += [(p, r) for p in policies[shift:] + policies[:shift]]
    return runs


def release_device_memory(device: str) -> None:
    """Collects the last run's engine before the next is built.

    NOTE: otherwise its garbage (requests, blocks, CUDA graphs and the KV pool) can be
    collected in the middle of the next policy's run, and two pools are held while the next
    one is allocated.
    """
    gc.collect()
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def write_request_log(outcome: Any, path: Path) -> Path:
    """Writes one JSON object per request of a run (``RequestRecord.log_row``), in the order
    they finished.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in outcome.records:
            f.write(json.dumps(record.log_row(outcome.start)) + "\n")
    return path


class BenchError(ValueError):
    """A bad option or an impossible setup (the CLI prints it on one line, exit code 2)."""


def load_workload(cfg: BenchConfig) -> Any:
    """The trace, with arrivals and with jobs cut to ``max_context``."""
    from workloads import apply_arrivals, load_trace

    options: dict[str, Any] = {}
    if ":" not in cfg.workload:
        options["token_scale"] = cfg.token_scale
    try:
        trace = load_trace(cfg.workload, num_jobs=cfg.jobs, seed=cfg.seed, **options)
    except ValueError as exc:
        raise BenchError(f"workload: {exc}") from None
    if cfg.rate is not None:
        trace = apply_arrivals(trace, f"poisson:{cfg.rate}", cfg.seed)
    if cfg.max_context is not None:
        trace = _cut_jobs(trace, cfg.max_context)
    return trace


def _cut_jobs(trace: Any, max_context: int) -> Any:
    jobs = []
    for job in trace.jobs:
        turns = []
        for k in range(len(job.turns)):
            candidate = job.model_copy(update={"turns": job.turns[: k + 1]})
            if candidate.total_tokens > max_context:
                break
            turns.append(job.turns[k])
        if not turns:
            continue
        last = turns[-1].model_copy(update={"tool": None, "tool_duration_s": 0.0, "think_time_s": 0.0})
        jobs.append(job.model_copy(update={"turns": [*turns[:-1], last]}))
    if not jobs:
        raise BenchError(f"max_context: no job's first turn fits {max_context} tokens")
    return trace.model_copy(update={"jobs": jobs})


def pool_blocks(cfg: BenchConfig, trace: Any) -> int:
    need = largest_request_blocks(trace, cfg.block_size)
    if cfg.kv_blocks is not None:
        blocks = cfg.kv_blocks
    elif cfg.kv_fraction is None:
        blocks = max(need, int(0.5 * working_set_blocks(trace, cfg.block_size)))
    else:
        if not 0 < cfg.kv_fraction:
            raise BenchError(f"kv_fraction: must be > 0, got {cfg.kv_fraction}")
        blocks = int(cfg.kv_fraction * working_set_blocks(trace, cfg.block_size))
    if blocks < need:
        raise BenchError(
            f"kv_blocks: a pool of {blocks} blocks cannot hold the workload's largest job "
            f"({need} blocks of {cfg.block_size}); raise --kv-blocks/--kv-fraction"
        )
    return blocks


def run_bench(cfg: BenchConfig, progress: Any = None) -> tuple[Results, Path]:
    """Runs every policy on the same workload and writes ``results.json`` and the report.

    Args:
        cfg: the run.
        progress: optional ``rich.progress.Progress`` to show per-policy progress bars.

    Returns:
        The results and the run folder.
    """
    from asymcache_core import EngineConfig
    from eval.report import write_report
    from kernels.dispatch import compiled_kernel_count

    if cfg.repeats < 1:
        raise BenchError(f"repeats: must be >= 1, got {cfg.repeats}")
    if cfg.backend not in ("real", "sim", "http"):
        raise BenchError(f"backend: one of real, sim, http; got {cfg.backend!r}")
    policies = []
    for name in cfg.policies:
        if cfg.backend == "http":  # the server runs its own policy: names only label the runs
            policies.append(BenchPolicy(name, {}, False, "continuum"))
            continue
        try:
            policies.append(resolve_bench_policy(name))
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    if cfg.backend != "http":
        from asymcache_core.loaders import resolve_hf_config

        try:
            resolve_hf_config(cfg.model)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    trace = load_workload(cfg)
    started = dt.datetime.now(dt.UTC)
    run_dir = cfg.out or Path("runs") / started.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    t_start = time.perf_counter()
    blocks = None
    if cfg.backend == "http":
        from eval.http_backend import run_http

        if not cfg.url:
            raise BenchError("url: --backend http needs --url")
        if cfg.repeats > 1:
            raise BenchError("repeats: the http backend runs each server once (--repeats 1)")
        outcomes = run_http(cfg, trace, policies, progress)
        latency_source = "server"
    else:
        blocks = pool_blocks(cfg, trace)
        try:
            base = EngineConfig(
                model=cfg.model, device=cfg.device, block_size=cfg.block_size, num_kv_blocks=blocks,
                seed=cfg.seed, latency_profile=cfg.latency_profile, tpot_slo_ms=cfg.tpot_slo_ms,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
            )
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        loaded = None
        if cfg.backend == "real":
            from asymcache_core.loaders import load_model

            try:
                loaded = load_model(cfg.model, base.torch_device, base.torch_dtype, cfg.seed)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            if base.torch_device.type == "cuda":
                warm_up(loaded, base)
                warmed = compiled_kernel_count(cfg.device)
                if warmed is not None:
                    notes.append(f"warm-up: {warmed} Triton kernel variant(s) compiled before the runs")
        outcomes: dict[str, list[Any]] = {p.name: [] for p in policies}
        reference = None
        runs: list[tuple[BenchPolicy, int | None]] = list(run_order(policies, cfg.repeats))
        if cfg.backend == "real" and cfg.check_lossless:
            runs.append((resolve_bench_policy("vllm-apc"), None))
        latency_source = "analytic"
        for policy, repeat in runs:
            is_reference = repeat is None
            config = replace(base, **policy.engine_overrides)
            if is_reference or policy.unbounded_pool:
                # NOTE: the pool holds the whole working set: nothing is ever evicted.
                config = replace(config, num_kv_blocks=working_set_blocks(trace, cfg.block_size) + blocks)
            try:
                engine = make_engine(config, cfg.backend, loaded)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            latency_source = engine.latency.source
            label = "unbounded reference" if is_reference else policy.name
            if not is_reference and cfg.repeats > 1:
                label = f"{policy.name} ({repeat + 1}/{cfg.repeats})"
            task = progress.add_task(label, total=len(trace.jobs)) if progress is not None else None
            compiled_before = compiled_kernel_count(cfg.device) if cfg.backend == "real" else None
            outcome = drive(
                engine, trace, policy, time_scale=cfg.time_scale, seed=cfg.seed,
                concurrency=None if cfg.rate is not None else cfg.concurrency,
                sleep=None if cfg.backend == "sim" else time.sleep,
                on_progress=(lambda n, t=task: progress.update(t, completed=n)) if progress is not None else None,
            )
            if compiled_before is not None:
                compiled = (compiled_kernel_count(cfg.device) or 0) - compiled_before
                if compiled:
                    # NOTE: a compile (about a second each) inside a run lands in its latencies.
                    notes.append(f"{label}: {compiled} Triton kernel variant(s) compiled during the run")
            if is_reference:
                reference = outcome.outputs()
            else:
                outcomes[policy.name].append(outcome)
                if cfg.step_log:
                    name = step_log_name(policy.name) + (f"-run{repeat + 1}" if cfg.repeats > 1 else "")
                    write_step_log(engine.step_log, run_dir / "steps" / f"{name}.jsonl")
                    write_request_log(outcome, run_dir / "requests" / f"{name}.jsonl")
            del engine
            release_device_memory(cfg.device)
        if reference is not None:
            notes.append("lossless_agreement: tokens of every request compared with an unbounded-pool vllm-apc run")
        if cfg.backend == "sim":
            notes.append("sim backend: latency model on a virtual clock; tokens are synthetic")
        results_policies = {name: repeated_result(o, reference) for name, o in outcomes.items()}
    if cfg.backend == "http":
        results_policies = {name: policy_result(o, None) for name, o in outcomes.items()}
    results = Results(
        run=RunInfo(
            workload=cfg.workload, backend=cfg.backend, model=cfg.model, device=cfg.device,
            seed=cfg.seed, num_jobs=len(trace.jobs), kv_blocks=blocks, block_size=cfg.block_size,
            latency_profile=latency_source, started=started.isoformat(timespec="seconds"),
            duration_s=time.perf_counter() - t_start, command=cfg.command,
            machine=machine_description(cfg.device), notes=notes,
        ),
        policies=results_policies,
    )
    save_results(results, run_dir)
    write_report(results, run_dir)
    return results, run_dir
