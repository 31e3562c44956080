"""``asymcache bench``: a workload through a grid of bench variants, reported side by side.

A bench variant is a serving preset plus ablation suffixes (:mod:`eval.variants`);
``--policies`` takes a comma-separated list.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.bench_checks import BenchError, check_bench_sizes, check_kv_fraction
from eval.bench_workload import load_workload as load_workload  # NOTE: re-exported, its old home
from eval.bench_workload import load_workload_cut
from eval.harness import (
    drive,
    largest_request_blocks,
    machine_description,
    make_engine,
    policy_result,
    repeated_result,
    warm_up,
    working_set_blocks,
)
from eval.results import SLO, Results, RunInfo
from eval.results_io import save_results
from eval.variants import DEFAULT_POLICIES, BenchVariant

if TYPE_CHECKING:
    from asymcache_core.memory_budget import KVPoolPlan

#: The :class:`asymcache_core.EngineConfig` fields a :class:`BenchConfig` carries, under the same
#: names, and hands to every run's engine (the variant's overrides go on top). ``num_kv_blocks``
#: and ``max_model_len`` are engine fields too, but the bench reads them itself (see there).
ENGINE_FIELDS: tuple[str, ...] = (
    "model", "device", "dtype", "block_size", "max_num_batched_tokens", "max_num_seqs",
    "latency_profile", "tpot_slo_ms", "ttft_slo_ms", "attention_backend", "batch_invariant", "enforce_eager",
    "mixed_graph_max_tokens", "seed", "gpu_memory_utilization", "device_memory_gib", "cpu_offload_gb",
    "num_host_kv_blocks", "async_scheduling", "jump_forward", "speculative_config",
)


@dataclass
class BenchConfig:
    """What ``asymcache bench`` runs (CLI options map one to one; engine settings carry
    :class:`asymcache_core.EngineConfig`'s field names).

    Attributes:
        workload: ``swe``, ``toolloop``, ``chat`` or ``trace:PATH`` (or an importer spec).
        policies: bench variants (``PRESET`` or ``PRESET/SUFFIX...``, :class:`BenchVariant`).
        model: engine model spec.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: the engine's dtype (``auto``: float32 on CPU, bfloat16 on CUDA).
        backend: ``real``, ``sim`` or ``http``.
        url: server base URL for ``http``.
        jobs: jobs in the workload.
        rate: Poisson arrivals (jobs/s); ``None`` runs a closed loop.
        concurrency: jobs in flight in the closed loop.
        time_scale: multiplies tool pauses and think times; ``rate``'s arrivals are not scaled
            (jobs per second of the run).
        token_scale: multiplies the generators' token lengths (small models, CPU runs).
        num_kv_blocks: pool size in blocks (overrides ``kv_fraction``).
        gpu_memory_utilization: size the pool the way a server does, from the device's memory
            after the weights and the activations (vLLM's meaning,
            :func:`asymcache_core.memory_budget.plan_kv_pool`); the ``sim`` backend splits the
            memory of the device its latency profile was measured on (or ``device_memory_gib``).
        device_memory_gib: the memory ``gpu_memory_utilization`` splits (default: the device's,
            or the latency profile's for ``sim``).
        kv_fraction: pool as a fraction of the workload's working set (ablations); ``None``
            (and no ``gpu_memory_utilization``): 0.5, raised to what the largest job needs (an
            explicit fraction that cannot hold it is an error).
        block_size: tokens per block.
        max_model_len: longest context of a job: jobs are cut to the turns whose context fits
            (``None``: not cut). The engine keeps the model's own limit.
        seed: workload, token and engine seed.
        out: run folder (``runs/<timestamp>`` by default).
        check_lossless: also run an unbounded pool and compare every variant's tokens (real).
        latency_profile: JSON profile for the latency model (default: analytic).
        tpot_slo_ms: adaptive chunking's target.
        ttft_slo_ms: the engines' time-to-first-token target (bounds the default's program
            order; ``None``: unbounded). ``slo``'s ``ttft:MS`` only counts goodput.
        max_num_batched_tokens: per-step token cap.
        max_num_seqs: running requests at most.
        attention_backend: the engine's attention path (the ``no-msa`` suffix sets ``torch``).
        batch_invariant: the engines' batch-invariant mode (``None``: the engine's default, on
            for CUDA devices in bfloat16/float16).
        enforce_eager: never capture CUDA graphs.
        async_scheduling: plan each step while the previous one runs (``None``: the engine's
            default, on for the real backend on one CUDA device).
        jump_forward: append the tokens a request's grammar forces at once (``None``: the
            engine's default, on).
        speculative_config: vLLM's n-gram speculative decoding JSON (real backend only).
        mixed_graph_max_tokens: largest step replayed as piecewise CUDA graphs.
        step_log: also write every engine step (``StepStats``, with the latency model's
            prediction) to ``steps/<variant>.jsonl`` in the run folder.
        repeats: runs of each variant, in rounds over all variants (A, B, A, B...), so that
            slow drift of the machine hits every variant alike; the report pools them and
            keeps each run's means. On the ``sim`` backend repeat ``r`` runs the workload of
            seed ``seed + r`` (see :func:`repeat_seed`).
        slo: goodput targets, ``jct:S,ttft:MS,tpot:MS`` (:class:`eval.results.SLO`).
        cpu_offload_gb: every variant's host KV tier (GiB; :mod:`asymcache_core.host_tier`).
        num_host_kv_blocks: the host tier in blocks (overrides ``cpu_offload_gb``).
        plots: draw the report's PNG plots (``False``: the report says where each would be;
            ``asymcache report`` draws them later).
    """

    workload: str = "swe"
    policies: tuple[str, ...] = DEFAULT_POLICIES
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "auto"
    backend: str = "real"
    url: str | None = None
    jobs: int = 6
    rate: float | None = None
    concurrency: int = 6
    time_scale: float = 0.05
    token_scale: float = 0.05
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    device_memory_gib: float | None = None
    kv_fraction: float | None = None
    block_size: int = 16
    max_model_len: int | None = 512
    seed: int = 0
    out: Path | None = None
    check_lossless: bool = True
    latency_profile: str | None = None
    tpot_slo_ms: float = 100.0
    ttft_slo_ms: float | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    attention_backend: str = "auto"
    batch_invariant: bool | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    jump_forward: bool | None = None
    speculative_config: str | None = None
    mixed_graph_max_tokens: int = 1024
    step_log: bool = False
    repeats: int = 1
    slo: str | None = None
    cpu_offload_gb: float = 0.0
    num_host_kv_blocks: int | None = None
    plots: bool = True
    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in sys.argv))


def step_log_name(variant: str) -> str:
    """A file name for ``variant`` (``asymcache/fixed:256`` -> ``asymcache_fixed-256``)."""
    return variant.replace("/", "_").replace(":", "-").replace("+", "-")


def write_step_log(steps: Iterable[Any], path: Path) -> Path:
    """Writes one JSON object per engine step (the fields of ``StepStats``).

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step in steps:
            f.write(json.dumps(asdict(step)) + "\n")
    return path


def run_order(variants: list[BenchVariant], repeats: int) -> list[tuple[BenchVariant, int]]:
    """``(variant, repeat)`` in the order they run: rounds over the variants, each round's order
    rotated by one.

    NOTE: rounds spread the machine's drift over all variants alike. The rotation is there
    because on the GPU the variant that ran first in its round measured a lower chat TTFT more
    often than not. Rotating puts every variant first equally often when ``repeats`` is a
    multiple of the number of variants.
    """
    runs: list[tuple[BenchVariant, int]] = []
    for r in range(repeats):
        shift = r % max(1, len(variants))
        runs += [(v, r) for v in variants[shift:] + variants[:shift]]
    return runs


def repeat_seed(cfg: BenchConfig, repeat: int) -> int:
    """The workload, token and engine seed of run ``repeat`` (from 0) of every variant.

    NOTE: the ``sim`` backend runs on a virtual clock and is deterministic: a repeat with the
    same seed is the same run to the last step, and its spread would be zero. There each repeat
    draws a fresh workload instead, so that the report's interval is the spread over workloads.
    On the ``real`` and ``http`` backends the seed stays, and the spread is the machine's.
    """
    return cfg.seed + repeat if cfg.backend == "sim" else cfg.seed


def release_device_memory(device: str) -> None:
    """Collects the last run's engine before the next is built.

    NOTE: otherwise its garbage (requests, blocks, CUDA graphs and the KV pool) can be
    collected in the middle of the next variant's run, and two pools are held while the next
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


def engine_dtype(cfg: BenchConfig) -> str:
    """The engines' dtype: ``cfg.dtype``, except that a ``sim`` run with a CUDA latency profile
    and ``auto`` holds bfloat16 KV, as the engine would on that device (block bytes size the
    pool and the host tier)."""
    from asymcache_core.latency_model import LatencyModel

    if cfg.backend == "sim" and cfg.dtype == "auto" and cfg.latency_profile:
        if LatencyModel.from_json(cfg.latency_profile).device == "cuda":
            return "bfloat16"
    return cfg.dtype


def memory_pool_plan(cfg: BenchConfig, loaded: Any = None) -> KVPoolPlan:
    """The pool ``cfg.gpu_memory_utilization`` leaves on the run's device.

    The ``sim`` backend sizes it for the device its latency profile was measured on: that
    profile's memory (``--device-memory-gib`` overrides it) and, when the profile is a CUDA one
    and ``--dtype`` is ``auto``, bfloat16 KV and weights, as the engine would hold them there.

    Args:
        cfg: the run (``gpu_memory_utilization`` set).
        loaded: the loaded model of a ``real`` run (its weights are measured).

    Returns:
        The split of the device memory.

    Raises:
        BenchError: no device memory to split, or no room left for a block.
    """
    import torch

    from asymcache_core.config import EngineConfig
    from asymcache_core.latency_model import LatencyModel
    from asymcache_core.loaders import resolve_hf_config
    from asymcache_core.memory_budget import GIB, plan_for_device
    from asymcache_core.models import ModelConfig

    assert cfg.gpu_memory_utilization is not None
    engine_config = EngineConfig(device=cfg.device, dtype=engine_dtype(cfg))
    dtype = engine_config.torch_dtype
    total = None if cfg.device_memory_gib is None else int(cfg.device_memory_gib * GIB)
    if cfg.backend == "sim" and total is None and cfg.latency_profile:
        total = LatencyModel.from_json(cfg.latency_profile).device_memory_bytes
    model = loaded.config if loaded is not None else ModelConfig.from_hf(resolve_hf_config(cfg.model)[0])
    try:
        return plan_for_device(
            model, gpu_memory_utilization=cfg.gpu_memory_utilization, device=engine_config.torch_device,
            block_size=cfg.block_size, dtype_bytes=torch.finfo(dtype).bits // 8,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            weights=loaded.model if loaded is not None else None, device_memory_bytes=total,
        )
    except ValueError as exc:
        raise BenchError(str(exc)) from None


def pool_blocks(cfg: BenchConfig, trace: Any, plan: KVPoolPlan | None = None) -> int:
    """The pool of a run, in blocks: ``num_kv_blocks``, else the memory ``plan``, else the
    ``kv_fraction`` of the workload's working set.

    Raises:
        BenchError: a pool that cannot hold the workload's largest request, naming the option
            that sized it.
    """
    need = largest_request_blocks(trace, cfg.block_size)
    if cfg.num_kv_blocks is not None:
        blocks, sized_by = cfg.num_kv_blocks, "num_kv_blocks"
    elif plan is not None:
        blocks, sized_by = plan.num_blocks, "gpu_memory_utilization"
    elif cfg.kv_fraction is None:
        blocks = max(need, int(0.5 * working_set_blocks(trace, cfg.block_size)))
        sized_by = "num_kv_blocks"
    else:
        check_kv_fraction(cfg.kv_fraction)
        working_set = working_set_blocks(trace, cfg.block_size)
        blocks = int(cfg.kv_fraction * working_set)
        if blocks < need:
            raise BenchError(
                f"kv_fraction: {cfg.kv_fraction:g} of the workload's working set of {working_set} blocks is a "
                f"pool of {blocks} blocks, which cannot hold its largest job ({need} blocks of {cfg.block_size}); "
                "raise --kv-fraction or give --num-kv-blocks"
            )
    if blocks < need:
        raise BenchError(
            f"{sized_by}: a pool of {blocks} blocks cannot hold the workload's largest job "
            f"({need} blocks of {cfg.block_size}); raise --num-kv-blocks, --gpu-memory-utilization or --kv-fraction"
        )
    return blocks


def run_bench(cfg: BenchConfig, progress: Any = None) -> tuple[Results, Path]:
    """Runs every variant on the same workload and writes ``results.json`` and the report.

    Args:
        cfg: the run.
        progress: optional ``rich.progress.Progress`` to show per-variant progress bars.

    Returns:
        The results and the run folder.
    """
    from asymcache_core import EngineConfig
    from eval.report import write_report
    from kernels.dispatch import compiled_kernel_count

    check_bench_sizes(cfg)
    if cfg.backend not in ("real", "sim", "http"):
        raise BenchError(f"backend: one of real, sim, http; got {cfg.backend!r}")
    if cfg.max_model_len is not None and (
        not isinstance(cfg.max_model_len, int) or isinstance(cfg.max_model_len, bool) or cfg.max_model_len < 1
    ):
        raise BenchError(f"max_model_len: must be an integer >= 1, got {cfg.max_model_len!r}")
    variants = []
    for name in cfg.policies:
        if cfg.backend == "http":  # the server runs its own configuration: names only label the runs
            variants.append(BenchVariant.label(name))
            continue
        try:
            variants.append(BenchVariant.parse(name))
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    if cfg.backend != "http":
        from asymcache_core.engine_setup import check_max_model_len
        from asymcache_core.loaders import resolve_hf_config
        from asymcache_core.models import ModelConfig

        try:
            model_config = ModelConfig.from_hf(resolve_hf_config(cfg.model)[0])
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        try:
            # NOTE: jobs are cut to max_model_len, but the engine runs at most the model's
            # positions: a longer job would fail in the middle of the run. The engine's check,
            # so that the bench says it in the API's words.
            check_max_model_len(cfg, model_config)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    try:
        slo = SLO.parse(cfg.slo) if cfg.slo else None
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    trace, cuts = load_workload_cut(cfg)
    seeds = {r: repeat_seed(cfg, r) for r in range(cfg.repeats)}
    several = len(set(seeds.values()) | {cfg.seed}) > 1  # NOTE: sim repeats: one workload per seed
    cut_notes = [cuts.note(cfg.seed if several else None)] if cuts is not None else []
    traces = {}
    for r, seed in seeds.items():
        if seed == cfg.seed:
            traces[r] = trace
            continue
        traces[r], cuts = load_workload_cut(replace(cfg, seed=seed))
        cut_notes.append(cuts.note(seed) if cuts is not None else None)
    started = dt.datetime.now(dt.UTC)
    run_dir = cfg.out or Path("runs") / started.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: the run goes on without the jobs that do not fit, but says so (notes, warnings)
    notes: list[str] = [note for note in cut_notes if note is not None]
    t_start = time.perf_counter()
    blocks = None
    if cfg.backend == "http":
        from eval.http_backend import run_http

        if not cfg.url:
            raise BenchError("url: --backend http needs --url")
        if cfg.repeats > 1:
            raise BenchError("repeats: the http backend runs each server once (--repeats 1)")
        outcomes = run_http(cfg, trace, variants, progress)
        latency_source = "server"
    else:
        try:
            # NOTE: ``max_model_len`` only cuts the jobs: the engine keeps the model's own limit,
            # which sizes its CUDA graphs, so that a shorter cut does not change what is timed.
            base = EngineConfig(**{name: getattr(cfg, name) for name in ENGINE_FIELDS})
            base = replace(base, dtype=engine_dtype(cfg))
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        loaded = None
        if cfg.backend == "real":
            from asymcache_core.loaders import load_model

            try:
                loaded = load_model(cfg.model, base.torch_device, base.torch_dtype, cfg.seed)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
        plan = None
        if cfg.num_kv_blocks is None and cfg.gpu_memory_utilization is not None:
            plan = memory_pool_plan(cfg, loaded)
            notes.append(f"KV pool from --gpu-memory-utilization {cfg.gpu_memory_utilization}: {plan.describe()}")
        blocks = pool_blocks(cfg, trace, plan)
        for other in traces.values():
            pool_blocks(replace(cfg, num_kv_blocks=blocks), other)  # every repeat's largest job fits
        base = replace(base, num_kv_blocks=blocks)
        if cfg.backend == "real":
            if base.torch_device.type == "cuda":
                warm_up(loaded, base)
                warmed = compiled_kernel_count(cfg.device)
                if warmed is not None:
                    notes.append(f"warm-up: {warmed} Triton kernel variant(s) compiled before the runs")
        outcomes: dict[str, list[Any]] = {v.name: [] for v in variants}
        reference = None
        runs: list[tuple[BenchVariant, int | None]] = list(run_order(variants, cfg.repeats))
        if cfg.backend == "real" and cfg.check_lossless:
            runs.append((BenchVariant.parse("vllm-apc"), None))
        latency_source = "analytic"
        for variant, repeat in runs:
            is_reference = repeat is None
            run_trace = trace if repeat is None else traces[repeat]
            run_seed = cfg.seed if repeat is None else repeat_seed(cfg, repeat)
            config = replace(base, seed=run_seed, **variant.engine_overrides)
            if is_reference or variant.unbounded_pool:
                # NOTE: the pool holds the whole working set: nothing is ever evicted (nor offloaded).
                config = replace(config, num_kv_blocks=working_set_blocks(run_trace, cfg.block_size) + blocks,
                                 num_host_kv_blocks=0)
            try:
                engine = make_engine(config, cfg.backend, loaded)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            latency_source = engine.latency.source
            label = "unbounded reference" if is_reference else variant.name
            if not is_reference and cfg.repeats > 1:
                label = f"{variant.name} ({repeat + 1}/{cfg.repeats})"
            task = progress.add_task(label, total=len(run_trace.jobs)) if progress is not None else None
            compiled_before = compiled_kernel_count(cfg.device) if cfg.backend == "real" else None
            outcome = drive(
                engine, run_trace, variant, time_scale=cfg.time_scale, seed=run_seed,
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
                outcomes[variant.name].append(outcome)
                if cfg.step_log:
                    name = step_log_name(variant.name) + (f"-run{repeat + 1}" if cfg.repeats > 1 else "")
                    write_step_log(engine.step_log, run_dir / "steps" / f"{name}.jsonl")
                    write_request_log(outcome, run_dir / "requests" / f"{name}.jsonl")
            del engine
            release_device_memory(cfg.device)
        if reference is not None:
            notes.append("lossless_agreement: tokens of every request compared with an unbounded-pool vllm-apc run")
        if cfg.backend == "sim":
            notes.append("sim backend: latency model on a virtual clock; tokens are synthetic")
            if cfg.repeats > 1:
                notes.append(
                    f"sim backend: repeat r runs workload seed {cfg.seed} + r (seeds {cfg.seed}..{cfg.seed + cfg.repeats - 1}); "
                    "the intervals are the spread over workloads"
                )
        results_policies = {name: repeated_result(o, reference, slo) for name, o in outcomes.items()}
    if cfg.backend == "http":
        results_policies = {name: policy_result(o, None, slo) for name, o in outcomes.items()}
    results = Results(
        run=RunInfo(
            workload=cfg.workload, backend=cfg.backend, model=cfg.model, device=cfg.device,
            seed=cfg.seed, num_jobs=len(trace.jobs), kv_blocks=blocks, block_size=cfg.block_size,
            latency_profile=latency_source, started=started.isoformat(timespec="seconds"),
            duration_s=time.perf_counter() - t_start, command=cfg.command,
            machine=machine_description(cfg.device), notes=notes,
            concurrency=None if cfg.rate is not None else cfg.concurrency, rate=cfg.rate, slo=slo,
            time_scale=cfg.time_scale,
        ),
        policies=results_policies,
    )
    save_results(results, run_dir)
    write_report(results, run_dir, plots=cfg.plots)
    return results, run_dir
