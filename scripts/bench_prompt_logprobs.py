"""What prompt log probabilities cost a prefill: the same fresh prompts with ``prompt_logprobs``
off, 0, 5 and 20, side by side in one process, alternating, on one engine.

    python scripts/bench_prompt_logprobs.py [--device cpu|cuda] [--model smollm2-135m]
        [--batch 1] [--prompt 1024] [--rounds 5]

Each variant prefills ``--batch`` fresh random prompts (no cache hit) and samples one token;
prints the median wall time of that (every step until the first tokens) per variant and its
ratio to ``off``, and checks that every variant gives the same tokens and one entry per prompt
token. The cost is the vocabulary head over every prompt row instead of the last one's, plus a
log-sum-exp, a rank and a top-k per row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymcache_core import Engine, SamplingParams

VARIANTS: tuple[int | None, ...] = (None, 0, 5, 20)


def prefill_s(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Prefills the prompts and samples one token each; returns the wall time and the tokens."""
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    if engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.metrics.cached_tokens == 0, "a fresh prompt hit the cache"
        if params.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    return elapsed, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engine = Engine(model=args.model, device=args.device, max_num_seqs=max(args.batch, 1),
                    max_num_batched_tokens=max(8192, args.batch * args.prompt))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    samples: dict[int | None, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[int | None, list[list[int]]] = {}
    for round_ in range(args.rounds + 1):
        # NOTE: fresh prompts each round, the same for every variant: ``off`` runs first (the
        # prompts are new to the engine), the others take no cache hit over the positions whose
        # logits they need (the whole prompt), by design
        prompts = [torch.randint(100, vocab - 100, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
        for variant in VARIANTS:
            elapsed, out = prefill_s(engine, prompts, SamplingParams(max_tokens=1, prompt_logprobs=variant))
            if round_ > 0:  # the first round warms up
                samples[variant].append(elapsed)
            tokens.setdefault(variant, []).extend(out)
    off = statistics.median(samples[None])
    print(f"{args.model} on {args.device}: batch {args.batch} x {args.prompt}-token prompts, {args.rounds} rounds")
    print("| prompt_logprobs | prefill ms (median) | vs off | min ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for variant in VARIANTS:
        ms = statistics.median(samples[variant]) * 1e3
        lo, hi = min(samples[variant]) * 1e3, max(samples[variant]) * 1e3
        print(f"| {'off' if variant is None else variant} | {ms:.1f} | {ms / (off * 1e3):.3f}x | {lo:.1f} | {hi:.1f} |")
    print("tokens equal:", all(tokens[v] == tokens[None] for v in VARIANTS))


if __name__ == "__main__":
    main()
