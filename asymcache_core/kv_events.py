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
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import TYPE_CHECKING, Any

from asymcache_core.block_pool import BlockPool, KVBlock
from asymcache_core.config import json_object_text

if TYPE_CHECKING:
    from asymcache_core.host_tier import HostTier
    from asymcache_core.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

#: Medium of the engine's own KV pool, whatever device it lives on: the routers read ``"GPU"``
#: as the primary tier (``"CPU"`` would not tell it from the host tier on a CPU engine).
MEDIUM_DEVICE = "GPU"
#: Medium of the host KV tier (vLLM's CPU offloading reports ``"CPU"`` too).
MEDIUM_HOST = "CPU"
#: Sequence number that ends a replay (8 bytes, big-endian, signed), as vLLM sends it.
END_SEQ = -1
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """What ``--kv-events-config`` says: vLLM's keys and defaults.

    Attributes:
        enable_kv_cache_events: publish at all (off: no collector, no socket).
        publisher: ``zmq``, or ``null`` (collect and count, send nothing).
        endpoint: the PUB socket: bound when it has a wildcard (``tcp://*:5557``), ``::``, or is
            ``ipc://`` / ``inproc://``; connected otherwise (``tcp://router-host:5557``).
        replay_endpoint: the ROUTER socket replays are asked on (always bound); ``None``: none.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber).
        max_queue_size: batches waiting for the sender thread at most; more are dropped (their
            sequence numbers are skipped, so a subscriber sees the gap).
        topic: the first frame of every message (a subscriber's filter).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses and checks the JSON of ``--kv-events-config``.

        Raises:
            ValueError: not a JSON object, an unknown key or a bad value (the message names
                ``kv_events_config``).
        """
        if not isinstance(text, str):
            raise ValueError(f"kv_events_config: must be a JSON string or None, got {type(text).__name__}")
        raw = json_object_text("kv_events_config", text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        """Raises ``ValueError`` naming ``kv_events_config`` and the key of a bad value."""
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config: enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"kv_events_config: {key} must be a ZMQ address such as tcp://*:5557, got {value!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {key} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config: topic must be a string, got {self.topic!r}")


def _require(module: str) -> Any:
    """Imports a module of the ``kv-events`` extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(
            f"kv_events_config: KV events need {module} (pip install 'asymcache[kv-events]': pyzmq, msgpack)"
        ) from None


class NullEventPublisher:
    """Numbers batches and sends nothing (``publisher: "null"``)."""

    def __init__(self) -> None:
        self._seq = count()
        self.published = 0

    def publish(self, payload: bytes) -> int:
        self.published += 1
        return next(self._seq)

    def close(self) -> None:
        pass


class ZmqEventPublisher:
    """PUB socket for the batches, ROUTER socket for replays, one sender thread for both.

    The engine thread numbers and encodes a batch and queues it (it never waits on a socket);
    the sender thread publishes it as ``(topic, seq, payload)`` and keeps it for replay.
    The sockets are made and bound here, so a bad or busy address fails the engine's start,
    and are used by the sender thread alone afterwards.

    A replay request on the ROUTER socket is vLLM's: a DEALER (or REQ) client sends an empty
    frame and the first sequence number it wants (8 bytes, big-endian); the answer is one
    ``("", seq, payload)`` message per kept batch from there, then ``("", -1, "")``.

    Args:
        config: the endpoints and sizes.

    Raises:
        RuntimeError: pyzmq is not installed.
        ValueError: an endpoint cannot be bound or connected (naming ``kv_events_config``).
    """

    POLL_S = 0.05
    LINGER_MS = 500

    def __init__(self, config: KVEventsConfig) -> None:
        zmq = _require("zmq")
        self._zmq = zmq
        self.topic = config.topic.encode()
        # NOTE: the process-wide context, so an ``inproc://`` endpoint reaches in-process
        # subscribers; it is never terminated here (other sockets may use it).
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, self.LINGER_MS)
        self._replay = None
        endpoint = config.endpoint
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                endpoint = config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {endpoint!r}: {exc.strerror}") from None
        #: the PUB socket's address once bound (the port chosen for ``tcp://*:0``)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        #: the ROUTER socket's address once bound, or ``None``
        self.replay_endpoint: str | None = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.published = 0
        self.dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="asymcache-kv-events", daemon=True)
        self._thread.start()

    def publish(self, payload: bytes) -> int:
        """Queues one encoded batch; returns its sequence number."""
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, payload))
            self.published += 1
        except queue.Full:
            # NOTE: never block the engine step on a stuck sender: the batch is lost, and its
            # skipped sequence number tells subscribers so.
            self.dropped += 1
            logger.error("KV events: sender queue full, batch %d dropped", seq)
        return seq

    def close(self) -> None:
        """Sends what is queued, stops the thread and closes the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=5.0)
        except queue.Full:
            pass
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            # NOTE: a socket must not be closed under the thread that uses it; the stuck
            # (daemon) thread keeps them until the process exits.
            logger.error("KV events: sender stuck, %d batches not sent", self._queue.qsize())
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()  # lingers up to LINGER_MS to deliver what is sent
        if self._replay is not None:
            self._replay.close()

    # -- the sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # NOTE: everything queued is published before any replay is served, so a replay
            # answers with every batch the engine published before the request came.
            try:
                item = self._queue.get(timeout=self.POLL_S)
                while True:
                    if item is None:
                        return
                    self._send(*item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            if self._replay is not None:
                while self._replay.poll(0):
                    if not self._queue.empty():
                        break  # newer batches first: the request is served on the next pass
                    self._serve_replay()

    def _send(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except self._zmq.ZMQError as exc:  # the batch stays replayable
            logger.error("KV events: publishing batch %d failed: %s", seq, exc)
        self._kept.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # NOTE: [identity, "", start] from REQ or DEALER clients that send vLLM's delimiter;
        # [identity, start] from a DEALER that does not: answer in the client's framing.
        if len(frames) == 3 and frames[1] == b"":
            identity, head, start_bytes = frames[0], [frames[0], b""], frames[2]
        elif len(frames) == 2:
            identity, head, start_bytes = frames[0], [frames[0]], frames[1]
        else:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        del identity
        if len(start_bytes) != 8:
            logger.warning("KV events: replay start must be 8 bytes, got %d", len(start_bytes))
            self._replay.send_multipart([*head, END_SEQ.to_bytes(8, "big", signed=True), b""])
            return
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._kept:
            if seq >= start:
                self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([*head, END_SEQ.to_bytes(8, "big", signed=True), b""])


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
        self._pack = _require("msgpack").Packer(use_bin_type=True).pack
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
