"""Kernels: Multi-Segment Attention (MSA) over a paged KV cache, and batch-invariant dense ops.

The bottom of the stack: nothing here imports from ``asymcache_core`` or above.

- :mod:`kernels.metadata`: :class:`MSAMetadata`, the per-step description of segments.
- :mod:`kernels.reference`: the torch MSA (CPU path, its batch-invariant twin, test oracle).
- :mod:`kernels.msa_plan`: MSA launch plans (tiles, KV splits, the batch-invariant chunks).
- :mod:`kernels.msa_triton`: the Triton MSA and KV-store kernels.
- :mod:`kernels.batch_invariant`: matmul and RMSNorm whose rows never depend on the batch.
- :mod:`kernels.gemm_calibration`: the engine's batch-invariant linear op (cuBLAS where it was
  checked to give the Triton matmul's bits, the fastest Triton tiling elsewhere).
- :mod:`kernels.dispatch`: chooses the attention backend and dense ops from an explicit device,
  preference and mode.
"""

from __future__ import annotations

from kernels.dispatch import AttentionBackend, DenseOps, select_attention_backend, select_dense_ops
from kernels.metadata import MSAMetadata, build_msa_metadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch

__all__ = [
    "AttentionBackend",
    "DenseOps",
    "MSAMetadata",
    "build_msa_metadata",
    "msa_naive",
    "msa_torch",
    "select_attention_backend",
    "select_dense_ops",
    "store_kv_torch",
]
