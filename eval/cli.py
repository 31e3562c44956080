"""``asymcache``: the command line (typer). ``asymcache --help`` lists every command."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import shutil
import sys
import time
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import typer

from agent_runtime.presets import preset_names
from eval.bench import ENGINE_FIELDS as BENCH_ENGINE_FIELDS
from eval.bench import SUFFIX_SPELLINGS

try:  # NOTE: typer >= 0.24 ships its own copy of click; older releases use click itself.
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exceptions
from typer.core import TyperGroup

F = TypeVar("F", bound=Callable[..., Any])

#: Set to show the traceback of an unexpected error instead of its one line.
DEBUG_ENV = "ASYMCACHE_DEBUG"


def one_line(message: str) -> str:
    """A message on one line: its lines (list bullets dropped) joined by ``; ``, so that a list
    of problems stays readable (``3 problem(s): run: Field required; ...``)."""
    parts = [line.strip().removeprefix("- ").strip() for line in message.splitlines()]
    return "; ".join(part for part in parts if part).replace(":;", ":")


def _tidy_flags(command: Any, ctx: Any) -> None:
    """Flags show no ``<bool>`` type in the help (they take no value)."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


class OneLineErrors(TyperGroup):
    """The command group: every usage error (unknown option, bad value, missing argument) is one
    ``error:`` line on stderr and exit code 2, never a box or a traceback."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(0)
        except click_exceptions.ClickException as exc:
            typer.echo(f"error: {one_line(exc.format_message())}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _tidy_flags(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _tidy_flags(self, ctx)
        super().format_help(ctx, formatter)


_CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    help="AsymCache: agent serving with hole-aware KV eviction, MSA and Continuum pinning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
    context_settings=_CONTEXT,
)
agent_app = typer.Typer(help="Run agents on the local model.", no_args_is_help=True, cls=OneLineErrors,
                        context_settings=_CONTEXT)
app.add_typer(agent_app, name="agent")


def version() -> str:
    """The installed package's version (the source tree's ``pyproject.toml`` when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("asymcache")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"asymcache {version()}")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """AsymCache: agent serving with hole-aware KV eviction, MSA and Continuum pinning."""


#: The engine settings ``asymcache profile`` takes: those that shape a forward step (the grid
#: sizes the pool, and no scheduler runs).
PROFILE_ENGINE_FIELDS = frozenset(
    {
        "model", "device", "dtype", "block_size", "attention_backend", "batch_invariant", "enforce_eager",
        "mixed_graph_max_tokens", "seed",
    }
)


def clean_errors(fn: F) -> F:
    """Errors become one ``error:`` line on stderr and exit code 2, never a traceback.

    Bad input (``ValueError``, a file that cannot be read or written) says what was wrong; an
    unexpected exception names its type (``ASYMCACHE_DEBUG=1`` re-raises it with its traceback).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click_exceptions.ClickException):
            raise
        except ValueError as exc:  # includes TraceError, BenchError, config errors
            message = one_line(str(exc)) or type(exc).__name__
        except OSError as exc:
            message = one_line(str(exc)) or type(exc).__name__
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            message = f"unexpected {type(exc).__name__}: {one_line(str(exc))} ({DEBUG_ENV}=1 shows the traceback)"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def engine_options(
    names: Collection[str] | None = None,
    *,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a command one option per :class:`asymcache_core.EngineConfig` field, spelled as
    the field's ``cli`` metadata says (:func:`asymcache_core.config.cli_flags`: vLLM's names,
    older names as aliases), and hands their values to the command as one dict, ``engine_args``
    (field name -> value, ready for ``EngineConfig(**engine_args)``).

    NOTE: the options carry no typer range checks: ``EngineConfig`` validates the values, so a
    bad one is the config's one-line message naming the field (exit code 2 via
    :func:`clean_errors`), the same as from Python.

    Args:
        names: the fields to offer (default: every field with a flag); options follow the
            config's field order.
        exclude: fields to leave out.
        defaults: this command's defaults where they differ from the config's.
        helps: this command's help texts where the field's own would mislead.

    Returns:
        A decorator for a command function that takes ``engine_args: dict[str, Any]``.

    Raises:
        TypeError: a name that is not an engine field with a flag (a bug in this module).
    """
    from asymcache_core.config import EngineConfig, cli_flags

    flags = cli_flags()
    wanted = set(flags if names is None else names) - set(exclude)
    unknown = sorted((wanted | set(defaults or {}) | set(helps or {})) - set(flags))
    if unknown:
        raise TypeError(f"engine_options: {unknown[0]!r} is not an engine field with a flag")
    chosen = [name for name in flags if name in wanted]
    hints = typing.get_type_hints(EngineConfig)
    config_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    options = []
    for name in chosen:
        flag = flags[name]
        is_flag = hints[name] in (bool, bool | None)
        decls = (f"{flag.name}/--no-{flag.name[2:]}",) if is_flag else (flag.name, *flag.aliases)
        default = (defaults or {}).get(name, config_defaults[name])
        option = typer.Option(default, *decls, help=(helps or {}).get(name, flag.help))
        options.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=hints[name]))

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(fn, eval_str=True)
        params = [p for p in own.parameters.values() if p.name != "engine_args"] + options

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            engine_args = {name: kwargs.pop(name) for name in chosen}
            return fn(*args, engine_args=engine_args, **kwargs)

        # NOTE: typer reads a command's options off its signature and annotations: both list
        # the generated options in place of ``engine_args``.
        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params} | {"return": own.return_annotation}
        return command

    return decorate


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
    time_scale: float = typer.Option(0.05, min=0.0, help="Multiplies tool pauses and arrivals."),
    token_scale: float = typer.Option(0.05, min=0.0001, help="Multiplies generated token lengths."),
    kv_fraction: float = typer.Option(
        None, help="Pool as a fraction of the whole workload's working set (ablations; default 0.5, at least the "
        "largest job). With many jobs that pool may never fill: --num-kv-blocks puts it under pressure.",
    ),
    out: Path = typer.Option(None, help="Run folder (default runs/<time>)."),
    lossless_check: bool = typer.Option(
        True, "--lossless-check/--no-lossless-check",
        help="Compare every policy's tokens with an unbounded-pool reference run (real backend).",
    ),
    step_log: bool = typer.Option(
        False, "--step-log", help="Also write every engine step to steps/<policy>.jsonl and every request to requests/<policy>.jsonl."
    ),
    repeats: int = typer.Option(
        1, min=1, help="Runs of each policy, in rounds (order rotated each round); the report shows each mean as "
        "[min, max] over the runs. The sim backend is deterministic, so there run r uses seed + r.",
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

    options: dict[str, Any] = {
        "workload": workload, "policies": policies, "backend": backend, "jobs": jobs, "rate": rate,
        "concurrency": concurrency, "seeds": seeds, "time_scale": time_scale, "token_scale": token_scale,
        "check_lossless": lossless_check, **engine_args,
    }
    if suite is not None:
        if suite not in SUITES:
            raise ValueError(f"suite: unknown suite {suite!r}; known: {', '.join(SUITES)}")
        given = {name for name in ctx.params if _given(ctx, name)} | ({"check_lossless"} if _given(ctx, "lossless_check") else set())
        for key, value in SUITES[suite].items():
            if key not in given:
                options[key] = ",".join(map(str, value)) if isinstance(value, tuple) else value
    workloads = [w.strip() for w in str(options.pop("workload")).split(",") if w.strip()]
    seed = options.pop("seed")
    seed_list = _numbers("seeds", options.pop("seeds"), int) or [seed]
    rates = _numbers("rate", options.pop("rate"), float)
    loads = _numbers("concurrency", options.pop("concurrency"), int)
    if rates and not _given(ctx, "concurrency"):
        loads = []  # --rate alone: open-loop points only
    if any(c < 1 for c in loads):
        raise ValueError(f"concurrency: must be >= 1, got {loads}")
    if any(not r > 0 for r in rates):
        raise ValueError(f"rate: must be > 0, got {rates}")
    policy_names = tuple(p.strip() for p in str(options.pop("policies")).split(",") if p.strip())
    if not policy_names:
        raise ValueError("policies: give at least one policy")
    if not workloads:
        raise ValueError("workload: give at least one workload")
    points = sweep_points(workloads, seed_list, loads, rates)
    first = points[0]  # a single run; a sweep sets each point's own
    cfg = BenchConfig(
        policies=policy_names, url=url, workload=first.workload, seed=first.seed, rate=first.rate,
        concurrency=first.concurrency or 1, kv_fraction=kv_fraction, out=out, step_log=step_log,
        repeats=repeats, slo=slo, **options,
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


def _memory_sized_pool(ctx: typer.Context, engine_args: dict[str, Any]) -> None:
    """``--gpu-memory-utilization`` without ``--num-kv-blocks`` sizes the pool from memory: the
    command's own fixed pool default then gives way."""
    if engine_args.get("gpu_memory_utilization") is not None and not _given(ctx, "num_kv_blocks"):
        engine_args["num_kv_blocks"] = None


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was set on the command line (not a default).

    NOTE: compared by name: typer ships its own copy of click, whose ``ParameterSource`` is
    not ``click.core``'s.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _numbers(name: str, text: str | None, kind: type) -> list[Any]:
    """A comma-separated list of numbers (``None``: empty); a bad item is a ValueError naming
    the option."""
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from None


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


def torch_device_type(device: str) -> str:
    return device.split(":", 1)[0]


def print_results_table(results: Any) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from eval.report_summary import format_metric, run_warnings

    run = results.run
    runs = max((len(r.runs) for r in results.policies.values()), default=0)
    title = f"{run.workload} x {run.num_jobs} jobs, {run.backend}, {run.model}, pool {run.kv_blocks} blocks"
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
    from eval.results import RESULTS_FILE
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


@app.command()
@clean_errors
@engine_options(exclude={"kv_memory_fraction"}, defaults={"num_kv_blocks": 256})
def generate(
    ctx: typer.Context,
    prompt: str = typer.Argument(..., help="A user message (rendered with the chat template)."),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Generate one chat answer with the embedded engine (printed as it is generated)."""
    from asymcache_core import Engine, SamplingParams
    from eval.cli_progress import showing_model_loads

    _memory_sized_pool(ctx, engine_args)
    with showing_model_loads():
        engine = Engine(**engine_args)
    if engine.tokenizer is None:
        why = f" ({engine.loaded.tokenizer_source})" if engine.loaded is not None else ""
        raise ValueError(f"model: {engine.config.model!r} has no tokenizer{why}")
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    stream_answer(engine, text, SamplingParams(max_tokens=max_tokens, temperature=temperature), _write_stdout)
    typer.echo("")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_answer(engine: Any, prompt: str, params: Any, write: Callable[[str], None]) -> str:
    """Runs one request and writes its text as it grows (each step's new characters).

    Args:
        engine: an :class:`asymcache_core.Engine`.
        prompt: the rendered prompt.
        params: its :class:`asymcache_core.SamplingParams`.
        write: called with each new piece of text.

    Returns:
        The whole answer.

    Raises:
        ValueError: the request failed.
    """
    request_id = engine.add_request(prompt, params)
    shown = ""
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error:
                raise ValueError(f"generate: {out.error}")
            # NOTE: a stop string would cut text already shown; only growth is written.
            if out.text.startswith(shown) and len(out.text) > len(shown):
                write(out.text[len(shown):])
                shown = out.text
            if out.finished:
                return shown


def startup_line(ready: Mapping[str, Any], policy: str, seconds: float) -> str:
    """The line ``serve`` logs once its engine is built.

    Args:
        ready: the engine's ``engine_ready`` log fields (model, dtype, device,
            eviction_policy, kv_blocks, kv_gib).
        policy: the serving preset.
        seconds: since the command started.
    """
    return (
        f"serve: model {ready['model']}, dtype {ready['dtype']}, device {ready['device']}, "
        f"policy {policy} (eviction {ready['eviction_policy']}), "
        f"pool {ready['kv_blocks']} blocks ({ready['kv_gib']:.2f} GiB); loaded in {seconds:.1f} s"
    )


class StartupLine(logging.Handler):
    """Writes :func:`startup_line` to stderr when the engine reports itself ready.

    Args:
        policy: the serving preset.
        clock: time source (the start is read at construction).
    """

    def __init__(self, policy: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logging.INFO)
        self.policy = policy
        self.clock = clock
        self.started = clock()
        self.done = False

    def emit(self, record: logging.LogRecord) -> None:
        ready = getattr(record, "engine_ready", None)
        if ready is None or self.done:
            return
        self.done = True
        typer.echo(startup_line(ready, self.policy, self.clock() - self.started), err=True)

    @classmethod
    @contextlib.contextmanager
    def listening(cls, policy: str, clock: Callable[[], float] = time.monotonic) -> Iterator[StartupLine]:
        """Attaches a handler to the engine's logger for the duration of the block."""
        engine_log = logging.getLogger("asymcache_core.engine")
        handler, level = cls(policy, clock), engine_log.level
        engine_log.setLevel(logging.INFO)
        engine_log.addHandler(handler)
        try:
            yield handler
        finally:
            engine_log.removeHandler(handler)
            engine_log.setLevel(level)


@app.command()
@clean_errors
@engine_options(exclude={"kv_memory_fraction"}, defaults={"num_kv_blocks": 2048, "max_step_log": 10_000})
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: str = typer.Option(None, help="Require this bearer token."),
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    max_request_body_bytes: int = typer.Option(8 << 20, help="Request bodies beyond this are a 413."),
    max_queue_len: int = typer.Option(256, help="Completions waiting beyond the running batch before new ones get a 429 (one of n choices counts n)."),
    shutdown_timeout: float = typer.Option(30.0, help="On SIGTERM, seconds in-flight requests may finish before they are aborted."),
    replicas: int = typer.Option(1, help="Engine replicas behind the one endpoint; above 1 on a local Ray cluster "
                                 "(the ray extra), each job kept on the replica that holds its KV."),
    served_model_name: str = typer.Option(None, help="The model name clients send and /v1/models lists "
                                          "(default: --model)."),
    chat_template: str = typer.Option(None, help="A chat template, as a Jinja file or its text, instead of the "
                                      "model's."),
    default_chat_template_kwargs: str = typer.Option(
        None, help='Template variables every chat gets unless it sets its own, as a JSON object '
        '(e.g. \'{"enable_thinking": false}\').'),
    trust_request_chat_template: bool = typer.Option(
        False, "--trust-request-chat-template", help="Serve chats that send a chat_template of their own."),
    tool_call_parser: str = typer.Option(
        "hermes", help="How tool calls are written and parsed: hermes (tagged; Qwen, and models without a tools "
        "template) or llama3_json (Llama 3.1+, with its own template)."),
    reasoning_parser: str = typer.Option(
        None, help="Split reasoning models' thinking off chat replies into reasoning_content: deepseek_r1 or "
        "qwen3 (vLLM's names)."),
    responses_store_size: int = typer.Option(
        4096, help="Responses API responses kept for previous_response_id and GET /v1/responses/{id} (least "
        "recently used dropped first; 0: none)."),
    enable_auto_tool_choice: bool = typer.Option(
        True, "--enable-auto-tool-choice", help="vLLM's flag, accepted: tool calls are parsed under "
        "tool_choice auto whether it is given or not."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /metrics)."""
    from agent_runtime.commands import run_serve

    _memory_sized_pool(ctx, engine_args)
    template_kwargs = _json_object("default_chat_template_kwargs", default_chat_template_kwargs)
    from eval.cli_progress import showing_model_loads

    with StartupLine.listening(policy), showing_model_loads():
        run_serve(host=host, port=port, api_key=api_key, policy=policy, max_request_body_bytes=max_request_body_bytes,
                  max_queue_len=max_queue_len, shutdown_timeout=shutdown_timeout, replicas=replicas,
                  served_model_name=served_model_name, chat_template=chat_template,
                  default_chat_template_kwargs=template_kwargs,
                  trust_request_chat_template=trust_request_chat_template, tool_call_parser=tool_call_parser,
                  reasoning_parser=reasoning_parser, responses_store_size=responses_store_size, **engine_args)


def _json_object(name: str, text: str | None) -> dict[str, Any] | None:
    """A JSON object given on the command line (None when not given).

    Raises:
        ValueError: not a JSON object (naming ``name``).
    """
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    return value


@app.command()
@clean_errors
@engine_options()
def chat(
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Interactive chat with the local model (/exit to quit)."""
    from agent_runtime.commands import run_chat
    from eval.cli_progress import showing_model_loads

    with showing_model_loads():
        run_chat(policy=policy, **engine_args)


@agent_app.command("run")
@clean_errors
@engine_options()
def agent_run(
    task: str = typer.Argument(..., help="What the agent should do."),
    workdir: Path = typer.Option(
        Path("."), help="The agent's working directory: the file tools stay inside it; bash runs there, sandboxed "
        "only where bubblewrap is installed (otherwise its own session, rlimits and a scrubbed environment)."
    ),
    max_turns: int = typer.Option(6, min=1),
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    tool_choice: str = typer.Option(
        "required", help="Per-turn tool choice, comma-separated: auto, none, required or a tool name (that "
        "call is forced, constrained decoding); later turns are auto. Small models need the tools named."
    ),
    *,
    engine_args: dict[str, Any],
) -> None:
    """A real tool loop (bash, read/list/write files) on the local model."""
    from agent_runtime.commands import run_agent

    if not workdir.is_dir():
        raise ValueError(f"workdir: {str(workdir)!r} is not a directory")
    choices = [c.strip() for c in tool_choice.split(",") if c.strip()]
    from eval.cli_progress import showing_model_loads

    with showing_model_loads():
        run_agent(
            task=task, workdir=workdir, max_turns=max_turns, policy=policy, tool_choice=choices, **engine_args
        )


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
