"""The CPU's linear op for a few rows: the weight as the GEMM's left operand, where that pays.

``F.linear(x, w)`` computes ``x [M, K] @ w[N, K]^T``. With a few rows (a decode step's batch)
some CPU BLAS builds run that product far slower than the same dot products as ``w @ x^T``,
whose large operand is the left one and splits over the threads; others run it faster. Timed
with weights cycled so that every call reads them from memory, as a decode step does
(``python scripts/bench_cpu_linear.py``, torch 2.13's MKL, two threads):

- the CPU machine of 2026-12-04: SmolLM2-135M's fused gate/up projection at 2 rows 1.21 ms
  with ``F.linear`` against 0.59 ms weight-left, its LM head at 16 rows 26.4 against 18.6 ms;
  the engine's decode steps 1.14-1.25x (batch 1) and 1.21-1.73x (batch 16) faster;
- an AVX-512 Xeon of 2026-12-05: the same gate/up at 2 rows 0.28 against 0.77 ms, the LM
  head at 1 row 4.2 against 12.2 ms; decode steps 0.52x (batch 1) and 0.89x (batch 16).

So :func:`linear_cpu`, the CPU engine's op, takes the weight-left form only where a probe of
this process's BLAS (:func:`weight_left_pays`) found it clearly faster, and on two or more
threads (on one thread neither form wins throughout). From :data:`FEW_ROWS` rows both forms
run the same blocked kernel (same bits, same time).

Shapes: activations ``[..., K]``, weights ``[N, K]`` (``nn.Linear`` layout), outputs
``[..., N]``. The weight-left result is the same float32 math in another summation order: a
row's bits may differ from ``F.linear``'s in the last places, and between row counts below
:data:`FEW_ROWS` (the engine's batch-invariant mode keeps its own op,
:func:`kernels.batch_invariant.linear_padded`).
"""

from __future__ import annotations

import functools
import statistics
import time

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


# How much faster the weight-left form must run in the probe to be taken: a margin, so that a
# machine near the line does not switch forms (and bits) from one process to the next.
WEIGHT_LEFT_MARGIN = 1.25


def weight_left_wins(library_ms: float, weight_left_ms: float) -> bool:
    """Whether the probe's times clear :data:`WEIGHT_LEFT_MARGIN` for the weight-left form."""
    return library_ms >= WEIGHT_LEFT_MARGIN * weight_left_ms


def probe_weight_left(rounds: int = 5) -> tuple[float, float]:
    """Milliseconds a call of ``F.linear`` and of :func:`linear_weight_left` take on this process's
    BLAS: two rows against a 3,072 x 576 float32 weight (a small model's gate/up projection),
    four copies cycled (28 MB, past the per-core caches), medians of alternating rounds."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn((3072, 576), generator=gen) for _ in range(4)]
    x = torch.randn((2, 576), generator=gen)
    times: dict[str, list[float]] = {"library": [], "weight_left": []}
    forms = (("library", F.linear), ("weight_left", linear_weight_left))
    for fn in (F.linear, linear_weight_left):  # warm-up
        fn(x, weights[0])
    for _ in range(rounds):
        for name, fn in forms:
            start = time.perf_counter()
            for _ in range(3):
                for weight in weights:
                    fn(x, weight)
            times[name].append((time.perf_counter() - start) / (3 * len(weights)) * 1e3)
    return statistics.median(times["library"]), statistics.median(times["weight_left"])


# NOTE: cached per thread count for the process, as a device property is: the BLAS and the
# machine do not change under a running engine (about 30 ms once).
@functools.cache
def weight_left_pays(threads: int) -> bool:
    """Whether the weight-left form runs clearly faster than ``F.linear`` on this machine at
    ``threads`` threads (:func:`probe_weight_left`; never on one thread)."""
    if threads < 2:
        return False
    return weight_left_wins(*probe_weight_left())


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU engine's linear op: :func:`linear_weight_left` where :func:`weight_left_pays`,
    else ``F.linear``."""
    if weight_left_pays(torch.get_num_threads()):
        return linear_weight_left(x, weight, bias)
    return F.linear(x, weight, bias)
