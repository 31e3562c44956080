"""Chooses the attention backend from an explicit device and preference.

No import-time globals: the engine asks once, with its config, and keeps the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch

MSAFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MSAMetadata, float], torch.Tensor]
StoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]

PrepareFn = Callable[[MSAMetadata, int, int, int], MSAMetadata]

BACKENDS = ("auto", "torch", "naive", "triton")


def no_plan(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int) -> MSAMetadata:
    """``prepare`` of backends that need no per-step launch plan."""
    return meta


@dataclass(frozen=True)
class AttentionBackend:
    """A matched pair of KV-store and MSA functions.

    Attributes:
        name: ``torch``, ``naive`` or ``triton``.
        store_kv: writes ``k, v [T, HKV, D]`` into ``k_cache, v_cache`` at ``slot_mapping``.
        attend: ``(q, k_cache, v_cache, meta, scale) -> out`` with the MSA contract.
        prepare: ``(meta, num_q_heads, num_kv_heads, head_dim) -> meta`` run once per step
            before the layers: returns the metadata with the backend's launch plan attached,
            so that host work (tile tables, their copy to the device) is not paid per layer.
    """

    name: str
    store_kv: StoreFn
    attend: MSAFn
    prepare: PrepareFn = no_plan


def triton_available(device: torch.device) -> bool:
    """True when the Triton MSA kernels can run on ``device``."""
    if device.type != "cuda":
        return False
    try:
        import kernels.msa_triton  # noqa: F401
    except ImportError:
        return False
    return True


def compiled_kernel_count(device: torch.device | str) -> int | None:
    """Triton kernel binaries compiled so far in this process (``None`` off CUDA or without
    Triton): see :func:`kernels.msa_triton.compiled_variants`."""
    if not triton_available(torch.device(device)):
        return None
    from kernels.msa_triton import compiled_variants

    return compiled_variants()


def select_attention_backend(device: torch.device | str, preference: str = "auto") -> AttentionBackend:
    """Returns the backend for ``device``.

    Args:
        device: where the model runs.
        preference: ``auto`` (Triton on CUDA when importable, torch elsewhere), ``torch``,
            ``naive`` or ``triton``.

    Raises:
        ValueError: unknown preference, or ``triton`` where it cannot run.
    """
    device = torch.device(device)
    if preference not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {preference!r}; one of {BACKENDS}")
    if preference == "auto":
        preference = "triton" if triton_available(device) else "torch"
    if preference == "triton":
        if not triton_available(device) and not _interpreting():
            raise ValueError("attention_backend: 'triton' needs a CUDA device and triton")
        from kernels.msa_triton import msa_triton, plan_msa, store_kv_triton

        def prepare(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int) -> MSAMetadata:
            device = meta.block_tables.device
            plan = plan_msa(meta, num_q_heads, num_kv_heads, head_dim, device)
            return dataclasses.replace(meta, plan=plan)

        return AttentionBackend("triton", store_kv_triton, msa_triton, prepare)
    if preference == "naive":
        return AttentionBackend("naive", store_kv_torch, msa_naive)
    return AttentionBackend("torch", store_kv_torch, msa_torch)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
