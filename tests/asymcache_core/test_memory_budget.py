"""Sizing the KV pool from device memory (``--gpu-memory-utilization``)."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import Engine, EngineConfig
from asymcache_core.loaders import resolve_hf_config
from asymcache_core.memory_budget import GIB, activation_reserve_bytes, plan_kv_pool
from asymcache_core.models import ModelConfig


def llama8b() -> ModelConfig:
    return ModelConfig.from_hf(resolve_hf_config("dummy:llama-3.1-8b")[0])


def test_plan_splits_the_budget_into_weights_activations_and_blocks():
    model = llama8b()
    plan = plan_kv_pool(
        model, gpu_memory_utilization=0.9, total_bytes=140 * GIB, block_size=16, dtype_bytes=2,
        max_num_batched_tokens=8192, max_num_seqs=256,
    )
    # Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB a token.
    assert plan.block_bytes == 16 * 128 * 1024
    assert plan.weight_bytes == model.num_params * 2
    assert plan.budget_bytes == int(0.9 * 140 * GIB)
    left = plan.budget_bytes - plan.weight_bytes - plan.activation_bytes
    assert plan.num_blocks == left // plan.block_bytes
    assert 50_000 < plan.num_blocks < 60_000  # ~110 GiB of KV after ~15 GiB of weights
    assert f"{plan.num_blocks} KV blocks" in plan.describe()
    # a bigger step reserves more and leaves fewer blocks; a higher utilization leaves more
    bigger = plan_kv_pool(model, gpu_memory_utilization=0.9, total_bytes=140 * GIB, block_size=16, dtype_bytes=2,
                          max_num_batched_tokens=32768, max_num_seqs=256)
    higher = plan_kv_pool(model, gpu_memory_utilization=0.95, total_bytes=140 * GIB, block_size=16, dtype_bytes=2,
                          max_num_batched_tokens=8192, max_num_seqs=256)
    assert bigger.num_blocks < plan.num_blocks < higher.num_blocks


def test_activation_reserve_grows_with_the_step():
    model = llama8b()
    small = activation_reserve_bytes(model, max_num_batched_tokens=512, max_num_seqs=8, dtype_bytes=2)
    large = activation_reserve_bytes(model, max_num_batched_tokens=8192, max_num_seqs=8, dtype_bytes=2)
    assert large - small == (8192 - 512) * (4 * model.hidden_size + 3 * model.intermediate_size) * 2


def test_no_room_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: 0.1 of 140.0 GiB leaves no room"):
        plan_kv_pool(llama8b(), gpu_memory_utilization=0.1, total_bytes=140 * GIB, block_size=16, dtype_bytes=2,
                     max_num_batched_tokens=8192, max_num_seqs=256)
    with pytest.raises(ValueError, match="^gpu_memory_utilization: must be a number in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="^device_memory_gib: must be a positive number"):
        EngineConfig(device_memory_gib=-1.0)


def test_simulated_engine_gets_the_pool_of_the_device_it_simulates():
    engine = Engine.simulated(
        None, model="dummy:llama-3.1-8b", dtype="bfloat16", gpu_memory_utilization=0.9, device_memory_gib=140.0,
        max_num_batched_tokens=8192, max_num_seqs=256,
    )
    expected = plan_kv_pool(llama8b(), gpu_memory_utilization=0.9, total_bytes=140 * GIB, block_size=16,
                            dtype_bytes=2, max_num_batched_tokens=8192, max_num_seqs=256)
    assert engine.num_blocks == expected.num_blocks == engine.memory_plan.num_blocks
    assert engine.stats().kv_blocks_total == expected.num_blocks
    with pytest.raises(ValueError, match="^device_memory_gib: a simulated device needs its memory"):
        Engine.simulated(None, model="dummy:llama-3.1-8b", gpu_memory_utilization=0.9)
    # an explicit pool wins over the memory split
    assert Engine.simulated(None, model="dummy:llama-3.1-8b", num_kv_blocks=77, gpu_memory_utilization=0.9,
                            device_memory_gib=140.0).num_blocks == 77


def test_real_cpu_engine_measures_its_weights(smollm):
    from tests.conftest import make_engine

    engine = make_engine(smollm, num_kv_blocks=None, gpu_memory_utilization=0.9, device_memory_gib=2.0)
    plan = engine.memory_plan
    assert plan is not None and plan.num_blocks == engine.num_blocks > 0
    from kernels.cpu_linear import packed_weight_bytes

    weights = sum(p.numel() * p.element_size() for p in smollm.model.parameters())
    # with the packed copies of the few-row op where it runs oneDNN's form (kernels/cpu_linear.py)
    assert plan.weight_bytes == weights + packed_weight_bytes(smollm.model, torch.get_num_threads())
    assert plan.activation_bytes == activation_reserve_bytes(
        engine.model_config, max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_num_seqs=engine.config.max_num_seqs, dtype_bytes=4, runtime_overhead_bytes=0,
    )


def test_a_cpu_plan_counts_the_packed_weight_copies_of_the_few_row_op(monkeypatch):
    from asymcache_core.memory_budget import plan_for_device
    from kernels import cpu_linear

    model = llama8b()
    weights = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    kwargs = dict(gpu_memory_utilization=0.9, device=torch.device("cpu"), block_size=16, dtype_bytes=4,
                  max_num_batched_tokens=256, max_num_seqs=8, weights=weights, device_memory_bytes=64 * GIB)
    params = sum(p.numel() * 4 for p in weights.parameters())
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("library",) * len(cpu_linear.ROW_BUCKETS))
    plain = plan_for_device(model, **kwargs)
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("onednn",) * len(cpu_linear.ROW_BUCKETS))
    packed = plan_for_device(model, **kwargs)
    assert plain.weight_bytes == params
    assert packed.weight_bytes == params + 2 * 1024 * 2048 * 4  # each linear weight a second time
    assert packed.num_blocks < plain.num_blocks
