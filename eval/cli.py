"""``asymcache``: the command line (typer). ``asymcache --help`` lists every command."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

app = typer.Typer(
    help="AsymCache: agent serving with hole-aware KV eviction, MSA and Continuum pinning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
agent_app = typer.Typer(help="Run agents on the local model.", no_args_is_help=True)
app.add_typer(agent_app, name="agent")

F = TypeVar("F", bound=Callable[..., Any])


def clean_errors(fn: F) -> F:
    """Bad input becomes one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:  # includes TraceError, BenchError, config errors
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(2) from None
        except FileNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@clean_errors
def bench(
    workload: str = typer.Option("swe", help="swe | toolloop | chat | trace:PATH (or sharegpt:/bfcl:/mooncake:/bailian:PATH)"),
    policies: str = typer.Option(
        "vllm-apc,continuum,asymcache,asymcache+continuum",
        help="Comma-separated policies (add /no-holes, /fixed or /no-msa for ablations).",
    ),
    model: str = typer.Option("smollm2-135m", help="Model: smollm2-135m, a folder, a .gguf, dummy:<config>."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    backend: str = typer.Option("real", help="real | sim | http."),
    url: str = typer.Option(None, help="Base URL of an OpenAI-compatible server (http backend)."),
    jobs: int = typer.Option(6, min=1, help="Jobs in the workload."),
    rate: float = typer.Option(None, help="Poisson arrivals in jobs/s (default: closed loop)."),
    concurrency: int = typer.Option(6, min=1, help="Jobs in flight in the closed loop."),
    time_scale: float = typer.Option(0.05, min=0.0, help="Multiplies tool pauses and arrivals."),
    token_scale: float = typer.Option(0.05, min=0.0001, help="Multiplies generated token lengths."),
    kv_blocks: int = typer.Option(None, min=1, help="KV pool size in blocks."),
    kv_fraction: float = typer.Option(
        None, help="Pool as a fraction of the workload's working set (default 0.5, at least the largest job)."
    ),
    max_context: int = typer.Option(512, min=16, help="Cut jobs whose context would exceed this."),
    seed: int = typer.Option(0),
    out: Path = typer.Option(None, help="Run folder (default runs/<time>)."),
    no_lossless_check: bool = typer.Option(False, help="Skip the unbounded-pool reference run."),
    latency_profile: str = typer.Option(None, help="Latency profile JSON (asymcache profile)."),
    tpot_slo_ms: float = typer.Option(100.0, min=0.1, help="Adaptive chunking's time-per-output-token target."),
    max_batched_tokens: int = typer.Option(512, min=1, help="Per-step token cap (fixed chunking's budget)."),
    step_log: bool = typer.Option(
        False, help="Also write every engine step to steps/<policy>.jsonl and every request to requests/<policy>.jsonl."
    ),
    repeats: int = typer.Option(1, min=1, help="Runs of each policy, in rounds (order rotated each round); the report keeps each run's means."),
) -> None:
    """Run a workload through a grid of policies and report JCT, TTFT, TPOT and cache figures."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from eval.bench import BenchConfig, run_bench

    cfg = BenchConfig(
        workload=workload, policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        model=model, device=device, backend=backend, url=url, jobs=jobs, rate=rate,
        concurrency=concurrency, time_scale=time_scale, token_scale=token_scale,
        kv_blocks=kv_blocks, kv_fraction=kv_fraction, max_context=max_context, seed=seed, out=out,
        check_lossless=not no_lossless_check, latency_profile=latency_profile,
        tpot_slo_ms=tpot_slo_ms, max_num_batched_tokens=max_batched_tokens, step_log=step_log,
        repeats=repeats,
    )
    if not cfg.policies:
        raise ValueError("policies: give at least one policy")
    console = Console(stderr=True)
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        results, run_dir = run_bench(cfg, progress)
    print_results_table(results)
    typer.echo(f"report: {run_dir / 'report.html'}")


def torch_device_type(device: str) -> str:
    return device.split(":", 1)[0]


def print_results_table(results: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    run = results.run
    table = Table(title=f"{run.workload} x {run.num_jobs} jobs, {run.backend}, {run.model}, pool {run.kv_blocks} blocks")
    for col in ("policy", "JCT mean", "JCT p95", "TTFT mean", "TPOT mean", "hit rate", "computed tok", "recomputed", "evictions", "lossless"):
        table.add_column(col, justify="right" if col != "policy" else "left")

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    for name, r in results.policies.items():
        agree = "-" if r.lossless_agreement is None else f"{r.lossless_agreement:.0%}"
        table.add_row(
            name, s(r.jct.mean), s(r.jct.p95), s(r.ttft.mean), s(r.tpot.mean), f"{r.hit_rate:.1%}",
            str(r.computed_tokens), str(r.recomputed_tokens.total), str(r.evictions), agree,
        )
    Console(width=150).print(table)


@app.command()
@clean_errors
def report(run_dir: Path = typer.Argument(..., help="A folder holding results.json.")) -> None:
    """Rebuild report.md, the plots and report.html from a run folder's results.json."""
    from eval.report import rebuild_report

    for path in rebuild_report(run_dir):
        typer.echo(str(path))


@app.command()
@clean_errors
def profile(
    model: str = typer.Option("smollm2-135m"),
    device: str = typer.Option("cpu"),
    out: Path = typer.Option(Path("profile.json"), help="Where to write the profile."),
    repeats: int = typer.Option(3, min=1),
    quick: bool = typer.Option(False, help="A smaller grid (tests, smoke runs)."),
) -> None:
    """Measure the engine's forward steps and fit the step-latency model (knee, fit error)."""
    from rich.progress import Progress

    from asymcache_core import Engine
    from asymcache_core.profiler import ProfileGrid, fit, measure

    grid = ProfileGrid.for_device(torch_device_type(device), repeats=repeats)
    if quick:
        grid = ProfileGrid(chunk_tokens=(1, 16, 64), contexts=(0, 128), decode_batches=(1, 4),
                           decode_contexts=(64, 256), repeats=1)
    engine = Engine(model=model, device=device, num_kv_blocks=grid.num_blocks_needed(16))
    with Progress() as progress:
        task = progress.add_task("profiling", total=len(grid.points()))
        points = measure(engine, grid, lambda done, total: progress.update(task, completed=done))
    latency = fit(points, model=model, device=device, source=str(out))
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
    """Refit a latency profile's floors and decode term to live steps (for the simulator)."""
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
        f"{latency.per_decode_kv_s * 1e9:.2f} ns a key, error on these steps {latency.fit_error:.1%} -> {out}"
    )


@app.command("bench-engine")
@clean_errors
def bench_engine(
    prompt_len: int = typer.Option(128, min=1),
    new_tokens: int = typer.Option(64, min=2),
) -> None:
    """Engine prefill/decode tokens/s against transformers' generate (SmolLM2, batch 1 and 16)."""
    from eval.bench_engine import run

    run(prompt_len=prompt_len, new_tokens=new_tokens)


@app.command()
@clean_errors
def generate(
    prompt: str = typer.Argument(..., help="A user message (rendered with the chat template)."),
    model: str = typer.Option("smollm2-135m"),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
) -> None:
    """Generate one chat answer with the embedded engine."""
    from asymcache_core import Engine, SamplingParams

    engine = Engine(model=model, num_kv_blocks=256)
    if engine.tokenizer is None:
        raise ValueError(f"model: {model!r} has no tokenizer")
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    out = engine.generate([text], SamplingParams(max_tokens=max_tokens, temperature=temperature))[0]
    typer.echo(out.text)


@app.command()
@clean_errors
def serve(
    model: str = typer.Option("smollm2-135m"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: str = typer.Option(None, help="Require this bearer token."),
    policy: str = typer.Option("asymcache+continuum"),
    kv_blocks: int = typer.Option(2048, min=1),
    max_model_len: int = typer.Option(None, min=16),
    least_work_first: bool = typer.Option(
        False, help="Run the requests with the fewest tokens left to compute first (default: by arrival)."
    ),
    least_work_patience: float = typer.Option(
        None, help="With --least-work-first: a request lets later, smaller ones go first for at most this many "
        "times its own estimated prefill time (default: no bound)."
    ),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    max_num_batched_tokens: int = typer.Option(2048, min=1, help="Tokens per step (fixed chunking; the cap of adaptive)."),
    max_num_seqs: int = typer.Option(64, min=1, help="Running requests at most."),
    chunking: str = typer.Option("fixed", help="fixed, fixed:N, adaptive (every step meets --tpot-slo-ms) or adaptive:slack."),
    tpot_slo_ms: float = typer.Option(50.0, min=0.1, help="Adaptive chunking's time-per-output-token target."),
    latency_profile: str = typer.Option(None, help="Latency profile JSON (asymcache profile) for the eviction cost and adaptive chunking."),
    admit_full_prompt: bool = typer.Option(
        False, help="Admit a request only when its whole prompt fits (vLLM 0.32's default), not its first chunk."
    ),
    enforce_eager: bool = typer.Option(False, help="Never capture CUDA graphs."),
) -> None:
    """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /metrics)."""
    from agent_runtime.commands import run_serve

    run_serve(model=model, host=host, port=port, api_key=api_key, policy=policy,
              num_kv_blocks=kv_blocks, max_model_len=max_model_len, least_work_first=least_work_first,
              least_work_patience=least_work_patience, device=device, dtype=dtype,
              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, chunking=chunking,
              tpot_slo_ms=tpot_slo_ms, latency_profile=latency_profile, admit_full_prompt=admit_full_prompt,
              enforce_eager=enforce_eager)


@app.command()
@clean_errors
def chat(model: str = typer.Option("smollm2-135m")) -> None:
    """Interactive chat with the local model (/exit to quit)."""
    from agent_runtime.commands import run_chat

    run_chat(model=model)


@agent_app.command("run")
@clean_errors
def agent_run(
    task: str = typer.Argument(..., help="What the agent should do."),
    workdir: Path = typer.Option(Path("."), help="The agent's working directory (its tools stay inside)."),
    model: str = typer.Option("smollm2-135m"),
    max_turns: int = typer.Option(6, min=1),
    policy: str = typer.Option("asymcache+continuum"),
) -> None:
    """A real tool loop (bash, read/list/write files) on the local model."""
    from agent_runtime.commands import run_agent

    if not workdir.is_dir():
        raise ValueError(f"workdir: {str(workdir)!r} is not a directory")
    run_agent(task=task, workdir=workdir, model=model, max_turns=max_turns, policy=policy)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
