"""The batch-invariant linear and RMSNorm ops (:mod:`kernels.batch_invariant`).

- CPU: the row-padded BLAS linear gives each row the same bits at every batch size and
  offset; the Triton matmul and RMSNorm under the interpreter against the float64 oracle.
- GPU (``-m gpu``): the compiled Triton matmul and RMSNorm, bitwise per row across batch sizes
  (1 to 1,000 rows, several offsets), and accurate.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.batch_invariant import linear_naive, linear_padded, rms_norm_naive
from kernels.dispatch import DEFAULT_DENSE_OPS, select_dense_ops

# (N, K): a fused QKV, a wide gate-up, a down projection and a vocabulary head of SmolLM2.
_SHAPES = [(1728, 576), (3072, 576), (576, 1536), (49152, 576)]
_BATCHES = [1, 2, 3, 5, 7, 8, 9, 31, 64, 100, 257]


def _rows_invariant(fn, x: torch.Tensor) -> None:
    """``fn`` of every slice ``x[s : s + m]`` equals the same rows of ``fn(x)``, bit for bit."""
    full = fn(x)
    for start in (0, 3, 17):
        for m in _BATCHES:
            if start + m > x.shape[0]:
                continue
            part = fn(x[start : start + m])
            assert torch.equal(part, full[start : start + m]), f"rows {start}..{start + m} differ"


@pytest.mark.parametrize(("n", "k"), _SHAPES)
def test_linear_padded_is_row_invariant(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn((n, k), generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn((300, k), generator=gen)
    _rows_invariant(lambda rows: linear_padded(rows, weight, bias), x)
    err = (linear_padded(x, weight, bias).double() - linear_naive(x.double(), weight.double(), bias.double())).abs()
    assert float(err.max()) < 1e-4


def test_library_linear_is_not_row_invariant_on_this_cpu() -> None:
    """Why the padded linear exists: the library's own linear changes bits with the batch."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn((1728, 576), generator=gen)
    x = torch.randn((64, 576), generator=gen)
    full = torch.nn.functional.linear(x, weight)
    assert any(not torch.equal(torch.nn.functional.linear(x[:m], weight), full[:m]) for m in (1, 2, 3, 7))


def test_cpu_batch_invariant_ops_are_row_invariant() -> None:
    ops = select_dense_ops("cpu", batch_invariant=True)
    assert ops.name == "batch-invariant" and select_dense_ops("cpu") is DEFAULT_DENSE_OPS
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((300, 576), generator=gen)
    weight = torch.randn(576, generator=gen)
    _rows_invariant(lambda rows: ops.rms_norm(rows, weight, 1e-5), x)
    err = (ops.rms_norm(x, weight, 1e-5).double() - rms_norm_naive(x.double(), weight.double(), 1e-5)).abs()
    assert float(err.max()) < 1e-5


def test_select_dense_ops_rejects_unknown_devices() -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        select_dense_ops("meta", batch_invariant=True)


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 40, 24, True), (70, 130, 72, False), (9, 64, 64, True)])
def test_matmul_triton_interpreter(interp_dense: ModuleType, m: int, n: int, k: int, bias: bool) -> None:
    """Tails in every dimension (rows, columns and the K loop), with and without bias."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn((m, k), generator=gen)
    weight = torch.randn((n, k), generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = interp_dense.matmul_triton(x, weight, b)
    ref = linear_naive(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (m, n) and float((out.double() - ref).abs().max()) < 1e-4


def test_rms_norm_triton_interpreter(interp_dense: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((7, 100), generator=gen)
    weight = torch.randn(100, generator=gen)
    out = interp_dense.rms_norm_triton(x, weight, 1e-6)
    assert float((out.double() - rms_norm_naive(x.double(), weight.double(), 1e-6)).abs().max()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1728, 576)])
def test_matmul_triton_gpu_row_invariant(compiled_dense: ModuleType, dtype: torch.dtype, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", dtype)
    x = torch.randn((1000, k), generator=gen).to("cuda", dtype)
    _rows_invariant(lambda rows: compiled_dense.matmul_triton(rows, weight), x)
    ref = linear_naive(x[:64].double(), weight.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert float((compiled_dense.matmul_triton(x[:64], weight).double() - ref).abs().max()) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_triton_gpu_row_invariant(compiled_dense: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((1000, 4096), generator=gen).to("cuda", dtype)
    weight = torch.randn(4096, generator=gen).to("cuda", dtype)
    _rows_invariant(lambda rows: compiled_dense.rms_norm_triton(rows, weight, 1e-5), x)
    ref = rms_norm_naive(x.double(), weight.double(), 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert float((compiled_dense.rms_norm_triton(x, weight, 1e-5).double() - ref).abs().max()) < tol
