"""The randomized drivers' shared moves over a :class:`FakePool` with the plugin's free queue:
the whole order checked against the full scan, and one turn of request churn."""

from __future__ import annotations

import random
from collections.abc import Callable

from test_vllm_plugin_unit import FakePool, chain, pin

from asymcache_core.integrations.vllm import PinSet
from asymcache_core.integrations.vllm.reference import reference_plan


def check_whole_order(pool: FakePool, compared: dict[str, int]) -> None:
    """The queue's whole dry run equals the full scan of every cached block (``compared["orders"]``
    counts the checks)."""
    queue = pool.queue
    if not queue._cached:
        return
    want = reference_plan(queue, len(queue._cached), pool.clock(), pool.forest.copy())[0]
    order = [b.block_id for b in queue.get_all_free_blocks()][len(queue._uncached) :]
    assert order == want
    compared["orders"] += 1


def churn(
    pool: FakePool,
    pins: PinSet,
    rng: random.Random,
    live: list[tuple[str, str | None]],
    step: int,
    prefixes: list[list[str]],
    finish: bool,
    pick_job: Callable[[], str | None],
    last_share: float,
    pin_share: float,
) -> None:
    """One turn: with ``finish`` a live request ends (its job's last step with ``last_share``,
    else pinned with ``pin_share``), otherwise a new one runs on a shared prefix (when its blocks
    fit)."""
    if finish:
        req, job = live.pop(rng.randrange(len(live)))
        last = rng.random() < last_share
        ids = [b.block_id for b in pool.tables[req] if b.block_hash is not None]
        pool.finish(req, job=job, last_step=last)
        if job is not None and not last and rng.random() < pin_share:
            pin(pins, job, ids, ttl_s=rng.uniform(0.5, 3.0), now=pool.clock())
        return
    job = pick_job()
    p = rng.randrange(3)
    keys = prefixes[p] + chain(f"{job}_{p}_{rng.randrange(3)}_", rng.randint(1, 4))
    if len(keys) + 1 > pool.queue.num_free_blocks:
        return
    pool.run(f"r{step}", keys, job=job, partial=rng.random() < 0.5)
    live.append((f"r{step}", job))
