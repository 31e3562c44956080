"""Continuum-style KV pins: keep a job's blocks across a tool pause for a time-to-live.

The runtime decides *whether* and *how long* (``agent_runtime``'s TTL rule); this module is the
mechanism: pin the blocks a session's last request left behind, unpin at expiry or when the
session's next request is admitted, cap the share of the pool that pins may hold, and under
memory pressure release the latest-expiring pin first.
"""

from __future__ import annotations

from dataclasses import dataclass

from asymcache_core.block_pool import BlockPool


@dataclass
class Pin:
    """One session's pin.

    Attributes:
        session_id: the job/session.
        block_ids: pinned blocks (each pinned once).
        pinned_at: engine time of the pin.
        expires_at: engine time of its expiry.
    """

    session_id: str
    block_ids: list[int]
    pinned_at: float
    expires_at: float


class PinManager:
    """Owns every pin on a :class:`BlockPool`.

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
        return sum(len(p.block_ids) for p in self.pins.values())

    def is_pinned(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self.pins

    def remember(self, session_id: str, blocks: list[tuple[int, int]]) -> None:
        """Records ``(block_id, block_hash)`` of a session's just-finished request."""
        self.last_blocks[session_id] = blocks

    def forget(self, session_id: str) -> None:
        self.last_blocks.pop(session_id, None)
        self.unpin(session_id)

    def pin(self, session_id: str, ttl_s: float, now: float) -> int:
        """Pins the blocks of ``session_id``'s last request that are still cached.

        Returns:
            Blocks pinned (0 when nothing is left or ``ttl_s <= 0``).
        """
        self.unpin(session_id)
        if ttl_s <= 0:
            return 0
        blocks = [
            bid for bid, h in self.last_blocks.get(session_id, [])
            if self.pool.blocks[bid].block_hash == h
        ]
        if not blocks:
            return 0
        self.pool.pin(blocks)
        self.pins[session_id] = Pin(session_id, blocks, now, now + ttl_s)
        self.num_pins += 1
        self._enforce_cap()
        return len(blocks) if session_id in self.pins else 0

    def unpin(self, session_id: str) -> bool:
        pin = self.pins.pop(session_id, None)
        if pin is None:
            return False
        self.pool.unpin(pin.block_ids)
        return True

    def expire(self, now: float) -> list[str]:
        """Releases every pin whose TTL has passed; returns their sessions."""
        expired = [sid for sid, p in self.pins.items() if p.expires_at <= now]
        for sid in expired:
            self.unpin(sid)
        self.num_expired += len(expired)
        return expired

    def release_for_pressure(self) -> bool:
        """Releases the latest-expiring pin (memory pressure); False when none is left."""
        if not self.pins:
            return False
        latest = max(self.pins.values(), key=lambda p: p.expires_at)
        self.unpin(latest.session_id)
        self.num_released_pressure += 1
        return True

    def _enforce_cap(self) -> None:
        cap = int(self.max_pinned_fraction * self.pool.num_blocks)
        while self.pins and self.pool.num_pinned_idle > cap:
            self.release_for_pressure()

    def next_expiry(self) -> float | None:
        return min((p.expires_at for p in self.pins.values()), default=None)
