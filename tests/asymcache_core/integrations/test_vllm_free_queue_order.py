"""The free queue's grouped walk gives the full scan's order (every block scored), and its lazy
dry run reads no more than it is asked for (no vLLM needed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from free_queue_churn import check_whole_order, churn
from test_vllm_plugin_unit import BLOCK, FakePool, chain, check_every_pop, count_pricings, pin

from asymcache_core.integrations.vllm import BlockScorer, ExpectedLatencyFreeQueue, PinSet
from asymcache_core.latency_model import LatencyModel

MODELS = {
    # the score grows with position: groups are read by position
    "strict": LatencyModel(floor_s=1e-3, per_token_s=1e-5, per_attn_s=1e-8, knee_tokens=64),
    # no attention term: every position of a group scores the same (recency order)
    "flat": LatencyModel(floor_s=1e-3, per_token_s=1e-5, per_attn_s=0.0, knee_tokens=0),
    # a slope too small to order positions in floating point: every block is scored
    "exact": LatencyModel(floor_s=1e-3, per_token_s=1.0, per_attn_s=1e-300, knee_tokens=0),
}


class UnwatchedPins:
    """A pin registry without a ``listener``: the queue must skip its pinned blocks itself."""

    def __init__(self, pins: PinSet) -> None:
        self._pins = pins

    def __getattr__(self, name: str) -> Any:
        if name == "listener":
            raise AttributeError(name)
        return getattr(self._pins, name)


def _pool(model: str, opaque: bool, watched: bool, seed: int) -> tuple[FakePool, PinSet]:
    pins = PinSet(capacity_blocks=8)
    pool = FakePool(28, pins)
    pool.scorer = BlockScorer(pool.job_stats, MODELS[model], BLOCK)
    score = (lambda b, now: pool.scorer.score(b, now)) if opaque else pool.scorer.score
    view = pins if watched else UnwatchedPins(pins)
    pins.listener = None  # NOTE: FakePool's own queue lets go of the pins
    pool.queue = ExpectedLatencyFreeQueue(pool.blocks, score, pool.clock, pool.forest, view)  # type: ignore[arg-type]
    return pool, pins


@pytest.mark.parametrize(
    ("model", "opaque", "watched", "seed"),
    [("strict", False, True, s) for s in range(4)]
    + [("flat", False, True, 0), ("exact", False, True, 1), ("strict", True, True, 2), ("strict", False, False, 3)],
)
def test_every_pop_is_the_full_scan_order(model: str, opaque: bool, watched: bool, seed: int) -> None:
    rng = random.Random(seed)
    pool, pins = _pool(model, opaque, watched, seed)
    queue = pool.queue
    compared = {"pops": 0, "orders": 0}
    check_every_pop(pool, pins, compared)
    prefixes = [chain(f"sys{i}_", rng.randint(1, 3)) for i in range(3)]
    live: list[tuple[str, str]] = []
    for step in range(150):
        pool.clock.t += rng.uniform(0.0, 2.0)
        if step % 10 == 0:
            check_whole_order(pool, compared)
        # NOTE: the finish draw comes first only with requests live (the rng's order of before)
        finish = bool(live) and (rng.random() < 0.5 or queue.num_free_blocks < 8)
        churn(pool, pins, rng, live, step, prefixes, finish, lambda: f"j{rng.randrange(6)}", 0.2, 0.5)
    assert queue.stats.evicted_cached > 10 and compared["pops"] > 20 and compared["orders"] > 5


def test_pinned_blocks_are_never_candidates_and_come_back_unpinned() -> None:
    pins = PinSet(capacity_blocks=8)
    pool = FakePool(6, pins)
    pool.run("a", chain("a", 3), job="a")
    pool.finish("a", job="a")
    pin(pins, "a", [0, 1, 2], ttl_s=5.0, now=pool.clock())
    assert not set(pool.queue._cand) & {0, 1, 2}
    pins.unpin("a")
    assert 2 in pool.queue._cand  # the leaf is a candidate again


def test_a_dry_run_reads_only_what_is_taken() -> None:
    pool = FakePool(40)
    for j in range(10):
        pool.run(f"r{j}", chain(f"c{j}_", 4), job=f"j{j}")
        pool.finish(f"r{j}", job=f"j{j}")
    calls = count_pricings(pool.scorer)
    full = [b.block_id for b in pool.queue.get_all_free_blocks()]
    walk = pool.queue.iter_blocks_after(None)
    first = [next(walk).block_id for _ in range(3)]
    assert first == full[:3]
    # one price per group: the walk does not score block by block
    assert calls["n"] <= 2 * 10
    after = [b.block_id for b in pool.queue.iter_blocks_after(pool.blocks[full[4]])]
    assert after == full[5:]
    pool.queue.remove(pool.blocks[full[0]])
    with pytest.raises(RuntimeError):
        next(walk)  # the queue changed under the walk


def test_forest_links_stay_bounded_under_churn() -> None:
    pool = FakePool(16)
    sizes = []
    for n in range(300):
        keys = chain(f"conv{n}_", 3)  # every conversation new: its hashes never come back
        pool.run(f"r{n}", ["sys0", *keys], job=f"j{n % 7}")
        pool.finish(f"r{n}", job=f"j{n % 7}")
        sizes.append(len(pool.forest._parent))
        # a link is kept exactly while its key is cached or has a cached child
        for key in pool.forest._parent:
            assert pool.forest.copies(key) or pool.forest.children(key)
    assert max(sizes) <= 16 + 1 and pool.reachable_violations() == []
    # links come back when a pruned chain is cached again: its parent counts its children
    pool.run("again", ["sys0", *chain("conv0_", 3)], job="j0")
    assert pool.forest.parent("conv0_0") == "sys0" and pool.forest.children("conv0_1") == 1
    pool.finish("again", job="j0")
    pool.forest.clear()
    assert pool.forest._parent == {}
