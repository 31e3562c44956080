"""Where a CUDA-graph decode step's time goes, kernel by kernel. GPU machine only.

``PYTHONPATH=$PWD python scripts/gpu_trace_decode.py [--batch 1] [--context 2048] [--trace OUT.json.gz]``
builds the default engine (CUDA graphs, batch-invariant kernels) on dummy Llama-3.1-8B bf16,
prefills ``batch`` prompts of ``context`` tokens, then profiles a few decode-only
``engine.step()`` calls with ``torch.profiler`` (CUPTI records the kernels a graph replay runs).
It prints, per profiled step: the step's wall time, the span from its first kernel's start to
its last kernel's end, the kernels' summed time and the idle gaps between them on the device,
the host time before the first kernel; then the kernels grouped by name (count, total, mean) and
the largest gaps with the kernels on either side. Beside them: the weight-read floor at the
measured copy bandwidth. ``--trace`` also writes the Chrome trace.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import time

import torch
from gpu_profile_step import load_with_floor  # NOTE: a sibling script (scripts/ is on sys.path)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from asymcache_core import Engine, SamplingParams


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4, help="profiled decode steps")
    ap.add_argument("--trace", default=None, help="write the Chrome trace here")
    args = ap.parse_args()
    loaded, _, bandwidth, floor_ms = load_with_floor(args.model)
    engine = Engine(model=args.model, device="cuda", loaded=loaded,
                    num_kv_blocks=args.batch * (args.context + 256) // 16 + 64,
                    max_num_batched_tokens=8192, max_model_len=32768)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for _ in range(args.batch):
        prompt = torch.randint(1000, vocab - 1000, (args.context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    walls = []
    for _ in range(10):  # warm-up, and the unprofiled step time
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.model}, batch {args.batch} x "
          f"{args.context} tokens: unprofiled step {statistics.median(walls):.2f} ms (median of 10), weight-read "
          f"floor {floor_ms:.2f} ms at {bandwidth / 1e12:.2f} TB/s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            torch.cuda.synchronize()
            with record_function(f"step{i}"):
                engine.step()
                torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    events = prof.events()
    steps = sorted((e for e in events if e.name.startswith("step") and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    # NOTE: the steps' record_function ranges also appear on the device (gpu_user_annotation)
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("step")),
                     key=lambda e: e.time_range.start)
    print("| step | wall ms | host before 1st kernel ms | kernel span ms | kernels | kernel sum ms | device gaps ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    gaps: list[tuple[float, str, str]] = []
    for i, step in enumerate(steps):
        lo, hi = step.time_range.start, step.time_range.end
        mine = [k for k in kernels if lo <= k.time_range.start <= hi]
        if not mine:
            print(f"| {i} | {(hi - lo) / 1e3:.2f} | - | - | 0 | - | - |")
            continue
        span = mine[-1].time_range.end - mine[0].time_range.start
        busy = sum(k.time_range.end - k.time_range.start for k in mine)
        step_gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in itertools.pairwise(mine)]
        idle = sum(max(g, 0.0) for g, _, _ in step_gaps)
        print(f"| {i} | {(hi - lo) / 1e3:.2f} | {(mine[0].time_range.start - lo) / 1e3:.2f} | {span / 1e3:.2f} "
              f"| {len(mine)} | {busy / 1e3:.2f} | {idle / 1e3:.2f} |")
        if i > 0:  # NOTE: the first profiled step pays the profiler's own start-up
            for k in mine:
                by_name[k.name].append(k.time_range.end - k.time_range.start)
            gaps += step_gaps
    n_steps = max(len(steps) - 1, 1)
    print("\nkernels per step (steps 1..), by total time:")
    print("| kernel | per step | total us / step | mean us |")
    print("|---|---:|---:|---:|")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"| {short(name)} | {len(durs) / n_steps:.0f} | {sum(durs) / n_steps:.1f} | {statistics.mean(durs):.2f} |")
    print("\ngaps between consecutive kernels (steps 1..):")
    sizes = [g for g, _, _ in gaps]
    if sizes:
        print(f"count {len(sizes)}, mean {statistics.mean(sizes):.2f} us, median {statistics.median(sizes):.2f} us, "
              f"max {max(sizes):.1f} us")
        pair_gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for g, a, b in gaps:
            pair_gaps[(short(a, 40), short(b, 40))].append(g)
        print("| after | before | per step | mean gap us | total us / step |")
        print("|---|---|---:|---:|---:|")
        for (a, b), gs in sorted(pair_gaps.items(), key=lambda kv: -sum(kv[1]))[:15]:
            print(f"| {a} | {b} | {len(gs) / n_steps:.0f} | {statistics.mean(gs):.2f} | {sum(gs) / n_steps:.1f} |")


if __name__ == "__main__":
    main()
