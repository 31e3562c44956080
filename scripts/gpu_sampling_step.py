"""Decode steps with random sampling against greedy ones, through the engine (GPU).

``PYTHONPATH=$PWD python scripts/gpu_sampling_step.py [--cases 1x2048,8x2048,32x2048] [--tokens 48] [--rounds 3]``

One engine (dummy Llama-3.1-8B bf16, the defaults: batch-invariant kernels, CUDA graphs, async
scheduling) runs the same random prompts six ways, alternating in rounds: greedy; at random
(temperature 0.7, top-p 0.95, top-k 50, a seed per request) drawn on the device; the same
without top-k (top-p's cut found by the search of :mod:`kernels.top_p`); the first with
repetition, presence and frequency penalties (applied on the device); the first with a
processor that only masks (``min_tokens``' mask: masked on the device, as grammars are, its
mask built while the step's forward pass runs); the same with the step waited for before its
masks are built (``masked (waited)``: ``ModelRunner.masks_in_flight = False``, the engine before
2026-12-06, evening); a grammar-like mask whose kept tokens follow each row's last token (a
window of 8,192 ids: tens of microseconds a row on the host, as a grammar's bitmask), in flight
and waited for; and at random through the host path (the same settings and a logits processor that cannot say it passes: the
rows go to the host, and the step after waits for them, which is how every random row ran
before 2026-12-06). Prints the median ms per output token of decode-only steps, each way's
ratio to greedy, and checks that a second run of the device draws gives the same tokens
(keyed draws).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np
import torch

from asymcache_core import Engine, SamplingParams, batched_sampling
from asymcache_core.loaders import load_model
from asymcache_core.sampler import MinTokensMask
from asymcache_core.token_masks import apply_keep, pack_keep
from scripts.bench_sampling import RANDOM, unchanged
from scripts.gpu_async_step import run_case

#: the penalties of the fourth way (OpenAI's presence and frequency, vLLM's repetition)
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
#: the ways whose masks wait for the step before (the ablation of masks built in flight)
WAITED = {"masked (waited)", "window mask (waited)"}


class WindowMask:
    """A grammar-like processor that only masks: after token ``t`` it keeps the ``width`` ids
    from ``t + 1`` (wrapping around the vocabulary), so its mask is built afresh each step from
    the row's last token, as a grammar's is."""

    def __init__(self, width: int = 8192) -> None:
        self.width = width

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        last = output_token_ids[-1] if output_token_ids else 0
        keep = np.zeros(vocab, dtype=bool)
        keep[(last + 1 + np.arange(self.width)) % vocab] = True
        return pack_keep(keep)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        words = self.keep_words(output_token_ids, logits.shape[-1])
        return apply_keep(logits[None].clone(), [0], words[None])[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--cases", default="1x2048,8x2048,32x2048")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    ap.add_argument("--ways", default="", help="comma-separated ways to run besides greedy and random (default: all)")
    ap.add_argument("--search-min-rows", type=int, default=None,
                    help="rows from which top-p alone searches instead of sorting (default: the engine's)")
    args = ap.parse_args()
    if args.search_min_rows is not None:
        batched_sampling.SEARCH_MIN_ROWS = args.search_min_rows
    device = torch.device(args.device)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    os.environ.setdefault("ASYMCACHE_CACHE_DIR", tempfile.mkdtemp(prefix="sampling-step-"))
    longest = max(c for _, c in cases) + args.tokens + 16
    max_len = 1 << (longest - 1).bit_length()
    loaded = load_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, 0, max_len)
    engine = Engine(
        model=args.model, device=args.device, loaded=loaded, max_model_len=max_len, max_num_batched_tokens=8192,
        num_kv_blocks=max(b * (c + args.tokens) // 16 + 64 for b, c in cases) + 256,
        max_num_seqs=max(b for b, _ in cases),
    )
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}; {args.model}; async scheduling {engine.async_scheduling}; "
          f"ms per output token, median of {args.rounds} rounds")
    top_p_only = {k: v for k, v in RANDOM.items() if k != "top_k"}
    # NOTE: min_tokens' mask over the whole run: a processor that only masks, as a grammar does
    masked = MinTokensMask(1 << 20, frozenset({0}))
    window = WindowMask()
    ways = {
        "greedy": lambda b: [SamplingParams()] * b,
        "random": lambda b: [SamplingParams(seed=i, **RANDOM) for i in range(b)],
        "top-p alone": lambda b: [SamplingParams(seed=i, **top_p_only) for i in range(b)],
        "penalties": lambda b: [SamplingParams(seed=i, **RANDOM, **PENALTIES) for i in range(b)],
        "masked": lambda b: [SamplingParams(seed=i, logits_processors=(masked,), **RANDOM) for i in range(b)],
        "masked (waited)": lambda b: [SamplingParams(seed=i, logits_processors=(masked,), **RANDOM) for i in range(b)],
        "window mask": lambda b: [SamplingParams(seed=i, logits_processors=(window,), **RANDOM) for i in range(b)],
        "window mask (waited)": lambda b: [
            SamplingParams(seed=i, logits_processors=(window,), **RANDOM) for i in range(b)
        ],
        "host path": lambda b: [SamplingParams(seed=i, logits_processors=(unchanged,), **RANDOM) for i in range(b)],
    }
    if args.ways:
        wanted = {"greedy", "random", *args.ways.split(",")}
        ways = {w: f for w, f in ways.items() if w in wanted}
    others = [w for w in ways if w != "greedy"]
    print("\n| decode | greedy ms | " + " | ".join(f"{w} ms" for w in others) + " | "
          + " | ".join(f"{w} / greedy" for w in others) + " | repeat equal | masks equal |")
    print("|---|" + "---:|" * (1 + 2 * len(others)) + "---|---|")
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    for batch, context in cases:
        times: dict[str, list[float]] = {w: [] for w in ways}
        repeat_equal = masks_equal = True
        for rnd in range(args.rounds):
            prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
            seen = None
            tokens: dict[str, list[list[int]]] = {}
            for way in list(ways) if rnd % 2 == 0 else list(ways)[::-1]:
                engine.reset_prefix_cache()
                engine.runner.masks_in_flight = way not in WAITED
                ms, outs = run_case(engine, prompts, args.tokens, ways[way](batch))
                tokens[way] = outs
                times[way].append(ms)
                if way == "random":
                    seen = outs
            engine.reset_prefix_cache()
            _, again = run_case(engine, prompts, args.tokens, ways["random"](batch))
            repeat_equal &= again == seen
            # masks built in flight or after the step before waited for: the same tokens
            masks_equal &= all(tokens[w] == tokens[w.removesuffix(" (waited)")] for w in WAITED if w in tokens)
        med = {w: statistics.median(t) for w, t in times.items()}
        g = med["greedy"]
        print(f"| {batch} x {context} | {g:.3f} | " + " | ".join(f"{med[w]:.3f}" for w in others) + " | "
              + " | ".join(f"{med[w] / g:.3f}" for w in others) + f" | {repeat_equal} | {masks_equal} |", flush=True)

if __name__ == "__main__":
    main()
