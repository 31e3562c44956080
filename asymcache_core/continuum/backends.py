"""Where Continuum's pins live: the :class:`PinBackend` protocol and the embedded engine's pins.

:class:`~asymcache_core.continuum.controller.ContinuumController` decides *whether* and *how
long* to pin; a backend is the mechanism. Two implement the protocol:

* :class:`PinManager` (this module): the embedded engine's, over its
  :class:`~asymcache_core.block_pool.BlockPool` (pinned blocks leave the eviction candidates;
  the scheduler releases pins under memory pressure through :meth:`PinManager.release_for_pressure`).
* :class:`~asymcache_core.integrations.vllm.pins.PinSet`: the vLLM plugin's, whose pinned
  blocks stay in vLLM's free queue but are skipped as eviction candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from asymcache_core.block_pool import BlockPool


@dataclass
class Pin:
    """One job's pin.

    Attributes:
        job_id: the job.
        block_ids: the pinned blocks (each once).
        pinned_at: clock time of the pin.
        expires_at: clock time of its expiry.
    """

    job_id: str
    block_ids: tuple[int, ...]
    pinned_at: float
    expires_at: float


@runtime_checkable
class PinBackend(Protocol):
    """What the Continuum controller needs of a pin mechanism.

    A backend learns which blocks a job's finished request left behind from its own block
    manager (each has a ``remember`` fed by its engine); the controller only names the job.

    Invariants every backend keeps:

    1. One pin per job: :meth:`pin` first releases the job's earlier pin, even when it then
       pins nothing.
    2. :meth:`pin` pins only blocks that still hold the job's content, and nothing (returning 0)
       when ``ttl_s <= 0`` or no such block is left; it returns the blocks it pinned.
    3. A pinned block is never an eviction candidate, and pins never refuse an admission: past
       the backend's cap on pinned blocks, and under memory pressure, the pin that expires
       latest is released first (a pin refused by the cap returns 0).
    4. :meth:`expire` releases every pin whose ``expires_at <= now``.
    5. :meth:`unpin` is called once the job's next request holds the pinned blocks (so they
       were never evictable in between); :meth:`forget` when the job has ended: its pin and
       the blocks it remembered are dropped.
    6. Times are the caller's (one clock per backend); a backend reads no clock itself.
    """

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pins (each counted once)."""
        ...

    def is_pinned(self, job_id: str | None) -> bool:
        """Whether ``job_id`` holds a pin (``None``: never)."""
        ...

    def pin(self, job_id: str, ttl_s: float, now: float) -> int:
        """Pins the job's remembered blocks until ``now + ttl_s``; returns the blocks pinned."""
        ...

    def unpin(self, job_id: str) -> bool:
        """Releases the job's pin (its next request holds the blocks); whether it had one."""
        ...

    def forget(self, job_id: str) -> None:
        """The job ended: drops its pin and what the backend remembered of it."""
        ...

    def expire(self, now: float) -> list[str]:
        """Releases every pin that expired by ``now``; returns their jobs."""
        ...


class PinManager:
    """The embedded engine's pins (a :class:`PinBackend`) on a :class:`BlockPool`.

    Args:
        pool: the block pool.
        max_pinned_fraction: the most of the pool that idle pinned blocks may hold; pins past it
            are released latest-expiring first, so pins never starve admissions.
    """

    def __init__(self, pool: BlockPool, max_pinned_fraction: float = 0.5) -> None:
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction: must be in [0, 1], got {max_pinned_fraction}")
        self.pool = pool
        self.max_pinned_fraction = max_pinned_fraction
        self.pins: dict[str, Pin] = {}
        self.last_blocks: dict[str, list[tuple[int, int]]] = {}
        self.num_pins = 0
        self.num_expired = 0
        self.num_released_pressure = 0

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pins."""
        return sum(len(p.block_ids) for p in self.pins.values())

    def is_pinned(self, job_id: str | None) -> bool:
        """Whether ``job_id`` holds a pin."""
        return job_id is not None and job_id in self.pins

    def remember(self, job_id: str, blocks: list[tuple[int, int]]) -> None:
        """Records ``(block_id, block_hash)`` of a job's just-finished request."""
        self.last_blocks[job_id] = blocks

    def forget(self, job_id: str) -> None:
        """The job ended: drops its remembered blocks and its pin."""
        self.last_blocks.pop(job_id, None)
        self.unpin(job_id)

    def pin(self, job_id: str, ttl_s: float, now: float) -> int:
        """Pins the blocks of ``job_id``'s last request that still hold their hash.

        Args:
            job_id: the job.
            ttl_s: time to live.
            now: engine time.

        Returns:
            Blocks pinned (0 when nothing is left, ``ttl_s <= 0``, or the cap refused it).
        """
        self.unpin(job_id)
        if ttl_s <= 0:
            return 0
        blocks = tuple(
            bid for bid, h in self.last_blocks.get(job_id, [])
            if self.pool.blocks[bid].block_hash == h
        )
        if not blocks:
            return 0
        self.pool.pin(blocks)
        self.pins[job_id] = Pin(job_id, blocks, now, now + ttl_s)
        self.num_pins += 1
        self._enforce_cap()
        return len(blocks) if job_id in self.pins else 0

    def unpin(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin; whether it had one."""
        pin = self.pins.pop(job_id, None)
        if pin is None:
            return False
        self.pool.unpin(pin.block_ids)
        return True

    def expire(self, now: float) -> list[str]:
        """Releases every pin whose TTL has passed; returns their jobs."""
        expired = [job for job, p in self.pins.items() if p.expires_at <= now]
        for job in expired:
            self.unpin(job)
        self.num_expired += len(expired)
        return expired

    def release_for_pressure(self) -> bool:
        """Releases the latest-expiring pin (memory pressure); False when none is left."""
        if not self.pins:
            return False
        latest = max(self.pins.values(), key=lambda p: p.expires_at)
        self.unpin(latest.job_id)
        self.num_released_pressure += 1
        return True

    def _enforce_cap(self) -> None:
        cap = int(self.max_pinned_fraction * self.pool.num_blocks)
        while self.pins and self.pool.num_pinned_idle > cap:
            self.release_for_pressure()

    def next_expiry(self) -> float | None:
        """The earliest expiry of a pin, or ``None`` without pins."""
        return min((p.expires_at for p in self.pins.values()), default=None)
