"""Where a CUDA-graph decode step's wall time goes: host phases against the GPU's time. GPU only.

``python scripts/gpu_step_breakdown.py [--model dummy:llama-3.1-8b]`` prints, for decode-only
steps of a few batch sizes in the default (batch-invariant) mode: the median wall time of
``engine.step()``, the host time of each phase (scheduling, packing the inputs and refilling the
graph's buffers, sampling with its device-to-host copy, the scheduler's update and the outputs)
and the GPU time of the forward pass (CUDA events around it). A step's wall time minus its
forward's GPU time is what overlapping the host work with the previous step (async
scheduling) could at most save. ``--profile`` adds the busiest GPU kernels of batch-1 steps.
``--cases 1x2048,16x32768`` picks the decode batches (sequences x context). ``--compare-tables``
times every case's steps twice, alternating in rounds: with the runner's persistent block table
rows (the default) and with the tables padded from the requests' lists each step (the path
before them), and prints both; ``--lists-first`` puts the lists first in each round.
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

import asymcache_core.model_runner as model_runner
from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

CASES = ((1, 2048), (1, 16384), (8, 2048), (32, 2048))


def timed(store: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that each call's host time is appended to ``store[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="also list the GPU kernels of batch-1 steps")
    ap.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="BATCHxCONTEXT,...")
    ap.add_argument("--compare-tables", action="store_true",
                    help="also time each case with block tables padded from the lists every step")
    ap.add_argument("--lists-first", action="store_true",
                    help="with --compare-tables, each round times the lists before the rows")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    modes = (("lists", "rows") if args.lists_first else ("rows", "lists")) if args.compare_tables else ("rows",)
    rounds = 3 if args.compare_tables else 1
    dev = torch.device("cuda")
    loaded = load_model(args.model, dev, torch.bfloat16, seed=0)
    blocks = max(b * -(-(c + rounds * len(modes) * args.steps + 64) // 16) for b, c in cases) + 256
    engine = Engine(model=args.model, device="cuda", loaded=loaded, async_scheduling=False, num_kv_blocks=max(8192, blocks),
                    max_num_batched_tokens=8192, max_model_len=max(32768, max(c for _, c in cases) + 4096))
    runner = engine.runner
    table_rows = runner.block_table_rows
    host: dict[str, list[float]] = defaultdict(list)
    gpu: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    forward = runner.forward

    def forward_with_events(inputs: Any) -> Any:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = forward(inputs)
        end.record()
        gpu.append((begin, end))
        return out

    runner.forward = timed(host, "forward (enqueue)", forward_with_events)
    runner._sample = timed(host, "sample (incl. sync)", runner._sample)
    engine.scheduler.schedule = timed(host, "schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timed(host, "update", engine.scheduler.update_from_output)
    engine._process_output = timed(host, "outputs", engine._process_output)
    model_runner.pack_step = timed(host, "pack", model_runner.pack_step)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.model}, "
          f"batch_invariant={engine.config.batch_invariant}")
    phases = ("schedule", "pack", "forward (enqueue)", "sample (incl. sync)", "update", "outputs")
    print("| batch | context | tables | step ms | forward GPU ms | host-only ms | "
          + " | ".join(f"{p} ms" for p in phases) + " |")
    print("|---:|---:|---|---:|---:|---:|" + "---:|" * len(phases))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for batch, context in cases:
        for _ in range(batch):
            prompt = torch.randint(1000, vocab - 1000, (context,), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=rounds * len(modes) * args.steps + 10, ignore_eos=True))
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()
        for _ in range(3):
            engine.step()
        walls: dict[str, list[float]] = {m: [] for m in modes}
        gpus: dict[str, list[float]] = {m: [] for m in modes}
        hosts: dict[str, dict[str, float]] = {m: defaultdict(float) for m in modes}
        for _ in range(rounds):
            for mode in modes:
                # NOTE: without rows the runner pads the requests' lists every step (pack_step)
                runner.block_table_rows = table_rows if mode == "rows" else None
                host.clear()
                gpu.clear()
                for _ in range(args.steps):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    engine.step()
                    torch.cuda.synchronize()
                    walls[mode].append(time.perf_counter() - start)
                gpus[mode].extend(b.elapsed_time(e) for b, e in gpu)
                for p in phases:
                    hosts[mode][p] += sum(host[p]) / (args.steps * rounds) * 1e3
        runner.block_table_rows = table_rows
        for mode in modes:
            gpu_ms = statistics.median(gpus[mode])
            wall_ms = statistics.median(walls[mode]) * 1e3
            print(f"| {batch} | {context} | {mode} | {wall_ms:.2f} | {gpu_ms:.2f} | {wall_ms - gpu_ms:.2f} | "
                  + " | ".join(f"{hosts[mode][p]:.2f}" for p in phases) + " |", flush=True)
        if batch == 1 and context == 2048 and args.profile:
            print("CUDA-graph steps:")
            profile_steps(engine, 5)
        while engine.has_unfinished():
            engine.step()
    if args.profile:
        del engine
        eager = Engine(model=args.model, device="cuda", loaded=loaded, async_scheduling=False, num_kv_blocks=1024,
                       max_num_batched_tokens=8192, max_model_len=32768, enforce_eager=True)
        eager.add_request(torch.randint(1000, vocab - 1000, (2048,), generator=gen).tolist(),
                          SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(5):
            eager.step()
        print("eager steps (the same kernels, launched one by one):")
        profile_steps(eager, 5)


def profile_steps(engine: Engine, steps: int) -> None:
    """The GPU kernels of ``steps`` decode steps (graph replays included), busiest first."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events)
    print(f"kernels of {steps} steps: {sum(e.count for e in events)} launches, "
          f"{total_us / steps / 1e3:.2f} ms of GPU time a step")
    print("| kernel | calls a step | us a step | share |")
    print("|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_device_time_total / steps:.0f} "
              f"| {e.self_device_time_total / total_us:.1%} |")


if __name__ == "__main__":
    main()
