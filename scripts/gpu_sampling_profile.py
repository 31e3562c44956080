"""Where random sampling's time goes on the device, per stage (GPU).

``python scripts/gpu_sampling_profile.py [--batches 1,8,32] [--iters 50]``

For each batch and setting, the device time of a call (CUDA events around ``--iters`` calls
queued back to back) and its host time (the same calls without waiting): the cuts
(:func:`row_cuts`), the race kernel, the whole draw (:func:`sample_rows`), and greedy's argmax.
Then top-p's cut alone, the whole-vocabulary sort (the way before 2026-12-07) against the
search of :mod:`kernels.top_p` at a few points a pass and warps a program, with a check that
they cut alike; and the profiler's kernel table of one setting at the largest batch.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from asymcache_core.batched_sampling import RowSettings, row_cuts, sample_rows
from asymcache_core.sampling_params import SamplingParams
from kernels.sampling import gumbel_argmax_triton, row_keys
from kernels.top_p import top_p_cut_naive, top_p_cut_triton

VOCAB = 128_256
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "+ top-p": dict(temperature=0.7, top_p=0.95),
    "+ top-k + top-p": dict(temperature=0.7, top_k=50, top_p=0.95),
    "+ min-p": dict(temperature=0.7, min_p=0.05),
    "+ min-p + top-p": dict(temperature=0.7, min_p=0.05, top_p=0.95),
}
#: the search's (warps a program, tokens a read) timed against the sort
SEARCHES = [(8, 1024), (16, 2048), (16, 4096), (32, 4096)]


def _top_p_table(batches: list[int], iters: int) -> None:
    """Top-p's cut: the sort against the search, on rows from flat to peaked."""
    print("\ntop-p 0.95 cut alone, device ms a call (sort: torch's whole-vocabulary sort and cumsum)")
    print("| rows | logits scale | sort | " + " | ".join(f"search w={w} b={b}" for w, b in SEARCHES) + " | equal |")
    print("|---:|---:|---:|" + "---:|" * len(SEARCHES) + "---|")
    for batch in batches:
        for scale in (0.5, 3.0, 12.0):
            logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16) * scale
            temperature = torch.full((batch,), 0.7, device="cuda")
            cut = torch.full((batch,), float("-inf"), device="cuda")
            top_p = torch.full((batch,), 0.95, device="cuda")
            sort_ms, _ = _times(lambda: top_p_cut_naive(logits, temperature, cut, top_p), iters)  # noqa: B023
            cells = [
                _times(lambda w=w, b=b: top_p_cut_triton(logits, temperature, cut, top_p, False, w, b), iters)[0]  # noqa: B023
                for w, b in SEARCHES
            ]
            same = torch.equal(top_p_cut_triton(logits, temperature, cut, top_p), top_p_cut_naive(logits, temperature, cut, top_p))
            print(f"| {batch} | {scale} | {sort_ms:.3f} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {same} |", flush=True)


def _times(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(device ms, host ms) per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t) / iters * 1e3
    end.synchronize()
    return start.elapsed_time(end) / iters, host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--top-p-only", action="store_true", help="only the table of top-p's cut")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.top_p_only:
        _top_p_table(batches, args.iters)
        return
    print(f"{torch.cuda.get_device_name()}; vocab {VOCAB}; ms a call, device / host (enqueue)")
    print("| rows | setting | argmax | cuts | race kernel | sample_rows |")
    print("|---:|---|---:|---:|---:|---:|")
    for batch in batches:
        logits = torch.randn(batch, VOCAB, device="cuda") * 3
        for name, kw in SETTINGS.items():
            params = [SamplingParams(seed=i, **kw) for i in range(batch)]
            settings = RowSettings(params, list(range(batch)), [3] * batch)
            temperature, cut = row_cuts(logits, params)
            keys = torch.tensor([row_keys(i, 3) for i in range(batch)], dtype=torch.int64, device="cuda")
            cells = [
                _times(lambda: logits.argmax(dim=-1), args.iters),  # noqa: B023
                _times(lambda: row_cuts(logits, params), args.iters),  # noqa: B023
                _times(lambda: gumbel_argmax_triton(logits, temperature, cut, keys), args.iters),  # noqa: B023
                _times(lambda: sample_rows(logits, settings), args.iters),  # noqa: B023
            ]
            print(f"| {batch} | {name} | " + " | ".join(f"{d:.3f} / {h:.3f}" for d, h in cells) + " |", flush=True)
    _top_p_table(batches, args.iters)
    batch = batches[-1]
    logits = torch.randn(batch, VOCAB, device="cuda") * 3
    params = [SamplingParams(seed=i, **SETTINGS["+ top-p"]) for i in range(batch)]
    settings = RowSettings(params, list(range(batch)), [3] * batch)
    sample_rows(logits, settings)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            sample_rows(logits, settings)
        torch.cuda.synchronize()
    print(f"\nkernels of sample_rows, {batch} rows, temperature + top-p (10 calls):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
