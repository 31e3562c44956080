"""Decode steps with the batch-invariant GEMM tilings tuned before and after 2026-12-04. GPU only.

``python scripts/gpu_gemm_tilings.py [--cases 1x2048,1x16384,8x2048,32x2048] [--tokens 48] [--rounds 3]``

Two engines on one dummy Llama-3.1-8B (bf16, the defaults: batch-invariant, CUDA graphs, async
scheduling), each calibrating its GEMMs at start in a cache folder of its own:

- ``before``: the candidate tilings of 2026-12-03 (:data:`BEFORE`), each timed replaying one
  weight (the o and qkv weights then sit in the 60 MB L2);
- ``after``: the current candidates, timed on weight copies cycled past the L2 (the default).

Prints the tilings each chose for the model's shapes, then per case the median ms per output
token of decode-only steps, alternating in rounds on the same prompts, and whether the tokens
are equal (the tilings keep the bits: they must be).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from unittest import mock

import torch

import kernels.batch_invariant as batch_invariant
import kernels.gemm_calibration as gemm_calibration

BEFORE_FEW = ((16, 16, 128, 2, 6), (16, 32, 128, 4, 6), (16, 16, 256, 2, 5), (16, 32, 256, 4, 4))
BEFORE = {
    **gemm_calibration._TUNE_CANDIDATES,
    8: BEFORE_FEW,
    16: BEFORE_FEW,
    32: ((32, 32, 256, 4, 4), (32, 16, 256, 2, 5), (32, 32, 128, 4, 6), (16, 16, 128, 2, 6), (16, 32, 128, 4, 6)),
}
BEFORE_CONFIGS = {
    **batch_invariant._CONFIGS,
    2: ((8, (16, 32, 128, 4, 6)), (16, (16, 16, 128, 2, 6)), (32, (32, 32, 256, 4, 4)),
        *batch_invariant._CONFIGS[2][3:]),
}


def main() -> None:
    from asymcache_core import Engine
    from asymcache_core.loaders import load_model
    from scripts.gpu_async_step import run_case

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x2048,1x16384,8x2048,32x2048")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    longest = max(c for _, c in cases) + args.tokens + 16
    max_len = 1 << (longest - 1).bit_length()
    device = torch.device("cuda")
    loaded = load_model("dummy:llama-3.1-8b", device, torch.bfloat16, 0, max_len)
    blocks = max(b * (c + args.tokens) // 16 + 64 for b, c in cases) + 256

    def engine(name: str) -> Engine:
        os.environ["ASYMCACHE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"gemm-{name}-")
        patches = []
        if name == "before":
            patches = [
                mock.patch.object(gemm_calibration, "_TUNE_CANDIDATES", BEFORE),
                mock.patch.object(gemm_calibration, "_COLD_L2_MULTIPLE", 0),
                mock.patch.object(batch_invariant, "_CONFIGS", BEFORE_CONFIGS),
            ]
        for p in patches:
            p.start()
        try:
            eng = Engine(
                model="dummy:llama-3.1-8b", device="cuda", loaded=loaded, num_kv_blocks=blocks, max_model_len=max_len,
                max_num_batched_tokens=8192, max_num_seqs=max(b for b, _ in cases),
            )
        finally:
            for p in patches:
                p.stop()
        linear = eng.runner.backend.dense.linear
        for (n, k, _), tilings in sorted(linear.tilings.items()):
            span = linear.library_rows.get((n, k, torch.bfloat16))
            print(f"{name}: {n} x {k}: library rows {span}; tilings {tilings[:3]}")
        return eng

    engines = {"before": engine("before"), "after": engine("after")}
    if engines["before"].runner.backend.dense.linear.tilings == engines["after"].runner.backend.dense.linear.tilings:
        print("note: both engines chose the same tilings")
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    print("\n| decode | before ms/token | after ms/token | after / before | tokens equal |")
    print("|---|---:|---:|---:|---|")
    names = list(engines)
    for batch, context in cases:
        times: dict[str, list[float]] = {n: [] for n in names}
        equal = True
        for rnd in range(args.rounds):
            prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
            outs = {}
            for name in names if rnd % 2 == 0 else names[::-1]:
                engines[name].reset_prefix_cache()
                times[name].append(0.0)
                times[name][-1], outs[name] = run_case(engines[name], prompts, args.tokens)
            equal &= outs["before"] == outs["after"]
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"| {batch} x {context} | {before:.3f} | {after:.3f} | {after / before:.3f} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
