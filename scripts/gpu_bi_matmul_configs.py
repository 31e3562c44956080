"""Which Triton matmul tilings give the same bits, and what each costs (GPU).

Run on the GPU machine: ``python scripts/gpu_bi_matmul_configs.py``. For the projections of
Llama-3.1-8B in bf16, every configuration's output rows are compared bit for bit with the
reference configuration's at 1, 8, 32 and 256 rows, and timed at those batch sizes beside
cuBLAS (``F.linear``). A configuration may be chosen per batch size only if its bits match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.batch_invariant import _MATMUL_CONFIG, matmul_triton

SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096), (128256, 4096)]
CONFIGS = [
    (16, 64, 64, 4, 4), (16, 64, 64, 2, 4), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
]
BATCHES = [1, 8, 32, 256]


def time_us(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    ref_cfg = _MATMUL_CONFIG[2]
    totals = {cfg: {m: 0.0 for m in BATCHES} for cfg in CONFIGS}
    cublas = {m: 0.0 for m in BATCHES}
    same = {cfg: True for cfg in CONFIGS}
    for n, k in SHAPES:
        w = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        x = torch.randn((256, k), generator=gen).to("cuda", torch.bfloat16)
        ref = matmul_triton(x, w, config=ref_cfg)
        for m in BATCHES:
            cublas[m] += time_us(lambda m=m, x=x, w=w: F.linear(x[:m], w))
        for cfg in CONFIGS:
            for m in BATCHES:
                out = matmul_triton(x[:m], w, config=cfg)
                same[cfg] &= bool(torch.equal(out, ref[:m]))
                totals[cfg][m] += time_us(lambda m=m, cfg=cfg, x=x, w=w: matmul_triton(x[:m], w, config=cfg))
    print("| config (BM, BN, BK, warps, stages) | bits = reference | " + " | ".join(f"M={m} us" for m in BATCHES) + " |")
    print("|---|---|" + "---:|" * len(BATCHES))
    print("| cuBLAS (F.linear) | - | " + " | ".join(f"{cublas[m]:.0f}" for m in BATCHES) + " |")
    for cfg in CONFIGS:
        print(f"| {cfg} | {'yes' if same[cfg] else 'NO'} | " + " | ".join(f"{totals[cfg][m]:.0f}" for m in BATCHES) + " |")


if __name__ == "__main__":
    main()
