"""The batch-invariant CUDA-graph decode's split merge: in a launch of its own, or in the walk's
launch. GPU only.

``python scripts/gpu_decode_merge.py [--cases 1x2048,1x32768,3x8192,16x8192]
[--engine-cases 1x2048,16x8192] [--tokens 48] [--rounds 2]``

A decode's keys are walked in fixed 512-key chunks by several programs, and their states are
folded in chunk order. Three ways to run that for a CUDA-graph decode plan
(:func:`kernels.msa_plan.decode_graph_plan`), all giving the same bits:

- ``before``: the walk, then a merge kernel; the output is zero-filled first (for the graph's
  padding rows): three graph nodes a layer;
- ``pad rows``: the same, padding tiles writing their rows' zeros (no fill): two nodes;
- ``in the launch`` (the default since 2026-12-04): the last program of each (tile, KV head) to
  finish folds the chunk states (``MSAPlan.merge_counts``): one node.

Kernels: each case's launch over 32 layers' distinct KV caches, replayed as one CUDA graph,
microseconds a layer, and whether the outputs equal ``before``'s bit for bit (padding rows
zero). Engine: dummy Llama-3.1-8B bf16, the default engine (async scheduling, CUDA graphs)
with the ``before`` plans and with the default, alternating in rounds on the same prompts:
median ms per output token on decode-only steps and whether the tokens are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
from collections.abc import Iterator
from unittest import mock

import torch

from kernels import msa_plan
from kernels.msa_plan import MSAPlan

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 32
VARIANTS = ("before", "pad rows", "in the launch")


def variant_plan(plan: MSAPlan, variant: str) -> MSAPlan:
    """``plan`` (a graph decode plan of the default) as ``variant`` runs it."""
    if variant == "before":
        return dataclasses.replace(plan, merge_counts=None, pad_rows=False, covered_rows=0)
    if variant == "pad rows":
        return dataclasses.replace(plan, merge_counts=None)
    return plan


def _graph_size(batch: int) -> int:
    return batch if batch > 8 else 1 << (batch - 1).bit_length()


def kernel_case(batch: int, ctx: int) -> dict[str, tuple[float, bool]]:
    """``{variant: (us a layer, same bits as before)}`` of one decode case."""
    from kernels import msa_triton
    from kernels.bench_decode import graph_ms
    from kernels.metadata import build_msa_metadata

    size = _graph_size(batch)
    pages = batch * ctx // PAGE
    gen = torch.Generator(device="cuda").manual_seed(batch * ctx)
    tiles = torch.tensor([(i, i, 1, ctx - 1) for i in range(batch)] + [(i, i, 0, 0) for i in range(batch, size)],
                         dtype=torch.int32, device="cuda")
    base = msa_plan.decode_graph_plan(tiles, HQ, HKV, 131072, head_dim=D, invariant=True)
    layers = []
    for _ in range(LAYERS):
        k = torch.randn((pages, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn((pages, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn((size, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, -1).tolist()
        meta = build_msa_metadata(perm + [[0]] * (size - batch), [], [-1] * size, PAGE, device="cuda")
        layers.append((q, k, v, meta))
    results: dict[str, tuple[float, bool]] = {}
    outs: dict[str, torch.Tensor] = {}
    for variant in VARIANTS:
        plan = variant_plan(base, variant)
        fns = []
        for q, k, v, meta in layers:
            out = torch.empty_like(q)
            meta = dataclasses.replace(meta, plan=plan)
            fns.append(lambda q=q, k=k, v=v, meta=meta, out=out: msa_triton.msa_triton(q, k, v, meta, D**-0.5, out=out))
        out = torch.full_like(layers[0][0], float("nan"))
        q, k, v, meta = layers[0]
        msa_triton.msa_triton(q, k, v, dataclasses.replace(meta, plan=plan), D**-0.5, out=out)
        outs[variant] = out
        same = torch.equal(out[:batch], outs["before"][:batch]) and bool((out[batch:] == 0).all())
        results[variant] = (graph_ms(fns) * 1e3, same)
    return results


@contextlib.contextmanager
def before_plans() -> Iterator[None]:
    """The engine's plans as ``before`` runs them: graph plans built inside, and eager plans
    of the steps run inside, take the merge kernel and the zero fill."""
    real = msa_plan.decode_graph_plan

    def graph_plan(*args: object, **kwargs: object) -> MSAPlan:
        return variant_plan(real(*args, **kwargs), "before")  # type: ignore[arg-type]

    with mock.patch.object(msa_plan, "decode_graph_plan", graph_plan), \
            mock.patch.object(msa_plan, "_merge_counts", lambda *a: None):
        yield


def engine_cases(cases: list[tuple[int, int]], tokens: int, rounds: int) -> None:
    from asymcache_core import Engine
    from asymcache_core.loaders import load_model
    from scripts.gpu_async_step import run_case

    longest = max(c for _, c in cases) + tokens + 16
    max_len = 1 << (longest - 1).bit_length()
    device = torch.device("cuda")
    loaded = load_model("dummy:llama-3.1-8b", device, torch.bfloat16, 0, max_len)
    blocks = max(b * (c + tokens) // 16 + 64 for b, c in cases) + 256

    def engine() -> Engine:
        return Engine(
            model="dummy:llama-3.1-8b", device="cuda", loaded=loaded, num_kv_blocks=blocks, max_model_len=max_len,
            max_num_batched_tokens=8192, max_num_seqs=max(b for b, _ in cases),
        )

    with before_plans():
        engines = {"before": engine()}
    engines["in the launch"] = engine()
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    print(f"\n{'case':>10} {'before ms/token':>16} {'in the launch':>14} {'speed-up':>9} {'tokens equal':>13}")
    for batch, context in cases:
        times: dict[str, list[float]] = {name: [] for name in engines}
        equal = True
        for rnd in range(rounds):
            prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
            outs = {}
            for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                engines[name].reset_prefix_cache()
                with before_plans() if name == "before" else contextlib.nullcontext():
                    tpot, outs[name] = run_case(engines[name], prompts, tokens)
                times[name].append(tpot)
            equal &= outs["before"] == outs["in the launch"]
        old, new = statistics.median(times["before"]), statistics.median(times["in the launch"])
        print(f"{batch:>4} x {context:<5} {old:>16.3f} {new:>14.3f} {old / new:>8.3f}x {str(equal):>13}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x2048,1x8192,1x32768,3x8192,16x8192", help="BATCHxCONTEXT,... (kernels)")
    ap.add_argument("--engine-cases", default="1x2048,16x8192", help="BATCHxCONTEXT,... ('' to skip)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; us a layer, {LAYERS} layers' KV, one CUDA graph")
    print("| decode (graph size) | " + " | ".join(VARIANTS) + " | bits as before |")
    print("|---|" + "---:|" * len(VARIANTS) + "---|")
    for case in args.cases.split(","):
        batch, ctx = (int(x) for x in case.split("x"))
        res = kernel_case(batch, ctx)
        times = " | ".join(f"{res[v][0]:.2f}" for v in VARIANTS)
        print(f"| {batch} x {ctx} ({_graph_size(batch)}) | {times} | {all(s for _, s in res.values())} |", flush=True)
    if args.engine_cases:
        engine_cases([tuple(int(x) for x in c.split("x")) for c in args.engine_cases.split(",")],  # type: ignore[misc]
                     args.tokens, args.rounds)


if __name__ == "__main__":
    main()
