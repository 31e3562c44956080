"""The batch-invariant mode's launch knobs: its fixed chunk and its pipelining depth (GPU).

Run on the GPU machine: ``python scripts/gpu_bi_knobs.py [--cells 512:3,512:4,256:3]``, each
cell ``chunk:stages``. Shapes of :mod:`kernels.bench` (bf16, 32 q / 8 KV heads, head_dim 128,
16-token pages scattered over the pool); the last cell is the reference of each row's ratios.

- The chunk (:data:`kernels.msa_plan.INVARIANT_CHUNK`) sets which keys a row's online softmax
  folds together, so it is one number for every launch of a deployment: a shorter chunk gives
  a decode more programs (shorter walks) and costs every prefill tile a fold per chunk and
  every split decode a longer merge.
- The stages (``num_stages``) set how many KV tiles' copies a walk keeps in flight; they do not
  change the bits.

Decodes are timed as CUDA-graph replays, prefills eagerly, each prefill with a check that rows
computed alone (one-token launches) give the bits they have inside the prefill tile.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from gpu_bi_msa import rows_alone_equal, timed  # type: ignore[import-not-found]

from kernels import msa_plan
from kernels.bench import DTYPE, HKV, HQ, D, Layout, decode_layout, make_inputs, segment_layout


@contextmanager
def invariant_chunk(chunk: int, partial_bytes: int | None = None) -> Iterator[None]:
    """The planner's fixed chunk (and, if given, its partial-buffer bound) set for the block."""
    saved = msa_plan.INVARIANT_CHUNK, msa_plan._INVARIANT_PARTIAL_BYTES
    msa_plan.INVARIANT_CHUNK = chunk
    if partial_bytes is not None:
        msa_plan._INVARIANT_PARTIAL_BYTES = partial_bytes
    try:
        yield
    finally:
        msa_plan.INVARIANT_CHUNK, msa_plan._INVARIANT_PARTIAL_BYTES = saved


def plan_at(meta, chunk: int, stages: int):  # type: ignore[no-untyped-def]
    """``meta`` with its batch-invariant plan at ``chunk`` keys a chunk and ``stages`` deep."""
    with invariant_chunk(chunk):
        p = msa_plan.plan_msa(meta, HQ, HKV, D, meta.block_tables.device, dtype=DTYPE, invariant=True)
    launches = tuple(
        dataclasses.replace(launch, config=dataclasses.replace(launch.config, num_stages=stages))
        for launch in p.launches
    )
    return dataclasses.replace(meta, plan=dataclasses.replace(p, launches=launches))


def knob_tables(names: list[str], plans: list[Callable], alone: list[Callable]) -> None:  # type: ignore[type-arg]
    """Prints the decode and prefill tables of knob settings: ``plans[i](meta)`` is ``meta``
    planned at setting ``i``, ``alone[i]()`` a context in which rows computed alone (one-token
    plans) follow setting ``i``; the last setting is the reference of each row's ratios."""
    import kernels.msa_triton as module

    decodes = [decode_layout(1, 2048), decode_layout(1, 8192), decode_layout(1, 32768), decode_layout(8, 2048),
               decode_layout(32, 2048), decode_layout(4, 32768), decode_layout(64, 8192)]
    prefills = [Layout("causal 8k", [8192], [[(0, 8192)]]), segment_layout(16384, 4), segment_layout(32768, 8),
                Layout("2k at 6k", [8192], [[(6144, 2048)]])]
    head = " | ".join(names)
    print(f"| decode | KV MB | {head} |\n|---|---:|" + "---:|" * len(names))
    for layout in decodes:
        kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
        copies = max(1, min(8, -(-(256 << 20) // int(kv_bytes))))
        inputs = [make_inputs(layout, torch.Generator().manual_seed(i + 11)) for i in range(copies)]
        times = [timed(module, inputs, [plan(inp.meta) for inp in inputs], True) for plan in plans]
        ref = times[-1]
        print(f"| {layout.name} | {kv_bytes / 1e6:.0f} | "
              + " | ".join(f"{t * 1e3:.1f} us ({t / ref:.2f}x)" for t in times) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    print(f"\n| prefill | {head} |\n|---|" + "---:|" * len(names))
    for layout in prefills:
        inp = make_inputs(layout, torch.Generator().manual_seed(5))
        last = inp.meta.host_segments[-1]
        check = [last[1] + last[2] - 1, last[1] + last[2] // 2, last[1]]
        results = []
        for plan, context in zip(plans, alone, strict=True):
            meta = plan(inp.meta)
            with context():
                same = rows_alone_equal(module, inp, meta, check)
            results.append((timed(module, [inp], [meta], False), same))
        ref = results[-1][0]
        print(f"| {layout.name} | "
              + " | ".join(f"{t:.3f} ms ({t / ref:.2f}x{'' if same else ', BITS DIFFER ALONE'})" for t, same in results)
              + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="512:4,512:5,256:3,512:3", help="chunk:stages, the last the reference")
    args = ap.parse_args()
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]
    knob_tables(
        [f"chunk {c} s{s}" for c, s in cells],
        [lambda meta, c=c, s=s: plan_at(meta, c, s) for c, s in cells],
        # rows alone: in-program merge, same chunk
        [lambda c=c: invariant_chunk(c, partial_bytes=0) for c, _ in cells],
    )


if __name__ == "__main__":
    main()
