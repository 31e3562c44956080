"""KV cache events for KV-aware routers, in vLLM's wire format (``--kv-events-config``).

A router that places requests on the replica holding their prefix (NVIDIA Dynamo's KV router,
llm-d's KV-cache indexer) keeps an index of every replica's cached blocks, fed by the events
each engine publishes: a block was stored (its chained hash, its parent's, its tokens), a block
was removed, everything was cleared. This module publishes them the way vLLM does, so those
routers read this engine unchanged:

- :class:`KVEventCollector` watches the engine's block pools (a listener on each: the device
  pool, medium ``"GPU"``, and the host tier's pool, medium ``"CPU"``) and the cache manager's
  commits (which know a block's tokens), and gathers one step's events in order;
- :meth:`KVEventCollector.flush` (called once per engine step) encodes them as one
  ``KVEventBatch`` and hands it to the publisher;
- :class:`ZmqEventPublisher` sends each batch on a ZMQ PUB socket as the frames
  ``(topic, sequence number, payload)`` and keeps the last ``buffer_steps`` batches for a
  ROUTER socket that replays them to a subscriber that missed some.

The wire format (``docs/kv-events.md``) is msgpack with vLLM's array layout: a batch is
``[ts, events, data_parallel_rank]``, an event ``[tag, field, ...]`` in field order:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
``extra_keys`` is vLLM's too: one entry per block of ``block_hashes``, the keys its hash covers
besides its parent and its tokens, untagged: ``[cache_salt]`` on a salted chain's first block,
``nil`` on every other block (this engine has no LoRA adapters or multimodal inputs). Without
it a router that rebuilds block identities from ``token_ids`` could not tell a salted chain from
an unsalted one of the same tokens.

pyzmq and msgpack (the ``kv-events`` extra) are imported only when a publisher is created.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from asymcache_core.block_pool import BlockPool, KVBlock
from asymcache_core.kv_event_publishers import (
    END_SEQ,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    require_module,
)

if TYPE_CHECKING:
    from asymcache_core.host_tier import HostTier
    from asymcache_core.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

#: Medium of the engine's own KV pool, whatever device it lives on: the routers read ``"GPU"``
#: as the primary tier (``"CPU"`` would not tell it from the host tier on a CPU engine).
MEDIUM_DEVICE = "GPU"
#: Medium of the host KV tier (vLLM's CPU offloading reports ``"CPU"`` too).
MEDIUM_HOST = "CPU"

class _PoolListener:
    """The :class:`~asymcache_core.block_pool.BlockListener` of one pool: its stores and removals
    become events of its medium."""

    def __init__(self, collector: KVEventCollector, pool: BlockPool, medium: str) -> None:
        self.collector = collector
        self.pool = pool
        self.medium = medium

    def on_cached(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.collector.stored(self.medium, block.block_hash)

    def on_candidate(self, block: KVBlock) -> None:
        """A candidate still caches its content: no event."""

    def on_evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.collector.removed(self.medium, block.block_hash)

    def on_uncache(self, block_id: int) -> None:
        block_hash = self.pool.blocks[block_id].block_hash
        if block_hash is not None:
            self.collector.removed(self.medium, block_hash)


class KVEventCollector:
    """Gathers a step's KV events from the pools it watches; :meth:`flush` publishes them.

    A ``BlockStored`` event carries the block's tokens and its parent's hash, which the pool
    does not know: the cache manager reports them when it commits a block it computed
    (:meth:`record_tokens`), and they are kept while some watched pool caches the hash (a host
    copy or a reload of the block is stored again with them). Consecutive stores of one chain
    in one medium are one event, as are consecutive removals in one medium.

    The first batch starts with ``AllBlocksCleared``: a router that indexed an earlier run of
    this engine (same endpoint) forgets it.

    Args:
        block_size: tokens per block.
        publisher: takes each encoded batch (:class:`ZmqEventPublisher`, :class:`NullEventPublisher`).
        data_parallel_rank: the batches' rank field.
    """

    def __init__(
        self, block_size: int, publisher: ZmqEventPublisher | NullEventPublisher, data_parallel_rank: int = 0
    ) -> None:
        self._pack = require_module("msgpack").Packer(use_bin_type=True).pack
        self.block_size = block_size
        self.publisher = publisher
        self.data_parallel_rank = data_parallel_rank
        self.pools: dict[str, BlockPool] = {}
        # block hash -> (parent hash or None, its tokens, its extra keys or None), for the
        # hashes some pool caches
        self._tokens: dict[int, tuple[int | None, tuple[int, ...], tuple[str, ...] | None]] = {}
        self._gone: set[int] = set()
        self._gone_before: set[int] = set()
        self._events: list[list[Any]] = [["AllBlocksCleared"]]
        #: stores whose tokens were unknown (not published; a router then just misses a hit)
        self.unknown_tokens = 0
        #: batches published
        self.batches = 0

    # -- sources -------------------------------------------------------------------------------
    def watch(self, pool: BlockPool, medium: str) -> None:
        """Publishes the stores and removals of ``pool`` under ``medium``."""
        if medium in self.pools:
            raise ValueError(f"medium: {medium!r} is watched already")
        self.pools[medium] = pool
        pool.listeners.append(_PoolListener(self, pool, medium))

    def record_tokens(
        self,
        block_hash: int,
        parent_hash: int | None,
        token_ids: list[int],
        extra_keys: tuple[str, ...] | None = None,
    ) -> None:
        """The tokens of a block about to be cached (the cache manager's commit hook).

        Args:
            block_hash: its chained hash.
            parent_hash: the previous block's hash (``None`` for a sequence's first block).
            token_ids: its ``block_size`` tokens.
            extra_keys: what else its hash covers, as vLLM publishes it (``(cache_salt,)`` on a
                salted sequence's first block), or ``None``.
        """
        self._tokens[block_hash] = (parent_hash, tuple(token_ids), extra_keys)

    def stored(self, medium: str, block_hash: int) -> None:
        """``block_hash`` is now cached in ``medium``."""
        known = self._tokens.get(block_hash)
        if known is None:
            self.unknown_tokens += 1
            logger.warning("KV events: tokens of block %d unknown; its store is not published", block_hash)
            return
        self._gone.discard(block_hash)
        parent, tokens, extra_keys = known
        keys = None if extra_keys is None else list(extra_keys)
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockStored" and last[6] == medium and last[1][-1] == parent:
            last[1].append(block_hash)
            last[3].extend(tokens)
            last[8].append(keys)
            return
        event: list[Any] = ["BlockStored", [block_hash], parent, list(tokens), self.block_size]
        event += [None, medium, None, [keys]]  # lora_id, medium, lora_name, extra_keys
        self._events.append(event)

    def removed(self, medium: str, block_hash: int) -> None:
        """``block_hash`` is about to leave ``medium``."""
        if not any(block_hash in pool.cached for m, pool in self.pools.items() if m != medium):
            self._gone.add(block_hash)
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved" and last[2] == medium:
            last[1].append(block_hash)
            return
        self._events.append(["BlockRemoved", [block_hash], medium])

    # -- batches -------------------------------------------------------------------------------
    def flush(self, age_tokens: bool = True) -> int | None:
        """Publishes the events gathered since the last flush as one batch.

        Args:
            age_tokens: a step's flush (the tokens of hashes gone before it are forgotten);
                False for one between steps (a cache reset), which must not age them: the
                blocks a reset evicts reach the host tier at the next schedule, however many
                resets come first.

        Returns:
            The batch's sequence number, or ``None`` when there were no events.
        """
        if age_tokens:
            self._forget_tokens()
        if not self._events:
            return None
        events, self._events = self._events, []
        self.batches += 1
        return self.publisher.publish(self._pack([time.time(), events, self.data_parallel_rank]))

    def _forget_tokens(self) -> None:
        """Drops the tokens of hashes no pool caches any more.

        NOTE: a hash is kept one flush after it left the last pool: a device block evicted in a
        step (or by a reset between steps) is copied to the host tier, and stored there, when the
        next schedule issues its queued copies.
        """
        pools = self.pools.values()
        for block_hash in self._gone_before:
            if not any(block_hash in pool.cached for pool in pools):
                self._tokens.pop(block_hash, None)
        self._gone_before, self._gone = self._gone, set()
        limit = 2 * sum(pool.num_blocks for pool in pools) + len(self._gone_before)
        if len(self._tokens) > limit:  # hashes recorded but never cached
            self._tokens = {
                h: v for h, v in self._tokens.items()
                if h in self._gone_before or any(h in pool.cached for pool in pools)
            }

    def close(self) -> None:
        """Publishes what is pending and closes the publisher."""
        self.flush()
        self.publisher.close()


def create_kv_events(
    config_json: str | None,
    pool: BlockPool,
    host_tier: HostTier | None,
    kv: KVCacheManager,
    block_size: int,
) -> KVEventCollector | None:
    """The collector and publisher ``kv_events_config`` asks for, watching the engine's pools.

    Args:
        config_json: the ``--kv-events-config`` JSON, or ``None``.
        pool: the device pool (medium ``"GPU"``).
        host_tier: the host KV tier, whose pool is watched too (medium ``"CPU"``), or ``None``.
        kv: the cache manager, whose commits report the tokens of new blocks.
        block_size: tokens per block.

    Returns:
        The collector, or ``None`` when events are off.
    """
    if config_json is None:
        return None
    config = KVEventsConfig.from_json(config_json)
    if not config.enable_kv_cache_events:
        return None
    publisher: ZmqEventPublisher | NullEventPublisher = (
        ZmqEventPublisher(config) if config.publisher == "zmq" else NullEventPublisher()
    )
    collector = KVEventCollector(block_size, publisher)
    collector.watch(pool, MEDIUM_DEVICE)
    if host_tier is not None:
        collector.watch(host_tier.pool, MEDIUM_HOST)
    kv.on_commit = collector.record_tokens
    return collector


__all__ = [
    "END_SEQ",
    "MEDIUM_DEVICE",
    "MEDIUM_HOST",
    "KVEventCollector",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "create_kv_events",
]
