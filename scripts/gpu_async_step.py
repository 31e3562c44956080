"""Async scheduling against the synchronous loop on decode steps. GPU only.

``python scripts/gpu_async_step.py [--model dummy:llama-3.1-8b] [--cases 1x2048,32x2048]
[--tokens 48] [--rounds 2]`` builds two engines on one loaded model, the default (batch-invariant,
CUDA graphs, fused kernels) with ``async_scheduling`` off and on, and for each case (sequences x
context) runs the same random prompts through both, alternating in rounds: every request
prefills, then decodes ``--tokens`` tokens with EOS ignored. It prints the median time per
output token over the requests, counted from the last request's first token (decode-only steps:
the step interval the loop sustains), their ratio, and whether the two engines' tokens are
equal bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

CASES = ((1, 2048), (8, 2048), (32, 2048), (64, 1024), (16, 8192))


def run_case(
    engine: Engine, prompts: list[list[int]], tokens: int, params: list[SamplingParams] | None = None
) -> tuple[float, list[list[int]]]:
    """Runs ``prompts`` to ``tokens`` output tokens each (greedy, or ``params`` per prompt,
    whose ``max_tokens`` and ``ignore_eos`` are set here); returns the median time per output
    token (ms) once every request is decoding, and the outputs."""
    if params is None:
        params = [SamplingParams()] * len(prompts)
    params = [dataclasses.replace(p, max_tokens=tokens, ignore_eos=True) for p in params]
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    metrics = [finals[i].metrics for i in ids]
    # NOTE: only the steps after the last prefill: before it, decodes share steps with prompts
    decoding = max(m.first_token_time for m in metrics)
    tpots = []
    for m in metrics:
        times = [t for t in m.token_times if t > decoding]
        if len(times) >= 2:
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    return 1e3 * statistics.median(tpots), [finals[i].token_ids for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="BATCHxCONTEXT,...")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    device = torch.device(args.device)
    longest = max(c for _, c in cases) + args.tokens + 16
    max_len = 1 << (longest - 1).bit_length()
    loaded = load_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, 0, max_len)
    blocks = max(b * (c + args.tokens) // 16 + 64 for b, c in cases) + 256
    engines = {
        mode: Engine(
            model=args.model, device=args.device, loaded=loaded, num_kv_blocks=blocks, max_model_len=max_len,
            max_num_batched_tokens=8192, max_num_seqs=max(b for b, _ in cases), async_scheduling=mode,
        )
        for mode in (False, True)
    }
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    print(f"{'case':>10} {'sync ms/token':>14} {'async ms/token':>15} {'speed-up':>9} {'tokens equal':>13}")
    for batch, context in cases:
        times: dict[bool, list[float]] = {False: [], True: []}
        equal = True
        for rnd in range(args.rounds):
            # NOTE: fresh prompts per round (no cache hit); both modes run the same ones, in
            # alternating order so neither always runs first.
            prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
            outs = {}
            for mode in ((False, True) if rnd % 2 == 0 else (True, False)):
                engines[mode].reset_prefix_cache()
                tpot, outs[mode] = run_case(engines[mode], prompts, args.tokens)
                times[mode].append(tpot)
            equal &= outs[False] == outs[True]
        sync, asyn = statistics.median(times[False]), statistics.median(times[True])
        print(f"{batch:>4} x {context:<5} {sync:>14.2f} {asyn:>15.2f} {sync / asyn:>8.2f}x {str(equal):>13}", flush=True)


if __name__ == "__main__":
    main()
