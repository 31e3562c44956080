"""Sizing the KV pool from device memory, the way a server sizes it.

vLLM's ``--gpu-memory-utilization U`` means: the engine may use ``U`` of the device's total
memory for everything it holds (weights, the activations of its largest step and the KV pool);
the pool gets what is left after the other two. :func:`plan_kv_pool` does that arithmetic for a
real device (weights measured) and for a simulated one (weights from the parameter count), so a
simulated H200 gets the pool a real one would.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from asymcache_core.models import ModelConfig

GIB = 1 << 30

#: Memory a step needs beyond its activations: CUDA graphs' pools, the allocator's slack, the
#: sampler's buffers. vLLM's profiling run sees about this much on an 8B model.
RUNTIME_OVERHEAD_BYTES = 1 * GIB


class KVPoolPlan(NamedTuple):
    """How the device memory was split (bytes), and the pool it leaves.

    Attributes:
        total_bytes: the device's memory.
        budget_bytes: ``gpu_memory_utilization x total_bytes``, what the engine may use.
        weight_bytes: the model's weights.
        activation_bytes: the reserve for the largest step's activations and the runtime.
        block_bytes: bytes of one KV block (every layer, K and V).
        num_blocks: blocks of the pool.
    """

    total_bytes: int
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    block_bytes: int
    num_blocks: int

    def describe(self) -> str:
        """One line for logs and reports: what the pool got and why."""
        return (
            f"{self.num_blocks} KV blocks ({self.num_blocks * self.block_bytes / GIB:.1f} GiB) = "
            f"{self.budget_bytes / GIB:.1f} of {self.total_bytes / GIB:.1f} GiB - weights "
            f"{self.weight_bytes / GIB:.1f} GiB - activations {self.activation_bytes / GIB:.1f} GiB"
        )


def activation_reserve_bytes(
    model: ModelConfig,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype_bytes: int,
    runtime_overhead_bytes: int = RUNTIME_OVERHEAD_BYTES,
) -> int:
    """Peak memory of the largest step beyond weights and KV, estimated from the model's shapes.

    NOTE: a step of ``T`` tokens holds at most a few ``[T, hidden]`` tensors and the MLP's
    ``[T, 2 x intermediate]`` gate/up output at once (layers run one after another), plus fp32
    logits for the sampled rows only (one per running sequence). vLLM measures this with a
    profiling run; the estimate is within its order and keeps the simulator device-free.

    Args:
        model: the model's shapes.
        max_num_batched_tokens: tokens of the largest step.
        max_num_seqs: rows the sampler sees at most.
        dtype_bytes: bytes of the activation dtype.
        runtime_overhead_bytes: added for what is not activations (CUDA graphs, allocator).

    Returns:
        Bytes to keep free for activations and the runtime.
    """
    per_token = (4 * model.hidden_size + 3 * model.intermediate_size) * dtype_bytes
    logits = max_num_seqs * model.vocab_size * 4
    return max_num_batched_tokens * per_token + logits + runtime_overhead_bytes


def plan_kv_pool(
    model: ModelConfig,
    *,
    gpu_memory_utilization: float,
    total_bytes: int,
    block_size: int,
    dtype_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    weight_bytes: int | None = None,
    runtime_overhead_bytes: int = RUNTIME_OVERHEAD_BYTES,
) -> KVPoolPlan:
    """The KV pool ``gpu_memory_utilization`` of a device leaves after weights and activations.

    Args:
        model: the model's shapes.
        gpu_memory_utilization: share of ``total_bytes`` the engine may use, in (0, 1].
        total_bytes: the device's memory.
        block_size: tokens per KV block.
        dtype_bytes: bytes of the KV (and weight) dtype.
        max_num_batched_tokens: tokens of the largest step (the activation reserve).
        max_num_seqs: running sequences at most (the logits reserve).
        weight_bytes: measured weight memory; ``None``: parameter count x ``dtype_bytes``.
        runtime_overhead_bytes: reserve beyond activations (0 on a CPU: no graphs, no allocator
            pools).

    Returns:
        The split and the pool.

    Raises:
        ValueError: a utilization outside (0, 1], or one that leaves no room for a block (the
        message names ``gpu_memory_utilization`` and says what took the memory).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    weights = model.num_params * dtype_bytes if weight_bytes is None else weight_bytes
    activations = activation_reserve_bytes(
        model, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype_bytes=dtype_bytes,
        runtime_overhead_bytes=runtime_overhead_bytes,
    )
    budget = int(gpu_memory_utilization * total_bytes)
    block_bytes = model.kv_bytes_per_token(dtype_bytes) * block_size
    num_blocks = (budget - weights - activations) // block_bytes
    plan = KVPoolPlan(total_bytes, budget, weights, activations, block_bytes, max(0, num_blocks))
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {total_bytes / GIB:.1f} GiB leaves no room for "
            f"the KV pool after {weights / GIB:.1f} GiB of weights and {activations / GIB:.1f} GiB of "
            "activations; raise it or give --num-kv-blocks"
        )
    return plan


def plan_for_device(
    model: ModelConfig,
    *,
    gpu_memory_utilization: float,
    device: torch.device,
    block_size: int,
    dtype_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    weights: torch.nn.Module | None = None,
    device_memory_bytes: int | None = None,
    batch_invariant: bool = False,
) -> KVPoolPlan:
    """:func:`plan_kv_pool` for a device: a real one (``weights`` loaded on it, measured) or a
    simulated one (no ``weights``: its parameter count, and ``device_memory_bytes`` needed).

    Args:
        model: the model's shapes.
        gpu_memory_utilization: share of the device's memory the engine may use.
        device: where the engine runs (a simulated engine's is the host's ``cpu``).
        block_size: tokens per KV block.
        dtype_bytes: bytes of the KV (and weight) dtype.
        max_num_batched_tokens: tokens of the largest step.
        max_num_seqs: running sequences at most.
        weights: the loaded model (``None``: a simulated device).
        device_memory_bytes: the memory to split (default: the CUDA device's total; a CPU's
            available RAM plus the weights already loaded into it).
        batch_invariant: the engine runs in batch-invariant mode (on the CPU its linear op may
            pack the weights a second time: :func:`kernels.cpu_linear.packed_weight_bytes`).

    Returns:
        The split.

    Raises:
        ValueError: a simulated device without ``device_memory_bytes``, or no room for a block.
    """
    weight_bytes = None if weights is None else sum(p.numel() * p.element_size() for p in weights.parameters())
    total = device_memory_bytes
    if total is None and weights is None:
        raise ValueError(
            "device_memory_gib: a simulated device needs its memory to apply gpu_memory_utilization "
            "(--device-memory-gib, or a latency profile that records it)"
        )
    if total is None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    elif total is None:
        total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + (weight_bytes or 0)
    if weights is not None and device.type == "cpu":
        from kernels.cpu_linear import packed_weight_bytes

        # NOTE: the CPU's linear op may read oneDNN's packed copies of the linear weights,
        # made at their first call: memory the weights take a second time.
        weight_bytes = (weight_bytes or 0) + packed_weight_bytes(weights, torch.get_num_threads(), batch_invariant)
    return plan_kv_pool(
        model, gpu_memory_utilization=gpu_memory_utilization, total_bytes=total, block_size=block_size,
        dtype_bytes=dtype_bytes, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        weight_bytes=weight_bytes,
        # NOTE: a real CPU engine has no CUDA graphs or allocator pools to reserve for.
        runtime_overhead_bytes=0 if weights is not None and device.type == "cpu" else RUNTIME_OVERHEAD_BYTES,
    )


def check_device_pool_fits(pool_bytes: int, device: torch.device) -> None:
    """Raises ``ValueError`` naming ``num_kv_blocks`` when a KV pool of ``pool_bytes`` exceeds
    the device's whole memory (the host's on the CPU): allocating it would fail deep inside,
    or on the CPU swap the machine until the kernel kills the process.

    Args:
        pool_bytes: the pool's size.
        device: where it would live.
    """
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    elif device.type == "cpu":
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return
    if pool_bytes > total:
        raise ValueError(
            f"num_kv_blocks: a KV pool of {pool_bytes / GIB:.1f} GiB does not fit the {total / GIB:.1f} GiB "
            f"of {'the device' if device.type == 'cuda' else 'this machine'}"
        )


#: Host bytes of one block's bookkeeping in the pools (its Python object and table entries;
#: ~240 measured for a million blocks of a simulated engine), rounded up.
BLOCK_TABLE_BYTES = 256


def check_block_tables_fit(num_blocks: int, num_host_blocks: int, host_field: str = "cpu_offload_gb") -> None:
    """Raises ``ValueError`` naming the setting when the pools' block tables alone would not fit
    this machine's memory (:data:`BLOCK_TABLE_BYTES` a block, device and host tier).

    Args:
        num_blocks: blocks of the device pool.
        num_host_blocks: blocks of the host tier.
        host_field: the setting that sized the tier.
    """
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for name, count in (("num_kv_blocks", num_blocks), (host_field, num_host_blocks)):
        if count * BLOCK_TABLE_BYTES > total:
            raise ValueError(
                f"{name}: {count:,} blocks need {count * BLOCK_TABLE_BYTES / GIB:.1f} GiB of tables alone, "
                f"more than this machine's {total / GIB:.1f} GiB"
            )


def check_host_tier_fits(tier_bytes: int, field_name: str) -> None:
    """Raises ``ValueError`` naming ``field_name`` when a host KV tier of ``tier_bytes`` exceeds
    this machine's physical memory.

    Args:
        tier_bytes: the tier's size.
        field_name: the setting that sized it (``cpu_offload_gb`` or ``num_host_kv_blocks``).
    """
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if tier_bytes > total:
        raise ValueError(
            f"{field_name}: a host KV tier of {tier_bytes / GIB:.1f} GiB does not fit this machine's "
            f"{total / GIB:.1f} GiB of memory"
        )
