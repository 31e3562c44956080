"""KV cache manager: hash-chain lookup with holes, per-request block tables, allocation.

Block hashes chain over every earlier token, so a cached block after a missing one still holds
the exact K/V of its tokens at their positions (K/V of token i depend only on tokens <= i).
With ``hole_reuse`` the lookup keeps every hit; the scheduler then recomputes only the holes.
Without it, the lookup stops at the first miss, as vLLM's ``find_longest_cache_hit`` does.

The scheduler asks for blocks with two calls: :meth:`KVCacheManager.try_admit` for a waiting
request (lookup, room check, references on its hits, fresh blocks) and
:meth:`KVCacheManager.try_allocate` for a running one. Both return an :class:`Allocation`, or
``None`` and change nothing when the blocks do not fit.

With a host tier (:mod:`asymcache_core.host_tier`) a block missing on the device may be found on
the host: the lookup then either reloads each run of such blocks or recomputes it as a hole, by
cost (``reload_by_cost``, with hole reuse) or always reloads (prefix-only, as vLLM's offloading
connector does). A request admitted with reloads holds its blocks at once and runs once its
copies are complete (``Request.kv_ticket``); the step's copies go out in its plan
(:meth:`KVCacheManager.take_transfers`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from itertools import compress, repeat
from operator import is_not

from asymcache_core.block_pool import BlockPool
from asymcache_core.host_tier import HostTier, KVTransfers

# NOTE: re-exported: the hashes and the typed results are the manager's own interface
from asymcache_core.kv_cache_types import (  # noqa: F401
    _ROOT_HASH,
    RELOAD,
    Allocation,
    CacheHit,
    CommitHook,
    chain_hash,
    salted_root,
)
from asymcache_core.request import HOLE, Request


class KVCacheManager:
    """Maps requests to blocks of the :class:`BlockPool`.

    Args:
        pool: the block pool.
        block_size: tokens per block.
        hole_reuse: keep hits after a miss.
        tier: the host KV tier, or ``None``.
        reload_by_cost: choose reload or recompute per run of host hits by cost (default: with
            hole reuse; without it, a recomputed run would end the prefix): else reload all.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        hole_reuse: bool,
        tier: HostTier | None = None,
        reload_by_cost: bool | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hole_reuse = hole_reuse
        self.tier = tier
        self.reload_by_cost = hole_reuse and (reload_by_cost is None or reload_by_cost)
        #: device block -> ticket of the copy loading it (until that ticket completes)
        self.loading: dict[int, int] = {}
        #: prefetched device blocks held until their ticket completes: (ticket, blocks)
        self._prefetch_held: list[tuple[int, list[int]]] = []
        #: told ``(block hash, parent hash or None, tokens, extra keys)`` of each block
        #: :meth:`commit` caches (a KV event publisher: the pool knows hashes, not tokens); the
        #: extra keys are what the hash covers besides the parent and the tokens (``(salt,)`` on
        #: a salted chain's first block, else ``None``); ``None``: nobody
        self.on_commit: CommitHook | None = None

    # -- hashing ---------------------------------------------------------------------------
    def ensure_hashes(self, request: Request) -> list[int]:
        """Extends ``request.block_hashes`` to every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        full = len(tokens) // bs
        if len(hashes) >= full:
            return hashes  # NOTE: the usual case: every commit and every gated waiting request
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else salted_root(request.params.cache_salt)
            hashes.append(chain_hash(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes

    # -- lookup and admission --------------------------------------------------------------
    def hit_limit(self, request: Request) -> int:
        """Logical blocks of ``request`` a lookup may find: its full blocks (hashed), less the
        block of its last token and any block at or past ``prompt_logits_from``.

        NOTE: the waiting-hit tracker (:mod:`asymcache_core.waiting_hits`) watches exactly
        these blocks, so the two read the same bound.
        """
        hashes = self.ensure_hashes(request)
        # NOTE: the last token must run to produce logits, so its block is never taken from cache.
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        logits_from = request.prompt_logits_from
        if logits_from is not None:
            # NOTE: the prompt's log probabilities need the logits of every position from there
            # on (vLLM skips the prefix cache for such requests; here only what is uncomputed)
            max_blocks = min(max_blocks, logits_from // self.block_size)
        return max_blocks

    def lookup(self, request: Request) -> CacheHit:
        """Finds the cached blocks of ``request``'s context (the last token is never a hit)."""
        max_blocks = self.hit_limit(request)
        hashes = request.block_hashes
        # NOTE: a waiting request's walk covers its whole context on every step it waits (with
        # a host tier or hole reuse it does not stop at the first device miss), so it runs in C:
        # ``map`` of the hash maps' own ``get`` and ``compress`` over the misses; Python turns
        # only per host copy (SWE on a binding pool with a 64 GB tier: block by block, the
        # lookup was 40% of a simulated run's host time).
        hs = hashes[:max_blocks]
        table: list[int] = list(map(self.pool.cached.get, hs, repeat(HOLE)))
        on_host: list[int] = []  # logical indices found on the host only, ascending
        slots: list[int] = []
        if self.tier is not None and HOLE in table:
            misses = list(compress(range(len(table)), map(HOLE.__eq__, table)))
            found = list(map(self.tier.pool.cached.get, [hs[i] for i in misses]))
            kept = list(map(is_not, found, repeat(None)))
            on_host = list(compress(misses, kept))
            slots = list(compress(found, kept))
            for i in on_host:
                table[i] = RELOAD
        skipped = 0
        if not self.hole_reuse and HOLE in table:
            # prefix-only: the walk ends at the first block on neither tier; the device hits
            # past it are unusable
            stop = table.index(HOLE)
            rest = table[stop + 1 :]
            skipped = len(rest) - rest.count(HOLE) - rest.count(RELOAD)
            del table[stop:]
            del slots[bisect_left(on_host, stop) :]
            del on_host[len(slots) :]
        recomputed = 0
        if on_host and self.reload_by_cost:
            recomputed = self._recompute_cheap_runs(request, table, on_host)
        while table and table[-1] == HOLE:
            table.pop()
        reloads = dict(zip(on_host, slots, strict=True))
        if recomputed:
            reloads = {i: slot for i, slot in reloads.items() if i < len(table) and table[i] == RELOAD}
        holes = table.count(HOLE)
        leading = table.index(HOLE) if holes else len(table)
        bs = self.block_size
        return CacheHit(
            block_table=table,
            leading_tokens=leading * bs,
            hit_tokens=(len(table) - holes) * bs,
            hole_tokens=holes * bs,
            skipped_hit_tokens=skipped * bs,
            reloads=reloads,
            host_recomputed_tokens=recomputed * bs,
        )

    def _recompute_cheap_runs(self, request: Request, table: list[int], on_host: list[int]) -> int:
        """Turns each run of ``RELOAD`` entries whose recomputation costs less than its copy
        into holes (:meth:`cheap_host_runs`); returns the blocks turned. ``on_host``: the
        ``RELOAD`` indices, ascending."""
        turned = 0
        for i, j in self.cheap_host_runs(request.num_tokens, len(table) - table.count(HOLE), on_host):
            table[i:j] = [HOLE] * (j - i)
            turned += j - i
        return turned

    def cheap_host_runs(self, num_tokens: int, present: int, on_host: list[int]) -> list[tuple[int, int]]:
        """The runs of host-only blocks that cost less to recompute than to copy back.

        A run of ``n`` blocks from logical index ``i`` costs ``n`` block rebuilds under the
        latency model (their attention grows with the position; the step they join holds the
        request's own new tokens and at least the model's knee), against
        :meth:`HostTier.reload_seconds` of ``n`` blocks.

        Args:
            num_tokens: the request's tokens.
            present: its blocks found on either tier.
            on_host: the logical indices of its blocks found on the host only, ascending.

        Returns:
            ``(start, end)`` logical block ranges to recompute, ascending.
        """
        assert self.tier is not None
        bs = self.block_size
        # NOTE: a recomputed run joins a step that others fill too: under load the step is past
        # its knee and every token costs the per-token rate. Priced as if its request were alone
        # in the step (the tokens under the knee almost free), recomputation won the choice for
        # 15,819 blocks of a BFCL run (simulated H200, 800 device blocks, a 3,200-block tier,
        # 48 agents) and cost 21% of its mean job time (10.35 s against 8.15 s priced past the
        # knee; copying every host hit back: 8.20 s).
        base = max(num_tokens - present * bs, self.tier.latency.knee_tokens)
        fixed, slope = self.tier.latency.block_rebuild_line(bs, base)
        runs: list[tuple[int, int]] = []
        k = 0
        while k < len(on_host):
            # the run of consecutive indices on_host[k:m] is table[i:j]
            m = k + 1
            while m < len(on_host) and on_host[m] == on_host[m - 1] + 1:
                m += 1
            i, j = on_host[k], on_host[m - 1] + 1
            n = j - i
            recompute_s = n * fixed + slope * (i + j - 1) * n / 2
            if recompute_s < self.tier.reload_seconds(n):
                runs.append((i, j))
            k = m
        return runs

    def try_admit(
        self,
        request: Request,
        plan: Callable[[Request], list[tuple[int, int]]],
        *,
        reserve_prompt: bool = False,
        reclaim: Callable[[], bool] | None = None,
        on_hold: Callable[[Request], None] | None = None,
    ) -> Allocation | None:
        """Admits a waiting request in one call: lookup, room check, hits held, blocks taken.

        Args:
            request: a waiting request (no blocks held).
            plan: its segments for this step once its cache hits are installed as its table
                and frontier (the scheduler's chunking under the step's remaining budget).
            reserve_prompt: the room checked is for the whole rest of its context, not only
                this step's segments.
            reclaim: frees pinned blocks under pressure; retried while it succeeds and the
                request does not fit (False: nothing left to release).
            on_hold: called once the hits are held and before the fresh blocks are taken.

        Returns:
            The allocation; ``None`` when the plan is empty or the blocks do not fit, and then
            the request holds nothing and its table is empty again.
        """
        hit = self.lookup(request)
        # NOTE: as in vLLM, check the room before taking references: a request that does not
        # fit leaves its cached blocks where they were in the eviction order (holding and
        # releasing them would refresh them, protecting a waiting request's blocks under
        # every policy). The hits are installed without references so the plan sees them.
        self._install(request, hit)
        segments = plan(request)
        if not segments:  # the budget's remainder is less than a whole block
            self._uninstall(request)
            return None
        needed = self.blocks_needed(request, segments)
        # NOTE: room for the whole prompt (vLLM's default) when the scheduler asks for it (others
        # run): the first chunk alone lets several long prefills in that then preempt each other.
        reserve = needed
        if reserve_prompt:
            reserve = self.blocks_needed(request, [(request.num_computed_tokens, request.num_tokens)])
        short = not self._fits(reserve, hit)
        while short and reclaim is not None and reclaim():
            short = not self._fits(reserve, hit)
        if short:
            self._uninstall(request)
            return None
        held = [b for b in hit.block_table if b >= 0]
        self.pool.touch(held, request.job_id)
        if self.tier is not None:
            # NOTE: counted here, once per admission: lookups also run for requests that wait.
            self.tier.counters.recompute_chosen += hit.host_recomputed_tokens // self.block_size
        if on_hold is not None:
            # NOTE: before the fresh blocks are taken: what the hook releases (a pin on the
            # job's blocks that this request does not hold) may serve this allocation.
            on_hold(request)
        tickets = [self.loading[b] for b in held if b in self.loading]
        if hit.reloads:
            tickets.append(self._reload(request, hit.reloads))
        if tickets:
            # NOTE: no fresh blocks yet: the planner skips every block in the table from the
            # frontier on, so blocks taken now for segments that run later would read as hits.
            # They are taken when the request is planned, once its copies are complete.
            request.kv_ticket = max(tickets)
            return Allocation(segments, [], hit, deferred=True)
        return Allocation(segments, self._allocate(request, needed), hit)

    def _reload(self, request: Request, reloads: dict[int, int]) -> int:
        """Gives the ``RELOAD`` entries of ``request``'s table fresh blocks and plans their
        copies from the host; returns the copies' ticket."""
        assert self.tier is not None
        hashes = request.block_hashes
        blocks = self.pool.allocate(len(reloads), request.job_id)
        ticket = self.tier.ticket
        request.table_dirty_from = min(request.table_dirty_from, min(reloads))
        for (idx, slot), block_id in zip(sorted(reloads.items()), blocks, strict=True):
            request.block_ids[idx] = block_id
            self.pool.cache_block(block_id, hashes[idx], idx)
            self.tier.reload(slot, block_id)
            self.loading[block_id] = ticket
        return ticket

    def ready(self, request: Request) -> bool:
        """Whether ``request``'s blocks are all loaded (it may compute)."""
        ticket = request.kv_ticket
        if ticket is None:
            return True
        assert self.tier is not None
        if not self.tier.is_complete(ticket):
            return False
        request.kv_ticket = None
        return True

    def prefetch(self, hashes: list[int], job_id: str | None, limit: int) -> int:
        """Brings host copies of blocks back to the device ahead of their request, into free
        blocks only (nothing cached is evicted for them).

        Args:
            hashes: block hashes of a job's context, in order (the i-th is logical block i).
            job_id: the job they belong to.
            limit: blocks to bring at most.

        Returns:
            Blocks whose copy was planned.
        """
        if self.tier is None or limit <= 0:
            return 0
        taken: list[int] = []
        ticket = self.tier.ticket
        for position, block_hash in enumerate(hashes):
            if len(taken) >= limit or not self.pool.free_uncached:
                break
            if self.pool.lookup(block_hash) is not None:
                continue
            slot = self.tier.lookup(block_hash)
            if slot is None:
                continue
            block_id = self.pool.allocate(1, job_id)[0]
            self.pool.cache_block(block_id, block_hash, position)
            self.tier.reload(slot, block_id, prefetch=True)
            self.loading[block_id] = ticket
            taken.append(block_id)
        if taken:
            # NOTE: held until the copy is complete, so that nothing evicts the block (and
            # writes it) while the copy into it may still land.
            self._prefetch_held.append((ticket, taken))
        return len(taken)

    def take_transfers(self) -> KVTransfers | None:
        """This step's block copies (``None`` without a tier); releases prefetched blocks
        whose copies are complete."""
        if self.tier is None:
            return None
        done = self.tier.is_complete
        keep: list[tuple[int, list[int]]] = []
        for ticket, blocks in self._prefetch_held:
            if done(ticket):
                self.pool.free(blocks)
            else:
                keep.append((ticket, blocks))
        self._prefetch_held = keep
        self.loading = {b: t for b, t in self.loading.items() if not done(t)}
        return self.tier.take_transfers()

    def prefetch_held_blocks(self) -> list[int]:
        """Device blocks held by prefetch copies that may be in flight."""
        return [b for _, blocks in self._prefetch_held for b in blocks]

    def try_allocate(self, request: Request, segments: list[tuple[int, int]]) -> Allocation | None:
        """Takes the fresh blocks a running request's ``segments`` write to.

        Returns:
            The allocation, or ``None`` (nothing taken) when they do not fit.
        """
        needed = self.blocks_needed(request, segments)
        if len(needed) > self.pool.num_free_blocks:
            return None
        return Allocation(segments, self._allocate(request, needed))

    def _install(self, request: Request, hit: CacheHit) -> None:
        """Installs ``hit`` as ``request``'s table and frontier, without taking references."""
        request.block_ids = list(hit.block_table)
        request.num_computed_tokens = hit.leading_tokens
        request.hit_end = len(hit.block_table) * self.block_size

    def _uninstall(self, request: Request) -> None:
        """Undoes :meth:`_install` of a request that was not admitted."""
        request.block_ids = []
        request.num_computed_tokens = 0
        request.hit_end = 0

    def _fits(self, needed: list[int], hit: CacheHit) -> bool:
        """The ``needed`` blocks of a waiting request fit: its own candidate hits leave the free
        count once it holds them."""
        fresh = len(needed) + len(hit.reloads)
        free = self.pool.num_free_blocks
        table = hit.block_table
        # NOTE: this runs on every step a request waits, so the per-block count of its
        # candidate hits only where it decides: not when the fresh blocks alone do not fit,
        # nor when they would fit with every hit a candidate
        if fresh > free:
            return False
        if fresh + len(table) - table.count(HOLE) - table.count(RELOAD) <= free:
            return True
        candidates = sum(1 for b in table if b >= 0 and self.pool.is_candidate(b))
        return fresh + candidates <= free

    # -- allocation ------------------------------------------------------------------------
    def blocks_needed(self, request: Request, segments: list[tuple[int, int]]) -> list[int]:
        """Logical block indices that ``segments`` write to and that have no block yet."""
        bs = self.block_size
        needed: list[int] = []
        for start, end in segments:
            for idx in range(start // bs, (end - 1) // bs + 1):
                if idx >= len(request.block_ids) or request.block_ids[idx] == HOLE:
                    if not needed or needed[-1] != idx:
                        needed.append(idx)
        return needed

    def _allocate(self, request: Request, block_indices: list[int]) -> list[int]:
        """Allocates fresh blocks for ``block_indices`` of ``request`` (caller checked room)."""
        if not block_indices:
            return []
        fresh = self.pool.allocate(len(block_indices), request.job_id)
        table = request.block_ids
        request.table_dirty_from = min(request.table_dirty_from, min(block_indices))
        for idx, block_id in zip(block_indices, fresh, strict=True):
            if idx >= len(table):
                table.extend([HOLE] * (idx + 1 - len(table)))
            table[idx] = block_id
        return fresh

    def commit(self, request: Request) -> None:
        """Registers every block below the frontier that is full and not cached yet."""
        bs = self.block_size
        hashes = self.ensure_hashes(request)
        full = min(request.num_computed_tokens // bs, len(hashes))
        # NOTE: blocks below ``num_committed_blocks`` were registered (or were hits) in earlier
        # steps; scanning only the new ones keeps this O(new blocks) on the step's hot path.
        for idx in range(request.num_committed_blocks, full):
            block_id = request.block_ids[idx]
            block = self.pool.blocks[block_id]
            if block.block_hash is None:
                if self.on_commit is not None:
                    parent = hashes[idx - 1] if idx else None
                    salt = request.params.cache_salt
                    # NOTE: the salt seeds the first block's hash only (the rest chain from it),
                    # so, as in vLLM's events, only that block carries it.
                    extra_keys = (salt,) if idx == 0 and salt is not None else None
                    tokens = request.all_token_ids[idx * bs : (idx + 1) * bs]
                    self.on_commit(hashes[idx], parent, tokens, extra_keys)
                if self.pool.cache_block(block_id, hashes[idx], idx):
                    self._count_creation(request, idx)
        request.num_committed_blocks = max(request.num_committed_blocks, full)

    def _count_creation(self, request: Request, idx: int) -> None:
        """Counts block ``idx`` that ``request`` just wrote to the prefix cache in its
        ``cache_creation_tokens`` if it is a full block of the prompt and no token is out yet.

        NOTE: vLLM's ``PrefillStats.finalize`` fixes the count at the first output (a prefill
        redone after a preemption adds nothing) and caps it at the prompt's full blocks less its
        hits, so hits, reloads and the tokens add up to the prompt. A block whose hash another
        block already caches is not written (:meth:`BlockPool.cache_block`) and not counted.
        """
        metrics = request.metrics
        bs = self.block_size
        prompt = request.num_prompt_tokens
        if metrics.first_token_time is None and (idx + 1) * bs <= prompt:
            room = prompt // bs * bs - metrics.cached_tokens
            metrics.cache_creation_tokens = min(metrics.cache_creation_tokens + bs, room)

    def drop_tail(self, request: Request) -> None:
        """Frees the blocks past a running request's frontier: those its rejected drafts were
        written to (speculative decoding). The block the frontier is in stays.

        NOTE: a block past the frontier in the table is a cache hit to the scheduler (it skips
        it): these hold rejected drafts' KV, never registered (no block of a draft is full of
        the request's tokens before it is kept).
        """
        keep = -(-request.num_computed_tokens // self.block_size)
        tail = request.block_ids[keep:]
        if tail:
            del request.block_ids[keep:]
            # NOTE: the model runner's row of the table still holds them: blocks appended here
            # later must be written over them
            request.table_dirty_from = min(request.table_dirty_from, keep)
            self.pool.free(b for b in reversed(tail) if b != HOLE)

    def free(self, request: Request) -> None:
        """Drops ``request``'s references, tail first (vLLM's order)."""
        if request.kv_ticket is not None and not self.ready(request):
            # NOTE: a copy may still land in its blocks: once freed they can be reused and
            # written, so wait for it (rare: a request preempted or aborted while loading).
            assert self.tier is not None
            self.tier.wait(request.kv_ticket)
            request.kv_ticket = None
        self.pool.free(b for b in reversed(request.block_ids) if b != HOLE)
        request.block_ids = []
        request.num_committed_blocks = 0

    def held_blocks(self, request: Request) -> list[int]:
        return [b for b in request.block_ids if b != HOLE]
