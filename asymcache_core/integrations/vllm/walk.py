"""The eviction walk of the vLLM plugin's free queue: its cached free blocks in eviction order,
lazily, changing nothing (the queue commits what it takes).

Candidates come from their score groups (:mod:`~asymcache_core.integrations.vllm.candidates`):
the walk reads the groups by their bounds and prices a group only when its bound is not above
the best exact candidate found so far, so a victim is handed out only when no unpriced group can
hold a lower ``(score, tick)``. Evicting a leaf may make its parent's blocks evictable: a
copy-on-write view of the forest (:class:`~asymcache_core.integrations.vllm.forest.ForestOverlay`)
wakes them. When nothing evictable is left, pins are released under pressure, then the deepest,
cheapest block goes (a forced orphan). The order is the full scan's
(:func:`~asymcache_core.integrations.vllm.reference.reference_plan`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

from asymcache_core.integrations.vllm.candidates import Bound, GroupRows
from asymcache_core.integrations.vllm.forest import CachedForest, ForestOverlay
from asymcache_core.integrations.vllm.scoring import GroupTerms

if TYPE_CHECKING:
    from asymcache_core.integrations.vllm.free_queue import ExpectedLatencyFreeQueue

#: Group of cached free blocks whose hash vanished without notice: they hold nothing (score -1).
HASHLESS: Hashable = ("<hashless>",)
#: The one group of a queue whose score is an opaque callable: every block is scored.
OPAQUE: Hashable = ("<opaque>",)


def chain_depth(forest: CachedForest | ForestOverlay, block_id: int) -> int:
    """Chain depth of a block's key (0 for roots and unknown keys).

    Args:
        forest: the forest (or a view of it) that links keys.
        block_id: the block.

    Returns:
        The number of parent links above its key.
    """
    depth = 0
    key = forest.key_of(block_id)
    while key is not None and depth < 1 << 20:
        key = forest.parent(key)
        depth += 1 if key is not None else 0
    return depth


def walk(
    queue: ExpectedLatencyFreeQueue, now: float
) -> Iterator[tuple[int | None, str | None, bool]]:
    """The eviction order of ``queue``'s cached free blocks at ``now``, lazily.

    Args:
        queue: the free queue (it must not change while the walk goes on).
        now: scoring time.

    Yields:
        ``(block_id, None, forced)`` per victim (``forced``: a last-resort orphan), and
        ``(None, job_id, False)`` where the order releases ``job_id``'s pin under pressure.

    Raises:
        RuntimeError: the queue changed during the walk.
    """
    scorer = queue._scorer
    cached = queue._cached
    index = queue._candidates
    memo: dict[Hashable, GroupTerms] = {}
    opaque: dict[int, float] = {}

    def terms(group: Hashable) -> GroupTerms:
        got = memo.get(group)
        if got is None:
            rows = index.groups.get(group)
            if rows is not None and rows.priced is not None and rows.priced[0] == now:
                # NOTE: priced at this very time, and re-priced on every change of its jobs.
                got = memo[group] = rows.priced[1]  # type: ignore[assignment]
            else:
                got = memo[group] = scorer.group_terms(group, now)  # type: ignore[union-attr, arg-type]
        return got

    def order_of(group: Hashable) -> str:
        return "flat" if group is HASHLESS else "exact" if scorer is None else terms(group).order

    def price(group: Hashable, rows: GroupRows, at: float, level: float) -> Bound:
        if group is HASHLESS:
            return Bound(-1.0, -math.inf, math.inf, False, False)
        if scorer is None:
            return Bound(-math.inf, -math.inf, math.inf, False, False)
        head = rows.by_position[0]
        got = scorer.group_bound(group, head[0], at, level, fresh.pop(group, None))  # type: ignore[arg-type]
        memo[group] = got.terms
        rows.priced = (at, got.terms)
        order = got.terms.order
        tick: float = -math.inf
        if got.exact and order != "exact":
            # NOTE: the group's lowest (score, tick): its first row by position (strict) or by
            # recency (flat); an "exact" group's rounding may tie a deeper block with it.
            tick = head[1] if order == "strict" else rows.by_tick[0][0]
        return Bound(got.score, tick, got.until, got.exact, got.reads_global)

    if scorer is None or not scorer.watching():
        index.dirty.update(index.groups)  # NOTE: no job events reach us: price every group
    fresh: dict[Hashable, GroupTerms] = {}
    if index.level == -math.inf and scorer is not None and index.dirty:
        # NOTE: no victim yet, so no level to pick horizons by: the lowest group's score now
        # is about where the first victims will be (without it every bound would be short).
        lowest = math.inf
        for group in index.dirty:
            rows = index.groups.get(group)
            if rows is not None:
                got = fresh[group] = scorer.group_terms(group, now)  # type: ignore[arg-type]
                lowest = min(lowest, scorer.score_at(got, rows.by_position[0][0]))
        index.level = lowest if lowest < math.inf else -math.inf
    index.refresh(now, price)
    version = queue._version
    view = ForestOverlay(queue.forest)
    explored = queue._explored
    explored.clear()

    def score(block_id: int, group: Hashable) -> float:
        if group is HASHLESS:
            return -1.0  # NOTE: a block whose hash vanished while free holds nothing.
        if scorer is None:
            got = opaque.get(block_id)
            if got is None:
                got = opaque[block_id] = queue.score(cached[block_id][1], now)
            return got
        return scorer.score_at(terms(group), scorer.position(block_id))

    def explore(group: Hashable, rows: GroupRows) -> Iterator[tuple[float, int, int]]:
        """A group's live candidates as ``(score, tick, block_id)``, in order."""
        order = order_of(group)
        if order == "exact":
            # NOTE: the score's order by position is not certain: score every block.
            live = [(score(r[1], group), r[0], r[1]) for r in rows.by_tick if index.live_row(r)]
            yield from sorted(live)
            return
        heap: list = rows.by_position if order == "strict" else rows.by_tick
        # NOTE: a heap read in order without popping (the walk must not change it).
        front = [(heap[0], 0)] if heap else []
        while front:
            row, i = heapq.heappop(front)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(front, (heap[child], child))
            if index.live_row(row):
                block_id = row[-2]
                yield (score(block_id, group), cached[block_id][0], block_id)

    # (score, tick, block_id, sequence, source): the next candidate of each priced group
    # (source: the group's reader, or the group itself while only its head was read), and
    # blocks considered one by one (source None).
    frontier: list[tuple[float, int, int, int, object]] = []
    seq = itertools.count()

    def advance(source: Iterator[tuple[float, int, int]]) -> None:
        got = next(source, None)
        if got is not None:
            heapq.heappush(frontier, (*got, next(seq), source))

    def enter(group: Hashable, rows: GroupRows) -> None:
        """Puts a group's first candidate on the frontier."""
        explored.append(group)
        order = order_of(group)
        heap: list = rows.by_position if order == "strict" else rows.by_tick
        if order != "exact" and heap and index.live_row(heap[0]):
            # NOTE: a group's head is its heap's top (leaving candidates trim the tops): no
            # reader until the head goes.
            block_id = heap[0][-2]
            heapq.heappush(
                frontier,
                (score(block_id, group), cached[block_id][0], block_id, next(seq), (group, rows)),
            )
        else:
            advance(explore(group, rows))

    groups = index.by_bound()
    upcoming = next(groups, None)
    taken: set[int] = set()
    waiting: dict[Hashable, list[int]] = {}
    pressure: list[tuple[str, tuple[int, ...]]] | None = None
    still_pinned: set[int] | None = None

    def pinned(block_id: int) -> bool:
        if queue.pins is None:
            return False
        return (
            queue.pins.holds_block(block_id) if still_pinned is None else block_id in still_pinned
        )

    def consider(block_id: int) -> None:
        if block_id in taken or block_id not in cached or pinned(block_id):
            return
        tick, block = cached[block_id]
        key = queue._index_key[block_id]
        if block.block_hash is None or view.evictable(key):
            group = queue._group_key(block_id)
            heapq.heappush(frontier, (score(block_id, group), tick, block_id, next(seq), None))
        else:
            waiting.setdefault(key, []).append(block_id)

    def wake(block_id: int) -> None:
        """``block_id`` went: its parent's blocks may be candidates now."""
        parent = view.remove(block_id)
        if parent is not None and view.evictable(parent):
            ids = waiting.pop(parent, []) + [
                b for b in queue._key_blocks.get(parent, ()) if b not in taken
            ]
            for other in ids:
                consider(other)

    while len(taken) < len(cached):
        if queue._version != version:
            raise RuntimeError("the free queue changed during a walk of its order")
        # NOTE: a group whose bound is not above the frontier's best may hold a lower (score,
        # tick): price it first. Above it, no block of an unpriced group can come earlier.
        while upcoming is not None and (not frontier or upcoming[:2] <= frontier[0][:2]):
            enter(upcoming[2], upcoming[3])
            upcoming = next(groups, None)
        if frontier:
            got, _, block_id, _, source = heapq.heappop(frontier)
            if isinstance(source, tuple):
                source = explore(*source)
                next(source)  # NOTE: the head just popped
            if source is not None:
                advance(source)  # type: ignore[arg-type]
            if block_id in taken or (source is not None and pinned(block_id)):
                continue  # NOTE: a pinned row (pins without a listener) comes back with its pin
            key = view.key_of(block_id)
            if key is not None and not view.evictable(key):
                # NOTE: a copy of its key went earlier in this walk; wait for the children.
                waiting.setdefault(key, []).append(block_id)
                continue
            taken.add(block_id)
            index.level = got
            yield (block_id, None, False)
            wake(block_id)
            continue
        if pressure is None:
            pressure = list(queue.pins.pressure_order()) if queue.pins is not None else []
        if pressure:
            job_id, block_ids = pressure.pop(0)
            yield (None, job_id, False)
            still_pinned = {b for _, ids in pressure for b in ids}
            for block_id in block_ids:
                consider(block_id)
            continue
        # Last resort: nothing evictable is left; the deepest, cheapest block goes.
        rest = [b for b in cached if b not in taken]
        victim = min(
            rest,
            key=lambda b: (-chain_depth(view, b), score(b, queue._group_key(b)), cached[b][0], b),
        )
        for ids in waiting.values():
            if victim in ids:
                ids.remove(victim)
        taken.add(victim)
        yield (victim, None, True)
        wake(victim)
