"""MSA in the batch-invariant mode against the default launches, kernel alone (GPU).

Run on the GPU machine: ``python scripts/gpu_bi_msa.py [--compare OTHER/msa_triton.py]``.
Shapes of :mod:`kernels.bench` (bf16, 32 q / 8 KV heads, head_dim 128, 16-token pages scattered
over the pool). Two tables:

1. Decodes (CUDA-graph replays over enough copies to overflow the L2 cache): the default
   launch's time, then the batch-invariant plan's when it spreads its fixed chunks over
   programs below ``v`` programs per SM, up to ``v`` per SM, for each ``v`` of a grid.
2. Prefills (eager): the default launch's time, then the batch-invariant plan's at prefill
   tiles of 64/128/256 rows, each with a check that rows computed alone give the same bits
   as inside the tile.

``--compare`` times another copy of ``kernels/msa_triton.py`` (an older commit's) beside this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

import torch

from kernels import msa_plan
from kernels.bench import (
    DTYPE,
    HKV,
    HQ,
    PAGE,
    D,
    Layout,
    bench_ms,
    decode_layout,
    make_inputs,
    segment_layout,
)
from kernels.bench_decode import graph_ms
from kernels.metadata import build_msa_metadata


def plan(meta, invariant: bool, programs_per_sm: int | None = None, prefill_rows: int | None = None):  # type: ignore[no-untyped-def]
    """``meta`` with its launch plan, the invariant mode's knobs set as given."""
    saved = msa_plan._INVARIANT_PROGRAMS_PER_SM, msa_plan._INVARIANT_ROWS, msa_plan._INVARIANT_SPLIT_BELOW
    if programs_per_sm is not None:  # split below this many programs per SM, up to this many
        msa_plan._INVARIANT_PROGRAMS_PER_SM = msa_plan._INVARIANT_SPLIT_BELOW = programs_per_sm
    if prefill_rows is not None:
        msa_plan._INVARIANT_ROWS = (saved[1][0], prefill_rows)
    msa_plan.invariant_config.cache_clear()
    try:
        p = msa_plan.plan_msa(meta, HQ, HKV, D, meta.block_tables.device, dtype=DTYPE, invariant=invariant)
    finally:
        msa_plan._INVARIANT_PROGRAMS_PER_SM, msa_plan._INVARIANT_ROWS, msa_plan._INVARIANT_SPLIT_BELOW = saved
        msa_plan.invariant_config.cache_clear()
    return dataclasses.replace(meta, plan=p)


def rows_alone_equal(module, inp, meta, rows: list[int]) -> bool:  # type: ignore[no-untyped-def]
    """Whether the packed ``rows`` computed alone (one-token decode plans) equal their bits
    inside ``meta``'s launch."""
    scale = D**-0.5
    full = module.msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)
    located = {}
    for seq, q_start, q_len, pos in inp.meta.host_segments:
        for i in range(q_len):
            located[q_start + i] = (seq, pos + i)
    for row in rows:
        seq, pos = located[row]
        one = build_msa_metadata(inp.tables, [(seq, 0, 1, pos)], [-1], PAGE, device="cuda")
        alone = module.msa_triton(inp.q[row : row + 1], inp.k_cache, inp.v_cache, plan(one, True), scale)
        if not torch.equal(alone[0], full[row]):
            return False
    return True


def timed(module, inputs, metas, decode: bool) -> float:  # type: ignore[no-untyped-def]
    scale = D**-0.5
    fns = [
        lambda inp=inp, meta=meta: module.msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)
        for inp, meta in zip(inputs, metas, strict=True)
    ]
    if decode:
        return graph_ms(fns)
    return bench_ms(fns[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", default=None, help="another msa_triton.py to time beside this one")
    ap.add_argument("--decodes-only", action="store_true", help="the decode table only")
    args = ap.parse_args()
    modules = [importlib.import_module("kernels.msa_triton")]
    if args.compare:
        spec = importlib.util.spec_from_file_location("msa_compare", args.compare)
        assert spec is not None and spec.loader is not None
        other = importlib.util.module_from_spec(spec)
        sys.modules["msa_compare"] = other
        spec.loader.exec_module(other)
        modules.append(other)
    decodes = [decode_layout(32, 2048), decode_layout(1, 2048), decode_layout(32, 8192), decode_layout(4, 32768),
               decode_layout(128, 2048)]
    prefills = [Layout("causal 8k", [8192], [[(0, 8192)]]), segment_layout(16384, 4),
                Layout("2k at 6k", [8192], [[(6144, 2048)]])]
    pps_grid, rows_grid = (1, 2, 3, 6, 12), (64, 128, 256)
    print("| layout | module | default ms | " + " | ".join(f"pps {v}" for v in pps_grid) + " |")
    print("|---|---|---:|" + "---:|" * len(pps_grid))
    for layout in decodes:
        kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
        copies = max(1, min(8, -(-(256 << 20) // int(kv_bytes))))
        inputs = [make_inputs(layout, torch.Generator().manual_seed(i + 11)) for i in range(copies)]
        for module in modules:
            t_def = timed(module, inputs, [plan(inp.meta, False) for inp in inputs], True)
            cells = [timed(module, inputs, [plan(inp.meta, True, v) for inp in inputs], True) for v in pps_grid]
            print(f"| {layout.name} | {module.__name__} | {t_def:.3f} | "
                  + " | ".join(f"{c:.3f} ({c / t_def:.2f}x)" for c in cells) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    if args.decodes_only:
        return
    print("\n| layout | module | default ms | " + " | ".join(f"rows {v}" for v in rows_grid) + " |")
    print("|---|---|---:|" + "---:|" * len(rows_grid))
    for layout in prefills:
        inp = make_inputs(layout, torch.Generator().manual_seed(5))
        last = inp.meta.host_segments[-1]
        check = [last[1] + last[2] - 1, last[1] + last[2] // 2, last[1]]
        for module in modules:
            t_def = timed(module, [inp], [plan(inp.meta, False)], False)
            cells = []
            for rows in rows_grid:
                meta = plan(inp.meta, True, prefill_rows=rows)
                saved = msa_plan._INVARIANT_PARTIAL_BYTES
                msa_plan._INVARIANT_PARTIAL_BYTES = 0
                same = rows_alone_equal(module, inp, meta, check)
                msa_plan._INVARIANT_PARTIAL_BYTES = saved
                t = timed(module, [inp], [meta], False)
                cfg = meta.plan.launches[0].config
                cells.append(f"{t:.3f} ({t / t_def:.2f}x, w{cfg.num_warps} s{cfg.num_stages} bn{cfg.block_n}"
                             f"{'' if same else ', BITS DIFFER ALONE'})")
            print(f"| {layout.name} | {module.__name__} | {t_def:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
