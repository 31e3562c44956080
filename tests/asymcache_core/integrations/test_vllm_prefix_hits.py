"""The tracked prefix-cache hits of the ``least-work`` order (``prefix_hits.py``), no vLLM needed.

A hypothesis state machine drives a pool with vLLM's hash-map semantics (several blocks may hold
one key; a reset replaces the map) through random arrivals, admissions, block inserts,
evictions, moves, resets and chains that change, and checks after every event that each
request's tracked hit is the full lookup's. Then, over the fake vLLM of ``vllm_plugin_fakes``
with a fake coordinator, the scheduler's least-work order with tracked hits is the order the
full lookups give, step after step.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import pytest
import vllm_plugin_fakes as fakes
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asymcache_core.integrations.vllm.prefix_hits import PrefixHits, install_prefix_hit_hooks

BLOCK = 4


@dataclass(eq=False)
class Block:
    block_id: int
    block_hash: Hashable | None = None


class HashMap:
    """vLLM's ``BlockHashToBlockMap``: key -> the blocks holding that content."""

    def __init__(self) -> None:
        self.blocks: dict[Hashable, dict[int, Block]] = {}

    def get_one_block(self, key: Hashable) -> Block | None:
        held = self.blocks.get(key)
        return next(iter(held.values())) if held else None


class Pool:
    """The hash-map bookkeeping of vLLM's ``BlockPool`` that the hooks wrap."""

    def __init__(self) -> None:
        self.cached_block_hash_to_block = HashMap()
        self.blocks: list[Block] = []
        self.busy = False  # a reset fails while blocks are in use

    def _insert_block_hash(self, key: Hashable, block: Block, num_tokens: int | None) -> None:
        if block.block_hash == key:
            return
        assert block.block_hash is None
        block.block_hash = key
        self.cached_block_hash_to_block.blocks.setdefault(key, {})[block.block_id] = block

    def _remove_cached_block_hashes(self, block: Block) -> list[Hashable]:
        key = block.block_hash
        if key is None:
            return []
        held = self.cached_block_hash_to_block.blocks.get(key, {})
        held.pop(block.block_id, None)
        if not held:
            self.cached_block_hash_to_block.blocks.pop(key, None)
        block.block_hash = None
        return [key]

    def reset_prefix_cache(self) -> bool:
        if self.busy:
            return False
        self.cached_block_hash_to_block = HashMap()
        for block in self.blocks:
            block.block_hash = None
        return True

    # ---- what vLLM does through the wrapped methods ----

    def cache(self, key: Hashable) -> None:
        block = Block(len(self.blocks))
        self.blocks.append(block)
        self._insert_block_hash(key, block, BLOCK)

    def move(self, src: Block) -> None:
        """``move_block_hashes``: the content moves to a fresh block."""
        dst = Block(len(self.blocks))
        self.blocks.append(dst)
        for key in self._remove_cached_block_hashes(src):
            self._insert_block_hash(key, dst, BLOCK)


def key_of(block_hash: Hashable) -> Hashable:
    return ("g0", block_hash)


def chain_of(contents: list[int]) -> list[str]:
    """Block hashes that chain on the parent as vLLM's do: hash i names contents[: i + 1]."""
    return [".".join(map(str, contents[: i + 1])) for i in range(len(contents))]


def full_lookup(pool: Pool, hashes: list[str]) -> int:
    hit = 0
    for block_hash in hashes:
        if pool.cached_block_hash_to_block.get_one_block(key_of(block_hash)) is None:
            break
        hit += 1
    return hit


# NOTE: a 3-letter alphabet: prompts share prefixes often, so one key is in many chains
contents_st = st.lists(st.integers(min_value=0, max_value=2), min_size=0, max_size=7)


class PrefixHitsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.hits = install_prefix_hit_hooks(self.pool, key_of, BLOCK)
        self.requests: dict[str, list[str]] = {}
        self.next_id = 0
        self.registrations = 0

    @rule(contents=contents_st)
    def arrive(self, contents: list[int]) -> None:
        self.requests[f"r{self.next_id}"] = chain_of(contents)
        self.next_id += 1
        self.registrations += 1

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(min_value=0, max_value=1_000))
    def admit(self, pick: int) -> None:
        """The request leaves the waiting queue (admitted, aborted)."""
        request_id = sorted(self.requests)[pick % len(self.requests)]
        del self.requests[request_id]
        self.hits.forget(request_id)

    @precondition(lambda self: self.requests)
    @rule(
        pick=st.integers(min_value=0, max_value=1_000), upto=st.integers(min_value=1, max_value=7)
    )
    def run_and_cache(self, pick: int, upto: int) -> None:
        """Some request (waiting or not) computes its first blocks; vLLM caches each, even when
        another block already holds the content."""
        hashes = self.requests[sorted(self.requests)[pick % len(self.requests)]]
        for block_hash in hashes[:upto]:
            self.pool.cache(key_of(block_hash))

    @rule(contents=contents_st)
    def cache_other(self, contents: list[int]) -> None:
        """A request nobody waits for caches its blocks."""
        for block_hash in chain_of(contents):
            self.pool.cache(key_of(block_hash))

    @precondition(lambda self: any(b.block_hash is not None for b in self.pool.blocks))
    @rule(pick=st.integers(min_value=0, max_value=10_000), move=st.booleans())
    def evict_or_move(self, pick: int, move: bool) -> None:
        cached = [b for b in self.pool.blocks if b.block_hash is not None]
        block = cached[pick % len(cached)]
        if move:
            self.pool.move(block)
        else:
            self.pool._remove_cached_block_hashes(block)

    @rule(busy=st.booleans())
    def reset(self, busy: bool) -> None:
        self.pool.busy = busy
        assert self.pool.reset_prefix_cache() is not busy

    @precondition(lambda self: self.requests)
    @rule(
        pick=st.integers(min_value=0, max_value=1_000),
        cut=st.integers(min_value=0, max_value=7),
        more=contents_st,
    )
    def change_chain(self, pick: int, cut: int, more: list[int]) -> None:
        """The chain grows (preempted with output tokens) or is cut and re-extended (a streaming
        session's next input)."""
        request_id = sorted(self.requests)[pick % len(self.requests)]
        hashes = self.requests[request_id]
        contents = [int(part) for part in hashes[-1].split(".")] if hashes else []
        new = chain_of(contents[:cut] + more)
        if new != hashes:
            self.registrations += 1
        self.requests[request_id] = new

    @invariant()
    def tracked_hits_are_the_full_lookups(self) -> None:
        for request_id, hashes in self.requests.items():
            hit = self.hits.hit_blocks(request_id, hashes)
            assert hit == full_lookup(self.pool, hashes), (request_id, hashes)
            tokens = len(hashes) * BLOCK + 1
            assert self.hits.hit_tokens(request_id, hashes, tokens) == hit * BLOCK
            if hashes:  # a prompt of whole blocks: its last block is computed again
                last_recomputed = self.hits.hit_tokens(request_id, hashes, tokens - 1)
                assert last_recomputed == min(hit, len(hashes) - 1) * BLOCK
        # events kept every chain current: re-registered only where the chain changed
        assert self.hits.registrations == self.registrations
        assert len(self.hits) == len(self.requests)


TestPrefixHitsMachine = PrefixHitsMachine.TestCase
TestPrefixHitsMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_chain_with_a_repeated_hash_is_left_to_the_full_lookup() -> None:
    pool = Pool()
    hits = install_prefix_hit_hooks(pool, key_of, BLOCK)
    pool.cache(key_of("a"))
    assert hits.hit_blocks("r", ["a", "b", "a"]) is None
    assert hits.hit_tokens("r", ["a", "b", "a"], 13) is None
    assert hits.hit_blocks("s", ["a", "b"]) == 1
    hits.retain({"s"})
    assert len(hits) == 1


def test_an_event_touches_only_the_chains_that_hold_or_wait_for_its_key() -> None:
    seen: list[Hashable] = []
    cached: set[Hashable] = set()

    def is_cached(key: Hashable) -> bool:
        seen.append(key)
        return key in cached

    hits = PrefixHits(is_cached, lambda h: h, BLOCK)
    for r in range(100):
        assert hits.hit_blocks(f"r{r}", [f"p{r}.{i}" for i in range(50)]) == 0
    seen.clear()
    cached.update(["p7.0", "p7.1"])
    hits.on_cached("p7.0")
    hits.on_cached("p9.5")  # nobody waits for it
    assert seen == ["p7.0", "p7.1", "p7.2"]
    assert hits.hit_blocks("r7", [f"p7.{i}" for i in range(50)]) == 2
    cached.discard("p7.0")
    hits.on_uncached("p7.0")
    assert hits.hit_blocks("r7", [f"p7.{i}" for i in range(50)]) == 0


# ---- the scheduler's order over the fake vLLM --------------------------------------------------


class HashMapView:
    """The fake pool's one-block-per-key map, read as vLLM's map."""

    def __init__(self, pool: fakes.BlockPool) -> None:
        self.pool = pool

    def get_one_block(self, key: Hashable) -> Any:
        return self.pool.cached.get(key)


class FullAttentionManager:
    """vLLM's full-attention lookup: the leading cached blocks, whole blocks only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: list[Hashable], max_length: int, pool: fakes.BlockPool, block_size: int
    ) -> tuple[tuple[list[Any], ...], int]:
        hit: list[Any] = []
        for block_hash in block_hashes[: max_length // block_size]:
            block = pool.cached.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return (hit,), len(hit) * block_size


class UnitaryKVCacheCoordinator:
    def __init__(self, pool: fakes.BlockPool, block_size: int) -> None:
        self.block_pool = pool
        self.single_type_managers = (FullAttentionManager(block_size),)
        self.eagle_group_ids: set[int] = set()
        self.lookups = 0

    def find_longest_cache_hit(self, block_hashes: list[Hashable], max_length: int) -> Any:
        self.lookups += 1
        blocks, hit = FullAttentionManager.find_longest_cache_hit(
            block_hashes, max_length, self.block_pool, self.single_type_managers[0].block_size
        )
        return blocks, hit, 0


def admit_what_fits(self: fakes.Scheduler) -> Any:
    """vLLM's admission, reduced: from the front of the waiting queue while the running batch
    has room and the pool has the blocks (the first that does not fit stops it)."""
    pool = self.kv_cache_manager.block_pool
    self.admission_order.append([r.request_id for r in self.waiting])
    new = []
    while self.waiting and len(self.running) < self.max_num_running_reqs:
        request = self.waiting[0]
        self.admission_tries += 1
        _, hit, _ = self.kv_cache_manager.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        hits = [pool.cached[k] for k in request.keys[: hit // self.block_size]]
        free = pool.free_block_queue.num_free_blocks - sum(b.ref_cnt == 0 for b in hits)
        if len(request.keys) - len(hits) > free:
            break
        self.waiting.popleft()
        pool.touch(hits)
        table = hits + pool.get_new_blocks(len(request.keys) - len(hits))
        pool.cache_full_blocks(request, table, len(hits), len(table), self.block_size, 0)
        self.kv_cache_manager.tables[request.request_id] = table
        request.status = fakes.RequestStatus.RUNNING
        self.running.append(request)
        new.append(types.SimpleNamespace(req_id=request.request_id))
    return types.SimpleNamespace(scheduled_new_reqs=new)


@pytest.fixture
def sched_mod(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.delenv("ASYMCACHE_VLLM_OPTIONS", raising=False)
    module = fakes.load_scheduler_module(monkeypatch)
    for name, attrs in {
        "vllm.v1.core.kv_cache_coordinator": {
            "UnitaryKVCacheCoordinator": UnitaryKVCacheCoordinator
        },
        "vllm.v1.core.single_type_kv_cache_manager": {"FullAttentionManager": FullAttentionManager},
    }.items():
        fake = types.ModuleType(name)
        fake.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(fakes.Scheduler, "schedule", admit_what_fits)
    monkeypatch.setattr(fakes.KVCacheManager, "enable_caching", True, raising=False)
    monkeypatch.setattr(
        fakes.KVCacheManager,
        "coordinator",
        property(
            lambda m: m.__dict__.setdefault(
                "_coordinator", UnitaryKVCacheCoordinator(m.block_pool, BLOCK)
            )
        ),
        raising=False,
    )
    monkeypatch.setattr(
        fakes.BlockPool, "cached_block_hash_to_block", property(HashMapView), raising=False
    )
    return module


def make(sched_mod: types.ModuleType, options: dict[str, Any]) -> Any:
    sched = sched_mod.AsymCacheScheduler(
        fakes.vllm_config({"implicit_jobs": False, **options}), num_blocks=24
    )
    sched.admission_order = []
    sched.admission_tries = 0
    sched.max_num_running_reqs = 2
    return sched


def prompt(family: int, n: int, tail: str = "") -> list[str]:
    return [f"f{family}.{i}" for i in range(n)] + ([f"f{family}.{tail}"] if tail else [])


def drive(sched: Any) -> list[list[str]]:
    """Arrivals in waves, a step per wave, the oldest running request finishing after each:
    prompts of three families, long and short, so admissions evict each other's blocks."""
    pool = sched.kv_cache_manager.block_pool
    n = 0
    for wave in range(8):
        for size in (9, 2, 5, 3):
            family = (n * 7 + wave) % 3
            sched.add_request(
                fakes.Request(f"r{n}", prompt(family, size, f"t{n}"), arrival_time=float(n))
            )
            n += 1
        sched.schedule()
        if wave == 4:
            pool.evict_blocks(
                {b.block_id for b in pool.blocks if b.block_hash is not None and b.block_id % 2}
            )
        while sched.running and (len(sched.running) > 1 or wave % 3 == 2):
            sched.finish_requests(sched.running[0].request_id, fakes.RequestStatus.FINISHED_STOPPED)
        if wave == 6:
            while sched.running:
                sched.finish_requests(
                    sched.running[0].request_id, fakes.RequestStatus.FINISHED_STOPPED
                )
            assert pool.reset_prefix_cache()
    return sched.admission_order


@pytest.mark.parametrize("patience", [None, 0.5])
def test_least_work_order_with_tracked_hits_is_the_full_lookups_order(
    sched_mod: types.ModuleType, patience: float | None
) -> None:
    options = {"order": "least-work", "least_work_patience": patience}
    tracked = make(sched_mod, options)
    assert tracked.asymcache_prefix_hits is not None
    # the same run with every key a full lookup (the path kept where tracking is not exact)
    looked_up = make(sched_mod, options)
    looked_up.asymcache_prefix_hits = None
    order = drive(tracked)
    assert order == drive(looked_up)
    assert sum(len(step) > 2 for step in order) >= 4  # the order had choices to make
    # the tracked keys made no lookups: only admissions did
    assert tracked.kv_cache_manager.coordinator.lookups == tracked.admission_tries
    assert looked_up.kv_cache_manager.coordinator.lookups > looked_up.admission_tries + 50
