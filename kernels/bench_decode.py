"""The decode launch sweep of ``python -m kernels.bench --decode-sweep``: decode launches as
CUDA-graph replays, over KV tile widths, warps, stages and splits, per (batch, context).

Shapes and inputs are those of :mod:`kernels.bench` (bf16, 32 q / 8 KV heads, head_dim 128,
16-token pages scattered over the pool).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

from kernels.bench import HKV, HQ, D, Inputs, Row, decode_layout, make_inputs, planned
from kernels.msa_plan import MSAConfig, choose_config
from kernels.msa_triton import msa_triton


def graph_ms(fns: list[Callable[[], object]], reps: int = 50) -> float:
    """Median milliseconds per call of ``fns``, replayed as one CUDA graph that runs each once.

    For launches shorter than their host-side launch cost (decodes at small batch): eager
    timing measures the Python launch, not the kernel, and the engine replays decodes as
    graphs. ``fns`` work on distinct inputs whose total exceeds the L2 cache, so no call reads
    what the previous one left there.
    """
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return statistics.median(times)


def _decode_graph_ms(inputs: list[Inputs], cfg: MSAConfig | None, scale: float) -> float:
    fns = []
    for inp in inputs:
        meta = planned(inp.meta, cfg)
        fns.append(lambda inp=inp, meta=meta: msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale))
    return graph_ms(fns)


def decode_sweep(copy_gbps: float) -> list[Row]:
    """Decode launches over KV tile widths, warps, stages and splits, per (batch, context),
    timed as CUDA-graph replays (:func:`graph_ms`), as the engine runs them.

    Prints, per layout, the planner's launch and the fastest one found with their share of the
    copy bandwidth; returns every timed row.
    """
    scale = D**-0.5
    rows: list[Row] = []
    print("| layout | planner | planner GB/s | best | best GB/s |")
    print("|---|---|---:|---|---:|")
    for batch in (1, 2, 4, 8):
        for ctx in (8192, 32768, 131072):
            layout = decode_layout(batch, ctx)
            kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
            # NOTE: enough distinct caches that together they overflow the 50 MB L2 cache
            copies = max(1, min(8, -(-(256 << 20) // int(kv_bytes))))
            inputs = [make_inputs(layout, torch.Generator().manual_seed(batch * 7 + ctx + i)) for i in range(copies)]
            base = choose_config(inputs[0].meta, HQ, HKV, D, inputs[0].q.device)

            timed: list[tuple[float, MSAConfig]] = [(_decode_graph_ms(inputs, None, scale), base)]
            splits = sorted({max(1, base.num_splits * f // 4) for f in (1, 2, 4, 8, 16)})
            for bn, warps, stages in ((64, 2, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 2, 4)):
                for sp in splits:
                    cfg = MSAConfig(base.block_m, bn, warps, stages, sp)
                    try:
                        timed.append((_decode_graph_ms(inputs, cfg, scale), cfg))
                    except Exception as exc:  # noqa: BLE001 - report, keep the sweep going
                        print(f"sweep {layout.name} {cfg} failed: {exc!r}", file=sys.stderr)
            for ms, cfg in timed:
                rows.append(Row(layout.name, "decode-sweep", ms, None, kv_bytes / ms / 1e6,
                                f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} split{cfg.num_splits}"))
            best_ms, best = min(timed, key=lambda t: t[0])
            plan_gbps, best_gbps = kv_bytes / timed[0][0] / 1e6, kv_bytes / best_ms / 1e6
            print(f"| {layout.name} | bn{base.block_n} w{base.num_warps} s{base.num_stages} split{base.num_splits} "
                  f"| {plan_gbps:.0f} ({plan_gbps / copy_gbps:.0%}) | bn{best.block_n} w{best.num_warps} "
                  f"s{best.num_stages} split{best.num_splits} | {best_gbps:.0f} ({best_gbps / copy_gbps:.0%}) |",
                  flush=True)
            del inputs
            torch.cuda.empty_cache()
    return rows
