"""Cost of one eviction in the vLLM plugin's free queue, indexed plan against full scan.

``python scripts/bench_free_queue.py [--sizes 5000 50000 200000] [--chain 200] [--decay]`` fills
an :class:`~asymcache_core.integrations.vllm.free_queue.ExpectedLatencyFreeQueue` with cached
free blocks in chains of ``--chain`` blocks (one job per chain, as finished agent turns leave
them) and times, side by side, popping 16 victims with the queue's indexed plan and planning
the same 16 with the full scan over every free block (the dry-run reference it is tested
against). The first evicting pop is timed apart: it prices every score group once (in a server
that cost is spread over the frees that filed the groups). By default every job scores the
prior, constant in time; with ``--decay`` each job has had a pause of its own (13 different
lengths), the clock starts where most jobs overstay theirs (their P(reuse) decays, each at its
own rate) and moves ``--step`` seconds before every pop. CPU only; no vLLM needed.

``--vllm`` (run with ``.venv-vllm``) times instead one evicting ``get_new_blocks(1)`` of a real
vLLM ``BlockPool`` full of the same chains, with the plugin's queue and pool hooks installed as
its scheduler installs them, against the same pool with vLLM's own LRU queue.
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


class Clock:
    """A settable clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build(
    num_blocks: int, chain: int, decay: bool
) -> tuple[ExpectedLatencyFreeQueue, CachedForest, Clock]:
    """The queue, its forest and its clock, full of ``num_blocks // chain`` finished jobs."""
    job_stats = JobStats()
    scorer = BlockScorer(job_stats, LatencyModel(0.007, 2e-5, 2e-9, 64), 16)
    forest = CachedForest()
    blocks = []
    jobs = num_blocks // chain
    for s in range(jobs):
        keys = [("h", s, i) for i in range(chain)]
        forest.learn_chain(keys)
        ids = list(range(s * chain, (s + 1) * chain))
        for block_id, key in zip(ids, keys, strict=True):
            forest.add(block_id, key)
            blocks.append(Block(block_id, key))
        scorer.annotate(ids, f"s{s}")
        finish = 1.0 + s * 1e-3
        if decay:
            # NOTE: a first turn and a pause of its own (0.5 to 4.1 s), then the turn whose
            # blocks these are, finished at a time spread over 10 s
            gap = 0.5 + (s % 13) * 0.3
            finish = 1.0 + 10.0 * s / jobs
            job_stats.on_arrival(f"s{s}", finish - gap - 1.0, 100)
            job_stats.on_finish(f"s{s}", finish - gap - 0.5, False, chain * 8)
            job_stats.on_arrival(f"s{s}", finish - 0.5, 100)
        else:
            job_stats.on_arrival(f"s{s}", 0.0, 100)
        job_stats.on_finish(f"s{s}", finish, False, chain * 16)
    clock = Clock(14.0 if decay else 5.0)
    return ExpectedLatencyFreeQueue(blocks, scorer.score, clock, forest), forest, clock


def vllm_pools(num_blocks: int, chain: int, repeats: int) -> tuple[float, float]:
    """Median ms of an evicting ``get_new_blocks(1)``: a real vLLM ``BlockPool`` with the
    plugin's queue, and one with vLLM's own."""
    import hashlib
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool  # NOTE: .venv-vllm only

    from asymcache_core.integrations.vllm.scheduler import install_pool_hooks

    out = []
    for plugin in (True, False):
        pool = BlockPool(num_blocks + 1, True, 16)  # NOTE: +1: vLLM keeps a null block
        if plugin:
            job_stats = JobStats()
            scorer = BlockScorer(job_stats, LatencyModel(0.007, 2e-5, 2e-9, 64), 16)
            forest = CachedForest()
            queue = ExpectedLatencyFreeQueue(
                pool.free_block_queue.get_all_free_blocks(), scorer.score, lambda: 5.0, forest
            )
            for block in pool.blocks:
                block.prev_free_block = block.next_free_block = None
            pool.free_block_queue = queue
            install_pool_hooks(pool, forest, queue, scorer)
        for s in range(num_blocks // chain):
            parent, hashes = b"", []
            for i in range(chain):
                parent = hashlib.sha256(parent + f"{s}_{i}".encode()).digest()
                hashes.append(parent)
            blocks = pool.get_new_blocks(chain)
            request = SimpleNamespace(block_hashes=hashes, mm_features=[], lora_request=None)
            pool.cache_full_blocks(request, blocks, 0, chain, 16, 0)
            if plugin:
                job_stats.on_arrival(f"s{s}", 0.0, 100)
                scorer.annotate([b.block_id for b in blocks], f"s{s}")
                job_stats.on_finish(f"s{s}", 1.0 + s * 1e-3, False, chain * 16)
            pool.free_blocks(reversed(blocks))
        pool.get_new_blocks(1)  # NOTE: the first eviction prices every group once
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            pool.get_new_blocks(1)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times) * 1e3)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000, 50_000, 200_000])
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--decay", action="store_true", help="jobs whose P(reuse) decays as the clock moves"
    )
    ap.add_argument(
        "--step", type=float, default=0.05, help="seconds the clock moves before each pop (--decay)"
    )
    ap.add_argument("--vllm", action="store_true", help="a real vLLM BlockPool (.venv-vllm)")
    args = ap.parse_args()
    if args.vllm:
        print(
            "| cached free blocks | chains (jobs) | plugin get_new_blocks(1) (ms) | vLLM's LRU (ms) |"
        )
        print("|---:|---:|---:|---:|")
        for size in args.sizes:
            plugin, stock = vllm_pools(size, args.chain, args.repeats)
            print(f"| {size:,} | {size // args.chain:,} | {plugin:.3f} | {stock:.4f} |")
        return
    print(
        "| cached free blocks | chains (jobs) | first pop of 16 (ms) | pop of 16 (ms) | full scan plan of 16 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        queue, forest, clock = build(size, args.chain, args.decay)
        start = time.perf_counter()
        queue.popleft_n(16)
        first = time.perf_counter() - start
        scan, indexed = [], []
        for _ in range(args.repeats):
            if args.decay:
                clock.t += args.step
            twin = forest.copy()
            start = time.perf_counter()
            queue._plan(16, clock(), twin, mutate=False)  # the reference: every block scanned
            scan.append(time.perf_counter() - start)
            start = time.perf_counter()
            queue.popleft_n(16)
            indexed.append(time.perf_counter() - start)
        a, b = statistics.median(indexed) * 1e3, statistics.median(scan) * 1e3
        print(f"| {size:,} | {size // args.chain:,} | {first * 1e3:.2f} | {a:.2f} | {b:.1f} |")


if __name__ == "__main__":
    main()
