"""Where a GPU engine step spends its time (torch profiler, one table). GPU machine only."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams


def main() -> None:
    eng = Engine(model="dummy:llama-3.1-8b", device="cuda", num_kv_blocks=8192, max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(2)
    for _ in range(32):
        eng.add_request(torch.randint(1000, 100000, (2048,), generator=gen).tolist(), SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    print(f"engine.step decode x32: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")
    plan = eng.scheduler.schedule()
    t = time.perf_counter()
    inputs = eng.runner.prepare(plan)
    print(f"prepare: {(time.perf_counter() - t) * 1e3:.2f} ms")
    ids = torch.tensor(inputs.input_ids, device="cuda")
    pos = torch.tensor(inputs.positions, device="cuda")
    rows = torch.tensor(inputs.logits_rows, device="cuda")
    model, r = eng.runner.model, eng.runner
    with torch.inference_mode():
        for _ in range(3):
            model(ids, pos, r.kv_caches, inputs.meta, r.backend, rows)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            model(ids, pos, r.kv_caches, inputs.meta, r.backend, rows)
        torch.cuda.synchronize()
        print(f"model forward only: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")
        q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = r.kv_caches[0]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            r.backend.attend(q, kc, vc, inputs.meta, 0.088)
        torch.cuda.synchronize()
        print(f"msa call: {(time.perf_counter() - t) / 100 * 1e3:.3f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(ids, pos, r.kv_caches, inputs.meta, r.backend, rows)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
