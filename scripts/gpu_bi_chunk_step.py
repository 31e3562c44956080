"""The batch-invariant chunk through the engine, with the decode graphs sized tight (GPU only).

``python scripts/gpu_bi_chunk_step.py [--chunks 512,128] [--limits 4096,32768] [--cases 1x2048,1x16384]``

A shorter fixed chunk (:data:`kernels.msa_plan.INVARIANT_CHUNK`) runs a short decode's walk on
more, shorter programs: the kernel alone took 0.71x at 1 x 2k with 128-key chunks (BENCHMARKS.md,
"Two knobs of the batch-invariant walk"), while the engine's batch-1 step did not move (5.39 ms
against 5.29). A decode graph is captured for ``max_model_len`` and launches a program for every
chunk of it, so at 128 keys a chunk a graph for 131,072 tokens launches 8,192 programs a layer
of which 128 have keys at 2,048. This script separates the two: one engine per chunk and
``max_model_len`` (the limit), decode-only steps in alternating rounds, median ms per output
token (:func:`scripts.gpu_async_step.run_case`), dummy Llama-3.1-8B bf16, the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Iterator

import torch

from kernels import msa_plan


@contextlib.contextmanager
def invariant_chunk(chunk: int) -> Iterator[None]:
    saved = msa_plan.INVARIANT_CHUNK
    msa_plan.INVARIANT_CHUNK = chunk
    try:
        yield
    finally:
        msa_plan.INVARIANT_CHUNK = saved


def main() -> None:
    from asymcache_core import Engine
    from asymcache_core.loaders import load_model
    from scripts.gpu_async_step import run_case

    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="512,128")
    ap.add_argument("--limits", default="4096,32768", help="max_model_len of the engines")
    ap.add_argument("--cases", default="1x2048,1x16384")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    limits = [int(c) for c in args.limits.split(",")]
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    os.environ.setdefault("ASYMCACHE_CACHE_DIR", tempfile.mkdtemp(prefix="bi-chunk-"))
    device = torch.device("cuda")
    loaded = load_model("dummy:llama-3.1-8b", device, torch.bfloat16, 0, max(limits))
    print(f"{torch.cuda.get_device_name()}; ms per output token, median of {args.rounds} rounds")
    engines: dict[tuple[int, int], Engine] = {}
    for limit in limits:
        fits = [(b, c) for b, c in cases if c + args.tokens + 16 <= limit]
        if not fits:
            continue
        blocks = max(b * (c + args.tokens) // 16 + 64 for b, c in fits) + 256
        for chunk in chunks:
            with invariant_chunk(chunk):
                engines[(limit, chunk)] = Engine(
                    model="dummy:llama-3.1-8b", device="cuda", loaded=loaded, num_kv_blocks=blocks,
                    max_model_len=limit, max_num_batched_tokens=8192, max_num_seqs=max(b for b, _ in fits),
                )
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    head = " | ".join(f"chunk {c}" for c in chunks)
    print(f"\n| decode | max_model_len | {head} | {chunks[-1]} / {chunks[0]} |")
    print("|---|---:|" + "---:|" * (len(chunks) + 1))
    for limit in limits:
        for batch, context in cases:
            if (limit, chunks[0]) not in engines or context + args.tokens + 16 > limit:
                continue
            times: dict[int, list[float]] = {c: [] for c in chunks}
            for rnd in range(args.rounds):
                prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
                for chunk in chunks if rnd % 2 == 0 else chunks[::-1]:
                    eng = engines[(limit, chunk)]
                    eng.reset_prefix_cache()
                    with invariant_chunk(chunk):
                        ms, _ = run_case(eng, prompts, args.tokens)
                    times[chunk].append(ms)
            med = {c: statistics.median(t) for c, t in times.items()}
            cells = " | ".join(f"{med[c]:.3f}" for c in chunks)
            print(f"| {batch} x {context} | {limit} | {cells} | {med[chunks[-1]] / med[chunks[0]]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
