"""Each waiting request's prefix-cache hit, kept current from the pool's events (``least-work``).

The ``least-work`` admission order sorts vLLM's waiting requests by the tokens each would
compute if admitted now, so it needs every waiting request's prefix-cache hit: the leading
blocks of its hash chain that the pool's hash map holds. Looking each one up at every step
(``coordinator.find_longest_cache_hit``) costs O(waiting requests x prompt blocks) per
``schedule()``. :class:`PrefixHits` keeps the answers instead and changes them only where the
cache changed:

- a key becomes cached: the chains whose first missing block it is advance (over any further
  blocks already cached);
- a key stops being cached (an eviction, a connector's drop, a block's content replaced): the
  chains that hold it in their hit fall back to it;
- the prefix cache is reset: every hit is 0.

A chain is registered the first time its request is asked about, and again when its hashes
changed since (vLLM appends hashes as a request generates tokens; a streaming session's are cut
and re-extended): a chain is recognised by its length and last hash (each hash chains on its
parent's, so the last one names the whole chain).

:func:`track_prefix_hits` wraps a vLLM ``BlockPool``'s cache bookkeeping on the instance to feed
it where its answers are exact: one KV cache group of full attention, prefix caching on, no
EAGLE drop, hashes at the block size. Elsewhere the caller keeps vLLM's full lookup. vLLM is
imported only inside the two functions that read its classes; the rest is plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False, slots=True)
class _Chain:
    """One request's block hashes and how many of them lead the cache (``hit``).

    Invariant: ``hashes[:hit]`` are cached and ``hashes[hit]`` is not (when ``hit < len``); the
    chain is in ``PrefixHits._holders`` under each of the first ``hit`` keys (with its
    position) and in ``PrefixHits._waiters`` under the key of ``hashes[hit]``. Holder entries
    at positions from ``hit`` to ``held`` are stale (left by a fall back; skipped by events).
    """

    hashes: tuple[Hashable, ...]
    hit: int = 0
    held: int = 0

    def matches(self, block_hashes: Sequence[Hashable]) -> bool:
        n = len(self.hashes)
        return len(block_hashes) == n and (n == 0 or block_hashes[-1] == self.hashes[-1])


class PrefixHits:
    """Per request, the number of leading blocks of its hash chain the prefix cache holds.

    Args:
        is_cached: whether the cache holds a block under a key (the pool's hash map).
        key_of: a block hash's key in that map (vLLM's key carries the KV cache group).
        block_size: tokens per block (the lookup's block size).
    """

    def __init__(
        self,
        is_cached: Callable[[Hashable], bool],
        key_of: Callable[[Hashable], Hashable],
        block_size: int,
    ) -> None:
        self._is_cached = is_cached
        self._key_of = key_of
        self.block_size = block_size
        self._chains: dict[str, _Chain] = {}
        # key -> {chain: the key's position in it}, for the chains whose hit holds the key
        self._holders: dict[Hashable, dict[_Chain, int]] = {}
        # key -> the chains whose first block missing from the cache it is
        self._waiters: dict[Hashable, set[_Chain]] = {}
        #: Chains registered (a request's first question, or its hashes changed).
        self.registrations = 0

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def num_entries(self) -> int:
        """Holder entries: one per tracked chain and cached block of its hit (the memory the
        index costs; stale ones included)."""
        return sum(len(holding) for holding in self._holders.values())

    def hit_blocks(self, request_id: str, block_hashes: Sequence[Hashable]) -> int | None:
        """Leading blocks of ``block_hashes`` the cache holds (registers the chain if new).

        Args:
            request_id: the request.
            block_hashes: its block hashes (vLLM's ``Request.block_hashes``).

        Returns:
            The number of blocks, or ``None`` for a chain that holds a hash twice (a hash
            collision: the events cannot be told apart by key; use the full lookup).
        """
        chain = self._chains.get(request_id)
        if chain is None or not chain.matches(block_hashes):
            chain = self._track(request_id, block_hashes)
        return None if chain.hit < 0 else chain.hit

    def hit_tokens(
        self, request_id: str, block_hashes: Sequence[Hashable], num_tokens: int
    ) -> int | None:
        """The hit in tokens as vLLM's admission finds it: whole blocks, at most
        ``num_tokens - 1`` tokens (the last token is always computed, for its logits).

        Args:
            request_id: the request.
            block_hashes: its block hashes.
            num_tokens: its tokens (prompt and any output of an earlier run).

        Returns:
            Tokens, or ``None`` where :meth:`hit_blocks` is.
        """
        hit = self.hit_blocks(request_id, block_hashes)
        if hit is None:
            return None
        return max(0, min(hit, (num_tokens - 1) // self.block_size)) * self.block_size

    def forget(self, request_id: str) -> None:
        """Drops a request's chain (it left the waiting queue).

        Args:
            request_id: the request.
        """
        chain = self._chains.pop(request_id, None)
        if chain is not None and chain.hit >= 0:
            self._unhold(chain)
            self._unwait(chain)

    def retain(self, request_ids: Collection[str]) -> None:
        """Drops the chains of all requests but these.

        Args:
            request_ids: the requests to keep (the waiting ones).
        """
        for request_id in [r for r in self._chains if r not in request_ids]:
            self.forget(request_id)

    # ---- cache events ------------------------------------------------------------------------

    def on_cached(self, key: Hashable) -> None:
        """The cache holds a block under ``key`` (it may have held one already).

        Args:
            key: the map's key.
        """
        waiting = self._waiters.pop(key, None)
        for chain in waiting or ():
            self._advance(chain)

    def on_uncached(self, key: Hashable) -> None:
        """The cache holds no block under ``key`` any more.

        Args:
            key: the map's key.
        """
        holding = self._holders.pop(key, None)
        for chain, position in (holding or {}).items():
            if position >= chain.hit:
                continue  # a stale entry: the chain fell back below it already
            self._unwait(chain)
            # NOTE: the holder entries past the new hit stay (stale, skipped above): a fall back
            # costs O(1) per chain instead of its hit's length; forget() clears them.
            chain.hit = position
            self._wait(key, chain)

    def on_reset(self) -> None:
        """The prefix cache was emptied."""
        self._holders.clear()
        self._waiters.clear()
        for chain in self._chains.values():
            if chain.hit >= 0:
                chain.hit = chain.held = 0
                self._advance(chain)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _track(self, request_id: str, block_hashes: Sequence[Hashable]) -> _Chain:
        self.forget(request_id)
        self.registrations += 1
        chain = _Chain(tuple(block_hashes))
        self._chains[request_id] = chain
        if len(set(chain.hashes)) != len(chain.hashes):
            # NOTE: vLLM hashes each block with its parent's hash, so a repeat is a collision;
            # the index (key -> position) cannot hold it: such a chain is not tracked.
            chain.hit = -1
        else:
            self._advance(chain)
        return chain

    def _advance(self, chain: _Chain) -> None:
        """Extends ``chain.hit`` over the cached blocks from it on and files the chain under
        its first missing key."""
        hashes, key_of, is_cached, holders = (
            chain.hashes,
            self._key_of,
            self._is_cached,
            self._holders,
        )
        position = chain.hit
        while position < len(hashes):
            key = key_of(hashes[position])
            if not is_cached(key):
                self._wait(key, chain)
                break
            # NOTE: no setdefault(key, {}): a throwaway dict per block is garbage the collector
            # walks every container for (a waiting queue's token lists: millions of references)
            holding = holders.get(key)
            if holding is None:
                holders[key] = {chain: position}
            else:
                holding[chain] = position
            position += 1
        chain.hit = position
        chain.held = max(chain.held, position)

    def _wait(self, key: Hashable, chain: _Chain) -> None:
        """Files ``chain`` under its first missing key."""
        waiting = self._waiters.get(key)
        if waiting is None:
            self._waiters[key] = {chain}
        else:
            waiting.add(chain)

    def _unhold(self, chain: _Chain) -> None:
        """Removes ``chain``'s holder entries (stale ones included)."""
        for position in range(chain.held):
            key = self._key_of(chain.hashes[position])
            holding = self._holders.get(key)
            if holding is not None:
                holding.pop(chain, None)
                if not holding:
                    del self._holders[key]

    def _unwait(self, chain: _Chain) -> None:
        """Removes ``chain`` from the waiters of its first missing key."""
        if chain.hit < len(chain.hashes):
            key = self._key_of(chain.hashes[chain.hit])
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(chain)
                if not waiting:
                    del self._waiters[key]


def incremental_lookup_blocker(kv_cache_manager: Any) -> str | None:
    """Why :class:`PrefixHits` would not give ``find_longest_cache_hit``'s answer, if so.

    Args:
        kv_cache_manager: vLLM's ``KVCacheManager``.

    Returns:
        The reason, or ``None`` where the two agree: prefix caching on, one KV cache group whose
        lookup is full attention's (the leading cached blocks, each a map probe), no EAGLE drop
        of the last hit block, block hashes at the group's block size.
    """
    if not kv_cache_manager.enable_caching:
        return "prefix caching is off"
    try:
        from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    except ImportError as exc:  # NOTE: another vLLM's layout: its lookup is not known here
        return f"vLLM's lookup classes not found ({exc})"
    coordinator = kv_cache_manager.coordinator
    if (
        type(coordinator).find_longest_cache_hit
        is not UnitaryKVCacheCoordinator.find_longest_cache_hit
    ):
        return f"{type(coordinator).__name__}: not a single KV cache group"
    group = coordinator.single_type_managers[0]
    lookup = getattr(type(group).find_longest_cache_hit, "__func__", None)
    if lookup is not FullAttentionManager.find_longest_cache_hit.__func__:
        return f"{type(group).__name__}: not full attention's lookup"
    if coordinator.eagle_group_ids:
        return "EAGLE/MTP drops the last hit block"
    if group.block_size != coordinator.block_pool.hash_block_size:
        return f"block size {group.block_size} != hash block size {coordinator.block_pool.hash_block_size}"
    return None


def track_prefix_hits(kv_cache_manager: Any) -> tuple[PrefixHits | None, str | None]:
    """A :class:`PrefixHits` fed by the manager's pool (:func:`install_prefix_hit_hooks`),
    where its answers are ``find_longest_cache_hit``'s.

    Args:
        kv_cache_manager: vLLM's ``KVCacheManager``, before anything is cached.

    Returns:
        ``(hits, None)``, or ``(None, reason)`` where the full lookup must be kept
        (:func:`incremental_lookup_blocker`).
    """
    reason = incremental_lookup_blocker(kv_cache_manager)
    if reason is not None:
        return None, reason
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    coordinator = kv_cache_manager.coordinator
    hits = install_prefix_hit_hooks(
        coordinator.block_pool,
        lambda block_hash: make_block_hash_with_group_id(block_hash, 0),
        coordinator.single_type_managers[0].block_size,
    )
    return hits, None


def install_prefix_hit_hooks(
    pool: Any, key_of: Callable[[Hashable], Hashable], block_size: int
) -> PrefixHits:
    """Wraps a vLLM ``BlockPool``'s hash-map bookkeeping on the instance to feed a new
    :class:`PrefixHits`.

    Every change to the pool's map (``cached_block_hash_to_block``) goes through
    ``_insert_block_hash`` (a key may become cached), ``_remove_cached_block_hashes`` (keys may
    stop being cached: an eviction, a connector's ``evict_blocks``, a partial block promoted,
    hashes moved to another block) or ``reset_prefix_cache`` (the map is replaced).

    Args:
        pool: the ``BlockPool`` (nothing cached yet).
        key_of: a block hash's key in the pool's map (of KV cache group 0).
        block_size: tokens per block.

    Returns:
        The tracker.
    """

    def is_cached(key: Hashable) -> bool:
        # NOTE: the attribute each time: a reset replaces the map.
        return pool.cached_block_hash_to_block.get_one_block(key) is not None

    hits = PrefixHits(is_cached, key_of, block_size)
    orig_insert: Callable[..., Any] = pool._insert_block_hash
    orig_remove: Callable[..., Any] = pool._remove_cached_block_hashes
    orig_reset: Callable[..., Any] = pool.reset_prefix_cache

    def _insert_block_hash(key: Any, block: Any, num_tokens: int | None) -> None:
        orig_insert(key, block, num_tokens)
        hits.on_cached(key)

    def _remove_cached_block_hashes(block: Any) -> Any:
        removed = orig_remove(block)
        for key in removed:
            # NOTE: another block may hold the same content (vLLM does not deduplicate).
            if not is_cached(key):
                hits.on_uncached(key)
        return removed

    def reset_prefix_cache() -> bool:
        ok = bool(orig_reset())
        if ok:
            hits.on_reset()
        return ok

    pool._insert_block_hash = _insert_block_hash
    pool._remove_cached_block_hashes = _remove_cached_block_hashes
    pool.reset_prefix_cache = reset_prefix_cache
    return hits
