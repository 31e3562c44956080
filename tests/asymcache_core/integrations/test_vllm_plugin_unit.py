"""The vLLM plugin's free-block order and pins, on fake blocks (no vLLM needed).

A small fake of vLLM V1's ``BlockPool`` (allocation pops from the free queue and drops the hash;
requests free their blocks tail first; cache hits touch free blocks out of the queue) drives the
real :class:`ExpectedLatencyFreeQueue`, :class:`CachedForest`, :class:`PinSet` and scorer.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import pytest

from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.continuum.estimator import ToolDurationEstimator
from asymcache_core.continuum.ttl import apply_ttl_rule, pin_benefit_s
from asymcache_core.eviction.asymcache import expected_latency_cost
from asymcache_core.integrations.vllm import (
    BlockScorer,
    CachedForest,
    ExpectedLatencyFreeQueue,
    JobHints,
    PinSet,
    parse_job_hints,
)
from asymcache_core.integrations.vllm.reference import reference_plan
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

LATENCY = LatencyModel(floor_s=1e-3, per_token_s=1e-5, per_attn_s=1e-8, knee_tokens=64)
BLOCK = 4


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None
    is_null: bool = False


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakePool:
    """What vLLM's BlockPool does around its free queue (single group, no partial hashes)."""

    def __init__(self, num_blocks: int, pins: PinSet | None = None) -> None:
        self.clock = Clock()
        self.job_stats = JobStats()
        self.scorer = BlockScorer(self.job_stats, LATENCY, BLOCK)
        self.forest = CachedForest()
        self.blocks = [FakeBlock(i) for i in range(num_blocks)]
        self.cached: dict[Hashable, set[int]] = {}
        self.parent_key: dict[Hashable, Hashable | None] = {}
        self.pins = pins
        self.queue = ExpectedLatencyFreeQueue(
            self.blocks, self.scorer.score, self.clock, self.forest, pins
        )
        self.tables: dict[str, list[FakeBlock]] = {}

    # -- vLLM BlockPool behaviour --
    def get_new_blocks(self, n: int) -> list[FakeBlock]:
        out = self.queue.popleft_n(n)
        for block in out:
            self._evict(block)
            block.ref_cnt += 1
        return out

    def _evict(self, block: FakeBlock) -> None:
        if block.block_hash is not None:
            self.cached[block.block_hash].discard(block.block_id)
            if not self.cached[block.block_hash]:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.forest.remove(block.block_id)
            self.scorer.forget(block.block_id)

    def touch(self, blocks: list[FakeBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[FakeBlock]) -> None:
        first, last = [], []
        for block in reversed(blocks):  # NOTE: vLLM frees a request's tail first.
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        self.queue.prepend_n(first)
        self.queue.append_n(last)

    # -- a request: tokens are given as a chain of block keys --
    def run(self, req: str, keys: list[str], job: str | None = None, partial: bool = False) -> list[FakeBlock]:
        """Prefix lookup, allocation of the rest, caching of full blocks; returns the table."""
        self.forest.learn_chain(keys)
        for i, key in enumerate(keys):
            self.parent_key.setdefault(key, keys[i - 1] if i else None)
        hits: list[FakeBlock] = []
        for key in keys:
            ids = self.cached.get(key)
            if not ids:
                break  # NOTE: vLLM's find_longest_cache_hit stops at the first miss.
            hits.append(self.blocks[min(ids)])
        self.touch(hits)
        new = self.get_new_blocks(len(keys) - len(hits) + (1 if partial else 0))
        table = hits + new
        for i, key in enumerate(keys):
            block = table[i]
            if block.block_hash is None:
                block.block_hash = key
                self.cached.setdefault(key, set()).add(block.block_id)
                self.forest.add(block.block_id, key)
        self.tables[req] = table
        if job is not None:
            self.job_stats.on_arrival(job, self.clock(), len(keys) * BLOCK)
        return table

    def finish(self, req: str, job: str | None = None, last_step: bool = False) -> None:
        table = self.tables.pop(req)
        self.scorer.annotate([b.block_id for b in table], job)
        if job is not None:
            self.job_stats.on_finish(job, self.clock(), last_step)
        self.free(table)

    def reachable_violations(self) -> list[Hashable]:
        """Cached keys whose parent key is not cached: resident but unreachable."""
        return [k for k in self.cached if self.parent_key.get(k) is not None and self.parent_key[k] not in self.cached]


def chain(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def pin(pins: PinSet, job: str, block_ids: list[int], ttl_s: float, now: float) -> int:
    """What the scheduler does at a job's finish: record its cached blocks, then pin them."""
    pins.remember(job, block_ids)
    return pins.pin(job, ttl_s, now)


def test_uncached_blocks_go_first_and_counts_match() -> None:
    pool = FakePool(8)
    assert pool.queue.num_free_blocks == 8
    pool.run("r", chain("a", 3), job="j", partial=True)
    pool.finish("r", job="j")
    assert pool.queue.num_free_blocks == 8
    out = pool.queue.popleft_n(5)
    assert all(b.block_hash is None for b in out)
    assert pool.queue.stats.evicted_cached == 0


def test_children_are_evicted_before_their_parents() -> None:
    pool = FakePool(4)
    pool.run("r", chain("a", 4), job="j")
    pool.finish("r", job="j")
    # Position-aware cost alone would take the root first (it is the cheapest to rebuild).
    costs = [pool.scorer.score(pool.blocks[b], pool.clock()) for b in range(4)]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    order = []
    for _ in range(4):
        block = pool.get_new_blocks(1)[0]
        order.append(block.block_id)
        assert pool.reachable_violations() == []
    table_ids = [0, 1, 2, 3]
    assert order == table_ids[::-1]
    assert pool.queue.stats.forced_orphans == 0


def test_shared_prefix_stays_until_every_child_is_gone() -> None:
    pool = FakePool(5)
    pool.run("r1", ["p0", "p1", "x2"], job="x")
    pool.finish("r1", job="x")
    pool.run("r2", ["p0", "p1", "y2"], job="y")
    pool.finish("r2", job="y")
    assert pool.forest.children("p1") == 2
    victims = [b.block_hash for b in pool.queue.popleft_n(4)]
    # the free uncached block first, then both leaves before the shared parent
    assert victims[0] is None
    assert set(victims[1:3]) == {"x2", "y2"}
    assert victims[3] == "p1"


def test_cheap_job_goes_before_expensive_job() -> None:
    pool = FakePool(6)
    pool.run("r1", chain("done", 3), job="done")
    pool.finish("r1", job="done", last_step=True)  # P(reuse) = 0
    pool.run("r2", chain("live", 3), job="live")
    pool.finish("r2", job="live")
    pool.job_stats.hint("live", expected_gap_s=5.0)
    victims = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in victims) == [0, 1, 2]
    assert pool.queue.stats.evicted_cached == 3
    assert pool.reachable_violations() == []


def test_scorer_is_the_embedded_policys_cost() -> None:
    pool = FakePool(4)
    pool.run("r", chain("a", 3), job="j")
    pool.finish("r", job="j")
    now = pool.clock()
    p = pool.job_stats.block_reuse_probability({"j"}, "j", now)
    base = pool.job_stats.expected_next_tokens("j")
    for pos in range(3):
        want = expected_latency_cost(p, pos, BLOCK, base, LATENCY)
        assert pool.scorer.score(pool.blocks[pos], now) == pytest.approx(want)


def test_duplicate_copies_may_go_while_one_stays() -> None:
    pool = FakePool(4)
    forest, blocks = pool.forest, pool.blocks
    forest.learn_chain(["k0", "k1"])
    for block_id, key in [(0, "k0"), (1, "k0"), (2, "k1")]:
        blocks[block_id].block_hash = key
        forest.add(block_id, key)
    # block 3 (uncached) and the three cached ones are free
    queue = ExpectedLatencyFreeQueue(blocks, pool.scorer.score, pool.clock, forest)
    first = [b.block_id for b in queue.popleft_n(2)]
    assert first[0] == 3 and first[1] in (0, 1)
    assert forest.copies("k0") == 1 and forest.children("k0") == 1
    rest = [b.block_id for b in queue.popleft_n(2)]
    assert rest[0] == 2  # the child before the last copy of its parent


def test_pinned_blocks_are_skipped_until_expiry() -> None:
    pins = PinSet(capacity_blocks=8)
    pool = FakePool(6, pins)
    pool.run("a", chain("a", 3), job="a")
    pool.finish("a", job="a")
    pin(pins, "a", [0, 1, 2], ttl_s=2.0, now=pool.clock())
    pool.run("b", chain("b", 3), job="b")
    pool.finish("b", job="b", last_step=False)
    assert [b.block_hash for b in pool.queue.popleft_n(3)] == ["b2", "b1", "b0"]
    pool.blocks[3].ref_cnt = pool.blocks[4].ref_cnt = pool.blocks[5].ref_cnt = 1
    # only pinned blocks are left: pressure releases the pin instead of failing
    assert [b.block_hash for b in pool.queue.popleft_n(1)] == ["a2"]
    assert pool.queue.stats.pressure_unpins == 1 and pins.stats.released_pressure == 1


def test_expired_pin_is_an_ordinary_candidate() -> None:
    pins = PinSet(capacity_blocks=8)
    pool = FakePool(4, pins)
    pool.run("a", chain("a", 2), job="a")
    pool.finish("a", job="a", last_step=True)
    pin(pins, "a", [0, 1], ttl_s=1.0, now=pool.clock())
    assert [b.block_id for b in pool.queue.get_all_free_blocks()][:2] == [2, 3]
    pool.clock.t += 1.5
    pool.queue.popleft_n(2)  # the uncached ones
    assert [b.block_hash for b in pool.queue.popleft_n(1)] == ["a1"]
    assert pins.stats.expired == 1 and pool.queue.stats.pressure_unpins == 0


def test_pressure_releases_latest_expiring_pin_first() -> None:
    pins = PinSet(capacity_blocks=16)
    pool = FakePool(4, pins)
    pool.run("a", ["a0"], job="a")
    pool.finish("a", job="a")
    pool.run("b", ["b0"], job="b")
    pool.finish("b", job="b")
    pin(pins, "a", [pool.blocks[0].block_id], ttl_s=1.0, now=pool.clock())
    pin(pins, "b", [pool.blocks[1].block_id], ttl_s=5.0, now=pool.clock())
    pool.queue.popleft_n(2)
    assert [b.block_hash for b in pool.queue.popleft_n(1)] == ["b0"]
    assert list(pins.pins) == ["a"]


def test_pin_cap_releases_latest_expiring() -> None:
    pins = PinSet(capacity_blocks=3)
    assert pin(pins, "a", [0, 1], ttl_s=1.0, now=0.0) == 2
    assert pin(pins, "b", [2, 3], ttl_s=5.0, now=0.0) == 0  # over the cap: the later one goes
    assert list(pins.pins) == ["a"] and pins.stats.released_pressure == 1
    assert pin(pins, "c", [4], ttl_s=0.5, now=0.0) == 1
    assert pins.num_pinned_blocks == 3
    assert pins.unpin("a") and not pins.unpin("a")


def test_forced_orphan_only_as_last_resort() -> None:
    pool = FakePool(3)
    table = pool.run("r", chain("a", 3), job="j")
    # a sliding-window manager freed the head while the tail is still in use
    pool.free([table[0], table[1]])
    victim = pool.queue.popleft_n(1)[0]
    assert victim.block_hash == "a1"  # the deepest of the non-candidates
    assert pool.queue.stats.forced_orphans == 1


def test_remove_append_and_errors() -> None:
    pool = FakePool(3)
    block = pool.blocks[1]
    pool.queue.remove(block)
    assert pool.queue.num_free_blocks == 2 and block not in pool.queue
    with pytest.raises(RuntimeError):
        pool.queue.remove(block)
    pool.queue.append(block)
    with pytest.raises(RuntimeError):
        pool.queue.append(block)
    pool.queue.popleft_n(3)
    with pytest.raises(ValueError):
        pool.queue.popleft()


def test_dry_run_order_matches_pops_and_changes_nothing() -> None:
    pool = FakePool(10)
    pool.run("r1", ["s0", "s1", "u2"], job="u")
    pool.finish("r1", job="u", last_step=True)
    pool.run("r2", ["s0", "s1", "v2", "v3"], job="v")
    pool.finish("r2", job="v")
    before = [b.block_id for b in pool.queue.get_all_free_blocks()]
    assert [b.block_id for b in pool.queue.get_all_free_blocks()] == before
    assert pool.queue.num_free_blocks == 10
    popped = [b.block_id for b in pool.queue.popleft_n(10)]
    assert popped == before
    after = list(pool.queue.iter_blocks_after(None))
    assert after == []


def test_note_hash_change_and_refile() -> None:
    pool = FakePool(3)
    pool.run("r", ["a0"], job="j")
    pool.finish("r", job="j")
    block = pool.blocks[0]
    pool._evict(block)  # a connector evicted it while free
    pool.queue.note_hash_change(block)
    assert pool.queue.popleft_n(1)[0] is block  # it holds nothing now: it goes first
    pool.queue.append(block)
    pool.queue.refile_all()
    assert pool.queue.num_free_blocks == 3


def _check_pops_against_dry_run(pool: FakePool, pins: PinSet) -> list[int]:
    """Wraps the queue's ``popleft_n``: every live pop (indexed plan) must give the blocks that
    a dry run (full scan on a copy of the forest) would give first. Returns the pop sizes."""
    queue = pool.queue
    live_pop = queue.popleft_n
    sizes: list[int] = []

    def popleft_n(n: int) -> list[FakeBlock]:
        pins.expire(pool.clock())  # the live pop expires pins first; so must the reference
        expected = [b.block_id for b in queue.get_all_free_blocks()][:n]
        got = live_pop(n)
        assert [b.block_id for b in got] == expected
        sizes.append(n)
        return got

    queue.popleft_n = popleft_n  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_never_orphans(seed: int) -> None:
    """Random jobs with shared prefixes, pins and a small pool: no cached block is ever left
    unreachable, and every pop follows the full-scan reference plan."""
    rng = random.Random(seed)
    pins = PinSet(capacity_blocks=6)
    pool = FakePool(24, pins)
    pops = _check_pops_against_dry_run(pool, pins)
    prefixes = [chain(f"sys{i}_", rng.randint(1, 3)) for i in range(3)]
    live: list[tuple[str, str]] = []
    for step in range(120):
        pool.clock.t += rng.uniform(0.0, 1.0)
        if live and (rng.random() < 0.5 or pool.queue.num_free_blocks < 8):
            req, job = live.pop(rng.randrange(len(live)))
            last = rng.random() < 0.2
            ids = [b.block_id for b in pool.tables[req] if b.block_hash is not None]
            pool.finish(req, job=job, last_step=last)
            if not last and rng.random() < 0.5:
                pin(pins, job, ids, ttl_s=rng.uniform(0.5, 3.0), now=pool.clock())
            continue
        job = f"j{rng.randrange(6)}"
        p = rng.randrange(3)
        # NOTE: a key names its whole prefix, as a chained hash does.
        keys = prefixes[p] + chain(f"{job}_{p}_{rng.randrange(3)}_", rng.randint(1, 4))
        if len(keys) + 1 > pool.queue.num_free_blocks:
            continue
        req = f"r{step}"
        pool.run(req, keys, job=job, partial=rng.random() < 0.5)
        live.append((req, job))
        assert pool.reachable_violations() == []
    assert pool.queue.stats.forced_orphans == 0
    assert pool.queue.stats.evicted_cached > 0
    assert len(pops) > 20


def test_parse_job_hints() -> None:
    assert parse_job_hints(None) == JobHints()
    hints = parse_job_hints({"job_id": 7, "is_last_step": "true", "tool_name": "bash", "pin_ttl_s": "1.5"})
    assert hints == JobHints("7", True, "bash", 1.5)
    assert parse_job_hints({"is_last_step": 0}, fallback_job_id="s").job_id == "s"
    assert parse_job_hints({"job_id": "a", "is_last_step": 1}).is_last_step
    assert parse_job_hints({"job_id": "a", "pin_ttl_s": "x"}).pin_ttl_s is None


def test_pin_set_is_a_pin_backend() -> None:
    pins = PinSet(capacity_blocks=8)
    assert pins.pin("a", ttl_s=1.0, now=0.0) == 0  # nothing recorded
    pins.remember("a", [3, 3, 4])
    assert pins.pin("a", ttl_s=0.0, now=0.0) == 0 and not pins.is_pinned("a")
    assert pins.pin("a", ttl_s=1.0, now=0.0) == 0  # the recorded blocks were used once
    assert pin(pins, "a", [3, 3, 4], ttl_s=1.0, now=0.0) == 2
    assert pins.is_pinned("a") and pins.holds_block(3) and not pins.holds_block(5)
    assert not pins.is_pinned(None) and not pins.is_pinned("b")
    pins.forget("a")
    assert not pins.is_pinned("a") and pins.num_pinned_blocks == 0
    assert pins.stats.released_other == 1 and pins.stats.released_next_request == 0


def test_ttl_comes_from_the_tool_estimator() -> None:
    clock = Clock()
    pins = PinSet(capacity_blocks=8)
    job_stats = JobStats()
    ctl = ContinuumController(pins, LATENCY, job_stats, clock)
    clock.t = 0.0
    assert ctl.on_request_arrival("j", 0.0) is None
    clock.t = 1.0
    pins.remember("j", [0, 1])
    decision = ctl.on_tool_call("j", ["bash"], 512, ended_at=1.0)
    benefit = pin_benefit_s(512, ctl.reload_cost, 0.0, 0.5)
    want = apply_ttl_rule("continuum", ToolDurationEstimator(), "bash", benefit)
    assert decision.ttl_s == pytest.approx(want.ttl_s) and decision.benefit_s == pytest.approx(benefit)
    assert job_stats.state("j").expected_gap == 2.0  # the cold-start pause hint
    assert ctl.on_request_arrival("j", 2.5) == pytest.approx(1.5)
    assert ctl.durations.samples("bash") == [1.5]
    clock.t = 3.0
    pins.remember("j", [0, 1])
    explicit = ctl.on_tool_call("j", ["tool"], 600, ended_at=3.0, ttl_s=3.0)
    assert explicit.ttl_s == 3.0 and explicit.blocks_pinned == 2 and pins.pins["j"].expires_at == 6.0
    ctl.on_request_arrival("j", 3.5)
    ctl.on_job_finished("j")
    assert ctl.memoryfulness.num_jobs == 1 and ctl.paused_jobs() == []
    assert not pins.is_pinned("j") and job_stats.state("j").finished


def test_entry_point_choice_is_opt_in() -> None:
    from asymcache_core.integrations.vllm import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS
    from asymcache_core.integrations.vllm.plugin import chosen_scheduler

    assert chosen_scheduler(None, True) is None
    assert chosen_scheduler("0", False) is None
    assert chosen_scheduler(" off ", True) is None
    # "1" follows vLLM's async_scheduling (on by default on CUDA): the sync class under a
    # two-deep batch queue would leave every other step empty
    assert chosen_scheduler("1", True) == ASYNC_SCHEDULER_CLS
    assert chosen_scheduler("1", False) == SCHEDULER_CLS
    assert chosen_scheduler("1", None) == SCHEDULER_CLS
    assert chosen_scheduler("auto", True) == ASYNC_SCHEDULER_CLS
    assert chosen_scheduler("auto", False) == SCHEDULER_CLS
    # explicit choices win over the config
    assert chosen_scheduler("async", False) == ASYNC_SCHEDULER_CLS
    assert chosen_scheduler("Sync", True) == SCHEDULER_CLS


def check_every_pop(pool: FakePool, pins: PinSet | None, compared: dict[str, int]) -> None:
    """Makes every pop of the pool's queue check itself against the full scan."""
    queue = pool.queue
    live_pop = queue.popleft_n

    def popleft_n(n: int) -> list[FakeBlock]:
        if pins is not None:
            pins.expire(pool.clock())
        head = [b.block_id for b in queue._uncached.values()][:n]
        if n > len(head):
            head += reference_plan(queue, n - len(head), pool.clock(), pool.forest.copy())[0]
        got = live_pop(n)
        assert [b.block_id for b in got] == head
        compared["pops"] += 1
        return got

    queue.popleft_n = popleft_n  # type: ignore[method-assign]


def count_pricings(scorer: BlockScorer) -> dict[str, int]:
    """Counts ``scorer``'s group pricings from now on (``["n"]``)."""
    calls = {"n": 0}
    terms = scorer.group_terms

    def counted(group: Any, now: float) -> Any:
        calls["n"] += 1
        return terms(group, now)

    scorer.group_terms = counted  # type: ignore[method-assign]
    return calls
