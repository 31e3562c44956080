"""The embedded engine's host work per step in a simulated run at production scale.

Runs one ``asymcache bench --backend sim`` point per source tree (e.g. a checkout of the commit
before an optimisation and the working tree), each in its own process, and prints one markdown
table: wall and CPU seconds of the run (the machine may be shared: wall time counts other
processes' turns, CPU time does not), engine steps and host CPU ms per step (the CPU clock read
around ``Engine.step``). With ``--profile`` the runs go under cProfile and the table lists the
functions with the most time of their own (the profiler inflates every time: take the times
from a run without it).

Usage::

    python scripts/bench_host_step.py --tree before=/tmp/base --tree after=. -- \\
        --workload swe --seeds 1 --jobs 150 --concurrency 128 ...   # bench's own options

The options after ``--`` go to ``asymcache bench`` unchanged (``--backend sim`` and an ``--out``
folder per tree are added).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the engine's step and the harness's simulated run, by ``(file suffix, function)``
STEP_FUNCTION = ("asymcache_core/engine.py", "step")
DRIVE_FUNCTION = ("eval/harness.py", "drive")


def _timed_child(bench_args: list[str], summary_path: Path, top: int, profile: bool) -> None:
    """Runs the bench in this process and writes a JSON summary: wall and CPU seconds, steps
    and the CPU seconds inside ``Engine.step`` (a wrapper reads the CPU clock around each
    step); with ``profile``, under cProfile, adding the ``top`` functions by own time (the
    profiler's own cost inflates every figure: compare times only between unprofiled runs),
    and the profile (``.prof`` beside the summary)."""
    from asymcache_core.engine import Engine
    from eval.cli import app

    plain_step = Engine.step
    step_cpu = [0, 0.0]  # steps, CPU seconds

    def timed_step(engine: Engine, *args: object, **kwargs: object) -> object:
        start = time.process_time()
        try:
            return plain_step(engine, *args, **kwargs)
        finally:
            step_cpu[0] += 1
            step_cpu[1] += time.process_time() - start

    Engine.step = timed_step  # type: ignore[method-assign]
    profiler = cProfile.Profile() if profile else None
    wall_start = time.perf_counter()
    cpu_start = time.process_time()
    if profiler is not None:
        profiler.enable()
    try:
        app(args=["bench", "--backend", "sim", *bench_args], standalone_mode=False)
    finally:
        if profiler is not None:
            profiler.disable()
    summary: dict[str, object] = {
        "wall_s": time.perf_counter() - wall_start,
        "cpu_s": time.process_time() - cpu_start,
        "steps": step_cpu[0],
        "step_cpu_s": step_cpu[1],
        "top": [],
    }
    if profiler is not None:
        profiler.dump_stats(summary_path.with_suffix(".prof"))
        raw = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        own = sorted(
            (
                (tottime, f"{filename.split('asymcache_core/')[-1]}:{function}", ncalls)
                for (filename, _line, function), (
                    _cc,
                    ncalls,
                    tottime,
                    _cum,
                    _callers,
                ) in raw.items()
                if "asymcache_core" in filename
            ),
            reverse=True,
        )
        summary["top"] = [{"function": name, "own_s": t, "calls": n} for t, name, n in own[:top]]
    summary_path.write_text(json.dumps(summary, indent=1))


def _run_tree(
    label: str, tree: Path, bench_args: list[str], out_root: Path, top: int, profile: bool
) -> dict:
    """Times (or profiles) the bench point in a child process whose imports come from ``tree``."""
    summary_path = out_root / f"{label}.json"
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        str(summary_path),
        "--top",
        str(top),
        *(["--profile"] if profile else []),
        "--",
        *bench_args,
        "--out",
        str(out_root / label),
    ]
    subprocess.run(command, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def _table(results: dict[str, dict]) -> str:
    """The markdown table of every tree's summary."""
    lines = [
        "| tree | wall s | CPU s | steps | host CPU ms/step | top own time (s, profiled) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, summary in results.items():
        per_step = 1e3 * summary["step_cpu_s"] / max(summary["steps"], 1)
        top = "; ".join(f"`{e['function']}` {e['own_s']:.2f}" for e in summary["top"]) or "-"
        lines.append(
            f"| {label} | {summary['wall_s']:.1f} | {summary['cpu_s']:.1f} "
            f"| {summary['steps']} | {per_step:.2f} | {top} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree", action="append", default=[], help="LABEL=PATH of a source tree (repeatable)"
    )
    parser.add_argument("--top", type=int, default=6, help="functions listed per tree")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run under cProfile and list the top functions (inflates the times)",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.child is not None:
        _timed_child(bench_args, args.child, args.top, args.profile)
        return
    if not args.tree:
        parser.error("--tree: give at least one LABEL=PATH")
    trees: list[tuple[str, Path]] = []
    for spec in args.tree:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            print(f"error: --tree: {spec!r} is not LABEL=DIRECTORY", file=sys.stderr)
            sys.exit(2)
        trees.append((label, Path(path).resolve()))
    out_root = Path(tempfile.mkdtemp(prefix="bench_host_step_"))
    results = {
        label: _run_tree(label, tree, bench_args, out_root, args.top, args.profile)
        for label, tree in trees
    }
    print(_table(results))
    print(f"\nrun folders and summaries: {out_root}")


if __name__ == "__main__":
    main()
