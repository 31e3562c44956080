"""``asymcache bench`` over a load sweep: workloads x seeds x load points, every point a full
bench run (all variants side by side), summarised in ``sweep.json`` and a sweep report.

A load point is one closed-loop concurrency (jobs in flight) or one Poisson rate (jobs/s).
The operator's question, "how many agents can one GPU serve within my SLO, and what does each
variant buy me?", is answered by :func:`capacity_at_slo`: the largest load at which a variant's
JCT p90 (mean over seeds) stays within the SLO, interpolated between points.

Layout of a sweep folder::

    RUN_DIR/
      sweep.json              # a ``SweepResults`` document (this module)
      sweep.md, sweep.html, sweep_*.png   # written by ``eval.sweep_report``
      points/<workload>-s<seed>-<load>/   # one bench run folder per point (results.json, report)
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from eval.bench import BenchConfig, BenchError, check_bench_sizes, load_workload, run_bench
from eval.results import SLO
from eval.results_io import RESULTS_FILE, load_results
from eval.sweep_results import SweepPoint, SweepResults, point_figures, save_sweep, workload_slugs

# NOTE: the suites' files live in the project's bench_traces/, found from here, so that a suite
# runs from any working directory.
_TRACES = Path(__file__).resolve().parents[1] / "bench_traces"

#: A suite: the workloads, seeds and load points ``--suite NAME`` runs, and the settings it
#: runs them at unless the command line says otherwise.
SUITES: dict[str, dict[str, Any]] = {
    "agents": {
        "workload": ("swe", "toolloop", "chat", f"bfcl:{_TRACES / 'bfcl_multi_turn_sample.jsonl'}"),
        "seeds": (1, 2, 3),
        "concurrency": (32, 64, 128, 256),
        "jobs": 300,
        "policies": (
            "vllm-apc/reserve-prompt", "continuum/reserve-prompt", "asymcache+continuum/reserve-prompt",
            "vllm-apc/reserve-prompt/unbounded",
        ),
        "backend": "sim",
        "model": "dummy:llama-3.1-8b",
        "latency_profile": str(_TRACES / "profile_h200_llama8b_live_async_2026_12_03.json"),
        "gpu_memory_utilization": 0.9,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "max_model_len": 131072,
        "time_scale": 1.0,
        "token_scale": 1.0,
        "check_lossless": False,
    },
}
"""``agents``: SWE-style, tool-loop, long chat and an imported BFCL multi-turn sample, three
generator seeds, 32-256 agents in flight, 300 jobs a point, in the simulator with the H200
profile of Llama-3.1-8B at vLLM's settings (8,192-token steps, whole-prompt admission, 90% of
the device's memory) and real tool pauses; ``.../unbounded`` is the ceiling no eviction policy
can pass."""


@dataclass(frozen=True)
class LoadPoint:
    """One point of a sweep.

    Attributes:
        workload: the workload spec.
        seed: the generator (and engine) seed.
        concurrency: jobs in flight (closed loop), or ``None``.
        rate: Poisson arrivals in jobs/s, or ``None``.
        name: the workload's short name in the sweep (:func:`~eval.sweep_results.workload_slugs`:
            distinct where two files share a stem); ``None``: the file's stem.
    """

    workload: str
    seed: int
    concurrency: int | None = None
    rate: float | None = None
    name: str | None = field(default=None, compare=False)

    @property
    def load(self) -> float:
        """The point's x value: concurrency, else rate."""
        return float(self.concurrency if self.concurrency is not None else self.rate or 0.0)

    @property
    def label(self) -> str:
        """A folder name: ``swe-s1-c64``, ``chat-s2-r0.5``."""
        name = self.name or workload_slugs([self.workload])[self.workload]
        load = f"c{self.concurrency}" if self.concurrency is not None else f"r{self.rate:g}"
        return f"{name}-s{self.seed}-{load}"


def sweep_points(
    workloads: Sequence[str], seeds: Sequence[int], concurrency: Sequence[int], rates: Sequence[float]
) -> list[LoadPoint]:
    """Every point of a sweep, workload by workload, seed by seed, load ascending.

    Args:
        workloads: workload specs.
        seeds: seeds (each point runs once per seed).
        concurrency: closed-loop points.
        rates: Poisson points (jobs/s).

    Returns:
        The points.
    """
    loads = [(c, None) for c in sorted(set(concurrency))] + [(None, r) for r in sorted(set(rates))]
    names = workload_slugs(workloads)
    return [LoadPoint(w, s, c, r, names[w]) for w in workloads for s in seeds for c, r in loads]


def _check_reusable(cfg: BenchConfig, point: LoadPoint) -> bool:
    """Whether the point's folder holds a finished run of this very point (its workload, seed
    and load), to read back instead of running it again.

    Returns:
        False when the folder holds no ``results.json``.

    Raises:
        BenchError: naming ``out``: the folder's run is another point's (a sweep over other
            settings, or an older sweep whose labels collided), or cannot be read.
    """
    assert cfg.out is not None
    if not (cfg.out / RESULTS_FILE).is_file():
        return False
    try:
        run = load_results(cfg.out).run
    except ValueError as exc:
        raise BenchError(f"out: {cfg.out} holds a results.json that cannot be reused: {exc}") from None
    want = {"workload": point.workload, "seed": point.seed, "concurrency": point.concurrency, "rate": point.rate}
    have = {"workload": run.workload, "seed": run.seed, "concurrency": run.concurrency, "rate": run.rate}
    if point.concurrency is None:
        have["concurrency"] = None  # NOTE: an open-loop point records no concurrency either way
    if have != want:
        diff = ", ".join(f"{k} {have[k]!r} (not {want[k]!r})" for k in want if have[k] != want[k])
        raise BenchError(
            f"out: {cfg.out} holds the results of another point: {diff}; give the sweep a new --out or remove that folder"
        )
    return True


def _run_point(cfg: BenchConfig) -> Path:
    """One point in a worker process: its bench run; returns the run folder."""
    return run_bench(cfg)[1]


def stop_workers(pool: ProcessPoolExecutor, grace_s: float = 5.0) -> None:
    """Cancels a pool's queued calls and ends its worker processes now, mid-call.

    NOTE: ``shutdown(wait=False, cancel_futures=True)`` alone leaves a running call running:
    its worker writes its point after the interrupt, and the interpreter's exit joins it.
    Python 3.14 has ``terminate_workers()``; before it the processes are only reachable
    through the pool's ``_processes`` table (read before ``shutdown`` clears it).

    Args:
        pool: the executor.
        grace_s: how long a worker may take to end after SIGTERM before it is killed.
    """
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_sweep(
    cfg: BenchConfig,
    points: Sequence[LoadPoint],
    *,
    workers: int = 1,
    on_point: Callable[[int, int, LoadPoint, float], None] | None = None,
) -> tuple[SweepResults, Path]:
    """Runs every point (``cfg`` with the point's workload, seed and load) and writes
    ``sweep.json`` and the sweep report.

    Args:
        cfg: the settings every point shares (its ``out`` is the sweep folder).
        points: the points (:func:`sweep_points`).
        workers: points run at once, each in its own process (the ``sim`` backend is
            single-threaded Python; a real engine should keep 1).
        on_point: called as ``(done, total, point, seconds)`` when a point finishes.

    A point whose folder already holds ``results.json`` is read back instead of run, so an
    interrupted sweep resumes where it stopped (and a sweep split over machines can be joined
    by running it once more over the joined folder).

    Returns:
        The sweep's results and its folder.

    Raises:
        BenchError: bad settings (checked on the first point before any other starts).
    """
    from eval.harness import machine_description
    from eval.sweep_report import write_sweep_report

    if not points:
        raise BenchError("concurrency: a sweep needs at least one load point")
    if workers < 1:
        raise BenchError(f"workers: must be >= 1, got {workers}")
    if workers > 1 and cfg.backend != "sim":
        raise BenchError("workers: only the sim backend runs points in parallel (a real engine owns the device)")
    started = dt.datetime.now(dt.UTC)
    run_dir = cfg.out or Path("runs") / started.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: the sweep names its workloads apart (two files with one stem must not share folders)
    names = workload_slugs([p.workload for p in points])
    points = [replace(p, name=names[p.workload]) for p in points]
    configs = [
        replace(cfg, workload=p.workload, seed=p.seed, concurrency=p.concurrency or cfg.concurrency, rate=p.rate,
                out=run_dir / "points" / p.label)
        for p in points
    ]
    # NOTE: every point's sizes and every workload are checked before the first point runs: a
    # bad trace path in the sweep's last workload would otherwise fail after hours of points
    first_of_workload = {c.workload: c for c in reversed(configs)}
    for c in configs:
        check_bench_sizes(c)
    for c in first_of_workload.values():
        load_workload(c)
    t0 = time.perf_counter()
    done: dict[int, Path] = {}
    # NOTE: a sweep folder resumes: a point whose results.json is there (an interrupted or
    # split sweep) is read back, not run again.
    todo = []
    for i, c in enumerate(configs):
        assert c.out is not None
        if _check_reusable(c, points[i]):
            done[i] = c.out
        else:
            todo.append(i)

    def finished(i: int, path: Path, began: float) -> None:
        done[i] = path
        if on_point is not None:
            on_point(len(done), len(points), points[i], time.perf_counter() - began)

    if workers == 1:
        for i in todo:
            began = time.perf_counter()
            finished(i, _run_point(configs[i]), began)
    elif todo:
        # NOTE: spawn, not fork: the parent has imported torch, whose thread pools do not
        # survive a fork.
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        began = time.perf_counter()
        futures = {pool.submit(_run_point, configs[i]): i for i in todo}
        try:
            for future in as_completed(futures):
                finished(futures[future], future.result(), began)
        except BaseException:
            # NOTE: a bad setting fails every point alike, and an interrupt must stop at once:
            # the queued points are cancelled and the running ones ended, not waited for.
            stop_workers(pool)
            raise
        pool.shutdown(wait=True)
    sweep_points_ = []
    for i, point in enumerate(points):
        results = load_results(done[i])
        sweep_points_.append(
            SweepPoint(
                workload=point.workload, seed=point.seed, concurrency=point.concurrency, rate=point.rate,
                kv_blocks=results.run.kv_blocks, run_dir=str(done[i].relative_to(run_dir)),
                policies=point_figures(results),
            )
        )
    slo = SLO.parse(cfg.slo) if cfg.slo else None
    sweep = SweepResults(
        command=cfg.command, started=started.isoformat(timespec="seconds"), duration_s=time.perf_counter() - t0,
        machine=machine_description(cfg.device), backend=cfg.backend, model=cfg.model, slo=slo,
        points=sweep_points_,
    )
    save_sweep(sweep, run_dir)
    write_sweep_report(sweep, run_dir, plots=cfg.plots)
    return sweep, run_dir


