"""The CPU's linear op for a few rows: the weight as the GEMM's left operand.

``F.linear(x, w)`` computes ``x [M, K] @ w[N, K]^T``. With a few rows (a decode step's batch)
the CPU BLAS (MKL in torch's x86 wheels) runs that product 1.1-3x slower on two threads than
the same dot products as ``w @ x^T``, whose large operand is the left one and splits over the
threads; on one thread neither form wins throughout, and ``F.linear`` runs. One row goes to a
matrix-vector kernel, slower than a two-column product where the weight is wider than long.
Timed on this project's CPU machine (2 cores, torch 2.13, weights cycled so that every call
reads them from memory, as a decode step does; ``python scripts/bench_cpu_linear.py``):
SmolLM2-135M's fused gate/up projection at 2 rows 1.21 against 0.59 ms, its LM head at 16
rows 26.4 against 18.6 ms; the engine's decode steps 1.14-1.25x (batch 1) and 1.21-1.73x
(batch 16) faster in two runs. From :data:`FEW_ROWS` rows on both forms run the same blocked
kernel (same bits, same time).

Shapes: activations ``[..., K]``, weights ``[N, K]`` (``nn.Linear`` layout), outputs
``[..., N]``. The result is the same float32 math in another summation order: a row's bits may
differ from ``F.linear``'s in the last places, and between row counts below
:data:`FEW_ROWS` (the engine's batch-invariant mode keeps its own padded op,
:func:`kernels.batch_invariant.linear_padded`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.batch_invariant import _as_rows

# Row counts from which F.linear already runs the blocked kernel the transposed form runs:
# measured equal in bits and time from 32 rows (bench_cpu_linear.py prints both).
FEW_ROWS = 32


def linear_weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` as ``(weight @ x^T)^T`` below :data:`FEW_ROWS` rows of float32.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]``.
        bias: optional ``[N]``, added after the product.

    Returns:
        ``[..., N]``, contiguous.
    """
    lead, rows = _as_rows(x)
    num = rows.shape[0]
    if num >= FEW_ROWS or num == 0 or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if torch.get_num_threads() < 2:
        # NOTE: the gain is in how the product splits over threads (the few rows of x
        # cannot feed two): on one thread the two forms tie or F.linear wins (one row 0.86-0.89x,
        # 8 rows of the down projection 0.61x, 2 rows of the LM head 1.92x: no rule to keep).
        return F.linear(x, weight, bias)
    if num == 1:
        if weight.shape[0] <= weight.shape[1]:
            # NOTE: a row against a weight no wider than long (a down projection) is as fast
            # or faster in BLAS's matrix-vector kernel (down at one row: 0.32 against 0.40 ms).
            return F.linear(x, weight, bias)
        # NOTE: one row goes to BLAS's matrix-vector kernel, 1.3-1.4x slower here than a
        # two-column product where the weight is wide (gate/up, LM head); the padding row
        # costs one more dot product per output.
        rows = torch.cat((rows, rows.new_zeros(1, rows.shape[1])))
    out = (weight @ rows.T).T[:num].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
