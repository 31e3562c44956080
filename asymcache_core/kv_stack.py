"""The engine's KV side, built from one :class:`EngineConfig`: the device block pool with its
eviction policy, the host tier below it, the cache manager over both, the KV event publisher,
Continuum's pins and controller, and job admission.

:func:`build_kv_stack` wires them the way :class:`~asymcache_core.engine.Engine` runs them; the
engine keeps each part as an attribute of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from asymcache_core.block_pool import BlockPool
from asymcache_core.config import EngineConfig
from asymcache_core.continuum.backends import PinManager
from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.continuum.ttft_target import TTFTTarget
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.host_tier import HostTier
from asymcache_core.job_admission import JobAdmission, gate_capacity_blocks
from asymcache_core.job_stats import JobStats
from asymcache_core.kv_cache_manager import KVCacheManager
from asymcache_core.kv_events import KVEventCollector, create_kv_events
from asymcache_core.latency_model import LatencyModel
from asymcache_core.memory_budget import GIB, check_block_tables_fit, check_host_tier_fits


class KVStack(NamedTuple):
    """The parts of the engine's KV side (:func:`build_kv_stack`).

    Attributes:
        pool: the device block pool, evicting under ``config.eviction_policy``.
        host_tier: the host tier below it (``None``: no ``cpu_offload_gb``).
        num_host_blocks: blocks of the host tier (0 without one).
        kv: the cache manager over the pool and the tier.
        kv_events: publishes stored / removed blocks for KV-aware routers (``None``: no
            ``kv_events_config``).
        pins: Continuum's pins of finished turns' blocks.
        continuum: the controller that prices pins and orders waiting requests.
        job_admission: the job gate (``None``: the policy and the config leave it off).
    """

    pool: BlockPool
    host_tier: HostTier | None
    num_host_blocks: int
    kv: KVCacheManager
    kv_events: KVEventCollector | None
    pins: PinManager
    continuum: ContinuumController
    job_admission: JobAdmission | None


def build_kv_stack(
    config: EngineConfig,
    *,
    num_blocks: int,
    block_bytes: int,
    latency: LatencyModel,
    job_stats: JobStats,
    clock: Callable[[], float],
    check_host_memory: bool,
) -> KVStack:
    """The KV side of an engine.

    Args:
        config: the engine's configuration.
        num_blocks: blocks of the device pool.
        block_bytes: bytes of one block (every layer's K and V), which sizes the host tier
            from ``cpu_offload_gb``.
        latency: the latency model the eviction scores, the tier's reload-or-recompute choice
            and the pins price with.
        job_stats: the per-job statistics they share.
        clock: the engine's clock.
        check_host_memory: refuse a host tier the machine cannot hold (a real engine; a
            simulated one allocates no host memory).
    """
    context = PolicyContext(config.block_size, latency, job_stats)
    policy = create_policy(config.eviction_policy, context)
    num_host_blocks = config.num_host_kv_blocks
    if num_host_blocks is None:
        num_host_blocks = int(config.cpu_offload_gb * GIB // block_bytes)
    host_field = "cpu_offload_gb" if config.num_host_kv_blocks is None else "num_host_kv_blocks"
    if check_host_memory and num_host_blocks > 0:
        # NOTE: checked before the tier's block table is built: a tier larger than the
        # machine can never be allocated, and building its table alone would take minutes.
        check_host_tier_fits(num_host_blocks * block_bytes, host_field)
    # NOTE: before any table is built: each block is a Python object of the pools' bookkeeping
    # (a simulated engine's whole cost), and a count past the machine's memory would only be
    # found when the process is killed
    check_block_tables_fit(num_blocks, num_host_blocks, host_field)
    pool = BlockPool(num_blocks, policy, clock)
    host_tier = None
    if num_host_blocks > 0:
        host_policy = create_policy(config.host_eviction_policy or config.eviction_policy, context)
        host_tier = HostTier(num_host_blocks, host_policy, clock, block_bytes=block_bytes, latency=latency)
        pool.listeners.append(host_tier)
    hole_reuse = policy.hole_reuse if config.hole_reuse is None else config.hole_reuse
    kv = KVCacheManager(pool, config.block_size, hole_reuse, tier=host_tier)
    kv_events = create_kv_events(config.kv_events_config, pool, host_tier, kv, config.block_size)
    pins = PinManager(pool)
    continuum = ContinuumController(pins, latency, job_stats, clock)
    if config.ttft_slo_ms is not None and config.priority == "adaptive":
        # NOTE: only the adaptive order moves requests ahead of their arrival and takes the
        # bound (Continuum's own ``program`` order is kept as the paper has it; ``fcfs``
        # is arrival order already)
        continuum.ttft_target = TTFTTarget(config.ttft_slo_ms / 1e3)
    gate = policy.job_admission if config.job_admission is None else config.job_admission
    # NOTE: jobs whose contexts the host tier holds come back by copy, not by
    # recomputation: the gate counts part of the tier, as far as jobs pause (at most half of
    # what it holds beyond the device: gate_capacity_blocks says why not all)
    tier_blocks = gate_capacity_blocks(num_blocks, num_host_blocks) - num_blocks
    job_admission = (
        JobAdmission(
            num_blocks * config.block_size,
            tier_tokens=tier_blocks * config.block_size,
            min_held_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            # NOTE: a stated time-to-first-token target: the turns the gate holds are the tail
            tier_for_ttft=config.ttft_slo_ms is not None,
        )
        if gate
        else None
    )
    return KVStack(pool, host_tier, num_host_blocks, kv, kv_events, pins, continuum, job_admission)
