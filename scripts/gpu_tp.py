"""Tensor parallelism measured: tokens, decode and prefill of TP=N against one GPU. Two GPUs (nvidia-h200-x2).

``python scripts/gpu_tp.py [--model dummy:llama-3.1-8b] [--tp 2] [--cases 1x2048,32x2048]
[--prefill 8192] [--skip-tp1]`` builds the engines, one after the other in one process:

- ``tp1``: one GPU with the defaults (CUDA graphs, batch-invariant mode);
- ``tp1-eager``: one GPU without CUDA graphs (tensor-parallel steps run eagerly: the fair peer);
- ``tpN``: ``--tensor-parallel-size N`` over NCCL (ranks 1.. are worker processes).

For each: greedy tokens of 4 random 512-token prompts (32 tokens each) compared with ``tp1``'s;
median ms per output token of decode-only steps per case (sequences x context, the requests'
last steps: :func:`scripts.gpu_async_step.run_case`); the median wall time of one prefill step
of ``--prefill`` fresh tokens; rank 0's collective kernels per decode step (profiler, the last
case). Floors: the weights each GPU holds read once at the copy rate measured on ``cuda:0``
(:func:`kernels.bench.copy_bandwidth`).
``--skip-tp1`` (a model that one GPU does not hold, ``dummy:llama-3.1-70b``) runs ``tpN`` only.
``--device cpu --model dummy:tiny`` checks the script on a CPU (gloo, float32, small cases).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams
from scripts.gpu_async_step import run_case


def prefill_ms(engine: Engine, tokens: int, vocab: int, rounds: int = 3) -> float:
    """Median wall time (ms) of the step that computes a fresh ``tokens``-token prompt."""
    gen = torch.Generator().manual_seed(tokens)
    times = []
    for _ in range(rounds):
        engine.reset_prefix_cache()
        engine.add_request(torch.randint(0, vocab, (tokens,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


def collective_us_per_step(engine: Engine, prompts: list[list[int]], steps: int = 8) -> float:
    """Rank 0's NCCL kernel time per decode step (microseconds; 0 off CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    engine.reset_prefix_cache()
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    total = sum(
        e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower() or "allgather" in e.key.lower()
    )
    while engine.has_unfinished():
        engine.step()
    return total / steps


def weight_bytes(engine: Engine) -> int:
    """Bytes of the weights rank 0 holds."""
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cases", default="1x2048,32x2048", help="BATCHxCONTEXT,... decode cases")
    ap.add_argument("--prefill", type=int, default=8192, help="fresh tokens of the timed prefill step")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per decode request")
    ap.add_argument("--skip-tp1", action="store_true", help="tpN only (a model one GPU does not hold)")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    longest = max(max(c for _, c in cases) + args.tokens, args.prefill, 512 + 32) + 16
    max_len = 1 << (longest - 1).bit_length()
    blocks = max(b * (c + args.tokens) // 16 + 64 for b, c in cases) + args.prefill // 16 + 512
    device = torch.device(args.device)
    rate = 0.0
    if device.type == "cuda":
        from kernels.bench import copy_bandwidth

        rate = copy_bandwidth()  # GB/s on cuda:0, read + write
    names = ([] if args.skip_tp1 else ["tp1", "tp1-eager"]) + [f"tp{args.tp}"]
    print(f"# {args.model} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"copy rate {rate:.0f} GB/s; GPUs visible {torch.cuda.device_count()}")
    print("| engine | weights a GPU GB | floor ms | tokens equal tp1 | "
          + " | ".join(f"decode {b}x{c} ms/token" for b, c in cases)
          + f" | prefill {args.prefill} ms | collectives us/step ({cases[-1][0]}x{cases[-1][1]}) |")
    print("|---|---:|---:|---|" + "---:|" * len(cases) + "---:|---:|")
    reference: list[list[int]] | None = None
    for name in names:
        tp = 1 if name in ("tp1", "tp1-eager") else args.tp
        engine = Engine(
            model=args.model, device=args.device, tensor_parallel_size=tp, num_kv_blocks=blocks,
            max_model_len=max_len, max_num_batched_tokens=max(8192, args.prefill),
            max_num_seqs=max(b for b, _ in cases), enforce_eager=name == "tp1-eager",
        )
        try:
            vocab = engine.loaded.config.vocab_size if engine.loaded is not None else 32000
            gen = torch.Generator().manual_seed(0)
            checks = [torch.randint(0, vocab, (512,), generator=gen).tolist() for _ in range(4)]
            outs = [o.token_ids for o in engine.generate(checks, SamplingParams(max_tokens=32, ignore_eos=True))]
            if reference is None:
                reference = outs
            equal = sum(a == b for a, b in zip(outs, reference, strict=True))
            tpots = []
            for batch, context in cases:
                prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
                engine.reset_prefix_cache()
                tpots.append(run_case(engine, prompts, args.tokens)[0])
            pre = prefill_ms(engine, args.prefill, vocab)
            last_b, last_c = cases[-1]
            coll = collective_us_per_step(
                engine, [torch.randint(0, vocab, (last_c,), generator=gen).tolist() for _ in range(last_b)]
            ) if tp > 1 and device.type == "cuda" else 0.0
            wbytes = weight_bytes(engine)
            floor = wbytes / (rate * 1e6) if rate else float("nan")
            print(f"| {name} | {wbytes / 1e9:.2f} | {floor:.2f} | {equal} of {len(reference)} | "
                  + " | ".join(f"{t:.2f}" for t in tpots) + f" | {pre:.1f} | {coll:.0f} |", flush=True)
        finally:
            engine.close()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
