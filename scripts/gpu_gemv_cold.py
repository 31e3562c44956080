"""Few-row GEMMs timed with the weight in L2 (one weight, replayed) and from HBM (copies cycled). GPU only.

``python scripts/gpu_gemv_cold.py [--rows 1,8,32] [--shapes qkv,o,gate_up,down]``

A decode step streams 16 GB of weights: no projection finds its weight in the 60 MB L2. A
timing that replays one weight finds the weights under ~60 MB there (Llama-3.1-8B's o and
qkv projections). Per shape and row count: cuBLAS (``F.linear``) and each Triton tiling
candidate, CUDA-graph replays of 20 calls, microseconds a call, ``hot`` (one weight) and
``cold`` (the call ``i`` reads copy ``i mod c``, ``c`` copies summing to >= 3x the L2), with
the weight-read floor at the copy rate measured in the same run
(:func:`kernels.bench.copy_bandwidth`; the runs of 2026-12-04 timed a uint8 copy, at 2.76 TB/s:
their floor column is not the floor); whether each tiling gives the reference bits.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.batch_invariant import matmul_triton
from kernels.bench import copy_bandwidth
from kernels.gemm_calibration import _TUNE_CANDIDATES

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
EXTRA: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 32, 256, 4, 6), (16, 64, 128, 4, 6), (16, 16, 256, 2, 8), (16, 32, 128, 4, 8), (16, 64, 256, 4, 4),
    (16, 128, 128, 4, 4), (16, 64, 128, 8, 6), (16, 32, 512, 4, 3), (16, 16, 512, 2, 4), (16, 64, 64, 4, 8),
)


def sweep_tilings(m: int) -> list[tuple[int, int, int, int, int]]:
    """Long-``K`` tilings for ``m`` rows whose stages fit 200 KB of shared memory (``--sweep``)."""
    block_m = 16 if m <= 16 else 32
    return [
        (block_m, bn, bk, w, st)
        for bn in (16, 32) for bk in (256, 512, 1024) for w in (2, 4, 8) for st in (2, 3, 4, 5, 6)
        if (block_m + bn) * bk * 2 * st <= 200 * 1024
    ]


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def case(weights: list[torch.Tensor], x: torch.Tensor, sweep: bool) -> list[tuple[str, float, float, str]]:
    """``(kernel, hot us, cold us, bits)`` for cuBLAS and each tiling candidate of ``x``'s rows
    (``sweep``: the calibration's candidates and :func:`sweep_tilings`, cold only)."""
    m = x.shape[0]
    ref = matmul_triton(x, weights[0])
    bucket = min(b for b in _TUNE_CANDIDATES if b >= m)
    extra = sweep_tilings(m) if sweep else (EXTRA if m <= 16 else ())
    tilings = list(dict.fromkeys((*_TUNE_CANDIDATES[bucket], *extra)))

    def both(call: Callable[[torch.Tensor], object]) -> tuple[float, float]:
        cycle = itertools.cycle(weights)
        hot = float("nan") if sweep else graph_us(lambda: call(weights[0]))
        return hot, graph_us(lambda: call(next(cycle)))

    hot, cold = both(lambda w: F.linear(x, w))
    rows = [("cuBLAS", hot, cold, "=" if torch.equal(F.linear(x, weights[0]), ref) else "x")]
    for tiling in tilings:
        try:
            same = torch.equal(matmul_triton(x, weights[0], config=tiling), ref)
            hot, cold = both(lambda w, t=tiling: matmul_triton(x, w, config=t))
        except Exception as exc:  # noqa: BLE001 - a tiling that does not fit is reported
            rows.append((str(tiling), float("nan"), float("nan"), str(exc).splitlines()[0][:40]))
            continue
        rows.append((str(tiling), hot, cold, "=" if same else "x"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="long-K tilings too, timed cold only")
    ap.add_argument("--top", type=int, default=0, help="print only the fastest N rows of each table")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()  # GB/s, read + write
    print(f"{torch.cuda.get_device_name()}; L2 {l2 / 2**20:.0f} MiB; copy rate {bw:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        count = max(2, -(-3 * l2 // nbytes))
        weights = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(count)]
        floor = nbytes / bw / 1e3
        for m in (int(r) for r in args.rows.split(",")):
            rows = case(weights, torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=gen), args.sweep)
            print(f"\n{name} ({n} x {k}, {nbytes / 1e6:.1f} MB, {count} copies), {m} rows: floor {floor:.1f} us")
            print("| kernel | hot us | cold us | cold / floor | bits |")
            print("|---|---:|---:|---:|---|")
            ranked = sorted(rows, key=lambda r: (r[2] != r[2], r[2]))
            for label, hot, cold, bits in ranked[: args.top or None]:
                print(f"| {label} | {hot:.1f} | {cold:.1f} | {cold / floor:.2f}x | {bits} |")
            timed = [r for r in rows[1:] if r[2] == r[2]]
            best_cold = min(timed, key=lambda r: r[2])
            print(f"best cold {best_cold[0]} ({best_cold[2]:.1f} us); cuBLAS {rows[0][2]:.1f}; bits all equal: "
                  f"{all(r[3] == '=' for r in timed)}", flush=True)


if __name__ == "__main__":
    main()
