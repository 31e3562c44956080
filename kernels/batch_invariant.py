"""Batch-invariant matmul and RMSNorm: a row's result never depends on the other rows.

A GEMM library picks its kernel (tile sizes, split-K, stream-K) from the problem's shape, so the
same row of activations multiplied by the same weight gives different bits at batch 1 and at
batch 64: the reduction over ``K`` runs in another order. These ops fix that order.

- :func:`matmul_triton`: ``x [M, K] @ w[N, K]^T`` without split-K: every output element is one
  float32 accumulator walking ``K`` in ascending order through tensor-core steps, whatever the
  batch. Measured on the H200 (``scripts/gpu_bi_matmul.py``): tile sizes, warps and stages
  leave the bits unchanged (row tiles of 16 to 256, column tiles of 16 to 256, K tiles of 64
  to 512 all agree), so the tiling follows the batch size; only splitting ``K`` across programs
  would change them.
- :class:`kernels.gemm_calibration.BatchInvariantLinear`, the engine's linear op, runs this
  kernel or cuBLAS where cuBLAS was checked to give its bits.
- :func:`rms_norm_triton`: one program per row, the whole row in one block.
- :func:`linear_padded`: the CPU twin of the matmul. CPU BLAS switches kernels with the number
  of rows (matrix-vector paths below 4-8 rows, other blockings and thread splits further up), so
  the rows are padded to a multiple of :data:`ROW_CHUNK` and multiplied that many at a time:
  every BLAS call has the same shape, whatever the batch.
- :func:`linear_naive`: the float64 oracle.

A bias is added after the product is rounded, elementwise, on every path (a fused bias epilogue
may differ from one kernel to another).

Shapes: activations ``[M, K]``, weights ``[N, K]`` (``nn.Linear`` layout), outputs ``[M, N]``.
"""

from __future__ import annotations

import torch

# Rows of every BLAS call the CPU matmul makes; a multiple of every BLAS micro-kernel height.
# NOTE: padding to a multiple of 8 and making one call was not enough: on an AVX-512 host
# (torch 2.13's MKL, 2 threads) a 576 x 1536 product gave other bits per row at 8 and at 304
# rows, whatever multiple of 8 to 64 the rows were padded to; same-shape calls agreed on every
# shape. 32 rows: 1.6x one call's time for 2,048 rows (64: 1.4x, 16: 2.5x) and 1.5x a padded
# call's for one row (64: 2.6x).
ROW_CHUNK = 32


def _as_rows(x: torch.Tensor) -> tuple[torch.Size, torch.Tensor]:
    """``x [..., K]`` as ``(leading shape, [M, K] rows with a contiguous last dim)``."""
    rows = x.reshape(-1, x.shape[-1])
    return x.shape[:-1], rows if rows.stride(-1) == 1 else rows.contiguous()


def linear_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float64, cast back to ``x``'s dtype (the oracle)."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def linear_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`torch.nn.functional.linear` on rows padded to a multiple of :data:`ROW_CHUNK`,
    :data:`ROW_CHUNK` rows per BLAS call.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]``, each row the same bits whatever the number of rows.
    """
    lead, rows = _as_rows(x)
    num = rows.shape[0]
    padded = -(-max(num, 1) // ROW_CHUNK) * ROW_CHUNK
    if padded != num:
        rows = torch.cat((rows, rows.new_zeros(padded - num, rows.shape[1])))
    out = rows.new_empty((padded, weight.shape[0]))
    weight_t = weight.t()
    for start in range(0, padded, ROW_CHUNK):
        torch.mm(rows[start : start + ROW_CHUNK], weight_t, out=out[start : start + ROW_CHUNK])
    if bias is not None:
        # NOTE: added after the GEMM, elementwise: a fused bias epilogue may differ by kernel.
        out = out + bias
    return out[:num].reshape(*lead, weight.shape[0])


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None

if triton is not None:

    @triton.jit
    def _matmul_kernel(
        x,
        w,
        out,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One ``[BLOCK_M, BLOCK_N]`` output tile; ``K`` walked in ascending ``BLOCK_K`` steps."""
        i_pid = tl.program_id(0)
        n_m = tl.cdiv(M, BLOCK_M)
        n_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles share each weight tile while it is in L2
        n_group = GROUP_M * n_n
        i_group = i_pid // n_group
        i_first = i_group * GROUP_M
        group_rows = tl.minimum(n_m - i_first, GROUP_M)
        i_m = i_first + (i_pid % n_group) % group_rows
        i_n = (i_pid % n_group) // group_rows

        o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_k = tl.arange(0, BLOCK_K)
        m_m = o_m < M
        m_n = o_n < N
        p_x = x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
        p_w = w + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_k in range(0, K, BLOCK_K):
            m_k = (i_k + o_k) < K
            b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
            if IEEE:
                b_acc = tl.dot(b_x, b_w, b_acc, input_precision="ieee")
            else:
                b_acc = tl.dot(b_x, b_w, b_acc)
            p_x += BLOCK_K
            p_w += BLOCK_K
        p_o = out + o_m[:, None].to(tl.int64) * stride_om + o_n[None, :]
        tl.store(p_o, b_acc.to(out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])

    @triton.jit
    def _rms_norm_kernel(x, w, out, N, eps, stride_x, stride_o, BLOCK: tl.constexpr):
        """Row ``i``: ``x * rsqrt(mean(x^2) + eps) * w`` in float32, rounded once."""
        i_row = tl.program_id(0).to(tl.int64)
        o_c = tl.arange(0, BLOCK)
        m_c = o_c < N
        b_x = tl.load(x + i_row * stride_x + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_var = tl.sum(b_x * b_x, 0) / N
        b_w = tl.load(w + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_y = b_x * tl.rsqrt(b_var + eps) * b_w
        tl.store(out + i_row * stride_o + o_c, b_y.to(out.dtype.element_ty), mask=m_c)


# (up to rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)) per operand width, the first
# whose bound holds. The bits are the same for every entry; the times were measured on the H200
# (scripts/gpu_bi_matmul.py, scripts/gpu_gemv_cold.py with the weights read from HBM): at a
# few rows, narrow column tiles and long K tiles give the weight stream enough programs and
# loads in flight to match cuBLAS's split-K kernels without splitting K. Float32 keeps K tiles
# short to fit shared memory with IEEE dots.
_CONFIGS: dict[int, tuple[tuple[int, tuple[int, int, int, int, int]], ...]] = {
    2: (
        (8, (16, 16, 512, 2, 4)),
        (16, (16, 32, 512, 2, 4)),
        (32, (32, 32, 256, 2, 5)),
        (64, (64, 32, 128, 4, 6)),
        (128, (64, 64, 128, 4, 4)),
        (256, (128, 64, 64, 4, 4)),
        (1 << 62, (128, 128, 64, 8, 3)),
    ),
    4: (
        (32, (16, 32, 32, 4, 3)),
        (1 << 62, (64, 64, 32, 4, 3)),
    ),
}


Tiling = tuple[int, int, int, int, int]


def _matmul_config(num_rows: int, elem_bytes: int) -> Tiling:
    for bound, config in _CONFIGS[4 if elem_bytes == 4 else 2]:
        if num_rows <= bound:
            return config
    raise AssertionError("unreachable: the last bound holds")


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # NOTE: after rounding, elementwise: the same bits whichever GEMM ran.
    return out if bias is None else out.add_(bias)


def matmul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Tiling | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias`` on the GPU.

    Args:
        x: ``[..., K]`` activations (last dim contiguous).
        weight: ``[N, K]``, contiguous.
        bias: optional ``[N]``, added after the product is rounded.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` to use (a tuned tiling,
            benchmarks); ``None``: chosen from the dtype and the number of rows. The bits do
            not depend on it.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    if triton is None:
        raise ValueError("batch_invariant: the Triton matmul needs triton")
    lead, rows = _as_rows(x)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    num, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((num, n), dtype=x.dtype, device=x.device)
    if num == 0:
        return out.reshape(*lead, n)
    if config is None:
        config = _matmul_config(num, x.element_size())
    block_m, block_n, block_k, num_warps, num_stages = config
    grid = (triton.cdiv(num, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        rows, weight, out, num, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return _add_bias(out, bias).reshape(*lead, n)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm of ``x [..., N]`` on the GPU (one program per row)."""
    if triton is None:
        raise ValueError("batch_invariant: the Triton RMSNorm needs triton")
    lead, rows = _as_rows(x)
    num, n = rows.shape
    out = torch.empty_like(rows)
    if num:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(num,)](
            rows, weight, out, n, float(eps), rows.stride(0), out.stride(0), BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.reshape(*lead, n)


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64, cast back to ``x``'s dtype (the oracle)."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


__all__ = [
    "ROW_CHUNK",
    "Tiling",
    "linear_naive",
    "linear_padded",
    "matmul_triton",
    "rms_norm_naive",
    "rms_norm_triton",
]
