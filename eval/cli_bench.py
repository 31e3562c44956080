"""The measuring commands: ``bench`` (runs and load sweeps), ``report``, ``profile``,
``calibrate`` and ``bench-engine``."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from agent_runtime.presets import preset_names
from eval.bench import ENGINE_FIELDS as BENCH_ENGINE_FIELDS
from eval.cli_app import (
    app,
    check_output_path,
    clean_errors,
    engine_options,
    name_list,
    number_list,
    option_given,
    torch_device_type,
)
from eval.variants import SUFFIX_SPELLINGS

#: The engine settings ``asymcache profile`` takes: those that shape a forward step (the grid
#: sizes the pool, and no scheduler runs).
PROFILE_ENGINE_FIELDS = frozenset(
    {
        "model", "device", "dtype", "block_size", "attention_backend", "batch_invariant", "enforce_eager",
        "mixed_graph_max_tokens", "seed",
    }
)


@app.command()
@clean_errors
@engine_options(
    {*BENCH_ENGINE_FIELDS, "num_kv_blocks", "max_model_len"},
    defaults={"max_model_len": 512, "max_num_batched_tokens": 512, "tpot_slo_ms": 100.0},
    helps={
        "num_kv_blocks": "KV pool size in blocks (default: from --gpu-memory-utilization, else --kv-fraction).",
        "max_model_len": "Cut jobs to the turns whose context fits this (the engine keeps the model's limit).",
        "seed": "Seeds the workload, its tokens and the engine (--seeds runs several).",
        "gpu_memory_utilization": "Size the pool as a server does: this share of the device's memory, less the "
        "weights and activations (vLLM's meaning; the sim backend splits its latency profile's device).",
    },
)
def bench(
    ctx: typer.Context,
    workload: str = typer.Option(
        "swe", help="swe | toolloop | chat | trace:PATH (or sharegpt:/bfcl:/mooncake:/bailian:PATH); comma-separated for several."
    ),
    policies: str = typer.Option(
        "vllm-apc,continuum,asymcache,asymcache+continuum",
        help=f"Comma-separated serving presets ({', '.join(preset_names())}), each with optional /SUFFIX "
        f"ablations that combine ({', '.join('/' + x for x in SUFFIX_SPELLINGS)}; N, P, MS: numbers; "
        "slo:MS beside /adaptive).",
    ),
    backend: str = typer.Option("real", help="real | sim | http."),
    url: str = typer.Option(None, help="Base URL of an OpenAI-compatible server (http backend)."),
    jobs: int = typer.Option(6, min=1, help="Jobs in the workload (per load point)."),
    rate: str = typer.Option(None, help="Poisson arrivals in jobs/s (default: closed loop); a comma list sweeps."),
    concurrency: str = typer.Option("6", help="Jobs in flight in the closed loop; a comma list sweeps (16,32,64)."),
    seeds: str = typer.Option(None, help="Comma-separated seeds: every load point runs once per seed."),
    suite: str = typer.Option(None, help="A named sweep (agents): its workloads, seeds, loads and settings; "
                              "options given on the command line win."),
    slo: str = typer.Option(None, help="Goodput targets: jct:S,ttft:MS,tpot:MS (any subset)."),
    workers: int = typer.Option(1, min=1, help="Sweep points run at once (sim backend; one process each)."),
    time_scale: float = typer.Option(0.05, min=0.0, help="Multiplies tool pauses and think times (not --rate's arrivals: jobs/s of the run)."),
    token_scale: float = typer.Option(0.05, min=0.0001, help="Multiplies generated token lengths."),
    kv_fraction: float = typer.Option(
        None, help="Pool as a share, in (0, 1], of the whole workload's working set (ablations; default 0.5, raised to "
        "hold the largest job; a fraction given that cannot hold it is an error). With many jobs that pool may never fill: --num-kv-blocks puts it under pressure.",
    ),
    out: Path = typer.Option(None, help="Run folder (default runs/<time>)."),
    lossless_check: bool = typer.Option(
        True, "--lossless-check/--no-lossless-check",
        help="Compare every policy's tokens with an unbounded-pool reference run (real backend).",
    ),
    step_log: bool = typer.Option(
        False, "--step-log", help="Also write every engine step to steps/<policy>.jsonl and every request to requests/<policy>.jsonl."
    ),
    plots: bool = typer.Option(
        True, "--plots/--no-plots",
        help="Draw the reports' PNG plots (about a second a run or sweep point; `asymcache report RUN_DIR` draws them later).",
    ),
    repeats: int = typer.Option(
        1, min=1, help="Runs of each policy, in rounds (order rotated each round); the report shows each mean with "
        "the least and the greatest of the runs. The sim backend is deterministic, so there run r uses seed + r.",
    ),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Run a workload through a grid of policies and report JCT, TTFT, TPOT and cache figures;
    several loads, seeds or workloads make a load sweep (sweep.json, capacity at the SLO)."""
    from asymcache_core import EngineConfig
    from eval.bench import BenchConfig
    from eval.sweep import SUITES, sweep_points

    # NOTE: the settings are checked before anything loads (the bench resolves the model first).
    EngineConfig(**engine_args)
    check_output_path("out", RUNS_DIR if out is None else out, folder=True)

    options: dict[str, Any] = {
        "workload": workload, "policies": policies, "backend": backend, "jobs": jobs, "rate": rate,
        "concurrency": concurrency, "seeds": seeds, "time_scale": time_scale, "token_scale": token_scale,
        "check_lossless": lossless_check, **engine_args,
    }
    if suite is not None:
        if suite not in SUITES:
            raise ValueError(f"suite: unknown suite {suite!r}; known: {', '.join(SUITES)}")
        given = {name for name in ctx.params if option_given(ctx, name)} | ({"check_lossless"} if option_given(ctx, "lossless_check") else set())
        for key, value in SUITES[suite].items():
            if key not in given:
                options[key] = ",".join(map(str, value)) if isinstance(value, tuple) else value
    workloads = name_list("workload", options.pop("workload"))
    seed = options.pop("seed")
    given_seeds = number_list("seeds", options.pop("seeds"), int)
    # NOTE: a bad item of --seeds once failed as the point's seed ("seed: must be ..."),
    # naming an option the command line does not hold
    bad_seed = next((s for s in given_seeds if not 0 <= s < 1 << 64), None)
    if bad_seed is not None:
        raise ValueError(f"seeds: every seed must be an integer in [0, 2**64), got {bad_seed}")
    seed_list = given_seeds or [seed]
    rates = number_list("rate", options.pop("rate"), float)
    loads = number_list("concurrency", options.pop("concurrency"), int)
    if rates and not option_given(ctx, "concurrency"):
        loads = []  # --rate alone: open-loop points only
    bad_load = next((c for c in loads if c < 1), None)
    if bad_load is not None:
        raise ValueError(f"concurrency: must be >= 1, got {bad_load}")
    bad_rate = next((r for r in rates if not r > 0), None)
    if bad_rate is not None:
        raise ValueError(f"rate: must be > 0, got {bad_rate:g}")
    policy_names = tuple(name_list("policies", options.pop("policies")))
    points = sweep_points(workloads, seed_list, loads, rates)
    first = points[0]  # a single run; a sweep sets each point's own
    cfg = BenchConfig(
        policies=policy_names, url=url, workload=first.workload, seed=first.seed, rate=first.rate,
        concurrency=first.concurrency or 1, kv_fraction=kv_fraction, out=out, step_log=step_log,
        repeats=repeats, slo=slo, plots=plots, **options,
    )
    with no_empty_run_folders(out):
        _run_bench_or_sweep(cfg, points, workers)


#: Where a run folder goes when ``--out`` is not given (``runs/<time>``, named by the bench).
RUNS_DIR = Path("runs")


def _has_files(folder: Path) -> bool:
    return any(p.is_file() or p.is_symlink() for p in folder.rglob("*"))


@contextlib.contextmanager
def no_empty_run_folders(out: Path | None, runs_dir: Path = RUNS_DIR) -> Iterator[None]:
    """Removes the run folder a failed bench created if nothing was written into it.

    Args:
        out: ``--out`` (``None``: a new folder under ``runs_dir``).
        runs_dir: the parent of default run folders.
    """
    parent = runs_dir if out is None else out.parent
    parent_existed = parent.exists()
    before = {p.name for p in parent.iterdir()} if parent.is_dir() else set()
    try:
        yield
    except BaseException:
        created = [out] if out is not None and out.name not in before else []
        if out is None and parent.is_dir():
            created = [p for p in parent.iterdir() if p.name not in before and p.is_dir()]
        for folder in created:
            if folder.is_dir() and not _has_files(folder):
                shutil.rmtree(folder, ignore_errors=True)
        if not parent_existed and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
        raise


def _run_bench_or_sweep(cfg: Any, points: list[Any], workers: int) -> None:
    """One run (a progress bar per policy) or a sweep (a line per point)."""
    from eval.bench import run_bench
    from eval.sweep import run_sweep

    if len(points) == 1:
        from eval.cli_progress import progress_for, showing_model_loads

        with progress_for() as progress, showing_model_loads(progress):
            results, run_dir = run_bench(cfg, progress)
        print_results_table(results)
        typer.echo(f"report: {run_dir / 'report.html'}")
        return

    def on_point(done: int, total: int, point: Any, seconds: float) -> None:
        # NOTE: one line per point, flushed, so a sweep written to a log shows its progress.
        typer.echo(f"[{done}/{total}] {point.label} done ({seconds:.0f} s)", err=True)

    sweep, run_dir = run_sweep(cfg, points, workers=workers, on_point=on_point)
    print_capacity_table(sweep)
    typer.echo(f"report: {run_dir / 'sweep.html'}")


def print_capacity_table(sweep: Any) -> None:
    """The sweep's capacity at the JCT p90 target, per workload and variant."""
    from rich.console import Console
    from rich.table import Table

    from eval.sweep_report import capacity_rows, format_capacity

    table = Table(title=f"capacity within the JCT p90 target ({sweep.backend}, {sweep.model})")
    for col in ("workload", "variant", "JCT p90 target", "capacity"):
        table.add_column(col, justify="left" if col in ("workload", "variant") else "right")
    for workload, name, target, _, cap, at_end in capacity_rows(sweep):
        table.add_row(workload, name, f"{target:.1f}s", format_capacity(cap, at_end))
    Console(width=150).print(table)


def print_results_table(results: Any) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from eval.report_summary import format_metric, run_warnings

    run = results.run
    runs = max((len(r.runs) for r in results.policies.values()), default=0)
    if run.backend == "http":
        pool = ""  # NOTE: the server's pool, unknown here
    else:
        pool = f", pool {run.kv_blocks} blocks" if run.kv_blocks is not None else ", pool unbounded"
    title = f"{run.workload} x {run.num_jobs} jobs, {run.backend}, {run.model}{pool}"
    if runs > 1:
        title += f", {runs} runs each (means: mean [min, max] over the runs)"
    table = Table(title=escape(title))
    for col in ("policy", "JCT mean", "JCT p95", "TTFT mean", "TPOT mean", "hit rate", "computed tok", "recomputed",
                "evictions", "peak blocks", "lossless"):
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    for name, r in results.policies.items():
        agree = "-" if r.lossless_agreement is None else f"{r.lossless_agreement:.0%}"
        cells = (
            name, format_metric(r, "jct_mean", r.jct.mean), s(r.jct.p95), format_metric(r, "ttft_mean", r.ttft.mean),
            format_metric(r, "tpot_mean", r.tpot.mean), f"{r.hit_rate:.1%}", str(r.computed_tokens),
            str(r.recomputed_tokens.total), str(r.evictions), str(r.peak_blocks_in_use), agree,
        )
        table.add_row(*(escape(c) for c in cells))
    # NOTE: wide enough for three intervals on one line each (a log is no terminal to wrap for).
    Console(width=200).print(table)
    for warning in run_warnings(results):
        typer.echo(f"warning: {warning}")


@app.command()
@clean_errors
def report(run_dir: Path = typer.Argument(..., help="A run folder holding results.json (or a sweep's sweep.json), or that file.")) -> None:
    """Rebuild report.md, the plots and report.html from a run folder's results.json (a sweep
    folder: sweep.md and sweep.html from its sweep.json)."""
    from eval.report import rebuild_report
    from eval.results_io import RESULTS_FILE
    from eval.sweep_results import SWEEP_FILE

    if run_dir.is_file():
        if run_dir.name not in (RESULTS_FILE, SWEEP_FILE):
            raise ValueError(f"run_dir: {str(run_dir)!r} is a file; give the run folder that holds {RESULTS_FILE}")
        run_dir = run_dir.parent
    elif not run_dir.is_dir():
        raise ValueError(f"run_dir: no folder {str(run_dir)!r}")
    if (run_dir / SWEEP_FILE).is_file():
        from eval.sweep_report import rebuild_sweep_report

        paths = rebuild_sweep_report(run_dir)
    else:
        paths = rebuild_report(run_dir)
    for path in paths:
        typer.echo(str(path))


@app.command()
@clean_errors
@engine_options(PROFILE_ENGINE_FIELDS)
def profile(
    out: Path = typer.Option(Path("profile.json"), help="Where to write the profile."),
    repeats: int = typer.Option(3, min=1),
    quick: bool = typer.Option(False, "--quick", help="A smaller grid (tests, smoke runs)."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Measure the engine's forward steps and fit the step-latency model (knee, fit error)."""
    from asymcache_core import Engine, EngineConfig
    from asymcache_core.profiler import ProfileGrid, fit, measure

    config = EngineConfig(**engine_args)
    model, device = config.model, config.device
    check_output_path("out", out)
    grid = ProfileGrid.for_device(torch_device_type(device), repeats=repeats)
    if quick:
        grid = ProfileGrid(chunk_tokens=(1, 16, 64), contexts=(0, 128), decode_batches=(1, 4),
                           decode_contexts=(64, 256), repeats=1)
    from eval.cli_progress import progress_for, showing_model_loads

    with showing_model_loads():
        engine = Engine(dataclasses.replace(config, num_kv_blocks=grid.num_blocks_needed(config.block_size)))
    with progress_for() as progress:
        task = progress.add_task("profiling", total=len(grid.points()))
        points = measure(engine, grid, lambda done, total: progress.update(task, completed=done))
    latency = fit(points, model=model, device=device, source=str(out))
    if engine.config.torch_device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(engine.config.torch_device).total_memory
        latency = dataclasses.replace(latency, device_memory_bytes=total)
    latency.to_json(out)
    typer.echo(
        f"floor {latency.floor_s * 1e3:.2f} ms, per token {latency.per_token_s * 1e6:.1f} us above a knee of "
        f"{latency.knee_tokens} tokens, attention {latency.per_attn_s * 1e9:.3f} ns/pair, "
        f"fit error {latency.fit_error:.1%} -> {out}"
    )
    if latency.decode_floor_s is not None:
        typer.echo(f"decode-only steps (CUDA graphs): floor {latency.decode_floor_s * 1e3:.2f} ms")
    typer.echo(f"decodes: {latency.per_decode_kv_s * 1e9:.2f} ns per key read")


@app.command()
@clean_errors
def calibrate(
    steps: list[Path] = typer.Argument(..., help="Step logs (steps/<policy>.jsonl of bench --step-log)."),
    latency_profile: Path = typer.Option(..., help="The profile to correct."),
    out: Path = typer.Option(Path("profile_live.json"), help="Where to write the corrected profile."),
) -> None:
    """Refit a latency profile's floors, decode term and host gap to live steps (for the simulator)."""
    import json

    from asymcache_core.latency_model import LatencyModel
    from asymcache_core.profiler import calibrate as calibrate_profile

    check_output_path("out", out)
    base = LatencyModel.from_json(latency_profile)
    records = []
    for path in steps:
        try:
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"steps: {path} is not JSON lines ({exc})") from None
    latency = calibrate_profile(base, records, source=str(out))
    latency.to_json(out)
    before = base.decode_floor_s if base.decode_floor_s is not None else base.floor_s
    after = latency.decode_floor_s if latency.decode_floor_s is not None else latency.floor_s
    typer.echo(
        f"{len(records)} steps: floor {base.floor_s * 1e3:.2f} -> {latency.floor_s * 1e3:.2f} ms, decode-only "
        f"{before * 1e3:.2f} -> {after * 1e3:.2f} ms + {base.per_decode_kv_s * 1e9:.2f} -> "
        f"{latency.per_decode_kv_s * 1e9:.2f} ns a key, host gap between steps {base.host_gap_s * 1e3:.2f} -> "
        f"{latency.host_gap_s * 1e3:.2f} ms, error on these steps {latency.fit_error:.1%} -> {out}"
    )


@app.command("bench-engine")
@clean_errors
@engine_options({"seed"})
def bench_engine(
    prompt_len: int = typer.Option(128, min=1),
    new_tokens: int = typer.Option(64, min=2),
    repeats: int = typer.Option(3, min=1, help="Measurements per engine and batch size, the engines alternating."),
    sampling: str = typer.Option("greedy", help="greedy, or random: temperature 0.7 and top-p 0.9 in both engines."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Engine prefill/decode tokens/s against transformers' generate (SmolLM2 fp32 on the CPU,
    batch 1 and 16; medians of alternating runs)."""
    from asymcache_core import EngineConfig
    from eval.bench_engine import SAMPLINGS, run
    from eval.cli_progress import progress_for, showing_model_loads

    if sampling not in SAMPLINGS:
        raise ValueError(f"--sampling: must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    seed = EngineConfig(**engine_args).seed
    with progress_for() as progress, showing_model_loads(progress):
        run(prompt_len=prompt_len, new_tokens=new_tokens, seed=seed, progress=progress, repeats=repeats,
            sampling=sampling)
