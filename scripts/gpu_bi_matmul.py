"""Where cuBLAS is already batch-invariant, and whether its bits are the Triton matmul's (GPU).

Run on the GPU machine: ``python scripts/gpu_bi_matmul.py [--skip bits,tune]``. For the
projections of Llama-3.1-8B (and a few other models) in bf16, the reference is
:func:`kernels.batch_invariant.matmul_triton` (one accumulator per output, ``K`` ascending).
Prints, per shape and batch size, whether ``F.linear`` of the rows equals the reference bits;
then, on the shapes where cuBLAS splits ``K`` at a few rows, times Triton tilings against
cuBLAS (CUDA-graph replays) and checks that each gives the reference bits; then times the
engine's calibrated linear op (tilings chosen at start-up per shape) on those shapes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.batch_invariant import matmul_triton
from kernels.gemm_calibration import BatchInvariantLinear, graph_time_us

SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096), (128256, 4096), (1728, 576), (14336, 5120)]
BATCHES = [1, 8, 32, 64, 128, 200, 256, 384, 512, 777, 1024, 1500, 2048, 3000, 4096, 8192]
# Shapes where cuBLAS splits K at a few rows (Llama-3.1-8B's o and down projections, Qwen2.5-7B's
# and a 70B's): the ones the batch-invariant linear leaves to Triton there.
TUNE_SHAPES = [(4096, 4096), (4096, 14336), (3584, 18944), (8192, 8192), (8192, 28672)]
TUNE_BATCHES = [1, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512]
DECODE = [(16, 16, 128, 2, 6), (16, 16, 128, 2, 8), (16, 16, 256, 2, 5), (16, 16, 256, 4, 6), (16, 16, 128, 1, 8),
          (16, 32, 128, 4, 6), (16, 32, 256, 4, 4), (16, 32, 128, 2, 8), (32, 16, 256, 2, 5), (32, 32, 256, 4, 4),
          (32, 32, 128, 4, 6), (32, 64, 128, 4, 4), (64, 16, 128, 4, 5), (64, 32, 128, 4, 4), (64, 32, 128, 4, 6),
          (64, 64, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4),
          (128, 128, 64, 8, 3), (128, 128, 64, 4, 4)]


def graph_us(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    return graph_time_us(fn, reps)


def bits_table(gen: torch.Generator) -> None:
    print("| N x K | " + " | ".join(f"M={m}" for m in BATCHES) + " |")
    print("|---|" + "---|" * len(BATCHES))
    for n, k in SHAPES:
        w = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        x = torch.randn((max(BATCHES) + 3, k), generator=gen).to("cuda", torch.bfloat16)
        ref = matmul_triton(x, w, config=(128, 128, 64, 8, 3))
        marks = []
        for m in BATCHES:
            own = F.linear(x[:m], w)
            off = F.linear(x[3 : 3 + m], w)
            marks.append(("=" if torch.equal(own, ref[:m]) else "x") + ("=" if torch.equal(off, ref[3 : 3 + m]) else "x"))
        print(f"| {n} x {k} | " + " | ".join(marks) + " |", flush=True)
        del w, x, ref
        torch.cuda.empty_cache()
    print("('=' equal to the Triton kernel's bits, at offset 0 then 3)")


def tune(gen: torch.Generator) -> None:
    """Per split-K shape and row count: cuBLAS, the automatic configuration and the best one."""
    print("\n| N x K | rows | cuBLAS us | auto us | auto / cuBLAS | best config | best us | best / cuBLAS |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    totals: dict[tuple, dict[int, float]] = {}
    for n, k in TUNE_SHAPES:
        w = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        x = torch.randn((max(TUNE_BATCHES), k), generator=gen).to("cuda", torch.bfloat16)
        ref = matmul_triton(x, w, config=(128, 128, 64, 8, 3))
        for m in TUNE_BATCHES:
            xm = x[:m]
            cub = graph_us(lambda xm=xm, w=w: F.linear(xm, w))
            auto = graph_us(lambda xm=xm, w=w: matmul_triton(xm, w))
            best = (float("inf"), None)
            for cfg in DECODE:
                if not torch.equal(matmul_triton(xm, w, config=cfg), ref[:m]):
                    print(f"   bits differ: {cfg} M={m} {n}x{k}")
                t = graph_us(lambda xm=xm, w=w, cfg=cfg: matmul_triton(xm, w, config=cfg))
                totals.setdefault(cfg, {}).setdefault(m, 0.0)
                totals[cfg][m] += t / cub
                best = min(best, (t, cfg))
            print(f"| {n} x {k} | {m} | {cub:.1f} | {auto:.1f} | {auto / cub:.2f} | {best[1]} | {best[0]:.1f} | "
                  f"{best[0] / cub:.2f} |", flush=True)
        del w, x, ref
        torch.cuda.empty_cache()
    print("\n| config | " + " | ".join(f"M={m}" for m in TUNE_BATCHES) + " |  (mean time / cuBLAS over the shapes)")
    print("|---|" + "---:|" * len(TUNE_BATCHES))
    for cfg, row in totals.items():
        print(f"| {cfg} | " + " | ".join(f"{row[m] / len(TUNE_SHAPES):.2f}" for m in TUNE_BATCHES) + " |")


def calibrated(gen: torch.Generator) -> None:
    """The engine's linear op after its start-up calibration (bits checked, tilings timed per
    shape and row bucket) against cuBLAS and the fixed tiling table, on the split-K shapes."""
    print("\n| N x K | rows | cuBLAS us | table us | calibrated us | calibrated / cuBLAS | path |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for n, k in TUNE_SHAPES[:2]:
        op = BatchInvariantLinear("cuda")
        op.calibrate({(n, k): 512}, torch.bfloat16)
        w = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        x = torch.randn((512, k), generator=gen).to("cuda", torch.bfloat16)
        ref = matmul_triton(x, w)
        for m in (1, 8, 16, 32, 64, 128, 256, 512):
            xm = x[:m]
            assert torch.equal(op(xm, w), ref[:m]), (n, k, m)
            cub = graph_us(lambda xm=xm, w=w: F.linear(xm, w))
            table = graph_us(lambda xm=xm, w=w: matmul_triton(xm, w))
            cal = graph_us(lambda xm=xm, w=w, op=op: op(xm, w))
            span = op.library_rows.get((n, k, torch.bfloat16))
            path = "cuBLAS" if span and span[0] <= m else next(
                (str(t) for b, t in op.tilings[(n, k, torch.bfloat16)] if m <= b), "table")
            print(f"| {n} x {k} | {m} | {cub:.1f} | {table:.1f} | {cal:.1f} | {cal / cub:.2f} | {path} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="", help="comma list of parts to skip: bits, tune, calibrated")
    skip = set(filter(None, ap.parse_args().skip.split(",")))
    gen = torch.Generator().manual_seed(0)
    if "bits" not in skip:
        bits_table(gen)
    if "tune" not in skip:
        tune(gen)
    if "calibrated" not in skip:
        calibrated(gen)


if __name__ == "__main__":
    main()
