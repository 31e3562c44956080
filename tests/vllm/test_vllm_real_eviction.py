"""The plugin's free queue inside a real vLLM ``BlockPool`` (no model): every evicting
``get_new_blocks`` hands out the full scan's order while jobs come and go and their reuse odds
decay, and an evicting allocation prices a few score groups, not every idle job's
(``make test-vllm``)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash

from asymcache_core.integrations.vllm.forest import CachedForest
from asymcache_core.integrations.vllm.free_queue import ExpectedLatencyFreeQueue
from asymcache_core.integrations.vllm.pins import PinSet
from asymcache_core.integrations.vllm.reference import reference_plan
from asymcache_core.integrations.vllm.scheduler import install_pool_hooks
from asymcache_core.integrations.vllm.scoring import BlockScorer
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

BLOCK = 16


@dataclass
class Request:
    """What ``BlockPool.cache_full_blocks`` reads of a vLLM request."""

    request_id: str
    block_hashes: list[BlockHash]
    job: str | None
    blocks: list[Any] = field(default_factory=list)
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None


def _hashes(words: list[str]) -> list[BlockHash]:
    """Chained block hashes of a prompt given as one word per block."""
    out: list[BlockHash] = []
    parent = b""
    for word in words:
        parent = hashlib.sha256(parent + word.encode()).digest()
        out.append(BlockHash(parent))
    return out


class Server:
    """A real ``BlockPool`` with the plugin's queue and hooks, driven the way vLLM's
    ``KVCacheManager`` and the plugin's scheduler drive them."""

    def __init__(self, num_blocks: int) -> None:
        self.now = 100.0
        self.stats = JobStats()
        self.scorer = BlockScorer(self.stats, LatencyModel(1e-3, 1e-5, 1e-8, 64), BLOCK)
        self.forest = CachedForest()
        self.pins = PinSet(num_blocks // 4)
        self.pool = BlockPool(num_blocks, True, BLOCK)
        self.queue = ExpectedLatencyFreeQueue(
            self.pool.free_block_queue.get_all_free_blocks(),
            score=self.scorer.score,
            clock=lambda: self.now,
            forest=self.forest,
            pins=self.pins,
        )
        for block in self.pool.blocks:
            block.prev_free_block = block.next_free_block = None
        self.pool.free_block_queue = self.queue
        install_pool_hooks(self.pool, self.forest, self.queue, self.scorer, self.pins)
        self.checked = 0

    def allocate(self, n: int) -> list[Any]:
        """``get_new_blocks``, checked against the full scan when it evicts."""
        queue = self.queue
        self.pins.expire(self.now)
        want = [b.block_id for b in queue._uncached.values()][:n]
        if n > len(want):
            want += reference_plan(queue, n - len(want), self.now, self.forest.copy())[0]
            self.checked += 1
        got = self.pool.get_new_blocks(n)
        assert [b.block_id for b in got] == want
        return got

    def run(self, request: Request) -> None:
        """Admission: the cached prefix is touched, the rest allocated and cached."""
        if request.job is not None:
            self.stats.on_arrival(request.job, self.now, BLOCK * len(request.block_hashes))
        hits: list[Any] = []
        for block_hash in request.block_hashes:
            got = self.pool.get_cached_block(block_hash, [0])
            if got is None:
                break
            hits.append(got[0])
        self.pool.touch(hits)
        request.blocks = hits + self.allocate(len(request.block_hashes) - len(hits))
        self.pool.cache_full_blocks(
            request, request.blocks, len(hits), len(request.blocks), BLOCK, 0
        )

    def finish(self, request: Request, last: bool, pin_s: float) -> None:
        """The plugin's scheduler at a request's end, then vLLM's free (tail first)."""
        self.scorer.annotate([b.block_id for b in request.blocks], request.job)
        if request.job is not None:
            self.stats.on_finish(request.job, self.now, last, BLOCK * len(request.blocks))
            if pin_s > 0 and not last:
                self.pins.remember(request.job, [b.block_id for b in request.blocks])
                self.pins.pin(request.job, pin_s, self.now)
                self.pins.discard_recorded(request.job)
        self.pool.free_blocks(reversed(request.blocks))


def test_every_evicting_allocation_is_the_full_scan_order() -> None:
    rng = random.Random(0)
    server = Server(48)
    jobs = [f"j{i}" for i in range(12)]
    live: list[Request] = []
    for step in range(400):
        server.now += rng.choice([0.0, 0.1, 0.5, 2.0, 8.0, 400.0]) * rng.random()
        roll = rng.random()
        if roll < 0.08:
            server.stats.hint(rng.choice(jobs), expected_gap_s=rng.choice([0.5, 2.0, 6.0]))
        elif roll < 0.1:
            server.stats.drop_idle(server.now, 30.0, 8, server.pins.is_pinned)
        elif live and (roll < 0.55 or server.pool.get_num_free_blocks() < 10):
            request = live.pop(rng.randrange(len(live)))
            server.finish(request, rng.random() < 0.15, rng.choice([0.0, 0.0, 1.0]))
        else:
            job = rng.choice([*jobs, None])
            words = [f"sys{rng.randrange(2)}_{i}" for i in range(rng.randint(0, 2))]
            words += [f"{job}_{rng.randrange(3)}_{i}" for i in range(rng.randint(1, 5))]
            if len(words) + 2 <= server.pool.get_num_free_blocks():
                request = Request(f"r{step}", _hashes(words), job)
                server.run(request)
                live.append(request)
    assert server.checked > 40 and server.queue.stats.evicted_cached > 60


def test_an_evicting_allocation_prices_a_few_groups_among_many_idle_jobs() -> None:
    server = Server(2 * 1500 + 8)
    for j in range(1500):
        request = Request(f"r{j}", _hashes([f"c{j}_0", f"c{j}_1"]), f"j{j}")
        server.run(request)
        server.finish(request, last=False, pin_s=0.0)
        server.now += 0.01
    server.allocate(8)  # the uncached blocks, then the first walk: every group priced once
    calls = {"n": 0}
    terms = server.scorer.group_terms

    def counted(group: Any, now: float) -> Any:
        calls["n"] += 1
        return terms(group, now)

    server.scorer.group_terms = counted  # type: ignore[method-assign]
    for _ in range(10):
        want = reference_plan(server.queue, 1, server.now, server.forest.copy())[0]
        before = calls["n"]
        got = server.pool.get_new_blocks(1)
        assert [b.block_id for b in got] == want
        assert calls["n"] - before <= 8  # not 1,500
