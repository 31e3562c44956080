"""Host cost of a step's text: full decode, the decode window, and tokenizers' DecodeStream.

``python scripts/bench_detokenize.py [--batch 64] [--lengths 100 1000 4000] [--steps 16]`` takes
the packaged SmolLM2 tokenizer and, for requests that have generated ``n`` tokens, times what one
decode step costs a batch of ``--batch`` requests to refresh their text, averaged over
``--steps`` consecutive steps: decoding every request's whole output, the window path of
:mod:`asymcache_core.detokenizer` (two ``tokenizer.decode`` calls a step) and its stream path
(one ``DecodeStream.step``). CPU only.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from asymcache_core.detokenizer import DetokenizerState, detokenize_incrementally
from asymcache_core.loaders import load_model


def _full(tok: Any, per_step: list[list[list[int]]]) -> float:
    """Seconds to decode every request's whole output at each step."""
    start = time.perf_counter()
    for step in per_step:
        for out in step:
            tok.decode(out, skip_special_tokens=True)
    return time.perf_counter() - start


def _incremental(tok: Any, per_step: list[list[list[int]]], states: list[DetokenizerState]) -> float:
    """Seconds to bring every request's text up to date at each step."""
    start = time.perf_counter()
    for step in per_step:
        for out, state in zip(step, states, strict=True):
            detokenize_incrementally(tok, out, state)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 4000])
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per length")
    args = ap.parse_args()
    tok = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0).tokenizer
    sample = "An agent reads the file, runs the tests, and edits the failing function. Ünïcödé 中文 🚀. "
    ids = tok.encode(sample * 400, add_special_tokens=False)
    steps = args.steps
    print(f"per decode step, batch of {args.batch}, mean of {steps} steps (ms)\n")
    print("| output tokens | full decode | window | DecodeStream | full / stream | window / stream |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.lengths:
        outputs = [ids[i : i + n] for i in range(args.batch)]
        start = n - steps
        # Each path's state after ``start`` tokens: all but the last fed at once, then the
        # last one, so that the timed steps decode short windows as in a real request.
        windows = [DetokenizerState(use_stream=False) for _ in outputs]
        streams = [DetokenizerState() for _ in outputs]
        for out, window, stream in zip(outputs, windows, streams, strict=True):
            for state in (window, stream):
                detokenize_incrementally(tok, out[: start - 1], state)
                detokenize_incrementally(tok, out[:start], state)
            assert stream.use_stream
        # Each step's token lists, sliced outside the timed loops (the engine passes its list).
        per_step = [[out[:m] for out in outputs] for m in range(start + 1, n + 1)]
        t_full = _full(tok, per_step) / steps
        t_window = _incremental(tok, per_step, windows) / steps
        t_stream = _incremental(tok, per_step, streams) / steps
        for out, window, stream in zip(outputs, windows, streams, strict=True):
            full_text = tok.decode(out, skip_special_tokens=True)
            detokenize_incrementally(tok, out, stream, final=True)
            detokenize_incrementally(tok, out, window, final=True)
            assert stream.text == full_text and window.text == full_text
        print(
            f"| {n:,} | {t_full * 1e3:.2f} | {t_window * 1e3:.3f} | {t_stream * 1e3:.3f} "
            f"| {t_full / t_stream:.0f}x | {t_window / t_stream:.1f}x |"
        )


if __name__ == "__main__":
    main()
