"""The library MSA decode at small batch with its block ids loaded a turn ahead, or not (GPU).

Run on the GPU machine: ``PYTHONPATH=. python scripts/gpu_decode_prefetch.py``. The library
mode's decode tiles (16 rows) load each KV tile's block ids in the turn that uses them unless
the launch fits one wave (``kernels.msa_triton._prefetch_block_ids``): carried a turn ahead, the
next tile's copies stay in flight, but a program takes a third buffer of shared memory, which
halves the programs an SM holds. Prints, per (batch, context), the launch as planned and with
the prefetch forced on, as CUDA-graph replays, with their share of the copy rate, and checks
that the outputs agree.
"""

from __future__ import annotations

from unittest import mock

import torch

from kernels import msa_triton as msa_triton_module
from kernels.bench import HKV, D, copy_bandwidth, decode_layout, planned
from kernels.bench_decode import _decode_fns, _inputs, graph_ms


def main() -> None:
    copy_gbps = copy_bandwidth()
    print(f"copy rate {copy_gbps:.0f} GB/s")
    print("| layout | programs | planned us | share | prefetch us | share | prefetch / planned | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    scale = D**-0.5
    for batch in (1, 2, 4, 8):
        for ctx in (8192, 32768, 131072):
            layout = decode_layout(batch, ctx)
            kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
            inputs = _inputs(layout, batch, ctx, kv_bytes)
            metas = [planned(inp.meta) for inp in inputs]
            launch = metas[0].plan.launches[0]
            programs = launch.num_tiles * HKV * launch.num_splits
            fns = _decode_fns(inputs, metas, scale)
            out_plain = fns[0]().clone()
            plain = graph_ms(fns)
            with mock.patch.object(msa_triton_module, "_prefetch_block_ids", lambda *a, **k: True):
                out_pf = fns[0]().clone()
                pf = graph_ms(fns)
            diff = (out_plain.float() - out_pf.float()).abs().max().item()
            print(f"| {layout.name} | {programs} | {plain * 1e3:.1f} | {kv_bytes / plain / 1e6 / copy_gbps:.0%} "
                  f"| {pf * 1e3:.1f} | {kv_bytes / pf / 1e6 / copy_gbps:.0%} | {pf / plain:.3f} | {diff:.2e} |", flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
