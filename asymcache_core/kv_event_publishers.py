"""The publishers of KV cache events and what configures them: ``--kv-events-config`` (vLLM's
``KVEventsConfig`` keys and defaults), a ZeroMQ publisher with vLLM's replay socket, and a null
one.

NOTE: separate from ``kv_events.py``: a publisher only sends the bytes the collector packs, on a
thread of its own; the collector is the part that watches the engine's pools.

pyzmq (the ``kv-events`` extra) is imported only when a ZeroMQ publisher is created.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

from asymcache_core.config import json_object_text

logger = logging.getLogger(__name__)

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


def require_module(module: str) -> Any:
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
        zmq = require_module("zmq")
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
