"""Cost of one eviction in the vLLM plugin's free queue, indexed plan against full scan.

``python scripts/bench_free_queue.py [--sizes 5000 50000 200000] [--chain 200]`` fills an
:class:`~asymcache_core.integrations.vllm.free_queue.ExpectedLatencyFreeQueue` with cached free
blocks in chains of ``--chain`` blocks (one job per chain, as finished agent turns leave
them) and times, side by side, popping 16 victims with the queue's indexed plan and planning
the same 16 with the full scan over every free block (the dry-run reference it is tested
against). CPU only; no vLLM needed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from asymcache_core.integrations.vllm.free_queue import (
    BlockScorer,
    CachedForest,
    ExpectedLatencyFreeQueue,
)
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel


@dataclass(eq=False)
class Block:
    block_id: int
    block_hash: object
    ref_cnt: int = 0


def build(num_blocks: int, chain: int) -> tuple[ExpectedLatencyFreeQueue, CachedForest]:
    job_stats = JobStats()
    scorer = BlockScorer(job_stats, LatencyModel(0.007, 2e-5, 2e-9, 64), 16)
    forest = CachedForest()
    blocks = []
    for s in range(num_blocks // chain):
        keys = [("h", s, i) for i in range(chain)]
        forest.learn_chain(keys)
        ids = list(range(s * chain, (s + 1) * chain))
        for block_id, key in zip(ids, keys, strict=True):
            forest.add(block_id, key)
            blocks.append(Block(block_id, key))
        scorer.annotate(ids, f"s{s}")
        job_stats.on_arrival(f"s{s}", 0.0, 100)
        job_stats.on_finish(f"s{s}", 1.0 + s * 1e-3, False, chain * 16)
    return ExpectedLatencyFreeQueue(blocks, scorer.score, lambda: 5.0, forest), forest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000, 50_000, 200_000])
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| cached free blocks | chains | indexed pop of 16 (ms) | full scan plan of 16 (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        queue, forest = build(size, args.chain)
        scan, indexed = [], []
        for _ in range(args.repeats):
            twin = forest.copy()
            start = time.perf_counter()
            queue._plan(16, 5.0, twin, mutate=False)  # the reference: every block scanned
            scan.append(time.perf_counter() - start)
            start = time.perf_counter()
            queue.popleft_n(16)
            indexed.append(time.perf_counter() - start)
        a, b = statistics.median(indexed) * 1e3, statistics.median(scan) * 1e3
        print(f"| {size:,} | {size // args.chain:,} | {a:.2f} | {b:.1f} | {b / a:.0f}x |")


if __name__ == "__main__":
    main()
