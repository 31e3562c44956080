"""MSA prefill tiles against compiled FlexAttention, on every multi-segment layout (GPU).

Run on the GPU machine: ``python scripts/gpu_msa_tiles.py [--configs 64:64:8:3,64:128:8:2]``,
each config ``block_m:block_n:warps:stages`` (tokens per tile, keys per KV tile); each is
timed at 1, 2 and 4 KV splits beside the planner's own launch (``msa``) and FlexAttention on
contiguous KV, on the layouts of :mod:`kernels.bench` (bf16, 32 q / 8 KV heads, head_dim 128,
16-token pages scattered). The library mode only: its tiles are free to follow the step (the
batch-invariant mode's KV tile is fixed: ``scripts/gpu_bi_tile.py``). Each config's output is
checked against the planner's launch (max abs difference), and so is each of the planner's
earlier choices, switched back on in turn (``_VARIANTS``): the grid tile first
(``kernels.msa_grid_order.HEADS_FIRST_MIN_GAIN``); that and the 128-key tiles always split
(``_WIDE_KV_MIN_SPLITS``); 64-key tiles only (``_WIDE_KV_MIN_KEYS``). In the planner's column,
``h`` marks a grid that goes KV head first.

``--configs ''`` times the planner alone (and its earlier choices) against FlexAttention.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from kernels.bench import (
    D,
    Layout,
    bench_ms,
    causal_flops,
    compiled_flex,
    flex_fn,
    make_inputs,
    narrow_kv_tiles,
    planned,
    segment_layout,
    split_wide_kv_tiles,
    tile_first_grid,
)
from kernels.msa_config import MSAConfig
from kernels.msa_triton import msa_triton

# The planner's earlier choices, each switched back on in turn: the grid tile first; that and
# the 128-key tiles always split; 64-key tiles only (the grid tile first).
_VARIANTS = {
    "tile first": (tile_first_grid,),
    "tile first, wide >= 2 splits": (tile_first_grid, split_wide_kv_tiles),
    "64-key tiles": (tile_first_grid, narrow_kv_tiles),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64:64:8:3,64:128:8:2,32:128:8:3,32:128:8:2,16:128:4:3,64:64:8:2")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--more", action="store_true", help="also layouts kernels.bench does not time")
    ap.add_argument("--new", action="store_true", help="also the layouts held out from the wide-tile rule")
    ap.add_argument("--order-held-out", action="store_true",
                    help="also the layouts held out from the grid-order rule (msa_grid_order.HEADS_FIRST_MIN_GAIN)")
    ap.add_argument("--all-splits", action="store_true", help="print every split's TFLOP/s")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",") if c]
    splits = [int(s) for s in args.splits.split(",")]
    flex = compiled_flex()
    grid = [(4096, 4), (8192, 2), (8192, 4), (8192, 8), (16384, 4), (16384, 8), (32768, 4), (32768, 8)]
    layouts = [segment_layout(c, n) for c, n in grid] + [Layout("causal 8k", [8192], [[(0, 8192)]])]
    if args.more:
        # layouts kernels.bench does not time: chunks deep in a prompt
        layouts += [Layout("2k at 6k", [8192], [[(6144, 2048)]]), Layout("8k at 24k", [32768], [[(24576, 8192)]])]
    if args.new:
        # layouts held out from the choice of the planner's wide-tile rule
        layouts += [
            segment_layout(65536, 8), segment_layout(24576, 6, hole=256, suffix=512),
            segment_layout(12288, 3, hole=1024, suffix=2048), segment_layout(16384, 2),
            segment_layout(49152, 4), segment_layout(16384, 16, hole=256, suffix=512),
            Layout("4k at 12k", [16384], [[(12288, 4096)]]), Layout("4k at 28k", [32768], [[(28672, 4096)]]),
            Layout("2 x 16k x4seg", [16384] * 2, segment_layout(16384, 4).segs * 2),
            Layout("4 x 2k fresh", [2048] * 4, [[(0, 2048)]] * 4),
        ]
    if args.order_held_out:
        layouts += [
            segment_layout(24576, 12), segment_layout(40960, 5, hole=2048, suffix=2048),
            segment_layout(8192, 16, hole=256, suffix=512), segment_layout(65536, 16, hole=1024),
            segment_layout(20480, 3, hole=3072, suffix=1024), Layout("6k at 10k", [16384], [[(10240, 6144)]]),
            Layout("3 x 8k x8seg", [8192] * 3, segment_layout(8192, 8).segs * 3),
            Layout("2k at 30k + 4k fresh", [32768, 4096], [[(30720, 2048)], [(0, 4096)]]),
        ]
    scale = D**-0.5
    t0 = time.time()
    head = ["msa", *(f"msa, {name}" for name in _VARIANTS), "flex"] + [f"{bm}x{bn} w{w} s{s}" for bm, bn, w, s in configs]
    print("TFLOP/s; for each config the best of its splits (and that split)")
    print("| layout | " + " | ".join(head) + " | msa / flex | best / flex |\n|---|" + "---:|" * (len(head) + 2))
    for i, layout in enumerate(layouts):
        inp = make_inputs(layout, torch.Generator().manual_seed(1000 + i))
        flops = causal_flops(inp)
        ref_meta = planned(inp.meta)
        ref = msa_triton(inp.q, inp.k_cache, inp.v_cache, ref_meta, scale)
        def run(meta, inp=inp):  # type: ignore[no-untyped-def]
            return msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)

        tile_ctx = [pos + min(off + 64, q_len) for _, _, q_len, pos in inp.meta.host_segments for off in range(0, q_len, 64)]
        mean_keys = sum(tile_ctx) / len(tile_ctx)
        lp = ref_meta.plan.launches[0]
        msa_tf = flops / bench_ms(lambda ref_meta=ref_meta: run(ref_meta)) / 1e9
        cells = [f"{msa_tf:.0f} "
                 f"({lp.config.block_m}x{lp.config.block_n} s{lp.num_splits}{' h' if lp.heads_first else ''})"]
        for switches in _VARIANTS.values():
            with contextlib.ExitStack() as stack:
                for switch in switches:
                    stack.enter_context(switch())
                meta = planned(inp.meta)
            err = (run(meta).float() - ref.float()).abs().max().item()
            lp = meta.plan.launches[0]
            cells.append(f"{flops / bench_ms(lambda meta=meta: run(meta)) / 1e9:.0f} (s{lp.num_splits})"
                         + (f" ERR {err:.1e}" if err > 2e-2 else ""))
        flex_tf = float("nan")
        if len(layout.ctxs) == 1:  # flex_fn expresses one sequence's segments
            fn = flex_fn(inp, layout, scale, flex)
            fn()
            flex_tf = flops / bench_ms(fn) / 1e9
        cells.append(f"{flex_tf:.0f}")
        best = msa_tf
        for bm, bn, w, s in configs:
            results = []
            for sp in splits:
                meta = planned(inp.meta, MSAConfig(bm, bn, w, s, sp))
                try:
                    err = (run(meta).float() - ref.float()).abs().max().item()
                    ms = bench_ms(lambda meta=meta: run(meta))
                except Exception as exc:  # noqa: BLE001
                    print(f"{layout.name} {bm}:{bn}:{w}:{s} split {sp} failed: {type(exc).__name__}", flush=True)
                    continue
                results.append((flops / ms / 1e9, sp, err))
            if not results:
                cells.append("-")
                continue
            tf, sp, err = max(results)
            best = max(best, tf)
            if args.all_splits:
                cells.append("/".join(f"{r[0]:.0f}" for r in results) + (" ERR" if max(r[2] for r in results) > 2e-2 else ""))
                continue
            cells.append(f"{tf:.0f} (s{sp}" + (f", ERR {err:.1e}" if err > 2e-2 else "") + ")")
        print(f"| {layout.name} ({mean_keys / 1024:.1f}k keys a tile) | " + " | ".join(cells) + f" | {msa_tf / flex_tf:.2f}x | {best / flex_tf:.2f}x |", flush=True)
        torch.cuda.empty_cache()
    print(f"[{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    main()
