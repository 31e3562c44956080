"""What reporting log probabilities costs a decode step: the same greedy batch with
``logprobs`` off, 0, 5 and 20, side by side in one process, alternating, on one engine.

    python scripts/bench_logprobs.py [--device cpu|cuda] [--model smollm2-135m] [--batch 16]
        [--prompt 128] [--tokens 64] [--rounds 5]

Prints the median time per decode step (the steps after every request's first token) of each
variant and its ratio to ``off``, and checks that every variant gives the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymcache_core import Engine, SamplingParams

VARIANTS: tuple[int | None, ...] = (None, 0, 5, 20)


def decode_step_s(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Runs the batch; returns the median decode-step time and the tokens."""
    for p in prompts:
        engine.add_request(p, params)
    times: list[float] = []
    outputs: dict[str, list[int]] = {}
    first_tokens = 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        if engine.config.torch_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if first_tokens >= len(prompts):
            times.append(elapsed)
        for out in outs:
            if len(out.token_ids) == 1 and out.new_token_ids:
                first_tokens += 1
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return statistics.median(times), [outputs[k] for k in sorted(outputs, key=lambda r: int(r.split("-")[-1]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engine = Engine(model=args.model, device=args.device, max_num_seqs=max(args.batch, 1))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    samples: dict[int | None, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[int | None, list[list[int]]] = {}
    decode_step_s(engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            step_s, toks = decode_step_s(engine, prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=v))
            samples[v].append(step_s)
            tokens.setdefault(v, toks)
            assert toks == tokens[v], "a variant's tokens changed between rounds"
    base = statistics.median(samples[None])
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}), "
          f"async_scheduling={engine.async_scheduling}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.tokens} tokens, {args.rounds} rounds")
    print("| logprobs | decode step ms | vs off | tokens equal |")
    print("|---|---:|---:|---|")
    for v in VARIANTS:
        med = statistics.median(samples[v])
        print(f"| {'off' if v is None else v} | {med * 1e3:.2f} | {med / base:.3f}x | {tokens[v] == tokens[None]} |")


if __name__ == "__main__":
    main()
