"""Each waiting request's cache hit, kept current from the pools' changes (``least_work_first``).

The least-work order sorts the waiting queue by the tokens each request still has to compute,
so it needs every waiting request's ``KVCacheManager.lookup(request).hit_tokens`` on every step
that can admit. A full lookup walks the request's whole context (with hole reuse or a host tier
it does not stop at the first miss): at 128 SWE agents it was most of a step's host work.
:class:`WaitingHits` keeps the answer instead, and changes it only where a block of the
request's own hash chain changes on a tier:

- the device pool or the host tier caches a hash, or drops it (an eviction, a failed step's
  ``uncache``, a cache reset): each tracked request holding that hash among the blocks a lookup
  may find (:meth:`KVCacheManager.hit_limit`) updates its counts;
- the request's context grows while it waits (a token of a step in flight, with async
  scheduling) or its prompt log probabilities advance: the bound moves, and the blocks past the
  old one are indexed at the next question.

Per request it keeps, over those blocks, where each one is (device, host, both, neither) and
the counts a lookup would find: the device hits, the hits on either tier, the host-only hits and
the first block on neither tier (prefix-only mode ends there). The answer is then, as
:meth:`KVCacheManager.lookup` computes it:

- no host tier: the device hits (hole reuse), or the leading ones (prefix-only);
- host tier, prefix-only: the leading blocks found on either tier (every host hit reloads);
- host tier, hole reuse, reload for all: every block found on either tier;
- host tier, hole reuse, reload by cost: every block found on either tier less the runs of
  host-only blocks that cost less to recompute than to copy back
  (:meth:`KVCacheManager.cheap_host_runs`, the lookup's own pricing). The price of a run
  depends on its place and length and on the request's length and hits, so the runs are priced
  again only when one of the request's blocks moved or its length changed since (the latency
  model is frozen).

A request whose chain holds a hash twice (a 64-bit hash collision: its index cannot tell the
two blocks apart) answers ``None``: the caller does the full lookup.

A request joins when it enters the waiting queue (:meth:`WaitingHits.join`: on arrival and
after a preemption) and leaves when it is admitted, aborted or finished
(:meth:`WaitingHits.leave`). Its blocks are indexed at its first question, so a request
admitted before the queue is ever sorted costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import contains, lshift, or_

from asymcache_core.block_pool import BlockPool, KVBlock
from asymcache_core.kv_cache_manager import KVCacheManager
from asymcache_core.request import Request

DEVICE = 1
"""State bit of a block cached in the device pool."""
HOST = 2
"""State bit of a block cached in the host tier."""


@dataclass(eq=False, slots=True)
class _Entry:
    """One waiting request's blocks and the counts of a lookup over them.

    Attributes:
        request: the request.
        keys: the hashes of its indexed blocks (the first ``hit_limit`` blocks at its last
            question), each in :attr:`WaitingHits._index` with its position.
        state: per indexed block, ``DEVICE | HOST`` bits of where it is cached.
        num_device: blocks on the device.
        num_any: blocks on either tier.
        num_host_only: blocks on the host and not on the device.
        first_miss: the first block on neither tier (``len(state)``: none).
        exact: False when the chain holds a hash twice (a collision): a full lookup answers.
        registered: its blocks are indexed (at its first question).
        version: bumped whenever ``state`` changes (the host runs' pricing is kept for it).
        priced: ``(version, num_tokens)`` that ``recomputed`` was priced for.
        recomputed: blocks on the host only that the lookup would recompute, not reload.
    """

    request: Request
    keys: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    num_device: int = 0
    num_any: int = 0
    num_host_only: int = 0
    first_miss: int = 0
    exact: bool = True
    registered: bool = False
    version: int = 0
    priced: tuple[int, int] | None = None
    recomputed: int = 0


def _next_miss(state: list[int], start: int) -> int:
    """The first index from ``start`` on whose block is on neither tier, or ``len(state)``."""
    try:
        return state.index(0, start)
    except ValueError:
        return len(state)


class _TierListener:
    """Tells the tracker when a pool's hash map gains or loses a hash (one per tier).

    A :class:`~asymcache_core.block_pool.BlockListener`: every change to ``BlockPool.cached``
    goes through ``cache_block`` (``on_cached``), an eviction (``on_evict``, the hash still set)
    or ``uncache`` (``on_uncache``, the hash still set).
    """

    def __init__(self, hits: WaitingHits, pool: BlockPool, bit: int) -> None:
        self.hits = hits
        self.pool = pool
        self.bit = bit

    def on_cached(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.hits._changed(block.block_hash, self.bit, True)

    def on_candidate(self, block: KVBlock) -> None:
        """Nothing: a candidate is still cached."""

    def on_evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.hits._changed(block.block_hash, self.bit, False)

    def on_uncache(self, block_id: int) -> None:
        block_hash = self.pool.blocks[block_id].block_hash
        if block_hash is not None:
            self.hits._changed(block_hash, self.bit, False)


class WaitingHits:
    """Per waiting request, the ``hit_tokens`` that ``kv.lookup(request)`` would return now.

    Args:
        kv: the cache manager whose lookup it answers for; its device pool and host tier (if
            any) get a listener that feeds the tracker.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._entries: dict[str, _Entry] = {}
        # hash -> {entry: the hash's position in the entry's chain}, for the indexed blocks
        self._index: dict[int, dict[_Entry, int]] = {}
        kv.pool.listeners.append(_TierListener(self, kv.pool, DEVICE))
        if kv.tier is not None:
            kv.tier.pool.listeners.append(_TierListener(self, kv.tier.pool, HOST))
        #: questions answered from the counts / left to a full lookup (tests and profiling)
        self.num_tracked_answers = 0
        self.num_lookup_answers = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._entries

    # -- membership ------------------------------------------------------------------------
    def join(self, request: Request) -> None:
        """``request`` entered the waiting queue (its blocks are indexed at its first question).

        A request that is tracked already starts over (its chain is indexed again).
        """
        self.leave(request)
        self._entries[request.request_id] = _Entry(request)

    def leave(self, request: Request) -> None:
        """``request`` left the waiting queue (admitted, aborted or finished); no-op if untracked."""
        entry = self._entries.pop(request.request_id, None)
        if entry is not None and entry.registered:
            self._unindex(entry, 0)

    # -- the answer ------------------------------------------------------------------------
    def hit_tokens(self, request: Request) -> int | None:
        """The tokens ``kv.lookup(request)`` would find cached now.

        Returns:
            The tokens; ``None`` for a request that is not tracked or whose chain holds a hash
            twice: the caller does the full lookup then.
        """
        entry = self._entries.get(request.request_id)
        if entry is None:
            return None
        kv = self.kv
        limit = kv.hit_limit(request)  # NOTE: extends the request's hashes if its tokens grew
        if limit < 0:
            return None  # NOTE: no tokens at all: the lookup's own answer stands
        keys = entry.keys
        hashes = request.block_hashes
        if keys and (len(hashes) < len(keys) or hashes[len(keys) - 1] != keys[-1]):
            # NOTE: a chain is named by its last hash (each chains on its parent's): another
            # one means the request's hashes were replaced, not extended
            self._unindex(entry, 0)
        if limit < len(entry.state):
            self._unindex(entry, max(limit, 0))
        if limit > len(entry.state):
            self._index_from(entry, len(entry.state), limit)
        entry.registered = True
        if not entry.exact:
            self.num_lookup_answers += 1
            return None
        if kv.tier is None:
            blocks = entry.num_device if kv.hole_reuse else entry.first_miss
        elif not kv.hole_reuse:
            blocks = entry.first_miss
        elif not kv.reload_by_cost:
            blocks = entry.num_any
        elif entry.num_host_only:
            # NOTE: each run of host-only blocks is reloaded or recomputed by its cost, which
            # depends on its place and length and on the request's length and hits: priced
            # again only when one of its blocks moved or its length changed.
            priced = (entry.version, request.num_tokens)
            if entry.priced != priced:
                state = entry.state
                on_host = list(compress(range(len(state)), map(HOST.__eq__, state)))
                runs = kv.cheap_host_runs(request.num_tokens, entry.num_any, on_host)
                entry.recomputed = sum(j - i for i, j in runs)
                entry.priced = priced
            blocks = entry.num_any - entry.recomputed
        else:
            blocks = entry.num_device
        self.num_tracked_answers += 1
        return blocks * kv.block_size

    # -- index -----------------------------------------------------------------------------
    def _index_from(self, entry: _Entry, start: int, limit: int) -> None:
        """Indexes blocks ``start`` to ``limit`` of ``entry``'s chain (``start == len(state)``)."""
        new = entry.request.block_hashes[start:limit]
        index = self._index
        for position, block_hash in enumerate(new, start):
            holders = index.get(block_hash)
            if holders is None:
                index[block_hash] = {entry: position}
            elif entry in holders:
                entry.exact = False  # NOTE: a repeated hash: its first position stays indexed
            else:
                holders[entry] = position
        state = list(map(contains, repeat(self.kv.pool.cached), new))
        num_device = sum(state)
        tier = self.kv.tier
        if tier is not None:
            on_host = map(lshift, map(contains, repeat(tier.pool.cached), new), repeat(1))  # 0 or HOST
            state = list(map(or_, state, on_host))
            num_any = len(state) - state.count(0)
            num_host_only = state.count(HOST)
        else:
            state = list(map(int, state))
            num_any = num_device
            num_host_only = 0
        at_end = entry.first_miss == len(entry.state)
        entry.keys.extend(new)
        entry.state.extend(state)
        entry.num_device += num_device
        entry.num_any += num_any
        entry.num_host_only += num_host_only
        entry.version += 1
        if at_end:
            entry.first_miss = _next_miss(entry.state, start)

    def _unindex(self, entry: _Entry, start: int) -> None:
        """Drops blocks from ``start`` on of ``entry``'s chain from the index and its counts."""
        index = self._index
        for position in range(start, len(entry.keys)):
            block_hash = entry.keys[position]
            holders = index.get(block_hash)
            if holders is not None and holders.get(entry) == position:
                del holders[entry]
                if not holders:
                    del index[block_hash]
        if start == 0:
            entry.num_device = entry.num_any = entry.num_host_only = 0
        else:
            dropped = entry.state[start:]
            entry.num_device -= sum(map(DEVICE.__and__, dropped))
            entry.num_any -= len(dropped) - dropped.count(0)
            entry.num_host_only -= dropped.count(HOST)
        del entry.keys[start:]
        del entry.state[start:]
        entry.version += 1
        entry.first_miss = min(entry.first_miss, start)
        if start == 0:
            # NOTE: a chain indexed again from its start rechecks its hashes for repeats
            entry.exact = True

    def _changed(self, block_hash: int, bit: int, present: bool) -> None:
        """A tier (``bit``) gained (``present``) or lost ``block_hash``."""
        holders = self._index.get(block_hash)
        if holders is None:
            return
        for entry, position in holders.items():
            state = entry.state
            old = state[position]
            new = old | bit if present else old & ~bit
            if new == old:
                continue
            state[position] = new
            entry.version += 1
            if bit == DEVICE:
                entry.num_device += 1 if present else -1
            if not old:
                entry.num_any += 1
                if position == entry.first_miss:
                    entry.first_miss = _next_miss(state, position + 1)
            elif not new:
                entry.num_any -= 1
                if position < entry.first_miss:
                    entry.first_miss = position
            entry.num_host_only += (new == HOST) - (old == HOST)

    def check(self) -> None:
        """Raises ``AssertionError`` when a tracked request's answer differs from a full lookup
        (tests)."""
        for entry in list(self._entries.values()):
            tracked = self.hit_tokens(entry.request)
            if tracked is not None:
                looked_up = self.kv.lookup(entry.request).hit_tokens
                assert tracked == looked_up, f"{entry.request.request_id}: tracked {tracked}, lookup {looked_up}"
