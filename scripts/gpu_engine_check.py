"""GPU smoke test of the engine: MSA (Triton) vs torch attention, lossless eviction, speed.

Run on the GPU machine: ``python scripts/gpu_engine_check.py [--model dummy:llama-3.1-8b]``.
Prints one table; exits non-zero when the engine fails outright.
"""

from __future__ import annotations

import argparse
import time

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model


def multi_turn(engine: Engine, jobs: int, turns: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    system = torch.randint(1000, vocab - 1000, (512,), generator=gen).tolist()
    ctx = {s: system + torch.randint(1000, vocab - 1000, (200,), generator=gen).tolist() for s in range(jobs)}
    outs = []
    for _ in range(turns):
        ids = {s: engine.add_request(ctx[s], SamplingParams(max_tokens=16, ignore_eos=True), job_id=f"s{s}") for s in range(jobs)}
        done = {}
        while len(done) < jobs:
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        for s in range(jobs):
            outs.append(done[ids[s]])
            ctx[s] = ctx[s] + done[ids[s]] + torch.randint(1000, vocab - 1000, (120,), generator=gen).tolist()
    engine.check_integrity()
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, model {args.model}")
    t = time.perf_counter()
    loaded = load_model(args.model, dev, torch.bfloat16, seed=0)
    print(f"load {time.perf_counter() - t:.1f}s")
    rows = []
    for backend in ("triton", "torch"):
        for policy, blocks in (("vllm-apc", 8192), ("asymcache", 160), ("vllm-apc", 160)):
            eng = Engine(model=args.model, device="cuda", loaded=loaded, num_kv_blocks=blocks,
                         eviction_policy=policy, attention_backend=backend)
            t = time.perf_counter()
            outs = multi_turn(eng, jobs=6, turns=3, seed=1)
            torch.cuda.synchronize()
            rows.append((backend, policy, blocks, outs, time.perf_counter() - t, eng.pool.num_evictions, eng.counters.hole_tokens))
    ref = rows[0][3]
    print(f"{'backend':<8}{'policy':<11}{'blocks':>7}{'agree':>8}{'evict':>7}{'holes':>7}{'time s':>8}")
    for backend, policy, blocks, outs, dt, ev, holes in rows:
        agree = sum(a == b for a, b in zip(outs, ref, strict=True)) / len(ref)
        print(f"{backend:<8}{policy:<11}{blocks:>7}{agree:>8.0%}{ev:>7}{holes:>7}{dt:>8.2f}")
    # raw step speed through the engine (triton)
    eng = Engine(model=args.model, device="cuda", loaded=loaded, num_kv_blocks=8192, max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1000, 100000, (2048,), generator=gen).tolist() for _ in range(32)]
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=65, ignore_eos=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    torch.cuda.synchronize()
    pre = time.perf_counter() - t
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    dec = time.perf_counter() - t
    params = loaded.config.num_params
    print(f"prefill 32x2048: {32 * 2048 / pre:,.0f} tok/s ({2 * params * 32 * 2048 / pre / 1e12:.0f} TFLOP/s linear)")
    print(f"decode batch 32 @2k: {dec / steps * 1e3:.2f} ms/step, {32 * steps / dec:,.0f} tok/s "
          f"(weight-read floor {2 * params / 4.3e12 * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
