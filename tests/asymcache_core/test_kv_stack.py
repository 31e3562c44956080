"""The engine's KV side as :func:`~asymcache_core.kv_stack.build_kv_stack` wires it."""

from __future__ import annotations

import pytest

from asymcache_core.config import EngineConfig
from asymcache_core.job_admission import gate_capacity_blocks
from asymcache_core.job_stats import JobStats
from asymcache_core.kv_stack import build_kv_stack
from asymcache_core.latency_model import LatencyModel
from asymcache_core.memory_budget import GIB

LATENCY = LatencyModel(floor_s=0.01, per_token_s=1e-4, per_attn_s=1e-9, knee_tokens=64, source="synthetic")
BLOCK_BYTES = 1 << 20


def build(check_host_memory: bool = False, **overrides: object):  # type: ignore[no-untyped-def]
    config = EngineConfig(model="dummy:tiny", device="cpu", **overrides)  # type: ignore[arg-type]
    return build_kv_stack(
        config, num_blocks=64, block_bytes=BLOCK_BYTES, latency=LATENCY, job_stats=JobStats(),
        clock=lambda: 0.0, check_host_memory=check_host_memory,
    )


def test_the_policy_decides_the_gate_and_hole_reuse_unless_the_config_says() -> None:
    ours = build(eviction_policy="asymcache")
    assert ours.job_admission is not None and ours.kv.hole_reuse
    assert ours.job_admission.capacity_tokens == 64 * 16
    vllm = build(eviction_policy="vllm-apc")
    assert vllm.job_admission is None and not vllm.kv.hole_reuse
    assert build(eviction_policy="vllm-apc", job_admission=True).job_admission is not None
    assert build(eviction_policy="asymcache", job_admission=False).job_admission is None
    # the parts share one pool, and the pins and the controller one pin manager
    assert ours.kv.pool is ours.pool and ours.pins.pool is ours.pool and ours.continuum.pins is ours.pins


def test_a_host_tier_listens_to_the_pool_and_may_widen_the_gate() -> None:
    none = build()
    assert none.host_tier is None and none.num_host_blocks == 0 and none.kv.tier is None
    sized = build(cpu_offload_gb=0.25)  # 256 MiB of 1 MiB blocks
    assert sized.num_host_blocks == int(0.25 * GIB // BLOCK_BYTES) == 256
    assert sized.host_tier is not None and sized.host_tier in sized.pool.listeners and sized.kv.tier is sized.host_tier
    assert sized.job_admission is not None
    # the gate may widen by half of what the tier holds beyond the device; it starts at the
    # device pool and widens as far as the jobs it sees pause (test_job_admission)
    gate = sized.job_admission
    assert gate.tier_tokens == (gate_capacity_blocks(64, 256) - 64) * 16 > 0
    assert gate.capacity_tokens == gate.device_tokens == 64 * 16
    assert none.job_admission is not None and none.job_admission.tier_tokens == 0
    # a stated time-to-first-token target: the whole share from the start
    stated = build(cpu_offload_gb=0.25, ttft_slo_ms=5000.0).job_admission
    assert stated is not None and stated.capacity_tokens == gate_capacity_blocks(64, 256) * 16
    assert build(num_host_kv_blocks=10, cpu_offload_gb=0.25).num_host_blocks == 10  # blocks win over GB


def test_a_host_tier_the_machine_cannot_hold_is_refused_before_it_is_built() -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        build(check_host_memory=True, cpu_offload_gb=1 << 20)
    assert build(check_host_memory=False, num_host_kv_blocks=8).num_host_blocks == 8


def test_a_ttft_target_bounds_only_the_adaptive_order() -> None:
    assert build(priority="adaptive", ttft_slo_ms=2000).continuum.ttft_target is not None
    assert build(priority="adaptive").continuum.ttft_target is None
    assert build(priority="program", ttft_slo_ms=2000).continuum.ttft_target is None
