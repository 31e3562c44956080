"""Decode launches as CUDA-graph replays, per (batch, context):

- ``python -m kernels.bench --decode-sweep``: over KV tile widths, warps, stages and splits;
- ``python -m kernels.bench --decode-floor``: the planner's launch split into its walk and its
  merge, in the library and batch-invariant modes, against a read floor (a kernel that only
  streams as many bytes), then the batch-invariant launch over programs per SM and stages.

Shapes and inputs are those of :mod:`kernels.bench` (bf16, 32 q / 8 KV heads, head_dim 128,
16-token pages scattered over the pool).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable
from unittest import mock

import torch
import triton
import triton.language as tl

from kernels import msa_plan
from kernels import msa_triton as msa_triton_module
from kernels.bench import HKV, HQ, D, Inputs, Layout, Row, decode_layout, make_inputs, planned
from kernels.metadata import MSAMetadata
from kernels.msa_config import MSAConfig, choose_config
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


def _decode_fns(inputs: list[Inputs], metas: list[MSAMetadata], scale: float) -> list[Callable[[], object]]:
    return [
        lambda inp=inp, meta=meta: msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)
        for inp, meta in zip(inputs, metas, strict=True)
    ]


def _decode_graph_ms(inputs: list[Inputs], cfg: MSAConfig | None, scale: float, invariant: bool = False) -> float:
    return graph_ms(_decode_fns(inputs, [planned(inp.meta, cfg, invariant) for inp in inputs], scale))


def _copies(layout_bytes: float) -> int:
    # NOTE: enough distinct inputs that together they overflow the 50 MB L2 cache
    return max(1, min(8, -(-(256 << 20) // int(layout_bytes))))


def _inputs(layout: Layout, batch: int, ctx: int, kv_bytes: float) -> list[Inputs]:
    """Distinct random inputs of ``layout`` (:func:`_copies` of them), seeded per layout."""
    return [make_inputs(layout, torch.Generator().manual_seed(batch * 7 + ctx + i)) for i in range(_copies(kv_bytes))]


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
            inputs = _inputs(layout, batch, ctx, kv_bytes)
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


@triton.jit
def _empty_kernel(p_x):
    pass


@triton.jit
def _read_kernel(p_x, p_out, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Reads ``n`` elements of ``p_x``, ``TILES`` blocks of ``BLOCK`` a program, and writes one
    sum a program: the read floor of a launch that streams as many bytes as a decode."""
    i_p = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i_t in tl.range(0, TILES, num_stages=4):
        o_x = (i_p * TILES + i_t).to(tl.int64) * BLOCK + o
        b_acc += tl.load(p_x + o_x, mask=o_x < n, other=0.0).to(tl.float32)
    tl.store(p_out + i_p, tl.sum(b_acc))


def _read_floor(x: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_read_kernel` over ``x`` with ~4 programs per SM (at least one 8k-element block each)."""
    block = 8192
    blocks = triton.cdiv(x.numel(), block)
    programs = min(blocks, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    tiles = triton.cdiv(blocks, programs)
    _read_kernel[(triton.cdiv(blocks, tiles),)](x, out, x.numel(), BLOCK=block, TILES=tiles, num_warps=8)


class _SkippedLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def decode_floor(copy_gbps: float) -> list[Row]:
    """Where a small-batch decode launch's time goes, per (batch, context), as CUDA-graph replays.

    Rows per layout: the planner's launch (split walk + merge) and its split walk alone (merge
    skipped: its output is wrong, only its time counts), the same two for the batch-invariant
    mode (the default on CUDA); three floors for reading the same KV bytes at this size from a
    contiguous buffer: :func:`_read_floor`, torch's ``sum`` and half a ``copy_``; and an empty
    Triton launch (the fixed cost of one graph node). Then :func:`_invariant_sweep`. Shares are
    of ``copy_gbps`` (a 2 GiB copy).
    """
    scale = D**-0.5
    rows: list[Row] = []
    empty_ms = graph_ms([lambda: _empty_kernel[(1,)](torch.empty(1, device="cuda"))] * 8)
    print(f"empty Triton launch in a graph: {empty_ms * 1000:.1f} us")
    print("| layout | KV MB | msa | its walk only | batch-invariant | its walk only | sum floor | read floor | copy floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 2, 4):
        for ctx in (8192, 32768, 131072):
            layout = decode_layout(batch, ctx)
            kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
            inputs = _inputs(layout, batch, ctx, kv_bytes)
            copies = len(inputs)
            timed: dict[str, float] = {}
            for label, invariant in (("msa", False), ("batch-invariant", True)):
                timed[label] = _decode_graph_ms(inputs, None, scale, invariant)
                # NOTE: the batch-invariant merge runs in the walk's launch (MSAPlan.merge_counts):
                # plans without counters put it back in a kernel of its own, here skipped
                with mock.patch.object(msa_triton_module, "_msa_reduce_kernel", _SkippedLaunch()), \
                        mock.patch.object(msa_plan, "_merge_counts", lambda *args: None):
                    timed[f"{label} walk only"] = _decode_graph_ms(inputs, None, scale, invariant)
            flat = [torch.empty(int(kv_bytes) // 2, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(copies)]
            sums = [torch.empty((), dtype=torch.float32, device="cuda") for _ in range(copies)]
            timed["sum floor"] = graph_ms([lambda x=x, o=o: torch.sum(x, dim=0, dtype=torch.float32, out=o) for x, o in zip(flat, sums, strict=True)])
            partial = [torch.empty(1 << 12, dtype=torch.float32, device="cuda") for _ in range(copies)]
            timed["read floor"] = graph_ms([lambda x=x, o=o: _read_floor(x, o) for x, o in zip(flat, partial, strict=True)])
            dst = [torch.empty_like(x) for x in flat]
            # a copy moves twice the bytes: its time is that of reading them and writing them
            timed["copy floor"] = graph_ms([lambda x=x, y=y: y.copy_(x) for x, y in zip(flat, dst, strict=True)]) / 2
            cells = []
            for name, ms in timed.items():
                gbps = kv_bytes / ms / 1e6
                rows.append(Row(layout.name, f"floor:{name}", ms, None, gbps))
                cells.append(f"{ms * 1000:.1f} us {gbps / copy_gbps:.0%}")
            print(f"| {layout.name} | {kv_bytes / 1e6:.0f} | " + " | ".join(cells) + " |", flush=True)
            del inputs, flat, dst
            torch.cuda.empty_cache()
    rows.append(Row("empty launch", "floor:empty", empty_ms))
    rows += _invariant_sweep(copy_gbps)
    return rows


def _invariant_sweep(copy_gbps: float) -> list[Row]:
    """The batch-invariant decode launch over its programs per SM and pipelining depth (neither
    changes a row's bits), per (batch, context)."""
    scale = D**-0.5
    rows: list[Row] = []
    variants = [(pps, stages) for pps in (3, 6, 12, 24) for stages in (3, 4)]
    print("| layout | " + " | ".join(f"{p}/SM s{st}" for p, st in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for batch in (1, 4):
        for ctx in (8192, 32768, 131072):
            layout = decode_layout(batch, ctx)
            kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
            inputs = _inputs(layout, batch, ctx, kv_bytes)
            cells = []
            for pps, stages in variants:
                metas = []
                with mock.patch.object(msa_plan, "_INVARIANT_PROGRAMS_PER_SM", pps):
                    for inp in inputs:
                        plan = planned(inp.meta, invariant=True).plan
                        plan = msa_plan.MSAStepPlan(tuple(
                            dataclasses.replace(launch, config=dataclasses.replace(launch.config, num_stages=stages))
                            for launch in plan.launches
                        ))
                        metas.append(dataclasses.replace(inp.meta, plan=plan))
                ms = graph_ms(_decode_fns(inputs, metas, scale))
                gbps = kv_bytes / ms / 1e6
                rows.append(Row(layout.name, "bi-sweep", ms, None, gbps, f"{pps}/SM s{stages}"))
                cells.append(f"{ms * 1000:.0f} us {gbps / copy_gbps:.0%}")
            print(f"| {layout.name} | " + " | ".join(cells) + " |", flush=True)
            del inputs
            torch.cuda.empty_cache()
    return rows
