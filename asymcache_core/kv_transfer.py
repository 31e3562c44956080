"""The host KV tier's memory and the block copies between it and the device's paged caches.

The host tensor is slot-major, ``[num_slots, L, 2, block_size, H_kv, D]``: one slot is one
contiguous run of bytes (its K and V in every layer), so a run of consecutive slots is one copy.
The device cache is one tensor ``[L, 2, num_blocks, block_size, H_kv, D]`` (the model's per-layer
K and V caches are views of it), so one kernel gathers or scatters a block of every layer.

On CUDA the host tensor is pinned and the copies run on two copy streams (one per direction),
overlapped with the forward passes: a step's copies gather (or scatter) the device blocks
through a fixed staging buffer in slot-major order and move whole slots over PCIe. Ordering,
per step ``N``:

- each copy stream first waits for everything the compute stream has queued (the blocks it
  copies out were written by earlier steps; the blocks it copies into were read by them);
- the reloads also wait for the offloads that wrote the slots they read
  (:attr:`KVTransfers.reloads_after`) and for those named below; an event after each batch;
- the compute stream waits, before step ``N``'s forward, for the offloads of the latest step
  that copied out a block this step reuses (:attr:`KVTransfers.wait_offloads_of`; usually long
  complete, or step ``N`` itself when a victim's queued copy was issued only now);
- a request whose blocks are reloaded runs once its ticket's reload event has completed
  (:meth:`HostKVCache.is_complete`).

On the CPU both tiers are host memory and every copy completes when issued.
"""

from __future__ import annotations

import math

import torch

from asymcache_core.host_tier import KVTransfers
from kernels import block_copy


def _runs(pairs: list[tuple[int, int]], key: int) -> list[tuple[int, int]]:
    """``(start index into pairs, length)`` of runs whose element ``key`` is consecutive."""
    runs: list[tuple[int, int]] = []
    for i, pair in enumerate(pairs):
        if runs and pairs[i - 1][key] + 1 == pair[key] and i == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def staging_passes(pairs: list[tuple[int, int]], key: int, size: int) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """A step's copies as staging passes: ``(pairs of the pass, runs of consecutive host slots
    in it)``, at most ``size`` pairs a pass, the host slot being element ``key`` of a pair.

    The pairs are sorted by host slot first: each run is one host-device copy call, and a
    request's blocks come back from slots that are consecutive but not in the order of its
    block table. NOTE: in the simulator's SWE row with a 64 GB tier (seed 21, 3,000 blocks),
    125,723 reloaded blocks made 92,782 runs in table order and 3,963 sorted; each run costs
    the engine's thread a copy call before the step's forward is launched (H200, 256 blocks
    from reversed slots a step: 13.63 ms a decode step in table order, 11.75 sorted,
    ``scripts/gpu_copy_order.py``).
    """
    ordered = sorted(pairs, key=lambda pair: pair[key])
    chunks = [ordered[first : first + size] for first in range(0, len(ordered), size)]
    return [(chunk, _runs(chunk, key)) for chunk in chunks]


class HostKVCache:
    """Host slots of the KV tier and the copies of each step's :class:`KVTransfers`.

    Args:
        kv_cache: the device cache, ``[L, 2, num_blocks, block_size, H_kv, D]``.
        num_slots: host slots.
        staging_blocks: blocks one staging pass moves (CUDA; bounds its device memory).
    """

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, staging_blocks: int = 64) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache: expected [L, 2, blocks, block_size, H, D], got {tuple(kv_cache.shape)}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: must be one contiguous tensor (its blocks are copied as views of it)")
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.num_layers = kv_cache.shape[0]
        block_shape = tuple(kv_cache.shape[3:])
        self.cuda = self.device.type == "cuda"
        shape = (num_slots, self.num_layers, 2, *block_shape)
        try:
            self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=self.cuda)
        except (RuntimeError, MemoryError) as exc:
            # NOTE: pinned (page-locked) memory can fail well below the machine's RAM (a
            # container's lock limit, other pinned users); the message names the setting to lower.
            gib = math.prod(shape) * kv_cache.element_size() / (1 << 30)
            what = "pin" if self.cuda else "allocate"
            raise ValueError(
                f"cpu_offload_gb: could not {what} {gib:.1f} GiB of host memory for {num_slots} KV blocks "
                f"({str(exc).splitlines()[0]}); lower cpu_offload_gb"
            ) from exc
        self.offload_staging: torch.Tensor | None = None
        self.reload_staging: torch.Tensor | None = None
        self.offload_stream = self.reload_stream = None
        if self.cuda:
            shape = (staging_blocks, self.num_layers, 2, *block_shape)
            self.offload_staging = torch.empty(shape, dtype=kv_cache.dtype, device=self.device)
            self.reload_staging = torch.empty(shape, dtype=kv_cache.dtype, device=self.device)
            # NOTE: one stream per direction: PCIe is full duplex and the GPU has a copy engine
            # for each, so reloads do not queue behind offloads.
            self.offload_stream = torch.cuda.Stream(self.device)
            self.reload_stream = torch.cuda.Stream(self.device)
        self._reload_events: dict[int, torch.cuda.Event] = {}
        self._offload_events: dict[int, torch.cuda.Event] = {}
        # NOTE: the cache as ``[L * 2, num_blocks, piece]`` and the staging buffers as
        # ``[blocks, L * 2, piece]``: the block-copy kernels' views. ``copy_launch`` ``None``
        # (off CUDA, or no Triton) runs their torch twins.
        self.pieces = kv_cache.view(self.num_layers * 2, kv_cache.shape[2], -1)
        self.copy_launch: block_copy.CopyLaunch | None = (
            block_copy.DEFAULT_LAUNCH if self.cuda and block_copy.triton is not None else None
        )

    @property
    def slot_bytes(self) -> int:
        return self.host[0].numel() * self.host.element_size()

    # -- the step's copies -------------------------------------------------------------------
    def issue(self, transfers: KVTransfers) -> None:
        """Issues a step's copies before its forward pass and makes the forward (and the
        reloads) wait for the offloads the plan names."""
        if not self.cuda:
            self._copy_cpu(transfers)
            return
        assert self.offload_stream is not None and self.reload_stream is not None
        main = torch.cuda.current_stream(self.device)
        wait_for = transfers.wait_offloads_of
        reuse_waits = [e for t, e in self._offload_events.items() if wait_for is not None and t <= wait_for]
        if transfers.offloads:
            self.offload_stream.wait_stream(main)
            with torch.cuda.stream(self.offload_stream):
                self._offload_cuda(transfers.offloads)
                self._offload_events[transfers.ticket] = self.offload_stream.record_event()
            if wait_for == transfers.ticket:
                reuse_waits.append(self._offload_events[transfers.ticket])
        if transfers.reloads:
            after = transfers.reloads_after
            self.reload_stream.wait_stream(main)
            for ticket, event in self._offload_events.items():
                if (after is not None and ticket <= after) or event in reuse_waits:
                    self.reload_stream.wait_event(event)
            with torch.cuda.stream(self.reload_stream):
                self._reload_cuda(transfers.reloads)
                self._reload_events[transfers.ticket] = self.reload_stream.record_event()
        for event in reuse_waits:
            main.wait_event(event)  # a block it copies out is written by this step
        for ticket in [t for t, e in self._offload_events.items() if t != transfers.ticket and e.query()]:
            del self._offload_events[ticket]

    def is_complete(self, ticket: int) -> bool:
        """Whether the reloads of ``ticket`` have landed on the device."""
        event = self._reload_events.get(ticket)
        if event is None:
            return True
        if not event.query():
            return False
        # NOTE: complete on the copy stream; the compute stream still orders after it.
        torch.cuda.current_stream(self.device).wait_event(event)
        del self._reload_events[ticket]
        return True

    def wait(self, ticket: int) -> None:
        """Blocks the host until the reloads of ``ticket`` have landed."""
        event = self._reload_events.pop(ticket, None)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        """Blocks until every copy issued so far has landed."""
        for stream in (self.offload_stream, self.reload_stream):
            if stream is not None:
                stream.synchronize()
        self._reload_events.clear()
        self._offload_events.clear()

    # -- CPU ---------------------------------------------------------------------------------
    def _copy_cpu(self, transfers: KVTransfers) -> None:
        if transfers.offloads:
            blocks = torch.tensor([b for b, _ in transfers.offloads], dtype=torch.long)
            slots = torch.tensor([s for _, s in transfers.offloads], dtype=torch.long)
            self.host[slots] = self.kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5)
        if transfers.reloads:
            slots = torch.tensor([s for s, _ in transfers.reloads], dtype=torch.long)
            blocks = torch.tensor([b for _, b in transfers.reloads], dtype=torch.long)
            self.kv_cache.index_copy_(2, blocks, self.host[slots].permute(1, 2, 0, 3, 4, 5))

    # -- CUDA (on the copy streams) ----------------------------------------------------------
    def _device_index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, copied from pinned memory on the current (copy) stream.

        NOTE: a copy from pageable memory would be synchronous and could serialize with the
        compute stream; a pinned source keeps it asynchronous and ordered on this stream.
        """
        return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def staged(self, staging: torch.Tensor) -> torch.Tensor:
        """A staging buffer as the block-copy kernels see it: ``[blocks, L * 2, piece]``."""
        return staging.view(staging.shape[0], *self.pieces.shape[::2])

    def _offload_cuda(self, offloads: list[tuple[int, int]]) -> None:
        staging = self.offload_staging
        assert staging is not None
        for chunk, runs in staging_passes(offloads, 1, staging.shape[0]):
            blocks = self._device_index([b for b, _ in chunk])
            block_copy.gather_blocks(self.pieces, blocks, self.staged(staging), self.copy_launch)
            for start, length in runs:
                slot = chunk[start][1]
                self.host[slot : slot + length].copy_(staging[start : start + length], non_blocking=True)

    def _reload_cuda(self, reloads: list[tuple[int, int]]) -> None:
        staging = self.reload_staging
        assert staging is not None
        for chunk, runs in staging_passes(reloads, 0, staging.shape[0]):
            for start, length in runs:
                slot = chunk[start][0]
                staging[start : start + length].copy_(self.host[slot : slot + length], non_blocking=True)
            blocks = self._device_index([b for _, b in chunk])
            block_copy.scatter_blocks(self.staged(staging), blocks, self.pieces, self.copy_launch)
