"""Why the batch-invariant decode launch takes longer inside a decode step than alone (GPU).

Run on the GPU machine: ``python scripts/gpu_walk_in_step.py [--contexts 2048,16384]``.

In the engine's CUDA graph a batch-1 decode at 2,048 keys spends ~23.6 us a layer in its
attention launch (the step's kernel table, BENCHMARKS.md "Where a decode step's time goes"),
where the same launch timed alone over 32 layers' distinct KV caches takes ~16 us
(``scripts/gpu_walk_diag.py``). Two things differ: the engine's graph plan is sized for its
``max_model_len`` (131,072: 1,584 programs, 32 with keys at 2k), and in the step each launch
comes after other kernels (the q/k/v projection streams 50 MB of weights, the MLP 352 MB), so
the launch's code, tables and KV start cold. This script times, as CUDA graphs of 32 layers:

- the launch alone, its plan sized for the context and for 131,072 keys;
- a "neighbour" alone: a one-row matmul over a 117 MB weight (the down projection's shape), a
  33.5 MB one (the o projection's: it stays in the 50 MB L2) or a 64 MB device copy;
- each neighbour followed by the launch: the launch's time in that company is the pair's
  time less the neighbour's.

Microseconds a layer, median of 20 replays; one process for everything (the kernels compile
once).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from unittest import mock

import torch
from gpu_walk_diag import (  # NOTE: a sibling script (scripts/ is on sys.path)
    HKV,
    HQ,
    PAGE,
    D,
    _layers,
)

from kernels import msa_plan
from kernels import msa_triton as msa_module
from kernels.bench_decode import graph_ms
from kernels.metadata import build_msa_metadata
from kernels.msa_plan import decode_graph_plan

LAYERS = 32


def launches(ctx: int, max_model_len: int) -> list:  # type: ignore[type-arg]
    """One decode launch a layer (walk and its in-launch merge), the plan sized for ``max_model_len``."""
    fns = []
    for q, k, v, table in _layers(ctx):
        tiles = torch.tensor([[0, 0, 1, ctx - 1]], device="cuda", dtype=torch.int32)
        plan = decode_graph_plan(tiles, HQ, HKV, max_model_len, head_dim=D, invariant=True)
        meta = build_msa_metadata(
            [table.tolist()], [(0, 0, 1, ctx - 1)], [int(table[-1]) * PAGE + PAGE - 1], PAGE, device="cuda"
        )
        meta = dataclasses.replace(meta, plan=plan)
        out = torch.empty_like(q)
        fns.append(lambda q=q, k=k, v=v, meta=meta, out=out: msa_module.msa_triton(q, k, v, meta, D**-0.5, out=out))
    return fns


def neighbours() -> dict[str, list]:  # type: ignore[type-arg]
    """Per kind, ``LAYERS`` calls that run before a layer's attention in the comparison."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((1, 14336), device="cuda", dtype=torch.bfloat16, generator=gen)
    big = [torch.randn((4096, 14336), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    x_small = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16, generator=gen)
    small = torch.randn((4096, 4096), device="cuda", dtype=torch.bfloat16, generator=gen)
    src = torch.randn((16 * 1024 * 1024,), device="cuda", dtype=torch.float32, generator=gen)
    dst = torch.empty_like(src)
    return {
        "matmul, 117 MB weight (cold)": [lambda i=i: torch.nn.functional.linear(x, big[i % 4]) for i in range(LAYERS)],
        "matmul, 33.5 MB weight (in L2)": [lambda: torch.nn.functional.linear(x_small, small) for _ in range(LAYERS)],
        "copy of 64 MB": [lambda: dst.copy_(src) for _ in range(LAYERS)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,16384")
    ap.add_argument("--limits", default="ctx,131072", help="what each plan is sized for: ctx or a number of keys")
    ap.add_argument("--programs-per-sm", default="12", help="the invariant split's programs per SM, a comma list")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; us a layer, {LAYERS} layers, median of 20 graph replays")
    others = neighbours()
    alone = {name: graph_ms(fns, 20) * 1e3 for name, fns in others.items()}
    for name, us in alone.items():
        print(f"# {name}: {us:.1f} us alone")
    print("| decode | plan sized for | programs per SM | alone | " + " | ".join(f"after a {n}" for n in others) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(others))
    for ctx in (int(c) for c in args.contexts.split(",")):
        # NOTE: a plan sized for fewer keys than the context cannot walk it (and repeated limits
        # repeat rows): each distinct limit of at least the context, once.
        limits = sorted({lim for c in args.limits.split(",") if (lim := ctx if c == "ctx" else int(c)) >= ctx})
        for limit, per_sm in itertools.product(limits, (int(p) for p in args.programs_per_sm.split(","))):
            with mock.patch.object(msa_plan, "_INVARIANT_PROGRAMS_PER_SM", per_sm):
                fns = launches(ctx, limit)
            cells = [f"{graph_ms(fns, 20) * 1e3:.1f}"]
            for name, before in others.items():
                pairs = [lambda a=a, b=b: (a(), b()) for a, b in zip(before, fns, strict=True)]
                cells.append(f"{graph_ms(pairs, 20) * 1e3 - alone[name]:.1f}")
            print(f"| 1 x {ctx} | {limit} | {per_sm} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
