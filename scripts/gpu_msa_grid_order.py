"""The MSA grid's order: tiles first (program ``(tile, KV head, split)``, the tile the fastest
axis) against KV heads first (``MSAPlan.heads_first``), on the planner's own launches (GPU).

Run on the GPU machine: ``python scripts/gpu_msa_grid_order.py [--quick]``. The GPU starts a
grid's programs in order along its fastest axis. With the tile first, the planner's
heaviest-first tile table holds within one KV head only, and the last head's deepest tiles start
when most of the launch is done; with the KV head first, every head of the deepest tile starts
first. Both orders compute the same bits (checked). Layouts: the prefill layouts of
``scripts/gpu_msa_tiles.py`` (bf16, 32 q / 8 KV heads, head_dim 128, 16-token pages scattered)
and decodes at batch 1-64 and 8k-128k keys, each in the library mode and the batch-invariant
mode (the CUDA default).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from kernels.bench import D, Layout, bench_ms, decode_layout, make_inputs, planned, segment_layout
from kernels.metadata import MSAMetadata
from kernels.msa_plan import MSAStepPlan
from kernels.msa_triton import msa_triton


def heads_first(meta: MSAMetadata) -> MSAMetadata:
    """``meta`` with every launch of its plan ordered by KV head first."""
    plan = meta.plan
    assert isinstance(plan, MSAStepPlan)
    return dataclasses.replace(
        meta, plan=MSAStepPlan(tuple(dataclasses.replace(lp, heads_first=True) for lp in plan.launches))
    )


def layouts(quick: bool) -> list[Layout]:
    if quick:
        return [segment_layout(32768, 8), Layout("8k at 24k", [32768], [[(24576, 8192)]]), decode_layout(1, 32768)]
    out = [segment_layout(c, n) for c, n in [(8192, 8), (16384, 4), (16384, 8), (32768, 4), (32768, 8)]]
    out += [
        Layout("causal 8k", [8192], [[(0, 8192)]]), Layout("8k at 24k", [32768], [[(24576, 8192)]]),
        segment_layout(65536, 8), segment_layout(16384, 16, hole=256, suffix=512),
        segment_layout(12288, 3, hole=1024, suffix=2048), Layout("4k at 28k", [32768], [[(28672, 4096)]]),
        Layout("2 x 16k x4seg", [16384] * 2, segment_layout(16384, 4).segs * 2),
    ]
    out += [decode_layout(b, c) for b in (1, 4, 16, 64) for c in (8192, 32768, 131072) if b * c <= 64 * 32768]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three layouts")
    args = ap.parse_args()
    scale = D**-0.5
    t0 = time.time()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| layout | mode | launches (tiles x splits) | tiles first us | heads first us | heads first speed-up |")
    print("|---|---|---|---:|---:|---:|")
    for i, layout in enumerate(layouts(args.quick)):
        inp = make_inputs(layout, torch.Generator().manual_seed(1000 + i))
        for mode, invariant in (("library", False), ("batch-invariant", True)):
            base = planned(inp.meta, invariant=invariant)
            flipped = heads_first(base)

            def run(meta: MSAMetadata, inp: object = inp) -> torch.Tensor:
                return msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)  # type: ignore[attr-defined]

            same = torch.equal(run(base), run(flipped))
            launches = " + ".join(f"{lp.num_tiles}x{lp.num_splits}" for lp in base.plan.launches)
            ms_base, ms_flip = bench_ms(lambda base=base: run(base)), bench_ms(lambda flipped=flipped: run(flipped))
            print(f"| {layout.name} | {mode} | {launches} | {ms_base * 1e3:.1f} | {ms_flip * 1e3:.1f} | "
                  f"{ms_base / ms_flip:.3f}x{'' if same else ' BITS DIFFER'} |", flush=True)
        del inp
        torch.cuda.empty_cache()
    print(f"[{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    main()
