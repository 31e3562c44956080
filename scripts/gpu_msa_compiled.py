"""What the device's Triton made of the library's prefill tiles (GPU).

Run on the GPU machine: ``python scripts/gpu_msa_compiled.py``. Launches MSA on a 16k x 4-segment
step (kernels.bench's shapes) with 64- and 128-key tiles, split and not, and prints for each
kernel Triton compiled: registers and spills a thread, shared memory, the pipeliner's waits
(how many copies each leaves in flight) and its copies. ``python -m kernels.offline_compile``
does the same here with this machine's Triton, whose version may differ.
"""
import re

import torch

import kernels.msa_triton as mt
from kernels.bench import D, make_inputs, planned, segment_layout
from kernels.msa_config import MSAConfig


def kernels():  # type: ignore[no-untyped-def]
    out = {}
    for cache in mt._msa_fwd_kernel.device_caches.values():
        table = cache[0] if isinstance(cache, tuple) else cache
        out.update(table)
    return out


inp = make_inputs(segment_layout(16384, 4), torch.Generator().manual_seed(1))
for cfg in [MSAConfig(64, 128, 8, 2, 1), MSAConfig(64, 128, 8, 2, 2), MSAConfig(64, 64, 8, 3, 1),
            MSAConfig(64, 64, 8, 3, 2), MSAConfig(64, 128, 8, 1, 1), MSAConfig(64, 128, 8, 1, 2)]:
    before = set(kernels())
    meta = planned(inp.meta, cfg)
    mt.msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, D**-0.5)
    torch.cuda.synchronize()
    for key, k in kernels().items():
        if key in before:
            continue
        ttgir = k.asm.get("ttgir", "")
        waits = re.findall(r"async_wait[^\n]*\{num = (\d+)", ttgir)
        print(cfg, "regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared, "waits", waits,
              "copies", ttgir.count("async_copy_global_to_local"), flush=True)
