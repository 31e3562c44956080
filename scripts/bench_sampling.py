"""What sampling a step's rows costs, side by side, on the device the logits are on: greedy
(argmax), random rows drawn where the logits are (temperature 0.7, top-p 0.95, top-k 50: one
batched path, no copy of the vocabulary), and the same rows through the host path (a logits
processor that cannot say it passes: the rows copied to the host, rewritten, drawn there; how
every random row was sampled before 2026-12-06). Llama-3 vocabulary (128,256), fp32 logits.

Usage: ``python scripts/bench_sampling.py [--batches 1,8,32] [--iters 100]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from asymcache_core.sampler import Sampler
from asymcache_core.sampling_params import SamplingParams

VOCAB = 128_256
RANDOM = dict(temperature=0.7, top_p=0.95, top_k=50)


def unchanged(_out: list[int], row: torch.Tensor) -> torch.Tensor:
    """A logits processor that rewrites nothing and cannot say so: its row takes the host path."""
    return row


def _time(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median ms of ``fn`` with the device synchronized around each call."""
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
    """One table row: the three ways at ``batch`` rows."""
    logits = torch.randn(batch, VOCAB, device=device) * 3
    ids, outputs = [f"r{i}" for i in range(batch)], [[1, 2, 3] for _ in range(batch)]
    draws = [3] * batch
    sampler = Sampler(0)
    greedy = [SamplingParams()] * batch
    rand = [SamplingParams(seed=i, **RANDOM) for i in range(batch)]
    host = [SamplingParams(seed=i, logits_processors=(unchanged,), **RANDOM) for i in range(batch)]

    def on_device(params: list[SamplingParams]) -> Callable[[], object]:
        # NOTE: what a launched step does: the tokens stay on the device (read by the next step)
        return lambda: sampler.sample_on_device(logits, ids, params, draws)

    t_greedy = _time(on_device(greedy), iters, device)
    t_rand = _time(on_device(rand), iters, device)
    t_host = _time(lambda: sampler.sample(logits, ids, host, outputs), iters, device)
    return f"| {batch} | {t_greedy:.3f} | {t_rand:.3f} | {t_host:.3f} | {t_host / t_rand:.1f}x |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}; vocab {VOCAB}; median ms of {args.iters} calls")
    print("| rows | greedy | random, on the device | random, host path | host / device |")
    print("|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        print(_row(batch, args.iters, device), flush=True)


if __name__ == "__main__":
    main()
