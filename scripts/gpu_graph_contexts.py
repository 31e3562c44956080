"""Batch-invariant decode graphs per context limit, against one graph per batch size. GPU only.

``PYTHONPATH=$PWD python scripts/gpu_graph_contexts.py [--model dummy:llama-3.1-8b]`` builds one
engine in the default (batch-invariant) mode with the model's own ``max_model_len`` (131,072
tokens for Llama-3.1-8B, as the bench harness runs it), prefills each (batch, context) case,
then times decode-only steps (median ``engine.step()`` wall time) in alternating rounds: the
graph of the shortest context limit that holds the batch (the default,
:func:`kernels.msa_plan.decode_graph_contexts`) and the graph sized for ``max_model_len`` (one
graph per batch size, as before). Before timing, one step's inputs are replayed through both
graphs and their logits compared bit for bit (the grid must not change the bits). Beside them:
the floor of reading the weights and the batch's KV once at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools

import torch
from gpu_decode_graphs import (  # NOTE: sibling scripts (scripts/ is on sys.path)
    alternating_ms,
    decode_bench,
    prefill_case,
)

from asymcache_core.cuda_graphs import DecodeBatch

CASES = ((1, 2_048), (1, 6_000), (1, 16_384), (1, 30_000), (2, 4_000), (4, 2_048), (8, 2_048), (8, 6_000), (16, 2_048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    args = ap.parse_args()
    bench = decode_bench(args.model, CASES, args.rounds * args.steps * 2)
    engine, graphs = bench.engine, bench.graphs
    assert engine.runner.backend.batch_invariant, "the default mode is batch-invariant"
    by_limit = graphs.context_limit
    recorded: list[DecodeBatch] = []
    run = graphs.run

    def recording(batch: DecodeBatch):  # type: ignore[no-untyped-def]
        recorded.append(batch)
        return run(batch)

    def widest(size: int, longest: int) -> int:
        return graphs.contexts[size][-1]

    print(f"{bench.header(args.model)}; graph limits: {graphs.contexts}")
    print("| batch | context | graph | limit | splits | bits | one graph ms | per limit ms | speed-up | weights + KV floor ms | per limit / floor |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for batch, context in CASES:
        prefill_case(engine, batch, context, args.rounds * args.steps * 2 + 8, gen)
        size = next(s for s in graphs.sizes if s >= batch)
        graphs.run = recording
        engine.step()
        graphs.run = run
        step = recorded[-1]
        limit = by_limit(size, max(step.positions) + 1)
        # the same inputs through both graphs (re-storing the same K/V at the same slots)
        logits = {}
        for name, choose in (("limit", by_limit), ("widest", widest)):
            graphs.context_limit = choose  # type: ignore[method-assign]
            out = graphs.run(step)
            assert out is not None
            logits[name] = out.clone()
        same = torch.equal(logits["limit"], logits["widest"])
        ms = alternating_ms(
            engine,
            {name: functools.partial(setattr, graphs, "context_limit", choose)
             for name, choose in (("widest", widest), ("limit", by_limit))},
            args.rounds, args.steps,
        )
        graphs.context_limit = by_limit  # type: ignore[method-assign]
        floor = bench.floor_ms(batch, context)
        print(f"| {batch} | {context} | {size} | {limit} | {graphs.plans[(size, limit)].num_splits} | "
              f"{'equal' if same else 'DIFFER'} | {ms['widest']:.2f} | {ms['limit']:.2f} | "
              f"{ms['widest'] / ms['limit']:.2f}x | {floor:.2f} | {ms['limit'] / floor:.2f}x |", flush=True)
        while engine.has_unfinished():
            engine.step()
    engine.check_integrity()


if __name__ == "__main__":
    main()
