"""Host cost of a step's text, full decode against incremental decode, side by side.

``python scripts/bench_detokenize.py [--batch 64] [--lengths 100 1000 4000]`` takes the packaged
SmolLM2 tokenizer and, for requests that have generated ``n`` tokens, times what one decode step
costs a batch of ``--batch`` requests to refresh their text: decoding every request's whole
output (the naive way) and the incremental decode of the one new token (the engine's
``asymcache_core.detokenizer``). CPU only.
"""

from __future__ import annotations

import argparse
import time

import torch

from asymcache_core.detokenizer import DetokenizerState, detokenize_incrementally
from asymcache_core.loaders import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 4000])
    args = ap.parse_args()
    tok = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0).tokenizer
    sample = "An agent reads the file, runs the tests, and edits the failing function. Ünïcödé 中文 🚀. "
    ids = tok.encode(sample * 400, add_special_tokens=False)
    print("| output tokens | batch | full decode per step (ms) | incremental per step (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.lengths:
        outputs = [ids[i : i + n] for i in range(args.batch)]
        start = time.perf_counter()
        for out in outputs:
            tok.decode(out, skip_special_tokens=True)
        full = time.perf_counter() - start
        states = []
        for out in outputs:  # the state after n - 1 tokens fed one step at a time
            state = DetokenizerState(tok.decode(out[: n - 9], skip_special_tokens=True), max(0, n - 10), n - 9)
            for m in range(n - 8, n):
                detokenize_incrementally(tok, out[:m], state)
            states.append(state)
        start = time.perf_counter()
        for out, state in zip(outputs, states, strict=True):
            detokenize_incrementally(tok, out, state)
        incremental = time.perf_counter() - start
        print(f"| {n:,} | {args.batch} | {full * 1e3:.2f} | {incremental * 1e3:.2f} | {full / incremental:.0f}x |")


if __name__ == "__main__":
    main()
