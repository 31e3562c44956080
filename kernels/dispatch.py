"""Chooses the attention backend from an explicit device and preference.

No import-time globals: the engine asks once, with its config, and keeps the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_linear import few_row_forms, linear_cpu
from kernels.metadata import MSAMetadata
from kernels.msa_tiled import msa_tiled, prepare_msa_tiled
from kernels.reference import (
    QKNorm,
    msa_naive,
    msa_torch,
    prepare_msa_torch,
    rope_store_torch,
    silu_mul_torch,
    store_kv_torch,
)

MSAFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MSAMetadata, float], torch.Tensor]
StoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]

PrepareFn = Callable[[MSAMetadata, int, int, int], MSAMetadata]
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddNormFn = Callable[
    [torch.Tensor, "torch.Tensor | None", torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
ActFn = Callable[[torch.Tensor], torch.Tensor]
RopeStoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, "QKNorm | None"],
    torch.Tensor,
]

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
        batch_invariant: ``attend`` gives each query the same bits whatever shares its step.
        dense: the linear and norm ops the model runs beside this attention: every kernel
            choice of an engine travels in this one object, passed to each forward call.
        rope_store: a fused rotary + KV store (:func:`kernels.fused.rope_store_triton`);
            ``None``: :meth:`rotate_and_store` rotates with torch ops and calls ``store_kv``.
    """

    name: str
    store_kv: StoreFn
    attend: MSAFn
    prepare: PrepareFn = no_plan
    batch_invariant: bool = False
    dense: DenseOps = field(default_factory=lambda: DEFAULT_DENSE_OPS)
    rope_store: RopeStoreFn | None = None

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """Rotates the q and k heads of a fused projection ``qkv [T, (HQ + 2 * HKV) * D]``,
        stores k and v at ``slot_mapping``; returns ``q [T, HQ, D]``.

        ``cos, sin [T, 1, D]`` are the step's rotary tables (``cat(cos, cos)``,
        ``cat(-sin, sin)``); ``qk_norm`` (``(q_weight, k_weight, eps)``, Qwen3's per-head
        RMSNorm) normalises each query and key head before the rotation.
        """
        if self.rope_store is not None:
            return self.rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, qk_norm)
        return rope_store_torch(
            qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, self.store_kv, qk_norm
        )


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE: one fused kernel instead of six (launch overhead dominates eager GPU steps).
    # In bf16/fp16 it normalises in fp32 and rounds once, where HF rounds before the
    # weight multiply: outputs may differ from HF in the last bit, never between our runs.
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


@dataclass(frozen=True)
class DenseOps:
    """The model's reductions outside attention: its linear layers and RMSNorm.

    Attributes:
        name: ``default`` (the fastest library kernels, whose reduction order may change with
            the batch) or ``batch-invariant`` (a row's bits never depend on the other rows).
        linear: ``(x [..., K], weight [N, K], bias [N] | None) -> [..., N]``.
        rms_norm: ``(x [..., N], weight [N], eps) -> [..., N]``.
        add_rms_norm: a fused residual add + norm (:func:`kernels.fused.add_rms_norm_triton`);
            ``None``: :meth:`add_norm` adds, then calls ``rms_norm``.
        silu_mul: a fused ``silu(gate) * up`` (:func:`kernels.fused.silu_mul_triton`);
            ``None``: :meth:`act` runs torch's ops.
    """

    name: str
    linear: LinearFn
    rms_norm: NormFn
    add_rms_norm: AddNormFn | None = None
    silu_mul: ActFn | None = None

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``; without a residual, ``(rms_norm(x), x)``."""
        if self.add_rms_norm is not None:
            return self.add_rms_norm(x, residual, weight, eps)
        total = x if residual is None else residual + x
        return self.rms_norm(total, weight, eps), total

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``gate_up [..., 2I]`` projection (gate first)."""
        if self.silu_mul is not None:
            return self.silu_mul(gate_up)
        return silu_mul_torch(gate_up)


DEFAULT_DENSE_OPS = DenseOps("default", F.linear, _rms_norm_torch)
# NOTE: the CPU's linear products run in the forms a probe of the machine finds fastest (oneDNN
# on packed weights for every row count, or the weight as the left operand for a few rows:
# kernels/cpu_linear.py).
CPU_DENSE_OPS = DenseOps("default", linear_cpu, _rms_norm_torch)


def select_dense_ops(device: torch.device | str, batch_invariant: bool = False) -> DenseOps:
    """The linear and norm ops for ``device``: the library's, or the batch-invariant ones
    (the Triton matmul and RMSNorm on CUDA; on the CPU oneDNN's product where a check of the
    machine found its rows' bits independent of the batch, else same-shape BLAS calls)."""
    device = torch.device(device)
    if not batch_invariant:
        if device.type != "cpu":
            return DEFAULT_DENSE_OPS
        few_row_forms(torch.get_num_threads())  # the probe (or its kept answer) now, not in the first step
        return CPU_DENSE_OPS
    if device.type == "cuda":
        if not triton_available(device):
            raise ValueError("batch_invariant: needs triton on CUDA")
        from kernels.batch_invariant import rms_norm_triton
        from kernels.gemm_calibration import BatchInvariantLinear

        return DenseOps("batch-invariant", BatchInvariantLinear(device), rms_norm_triton)
    if device.type != "cpu":
        raise ValueError(f"batch_invariant: not supported on {device.type}")
    from kernels.cpu_linear import linear_invariant_cpu

    # NOTE: the CPU norm reduces each row alone, in the same order whatever the rows: the
    # library kernel already is batch-invariant there (the engine tests check the bits).
    return DenseOps("batch-invariant", linear_invariant_cpu, _rms_norm_torch)


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


def select_attention_backend(
    device: torch.device | str,
    preference: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
    fused: bool = True,
) -> AttentionBackend:
    """Returns the backend for ``device``.

    Args:
        device: where the model runs.
        preference: ``auto`` (Triton on CUDA when importable, torch elsewhere), ``torch``,
            ``naive`` or ``triton``.
        dtype: the model's activations (the Triton launch plan fits its tiles to it).
        batch_invariant: a query's output never depends on what else shares the step, how its
            prompt was chunked or whether its history was cached or rebuilt: the Triton plan's
            fixed configuration and KV chunks, or :func:`~kernels.msa_tiled.msa_tiled` for
            ``torch``, with the batch-invariant dense ops (:func:`select_dense_ops`). ``naive``
            is a test oracle and has no such mode.
        fused: with ``triton``, the fused rotary + KV store, add + RMSNorm and SiLU-mul
            kernels of :mod:`kernels.fused` (one row per program: batch-invariant too);
            ``False`` (an ablation) runs those steps as separate torch ops.

    Raises:
        ValueError: unknown preference, or ``triton`` where it cannot run.
    """
    device = torch.device(device)
    if preference not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {preference!r}; one of {BACKENDS}")
    if preference == "naive" and batch_invariant:
        raise ValueError("attention_backend: 'naive' has no batch-invariant mode; use 'torch'")
    dense = select_dense_ops(device, batch_invariant)
    if preference == "auto":
        preference = "triton" if triton_available(device) else "torch"
    if preference == "triton":
        if not triton_available(device) and not _interpreting():
            raise ValueError("attention_backend: 'triton' needs a CUDA device and triton")
        from kernels.kv_store_triton import store_kv_triton
        from kernels.msa_plan import plan_msa
        from kernels.msa_triton import msa_triton

        def prepare(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int) -> MSAMetadata:
            device = meta.block_tables.device
            plan = plan_msa(
                meta, num_q_heads, num_kv_heads, head_dim, device, dtype=dtype, invariant=batch_invariant
            )
            return dataclasses.replace(meta, plan=plan)

        if not fused:
            return AttentionBackend("triton", store_kv_triton, msa_triton, prepare, batch_invariant, dense)
        from kernels.fused import add_rms_norm_triton, rope_store_triton, silu_mul_triton

        dense = dataclasses.replace(dense, add_rms_norm=add_rms_norm_triton, silu_mul=silu_mul_triton)
        return AttentionBackend(
            "triton", store_kv_triton, msa_triton, prepare, batch_invariant, dense, rope_store_triton
        )
    if preference == "naive":
        return AttentionBackend("naive", store_kv_torch, msa_naive, dense=dense)
    if batch_invariant:
        return AttentionBackend("torch", store_kv_torch, msa_tiled, prepare_msa_tiled, True, dense)
    return AttentionBackend("torch", store_kv_torch, msa_torch, prepare_msa_torch, dense=dense)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
