"""The host KV tier: a second, larger pool of KV blocks in host memory, below the device pool.

A block's life with the tier on:

- When a device block becomes an eviction candidate (no request holds it, no pin, cached
  content), it is queued for a copy to the host. The queued copies of a step are issued at its
  start on the copy stream, so they overlap its compute. A block whose hash the host already
  holds is not copied again: the hash chain says it is the same tokens at the same positions.
- The device pool evicts as before; an evicted block's content lives on in its host copy. A
  victim whose copy was queued but not issued yet is copied in the step that reuses it, and
  that step's forward waits for the copy; a victim whose copy was issued in an earlier step
  makes the forward wait for that step's copies (:attr:`KVTransfers.wait_offloads_of`).
- A lookup that misses a block on the device and finds it on the host either reloads the run
  of such blocks into fresh device blocks (host -> device) or recomputes it as a hole,
  whichever the cost model says is cheaper (:meth:`HostTier.reload_seconds` against the
  latency model's rebuild time); in prefix-only mode every host hit is reloaded, as vLLM's
  offloading connector does. A request whose blocks are loading waits until its copies are
  complete (:attr:`KVTransfers.ticket`) while the rest of the batch runs.
- The host pool evicts under its own policy (the same protocol, its own candidates).

Host slots are kept by a :class:`~asymcache_core.block_pool.BlockPool` of their own: a slot is
referenced while a copy that reads it may be in flight, a candidate otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from asymcache_core.block_pool import BlockPool, KVBlock
from asymcache_core.eviction.base import EvictionPolicy
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

#: Fixed cost of one batch of copies (the gather or scatter kernels per layer, launches, the
#: PCIe round trip), seconds: 0.4-1.6 ms per batch on an H200 for an 8B model (BENCHMARKS.md).
COPY_LATENCY_S = 1e-3


class KVTransfers(NamedTuple):
    """The block copies of one step, issued before its forward pass.

    Attributes:
        ticket: identifies this step's copies; a request whose blocks are loaded here runs
            once the runner reports the ticket complete.
        offloads: ``(device block, host slot)`` copies device -> host, issued first.
        reloads: ``(host slot, device block)`` copies host -> device, issued after them.
        wait_offloads_of: the forward and this step's reloads first wait for the offloads of
            this ticket and every earlier one: a block they copy out is reused and written by
            this step (``None``: no such block). It is this ticket when a victim's copy was
            queued but only issued now.
        reloads_after: the reloads first wait for the offloads of this ticket and every
            earlier one, which wrote the host slots they read (``None``: none in flight).
    """

    ticket: int
    offloads: list[tuple[int, int]]
    reloads: list[tuple[int, int]]
    wait_offloads_of: int | None
    reloads_after: int | None = None

    @property
    def is_empty(self) -> bool:
        return not self.offloads and not self.reloads


@dataclass
class HostTierCounters:
    """Run-wide counters of the tier (blocks unless named otherwise)."""

    offloaded: int = 0
    reloaded: int = 0
    prefetched: int = 0
    recompute_chosen: int = 0
    dropped: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0


@dataclass(frozen=True)
class _Snapshot:
    """What the host copy of a device block needs of it (the device block may be reused)."""

    block_id: int
    block_hash: int
    position: int
    job_id: str | None
    jobs: frozenset[str]


class HostTier:
    """The host pool, the queue of copies to it, and the cost of a reload.

    Invariants (:meth:`check_integrity`): the host pool's own; every queued device block holds
    cached content that the host does not hold yet (or did not when it was queued); a slot read
    by a reload stays referenced until that reload has landed.

    Args:
        num_blocks: host slots.
        policy: the host pool's eviction policy (its own instance).
        clock: engine time.
        block_bytes: bytes of one block in every layer (K and V).
        latency: the engine's latency model (copy bandwidth, rebuild cost).
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        clock: Callable[[], float],
        *,
        block_bytes: int,
        latency: LatencyModel,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_host_kv_blocks: must be positive, got {num_blocks!r}")
        self.pool = BlockPool(num_blocks, policy, clock)
        self.block_bytes = block_bytes
        self.latency = latency
        self.counters = HostTierCounters()
        self._queued: dict[int, KVBlock] = {}
        self._evicted: list[_Snapshot] = []
        self._reloads: list[tuple[int, int]] = []
        # (ticket, host slots its reloads read): held until the ticket is complete
        self._reading: list[tuple[int, list[int]]] = []
        # host slot -> ticket of the offload that last wrote it (at most one entry per slot)
        self._written_by: dict[int, int] = {}
        self._ticket = 0
        # device block -> ticket whose offloads copied it out (until the block is reused)
        self._copied_by: dict[int, int] = {}
        self._wait_for: int | None = None
        #: the runner's answer to "have the copies of this ticket landed?" (set by the engine);
        #: asked only of tickets already handed to it (:meth:`is_complete`)
        self.copies_landed: Callable[[int], bool] = lambda ticket: True
        #: blocks until the copies of a ticket are complete (set by the engine)
        self.wait: Callable[[int], None] = lambda ticket: None

    # -- the device pool's listener --------------------------------------------------------
    def on_cached(self, block: KVBlock) -> None:
        """Nothing to do: a block is copied out once it becomes a candidate."""

    def on_candidate(self, block: KVBlock) -> None:
        """A device block became an eviction candidate: queue its copy unless the host has it
        or the host policy sees no use for it (e.g. every job that used it is done)."""
        if block.block_hash is None or block.block_hash in self.pool.cached:
            return
        if self.pool.policy.worth_keeping(block, self.pool.clock()):
            self._queued[block.block_id] = block

    def on_evict(self, block: KVBlock) -> None:
        """A device block is about to lose its content: a queued copy must be issued first,
        and a copy issued earlier must have landed before the block is written."""
        ticket = self._copied_by.pop(block.block_id, None)
        if ticket is not None:
            self._wait_for = ticket if self._wait_for is None else max(self._wait_for, ticket)
        if self._queued.pop(block.block_id, None) is not None:
            assert block.block_hash is not None
            self._evicted.append(
                _Snapshot(block.block_id, block.block_hash, block.position, block.job_id, block.jobs)
            )

    def on_uncache(self, block_id: int) -> None:
        """A device block's content is not trustworthy (a failed step wrote it): never copy it."""
        self._queued.pop(block_id, None)
        ticket = self._copied_by.pop(block_id, None)
        if ticket is not None:
            self._wait_for = ticket if self._wait_for is None else max(self._wait_for, ticket)
        self._evicted = [s for s in self._evicted if s.block_id != block_id]

    # -- lookups and reloads ---------------------------------------------------------------
    @property
    def ticket(self) -> int:
        """The ticket the copies planned now will carry."""
        return self._ticket

    def is_complete(self, ticket: int) -> bool:
        """Whether the copies of ``ticket`` have landed on the device.

        NOTE: the copies planned now carry :attr:`ticket` and reach the runner only after the
        schedule that plans them (:meth:`take_transfers`, then the step's launch); the runner
        has no record of them yet and would call them complete, so a block still to be
        reloaded would read as loaded to a request admitted before they land.
        """
        return ticket < self._ticket and self.copies_landed(ticket)

    def lookup(self, block_hash: int) -> int | None:
        """The host slot holding ``block_hash``, or ``None``."""
        return self.pool.lookup(block_hash)

    def reload(self, slot: int, device_block: int, *, prefetch: bool = False) -> None:
        """Plans a copy of ``slot`` into ``device_block`` in this step (the slot stays held
        until the next step has issued its copies)."""
        self.pool.touch([slot])
        self._reloads.append((slot, device_block))
        self.counters.reloaded += 1
        if prefetch:
            self.counters.prefetched += 1
        self.counters.bytes_to_device += self.block_bytes

    def reload_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` blocks from the host to the device."""
        if num_blocks <= 0:
            return 0.0
        return COPY_LATENCY_S + num_blocks * self.block_bytes / self.latency.copy_bandwidth(True)

    def offload_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` blocks from the device to the host."""
        if num_blocks <= 0:
            return 0.0
        return COPY_LATENCY_S + num_blocks * self.block_bytes / self.latency.copy_bandwidth(False)

    def due_for_prefetch(
        self, last_blocks: Mapping[str, list[tuple[int, int]]], job_stats: JobStats, now: float, lead_s: float
    ) -> list[str]:
        """Paused jobs whose blocks should start coming back now, soonest first.

        A job is due when its expected return (:meth:`JobStats.expected_return`: the runtime's
        tool-pause hint, else its own gaps) is closer than the copy of its blocks plus ``lead_s``.

        Args:
            last_blocks: job -> ``(block, hash)`` of its last finished request (the pins').
            job_stats: the engine's job statistics.
            now: engine time.
            lead_s: margin before the return (a few steps).
        """
        due: list[tuple[float, str]] = []
        for job_id, blocks in last_blocks.items():
            back = job_stats.expected_return(job_id)
            if blocks and back is not None and 0 <= back - now <= self.reload_seconds(len(blocks)) + lead_s:
                due.append((back, job_id))
        return [job_id for _, job_id in sorted(due)]

    def clear(self) -> int:
        """Forgets every copy: those queued and not issued yet, and every host slot that no
        reload in flight reads (a cache reset: a later lookup finds nothing it dropped).

        Returns:
            Host slots dropped.
        """
        # NOTE: a dropped snapshot's device block is being reused: its copy, never issued,
        # needs no wait either.
        self._queued.clear()
        self._evicted.clear()
        return self.pool.evict_all()

    # -- the step's copies -----------------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        """Closes this step's copies: the queued offloads get host slots, the planned reloads
        go with them; the slots the previous step read are released."""
        # NOTE: a slot a reload reads stays held until that reload has landed, so no offload
        # can overwrite it while the copy may still be reading it.
        reading: list[tuple[int, list[int]]] = []
        for ticket, slots in self._reading:
            if self.is_complete(ticket):
                self.pool.free(slots)
            else:
                reading.append((ticket, slots))
        self._reading = reading
        wait = self._ticket if self._evicted else self._wait_for
        self._wait_for = None
        offloads: list[tuple[int, int]] = []
        snapshots = self._evicted + [
            _Snapshot(b.block_id, b.block_hash, b.position, b.job_id, b.jobs)  # type: ignore[arg-type]
            for b in self._queued.values()
        ]
        self._evicted, self._queued = [], {}
        for snap in snapshots:
            if snap.block_hash in self.pool.cached:
                continue
            if self.pool.num_free_blocks == 0:
                self.counters.dropped += 1  # every slot is being read this step
                continue
            slot = self.pool.allocate(1, snap.job_id)[0]
            host_block = self.pool.blocks[slot]
            host_block.jobs = snap.jobs
            self.pool.cache_block(slot, snap.block_hash, snap.position)
            self.pool.free([slot])
            offloads.append((snap.block_id, slot))
            self._copied_by[snap.block_id] = self._ticket
            self._written_by[slot] = self._ticket
        self.counters.offloaded += len(offloads)
        self.counters.bytes_to_host += len(offloads) * self.block_bytes
        reloads, self._reloads = self._reloads, []
        if reloads:
            self._reading.append((self._ticket, [slot for slot, _ in reloads]))
        after = max((self._written_by[s] for s, _ in reloads if s in self._written_by), default=None)
        transfers = KVTransfers(self._ticket, offloads, reloads, wait, after)
        self._ticket += 1
        return transfers

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` when an invariant of the class docstring is broken."""
        self.pool.check_integrity()
        for block_id, block in self._queued.items():
            assert block.block_id == block_id and block.block_hash is not None, f"queued block {block_id} uncached"
        reading: dict[int, int] = {}
        for slot in [s for _, slots in self._reading for s in slots] + [slot for slot, _ in self._reloads]:
            reading[slot] = reading.get(slot, 0) + 1
        for block in self.pool.blocks:
            assert block.pin_cnt == 0, f"host slot {block.block_id} pinned"
            assert block.ref_cnt == reading.get(block.block_id, 0), f"host slot {block.block_id}: reads"
