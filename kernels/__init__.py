"""Attention kernels: Multi-Segment Attention (MSA) over a paged KV cache.

The bottom of the stack: nothing here imports from ``asymcache_core`` or above.

- :mod:`kernels.metadata`: :class:`MSAMetadata`, the per-step description of segments.
- :mod:`kernels.reference`: the torch reference (CPU path and test oracle).
- :mod:`kernels.dispatch`: chooses a backend from an explicit device/preference.
"""

from __future__ import annotations

from kernels.dispatch import AttentionBackend, select_attention_backend
from kernels.metadata import MSAMetadata, build_msa_metadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch

__all__ = [
    "AttentionBackend",
    "MSAMetadata",
    "build_msa_metadata",
    "msa_naive",
    "msa_torch",
    "select_attention_backend",
    "store_kv_torch",
]
