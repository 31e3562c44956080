"""MSA launch plans on mixed steps: one launch vs tile classes vs deep-tile splits. GPU machine.

``python scripts/gpu_msa_mixed.py`` times :func:`kernels.msa_triton.msa_triton` (one layer,
bf16, Llama-3.1-8B heads: 32 query / 8 KV, head_dim 128, 16-token pages) on steps shaped like
the benchmarks' mixed steps, under three launch plans of the same segments, and prints one
table with each plan's error against the float64 oracle:

- ``one launch``: every segment in one launch with ``choose_config`` (no tile classes);
- ``classes``: short segments (decodes, one-block holes) in their own launch;
- ``classes+deep``: also split a tile far deeper than its launch (the default ``plan_msa``).

``--device cpu`` runs a small smoke version under the Triton interpreter
(``TRITON_INTERPRET=1``), for checking the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import torch

from kernels.metadata import build_msa_metadata
from kernels.reference import msa_naive

HQ, HKV, D, PAGE = 32, 8, 128, 16


def layout(name: str, scale: float) -> tuple[str, list[int], list[list[tuple[int, int]]]]:
    """``(name, contexts, segments per sequence as (pos_start, q_len))``, lengths times ``scale``."""

    def n(x: int) -> int:
        return max(1, int(x * scale))

    if name == "prefill+decodes":
        ctxs = [n(1024)] + [n(8000)] * 8
        return name, ctxs, [[(0, n(1024))]] + [[(c - 1, 1)] for c in ctxs[1:]]
    if name == "prefill+deep hole":
        return name, [n(1024), n(12_000)], [[(0, n(1024))], [(n(11_000), 48), (n(12_000) - 200, 200)]]
    if name == "swe-like":
        ctxs = [n(6144), n(20_000), n(20_000)] + [n(16_000)] * 4
        holes = [[(n(p), 16) for p in (10_000, 13_000, 16_000, 19_000)] + [(c - 300, 300)] for c in ctxs[1:3]]
        return name, ctxs, [[(n(4096), n(2048))], *holes] + [[(c - 1, 1)] for c in ctxs[3:]]
    raise ValueError(name)


def make_step(ctxs: list[int], segs: list[list[tuple[int, int]]], device: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tables, start = [], 0
    for c in ctxs:
        blocks = -(-c // PAGE)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    k = torch.randn((start, PAGE, HKV, D), generator=gen)
    v = torch.randn((start, PAGE, HKV, D), generator=gen)
    segments, slots, q_start = [], [], 0
    for seq, seq_segs in enumerate(segs):
        for pos, q_len in seq_segs:
            segments.append((seq, q_start, q_len, pos))
            slots += [tables[seq][p // PAGE] * PAGE + p % PAGE for p in range(pos, pos + q_len)]
            q_start += q_len
    q = torch.randn((q_start, HQ, D), generator=gen)
    meta = build_msa_metadata(tables, segments, slots, PAGE, device)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), meta


def time_ms(fn, device: str, reps: int) -> float:
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from kernels import msa_config, msa_plan
    from kernels import msa_triton as mt

    device = args.device
    scale, dtype, reps = (1.0, torch.bfloat16, 50) if device == "cuda" else (0.05, torch.float32, 1)
    scale_d = D**-0.5
    print("| step | tokens | plan | launches | splits | ms | max abs err |")
    print("|---|---:|---|---:|---|---:|---:|")
    for name in ("prefill+decodes", "prefill+deep hole", "swe-like"):
        _, ctxs, segs = layout(name, scale)
        q, k, v, meta = make_step(ctxs, segs, device, dtype, seed=len(name))
        ref = msa_naive(q.double().cpu(), k.double().cpu(), v.double().cpu(), dataclasses.replace(
            meta, block_tables=meta.block_tables.cpu(), slot_mapping=meta.slot_mapping.cpu()), scale_d)
        dev = torch.device(device)
        plans = {
            "one launch": msa_plan.plan_msa(meta, HQ, HKV, D, dev, config=msa_config.choose_config(meta, HQ, HKV, D, dev)),
            "classes": msa_plan.plan_msa(meta, HQ, HKV, D, dev, min_split_keys=1 << 30),
            "classes+deep": msa_plan.plan_msa(meta, HQ, HKV, D, dev),
        }
        for label, plan in plans.items():
            planned = dataclasses.replace(meta, plan=plan)
            out = mt.msa_triton(q, k, v, planned, scale_d)
            err = float((out.double().cpu() - ref).abs().max())
            ms = time_ms(functools.partial(mt.msa_triton, q, k, v, planned, scale_d), device, reps)
            splits = "/".join(str(launch.num_splits) for launch in plan.launches)
            print(f"| {name} | {q.shape[0]} | {label} | {len(plan.launches)} | {splits} | {ms:.3f} | {err:.2e} |")


if __name__ == "__main__":
    main()
