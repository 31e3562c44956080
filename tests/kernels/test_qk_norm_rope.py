"""Qwen3's per-head q/k RMSNorm inside the fused rotary + KV store (:func:`kernels.fused.rope_store_triton`
with ``qk_norm``) against its torch twin (:func:`kernels.reference.rope_store_torch`) and a float64
truth: under the interpreter on the CPU, compiled on the GPU (``-m gpu``)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.reference import rope_store_torch, rotate_torch, store_kv_torch
from tests.kernels.test_fused_ops import _rope_case


def _truth(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, head_dim: int,
           q_weight: torch.Tensor, k_weight: torch.Tensor) -> torch.Tensor:
    """The rotated, normalised q and k heads in float64."""
    qk = qkv.double()[:, : (hq + hkv) * head_dim].reshape(-1, hq + hkv, head_dim)
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6)
    weight = torch.cat((q_weight.double().expand(hq, head_dim), k_weight.double().expand(hkv, head_dim)))
    return rotate_torch(qk * weight, cos.double(), sin.double())


def _check(module: ModuleType, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    for case, (hq, hkv, head_dim) in enumerate([(4, 2, 64), (8, 1, 128), (6, 3, 32), (5, 5, 80)]):
        qkv, cos, sin, (k_ref, v_ref, k_out, v_out), slots = _rope_case(23, hq, hkv, head_dim, dtype, device, case)
        # an uneven scale per row so that the norm matters
        qkv = qkv * (1 + 4 * torch.rand((23, 1), generator=gen)).to(dtype).to(device)
        q_weight = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device)
        k_weight = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device)
        norm = (q_weight, k_weight, 1e-6)
        q_ref = rope_store_torch(qkv, cos, sin, k_ref, v_ref, slots, hq, hkv, store_kv_torch, norm)
        q = module.rope_store_triton(qkv, cos, sin, k_out, v_out, slots, hq, hkv, norm)
        truth = _truth(qkv, cos, sin, hq, hkv, head_dim, q_weight, k_weight)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert float(((q.double() - truth[:, :hq]).abs() / (1 + truth[:, :hq].abs())).max()) < tol
        assert float(((q.double() - q_ref.double()).abs() / (1 + q_ref.double().abs())).max()) < 4 * tol
        # the keys as normalised and rotated, in their slots; the values copied exactly
        written = slots >= 0
        stored = k_out.reshape(-1, hkv, head_dim)[slots[written]]
        expected = truth[:, hq:][written]
        assert float(((stored.double() - expected).abs() / (1 + expected.abs())).max()) < tol
        assert torch.equal(v_out, v_ref) and torch.equal(k_out == 7.0, k_ref == 7.0)
        # without the norm the projection would differ: the weights are not ones
        plain = module.rope_store_triton(qkv, cos, sin, k_out.clone(), v_out.clone(), slots, hq, hkv)
        assert not torch.allclose(plain, q, atol=1e-2)
        # a row's bits do not depend on the other rows
        part = module.rope_store_triton(qkv[3:9], cos[3:9], sin[3:9], k_out.clone(), v_out.clone(), slots[3:9],
                                        hq, hkv, norm)
        assert torch.equal(part, q[3:9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_store_interpreter(interp_fused: ModuleType, dtype: torch.dtype) -> None:
    _check(interp_fused, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_store_gpu(compiled_fused: ModuleType, dtype: torch.dtype) -> None:
    _check(compiled_fused, dtype, "cuda")
