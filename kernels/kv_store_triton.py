"""The KV store as a Triton kernel: a step's new keys and values into their paged slots.

Same contract as :func:`kernels.reference.store_kv_torch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copies token ``i_t``'s k, v ``[H, D]`` into its slot; negative slots are skipped."""
    i_t = tl.program_id(0)
    i_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    i_blk = i_slot // PAGE
    i_in = i_slot % PAGE
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = (o_h < H) & (o_h * 0 + i_slot >= 0)
    m_hd = m_h[:, None] & (o_d < D)[None, :]
    b_k = tl.load(k + i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :], mask=m_hd)
    b_v = tl.load(v + i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :], mask=m_hd)
    p_kc = k_cache + i_blk * stride_kcb + i_in * stride_kcs + o_h[:, None] * stride_kch
    p_vc = v_cache + i_blk * stride_vcb + i_in * stride_vcs + o_h[:, None] * stride_vch
    tl.store(p_kc + o_d[None, :], b_k.to(k_cache.dtype.element_ty), mask=m_hd)
    tl.store(p_vc + o_d[None, :], b_v.to(v_cache.dtype.element_ty), mask=m_hd)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes this step's K/V ``[T, HKV, D]`` into their slots of the paged caches.

    Args:
        k: ``[T, HKV, D]`` new keys (last dim contiguous).
        v: ``[T, HKV, D]`` new values.
        k_cache: ``[num_blocks, block_size, HKV, D]``, written in place.
        v_cache: same shape as ``k_cache``.
        slot_mapping: ``[T]`` int64 flat slots (``block * block_size + offset``); a negative
            slot (padding) is skipped.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, D=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


__all__ = ["store_kv_triton"]
