"""Chooses the attention backend from an explicit device and preference.

No import-time globals: the engine asks once, with its config, and keeps the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch

MSAFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MSAMetadata, float], torch.Tensor]
StoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]

BACKENDS = ("auto", "torch", "naive", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """A matched pair of KV-store and MSA functions.

    Attributes:
        name: ``torch``, ``naive`` or ``triton``.
        store_kv: writes ``k, v [T, HKV, D]`` into ``k_cache, v_cache`` at ``slot_mapping``.
        attend: ``(q, k_cache, v_cache, meta, scale) -> out`` with the MSA contract.
    """

    name: str
    store_kv: StoreFn
    attend: MSAFn


def triton_available(device: torch.device) -> bool:
    """True when the Triton MSA kernels can run on ``device``."""
    if device.type != "cuda":
        return False
    try:
        import kernels.msa_triton  # noqa: F401
    except ImportError:
        return False
    return True


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
        from kernels.msa_triton import msa_triton, store_kv_triton

        return AttentionBackend("triton", store_kv_triton, msa_triton)
    if preference == "naive":
        return AttentionBackend("naive", store_kv_torch, msa_naive)
    return AttentionBackend("torch", store_kv_torch, msa_torch)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
