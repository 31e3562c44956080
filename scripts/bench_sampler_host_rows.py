"""What sampling costs a step when rows need the host (logits processors), side by side: the
sampler's one batched copy against one copy a row (its loop before 2026-12-06), and a greedy row
whose processor passes (a thinking budget before its limit: the device argmax) against plain
rows. Llama-3 vocabulary (128,256), fp32 logits on the device.

Usage: ``python scripts/bench_sampler_host_rows.py [--batches 1,8,32] [--iters 200]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymcache_core.sampler import Sampler
from asymcache_core.sampling_params import SamplingParams

VOCAB = 128_256


class _Passing:
    """A processor that passes every token (the thinking budget before its limit)."""

    def passes(self, _out: list[int]) -> bool:
        return True

    def __call__(self, _out: list[int], row: torch.Tensor) -> torch.Tensor:
        return row


def _rewriting(_out: list[int], row: torch.Tensor) -> torch.Tensor:
    row[0] -= 1.0  # touches the row: the host path
    return row


def _per_row(sampler: Sampler, logits: torch.Tensor, ids: list[str], params: list[SamplingParams],
             outputs: list[list[int]]) -> list[int]:
    """The loop before: each host row copied (and synchronized) on its own."""
    return [sampler._sample_row(logits[i], ids[i], p, outputs[i], None) for i, p in enumerate(params)]


def _time(fn, iters: int, device: torch.device) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def _row(batch: int, iters: int, device: torch.device) -> str:
    """One table row: the four ways at ``batch`` rows."""
    logits = torch.randn(batch, VOCAB, device=device)
    ids, outputs = [f"r{i}" for i in range(batch)], [[1, 2, 3] for _ in range(batch)]
    sampler = Sampler(0)
    plain = [SamplingParams()] * batch
    passing = [SamplingParams(logits_processors=(_Passing(),)) for _ in range(batch)]
    host = [SamplingParams(logits_processors=(_rewriting,)) for _ in range(batch)]
    assert sampler.sample(logits, ids, passing, outputs) == sampler.sample(logits, ids, plain, outputs)
    t_plain = _time(lambda: sampler.sample(logits, ids, plain, outputs), iters, device)
    t_pass = _time(lambda: sampler.sample(logits, ids, passing, outputs), iters, device)
    t_one = _time(lambda: sampler.sample(logits.clone(), ids, host, outputs), iters, device)
    t_each = _time(lambda: _per_row(sampler, logits.clone(), ids, host, outputs), iters, device)
    return f"| {batch} | {t_plain:.3f} | {t_pass:.3f} | {t_one:.3f} | {t_each:.3f} | {t_each / t_one:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, vocab {VOCAB}")
    print("| batch | plain rows ms | passing processor ms | host rows, one copy ms | host rows, a copy each ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        print(_row(batch, args.iters, device))

if __name__ == "__main__":
    main()
