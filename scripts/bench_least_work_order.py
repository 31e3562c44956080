"""Cost of one least-work ordering pass inside vLLM: a lookup per waiting request, or tracked hits.

``.venv-vllm/bin/python scripts/bench_least_work_order.py [--waiting 100 1000 5000]
[--blocks 64 512] [--families 20] [--repeats 3]`` builds two real vLLM 0.32 ``KVCacheManager``
(one full-attention group, 16-token blocks, prefix caching on) whose pools cache the shared
contexts of ``--families`` jobs (3/4 of each prompt), fills a scheduler's waiting queue with W
requests (a job's context and a quarter of new tokens; real ``Request`` objects hashed by
vLLM's hasher) and times, side by side, the plugin scheduler's own ordering pass
(``_asymcache_order_waiting``) with every key a ``coordinator.find_longest_cache_hit`` (the
plugin before tracked hits) and with the hits kept by ``prefix_hits.PrefixHits``. The tracked
run's first pass, which registers every chain, is timed apart (with the index entries it leaves:
one per waiting request and cached block of its hit), and so is the dearest cache
event for the tracker: a job's first context block evicted (a connector's ``evict_blocks``)
and cached again by a request of that job, on each pool. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from asymcache_core.integrations.vllm.options import AsymCacheOptions
from asymcache_core.integrations.vllm.prefix_hits import track_prefix_hits
from asymcache_core.integrations.vllm.scheduler import AsymCacheScheduler
from asymcache_core.latency_model import LatencyModel

BLOCK = 16


def make_manager(num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    return KVCacheManager(
        config, max_model_len=1 << 20, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )


def run_once(manager: KVCacheManager, request: Request) -> None:
    """Computes ``request``'s prompt (its hit first, as vLLM admits it) and frees its blocks:
    they stay cached in the free queue."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
    manager.free(request)


def order_pass(manager: KVCacheManager, waiting: deque[Request], tracked: bool) -> Any:
    """A stand-in of the plugin scheduler with just what its ordering pass reads."""
    sched = object.__new__(AsymCacheScheduler)
    sched.kv_cache_manager = manager
    sched.waiting = waiting
    sched.running = []
    sched.max_num_running_reqs = 1 << 30
    sched.asymcache_options = AsymCacheOptions(order="least-work")
    sched.asymcache_latency = LatencyModel(1e-3, 1e-5, 1e-9, 64)
    sched.asymcache_prefix_hits = None
    if tracked:
        hits, why = track_prefix_hits(manager)
        assert hits is not None, why
        sched.asymcache_prefix_hits = hits
    return sched


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench(num_waiting: int, prompt_blocks: int, families: int, repeats: int) -> dict[str, float]:
    context_blocks = prompt_blocks * 3 // 4
    hasher = get_request_block_hasher(BLOCK, sha256)
    contexts = [
        [f * 100_000 + 7 + (i * 31) % 99_991 for i in range(context_blocks * BLOCK)]
        for f in range(families)
    ]
    count = 0

    def request(context: list[int], extra_blocks: int) -> Request:
        nonlocal count
        count += 1
        tail = [count * 1_000 + i for i in range(extra_blocks * BLOCK)]
        return Request(
            f"r{count}", context + tail, SamplingParams(max_tokens=1), None, block_hasher=hasher
        )

    num_blocks = families * prompt_blocks + prompt_blocks + 2
    managers = {"full": make_manager(num_blocks), "tracked": make_manager(num_blocks)}
    waiting = [
        request(contexts[i % families], prompt_blocks - context_blocks) for i in range(num_waiting)
    ]
    scheds = {}
    for name, manager in managers.items():
        scheds[name] = order_pass(manager, deque(waiting), tracked=name == "tracked")
        for context in contexts:
            run_once(manager, request(context, 0))
    out = {"first": timed(scheds["tracked"]._asymcache_order_waiting)}
    out["entries"] = scheds["tracked"].asymcache_prefix_hits.num_entries
    for name, sched in scheds.items():
        out[name] = statistics.median(timed(sched._asymcache_order_waiting) for _ in range(repeats))
    assert [r.request_id for r in scheds["full"].waiting] == [
        r.request_id for r in scheds["tracked"].waiting
    ]
    for name, manager in managers.items():
        pool = manager.block_pool
        root = manager.coordinator.find_longest_cache_hit(waiting[0].block_hashes, BLOCK)[0][0][0]
        again = request(contexts[0], 0)
        out[f"event_{name}"] = timed(
            lambda p=pool, b=root, m=manager, r=again: (
                p.evict_blocks({b.block_id}),
                run_once(m, r),
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waiting", type=int, nargs="+", default=[100, 1_000, 5_000])
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--families", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    init_none_hash(sha256)
    print(
        "| waiting | prompt blocks | lookups pass (ms) | tracked pass (ms) | ratio | tracked first pass (ms) "
        "| index entries | job's first block evicted + cached again, lookups / tracked pool (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for blocks in args.blocks:
        for num_waiting in args.waiting:
            r = bench(num_waiting, blocks, args.families, args.repeats)
            print(
                f"| {num_waiting:,} | {blocks} | {r['full']:.2f} | {r['tracked']:.2f} | {r['full'] / r['tracked']:.0f}x "
                f"| {r['first']:.1f} | {r['entries']:,} | {r['event_full']:.2f} / {r['event_tracked']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
