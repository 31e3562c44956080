"""Fused elementwise kernels of a decoder layer: rotary + KV store, residual add + RMSNorm, SiLU-mul.

A decode step at small batch is launch-bound: each layer ran about fifteen kernels, a third of
them elementwise (the rotary embedding alone was a concatenation, two multiplies, an add and
the KV store). These kernels do each of those groups in one launch, reading their inputs once:

- :func:`rope_store_triton`: rotates the query and key heads of a fused QKV projection (neox
  half-split layout), writes the rotated queries to a fresh ``[T, HQ, D]`` tensor and the
  rotated keys and the values into their slots of the paged caches.
- :func:`add_rms_norm_triton`: ``residual + x`` (rounded to the activations' dtype, as the
  unfused add stores it) and the RMSNorm of that sum, one program per row.
- :func:`silu_mul_triton`: ``silu(gate) * up`` of a fused ``[T, 2I]`` gate/up projection.

Each has a torch twin in :mod:`kernels.reference` (``rope_store_torch``,
``add_rms_norm_torch``, ``silu_mul_torch``) with the unfused semantics, which the CPU path runs
and the tests compare against. The kernels compute in float32 and round once, where the twins round
after every op in bf16/fp16: results agree to the dtype's rounding, exactly in float32 up to
fused multiply-adds. Every kernel works on one row (token) at a time and reduces only within
it, so a row's bits never depend on the other rows of the step.

Shapes: ``T`` tokens, ``HQ``/``HKV`` query/KV heads, ``D`` head dim, ``N`` hidden size, ``I``
intermediate size; caches ``[num_blocks, block_size, HKV, D]``.
"""

from __future__ import annotations

import torch

from kernels.reference import QKNorm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None

if triton is not None:

    @triton.jit
    def _rope_store_kernel(
        qkv,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm,
        k_norm,
        eps,
        s_qkv_t,
        s_cos_t,
        s_sin_t,
        s_q_t,
        s_q_h,
        s_kc_b,
        s_kc_p,
        s_kc_h,
        s_vc_b,
        s_vc_p,
        s_vc_h,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_KV: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        # One program per token: its query and key heads as one [BLOCK_H, BLOCK_HALF] tile of
        # each half, then its value heads.
        i_t = tl.program_id(0)
        half = D // 2
        o_h = tl.arange(0, BLOCK_H)
        o_d = tl.arange(0, BLOCK_HALF)
        m_d = o_d < half
        b_cos = tl.load(cos + i_t * s_cos_t + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sin = tl.load(sin + i_t * s_sin_t + half + o_d, mask=m_d, other=0.0).to(tl.float32)
        m_x = (o_h[:, None] < HQ + HKV) & m_d[None, :]
        p_x = qkv + i_t * s_qkv_t + o_h[:, None] * D + o_d[None, :]
        b_x1 = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_x2 = tl.load(p_x + half, mask=m_x, other=0.0).to(tl.float32)
        if HAS_NORM:
            # each head's RMSNorm over both halves, its query or key weight (Qwen3's q/k norm)
            b_rstd = tl.rsqrt((tl.sum(b_x1 * b_x1, axis=1) + tl.sum(b_x2 * b_x2, axis=1)) / D + eps)
            m_isq = (o_h < HQ)[:, None]
            b_w1 = tl.where(m_isq, tl.load(q_norm + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :],
                            tl.load(k_norm + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :])
            b_w2 = tl.where(m_isq, tl.load(q_norm + half + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :],
                            tl.load(k_norm + half + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :])
            b_x1 = b_x1 * b_rstd[:, None] * b_w1
            b_x2 = b_x2 * b_rstd[:, None] * b_w2
        b_o1 = b_x1 * b_cos[None, :] - b_x2 * b_sin[None, :]
        b_o2 = b_x2 * b_cos[None, :] + b_x1 * b_sin[None, :]
        m_q = (o_h[:, None] < HQ) & m_d[None, :]
        p_q = q_out + i_t * s_q_t + o_h[:, None] * s_q_h + o_d[None, :]
        tl.store(p_q, b_o1.to(q_out.dtype.element_ty), mask=m_q)
        tl.store(p_q + half, b_o2.to(q_out.dtype.element_ty), mask=m_q)
        slot = tl.load(slot_mapping + i_t)
        if slot >= 0:
            i_b = slot // PAGE
            i_p = slot % PAGE
            # key heads sit at rows HQ.. of the tile: row h writes KV head h - HQ
            m_k = (o_h[:, None] >= HQ) & m_x
            p_k = k_cache + i_b * s_kc_b + i_p * s_kc_p + (o_h[:, None] - HQ) * s_kc_h + o_d[None, :]
            tl.store(p_k, b_o1.to(k_cache.dtype.element_ty), mask=m_k)
            tl.store(p_k + half, b_o2.to(k_cache.dtype.element_ty), mask=m_k)
            o_kv = tl.arange(0, BLOCK_KV)
            o_full = tl.arange(0, 2 * BLOCK_HALF)
            m_v = (o_kv[:, None] < HKV) & (o_full[None, :] < D)
            p_v = qkv + i_t * s_qkv_t + (HQ + HKV + o_kv[:, None]) * D + o_full[None, :]
            b_v = tl.load(p_v, mask=m_v, other=0.0)
            p_vc = v_cache + i_b * s_vc_b + i_p * s_vc_p + o_kv[:, None] * s_vc_h + o_full[None, :]
            tl.store(p_vc, b_v.to(v_cache.dtype.element_ty), mask=m_v)

    @triton.jit
    def _add_rms_norm_kernel(
        x,
        residual,
        weight,
        out,
        residual_out,
        s_x,
        s_r,
        s_o,
        s_ro,
        eps,
        N: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        i_r = tl.program_id(0)
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_x = tl.load(x + i_r * s_x + o_n, mask=m_n, other=0.0)
        if HAS_RESIDUAL:
            b_r = tl.load(residual + i_r * s_r + o_n, mask=m_n, other=0.0)
            # NOTE: the sum is rounded to the stream's dtype before the norm, as the unfused
            # add stores it: the residual stream keeps the same bits either way.
            b_s = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(residual_out.dtype.element_ty)
            tl.store(residual_out + i_r * s_ro + o_n, b_s, mask=m_n)
            b_f = b_s.to(tl.float32)
        else:
            b_f = b_x.to(tl.float32)
        b_var = tl.sum(b_f * b_f, axis=0) / N
        b_w = tl.load(weight + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_y = b_f * tl.rsqrt(b_var + eps) * b_w
        tl.store(out + i_r * s_o + o_n, b_y.to(out.dtype.element_ty), mask=m_n)

    @triton.jit
    def _silu_mul_kernel(gate_up, out, s_g, s_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
        i_t = tl.program_id(0)
        i_c = tl.program_id(1)
        o_i = i_c * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < INTER
        b_g = tl.load(gate_up + i_t * s_g + o_i, mask=m_i, other=0.0).to(tl.float32)
        b_u = tl.load(gate_up + i_t * s_g + INTER + o_i, mask=m_i, other=0.0).to(tl.float32)
        b_y = b_g / (1.0 + tl.exp(-b_g)) * b_u
        tl.store(out + i_t * s_o + o_i, b_y.to(out.dtype.element_ty), mask=m_i)


def rope_store_triton(
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
    """Rotates q and k of a fused projection, stores k and v, returns q, in one launch.

    Args:
        qkv: ``[T, (HQ + 2 * HKV) * D]``: query heads, key heads, value heads (last dim
            contiguous).
        cos: ``[T, 1, D]``, ``cat(cos, cos)`` of each token's position (only the first half
            is read).
        sin: ``[T, 1, D]``, ``cat(-sin, sin)`` (only the second half is read).
        k_cache: ``[num_blocks, block_size, HKV, D]``, written in place.
        v_cache: same shape as ``k_cache``.
        slot_mapping: ``[T]`` int64 flat slots (``block * block_size + offset``); a negative
            slot (padding) stores nothing.
        num_q_heads: ``HQ``.
        num_kv_heads: ``HKV``.
        qk_norm: ``(q_weight [D], k_weight [D], eps)``: each query and key head is
            RMS-normalised first, in float32 with the rotation (Qwen3); None: none.

    Returns:
        ``q [T, HQ, D]``, contiguous, in ``qkv``'s dtype.
    """
    num_tokens = qkv.shape[0]
    head_dim = cos.shape[-1]
    q = qkv.new_empty(num_tokens, num_q_heads, head_dim)
    if num_tokens == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos = cos.reshape(num_tokens, head_dim)
    sin = sin.reshape(num_tokens, head_dim)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_store_kernel[(num_tokens,)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_q_heads + num_kv_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), HAS_NORM=qk_norm is not None,
        num_warps=4,
    )
    return q


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one launch; ``residual=None`` normalises ``x``.

    Args:
        x: ``[..., N]``.
        residual: ``[..., N]`` or ``None``.
        weight: ``[N]``.
        eps: the norm's epsilon.

    Returns:
        ``(normed, total)``, both ``[..., N]`` in ``x``'s dtype; ``total`` is ``x`` itself
        without a residual.
    """
    shape = x.shape
    rows = _rows(x)
    num_rows, width = rows.shape
    out = torch.empty_like(rows)
    total = torch.empty_like(rows) if residual is not None else rows
    if num_rows == 0:
        return out.reshape(shape), total.reshape(shape)
    res_rows = _rows(residual) if residual is not None else rows
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(num_rows,)](
        rows, res_rows, weight, out, total,
        rows.stride(0), res_rows.stride(0), out.stride(0), total.stride(0), eps,
        N=width, BLOCK_N=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return out.reshape(shape), total.reshape(shape)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` (gate first) in one launch; ``[..., I]``."""
    shape = gate_up.shape
    rows = _rows(gate_up)
    num_rows, width = rows.shape
    inter = width // 2
    out = rows.new_empty(num_rows, inter)
    if num_rows:
        block = 1024
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
        )
    return out.reshape(*shape[:-1], inter)


__all__ = ["add_rms_norm_triton", "rope_store_triton", "silu_mul_triton"]
