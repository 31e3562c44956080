"""Where a live mixed step's time goes on the GPU (decodes plus a prefill chunk). GPU machine only.

``python scripts/gpu_profile_mixed.py [--model dummy:llama-3.1-8b] [--profile PATH]`` builds
steps like the benchmark's: ``D`` requests decoding at a long context plus one fresh
``P``-token prefill, and prints one table: the ``engine.step()`` wall time split into
scheduling, input preparation (host), the forward pass and sampling, beside the latency
profile's prediction of the same step; then the busiest kernels of the largest mixed step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    """``fn`` with its synchronised wall time appended to ``bucket``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        bucket.append(time.perf_counter() - start)
        return out

    return wrapper


def instrument(runner: Any) -> dict[str, list[float]]:
    """Wraps the model runner's phases with synchronised timers: ``prepare`` (host input
    packing and the MSA metadata), ``forward`` (eager or piecewise graphs) and ``sample``;
    returns their buckets."""
    from asymcache_core import model_runner

    phases: dict[str, list[float]] = defaultdict(list)
    # NOTE: module functions the runner calls by their global names
    model_runner.pack_step = timed(model_runner.pack_step, phases["prepare"])
    model_runner.build_msa_metadata = timed(model_runner.build_msa_metadata, phases["prepare"])
    runner.model = timed(runner.model, phases["forward"])
    if runner.mixed_graphs is not None:
        runner.mixed_graphs.run = timed(runner.mixed_graphs.run, phases["forward"])
    runner._sample = timed(runner._sample, phases["sample"])
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--profile", default="bench_traces/profile_h200_llama8b.json")
    ap.add_argument("--decode-context", type=int, default=8000)
    ap.add_argument("--decodes", type=int, nargs="+", default=[0, 1, 4, 8])
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of the script)")
    ap.add_argument("--mixed-graph-tokens", type=int, default=1024,
                    help="largest step replayed as piecewise CUDA graphs (0: mixed steps run eagerly)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    loaded = load_model(args.model, dev, dtype, seed=0)
    engine = Engine(model=args.model, device=args.device, loaded=loaded, async_scheduling=False, num_kv_blocks=16384,
                    max_num_batched_tokens=8192, max_model_len=32768, latency_profile=args.profile or None,
                    mixed_graph_max_tokens=args.mixed_graph_tokens)
    phases = instrument(engine.runner)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, vocab - 1000, (n,), generator=gen).tolist()

    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.model}, profile {args.profile}, "
          f"mixed steps up to {args.mixed_graph_tokens} tokens as piecewise graphs")
    print("| decodes x context | prefill | step ms | schedule | prepare | forward | sample | other | predicted ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    last = None
    running = 0
    for decodes in sorted(args.decodes):
        for _ in range(decodes - running):
            engine.add_request(prompt(args.decode_context), SamplingParams(max_tokens=10_000, ignore_eos=True))
        running = decodes
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()
        for chunk in args.chunks:
            rows = []
            for rep in range(5):
                for bucket in phases.values():
                    bucket.clear()
                engine.add_request(prompt(chunk), SamplingParams(max_tokens=1, ignore_eos=True))
                sync()
                start = time.perf_counter()
                engine.step()
                sync()
                wall = time.perf_counter() - start
                stats = engine.step_log[-1]
                assert not stats.decode_only and stats.num_tokens == chunk + decodes, stats
                parts = {k: sum(v) for k, v in phases.items()}
                if rep:  # the first of each shape compiles or allocates
                    rows.append((wall, stats.schedule_s, parts.get("prepare", 0.0), parts.get("forward", 0.0),
                                 parts.get("sample", 0.0), stats.predicted_s))
            med = [statistics.median(col) * 1e3 for col in zip(*rows, strict=True)]
            other = med[0] - sum(med[1:5])
            print(f"| {decodes} x {args.decode_context} | {chunk} | {med[0]:.1f} | {med[1]:.2f} | {med[2]:.2f} | "
                  f"{med[3]:.1f} | {med[4]:.2f} | {other:.2f} | {med[5]:.1f} |")
            last = chunk
    engine.add_request(prompt(last or 1024), SamplingParams(max_tokens=1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"last mixed step: {launches} kernel launches, {gpu_ms:.2f} ms of GPU time (kernels)")
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
    for e in kernels[:8]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<4d} {e.key[:90]}")


if __name__ == "__main__":
    main()
