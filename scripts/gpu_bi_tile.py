"""The batch-invariant mode's KV tile: 64 keys (the default) against 128 (GPU).

Run on the GPU machine: ``python scripts/gpu_bi_tile.py [--cells 128:2,128:3,64:3]``, each cell
``block_n:stages[:warps[:prefill rows]]``, the last the reference of each row's ratios. Shapes of :mod:`kernels.bench`
(bf16, 32 q / 8 KV heads, head_dim 128, 16-token pages scattered over the pool).

The KV tile is what a row's online softmax steps over, so like the fixed chunk it is one
number for every launch of a deployment (decodes and prefills alike): a 128-key tile halves the
turns of a decode's walk (8 -> 4 per 512-key chunk), whose chain, not its bytes, bounds it at
small batch ("What a turn of the batch-invariant decode walk costs" in BENCHMARKS.md), and
changes every prefill tile's shape. Decodes are timed as CUDA-graph replays, prefills eagerly,
each prefill with a check that rows computed alone give the bits they have inside the tile.
``--offline`` compiles the cells for sm_90 here instead (registers, spills, shared memory).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from kernels import msa_plan
from kernels.bench import DTYPE, HKV, HQ, D

_invariant_config = msa_plan.invariant_config


@contextmanager
def invariant_tile(block_n: int, stages: int, warps: int = 0, prefill_rows: int = 0) -> Iterator[None]:
    """Within the block, every batch-invariant launch uses ``block_n``-key tiles, ``stages`` deep
    (and ``warps`` warps a program, and prefill tiles of ``prefill_rows`` rows, when not 0)."""

    def patched(*args, **kwargs):  # type: ignore[no-untyped-def]
        cfg = _invariant_config(*args, **kwargs)
        g_pad = 1 << (args[0] // args[1] - 1).bit_length()
        block_m = cfg.block_m
        if prefill_rows and block_m * g_pad > 64:
            block_m = max(1, prefill_rows // g_pad)
        return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, num_stages=stages,
                                   num_warps=warps or cfg.num_warps)

    patched.cache_clear = _invariant_config.cache_clear  # type: ignore[attr-defined]
    msa_plan.invariant_config = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        msa_plan.invariant_config = _invariant_config


def offline(cells: list[tuple[int, int]]) -> None:
    from kernels import offline_compile as oc

    steps = [("decode 1 x 8k", [(8192, 1)]), ("decode 32 x 2k", [(2048, 1)] * 32), ("prefill 8k", [(8192, 8192)])]
    print("| step | cell | regs | spill B | smem B | in flight |\n|---|---|---:|---:|---:|---:|")
    for name, segments in steps:
        for bn, st, *w in cells:
            with invariant_tile(bn, st, *w):
                launches = oc.record_step(segments, invariant=True)
            for launch in launches:
                if launch.kernel != "_msa_fwd_kernel":
                    continue
                try:
                    a = oc.analyse(oc.compile_launch(launch))
                except Exception as exc:  # noqa: BLE001
                    print(f"| {name} | {bn}:{st}:{w} | failed: {type(exc).__name__} |")
                    continue
                print(f"| {name} | {bn}:{st}:{w} | {a['registers']} | {a['spill_bytes']} | {a['shared_bytes']} | {a['copies_in_flight']} |",
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="128:2,128:3,64:3", help="block_n:stages[:warps[:prefill rows]], the last the reference")
    ap.add_argument("--offline", action="store_true", help="compile for sm_90 here, launch nothing")
    args = ap.parse_args()
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]
    if args.offline:
        offline(cells)  # type: ignore[arg-type]
        return
    from gpu_bi_knobs import knob_tables  # type: ignore[import-not-found]

    def planned(meta, cell):  # type: ignore[no-untyped-def]
        with invariant_tile(*cell):
            p = msa_plan.plan_msa(meta, HQ, HKV, D, meta.block_tables.device, dtype=DTYPE, invariant=True)
        return dataclasses.replace(meta, plan=p)

    knob_tables(
        [f"{c[0]} keys s{c[1]}" + "".join(f" {k}{v}" for k, v in zip(("w", "r"), c[2:], strict=False)) for c in cells],
        [lambda meta, c=c: planned(meta, c) for c in cells],
        [lambda c=c: invariant_tile(*c) for c in cells],
    )


if __name__ == "__main__":
    main()
