"""The CPU's few-row linear op (:mod:`kernels.cpu_linear`): the same products as ``F.linear``
at every row count, shape and dtype, and the op the CPU engine's dispatch picks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import linear_naive
from kernels.cpu_linear import (
    FEW_ROWS,
    linear_cpu,
    linear_weight_left,
    probe_weight_left,
    weight_left_pays,
    weight_left_wins,
)
from kernels.dispatch import (
    CPU_DENSE_OPS,
    DEFAULT_DENSE_OPS,
    select_attention_backend,
    select_dense_ops,
)


@pytest.fixture(autouse=True)
def two_threads():
    """The op takes its own path only with two or more threads (the test workers run one)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 16, FEW_ROWS - 1, FEW_ROWS, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_left_matches_the_float64_product(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn((960, 576), generator=gen) / 24
    bias = torch.randn(960, generator=gen) if with_bias else None
    x = torch.randn((rows, 576), generator=gen)
    out = linear_weight_left(x, weight, bias)
    assert out.shape == (rows, 960) and out.is_contiguous() and out.dtype == torch.float32
    ref = linear_naive(x.double(), weight.double(), None if bias is None else bias.double())
    err = (out.double() - ref).abs()
    assert err.numel() == 0 or float(err.max()) < 1e-4
    # the same float32 product as the library's, up to summation order
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_weight_left_keeps_leading_dims_and_strided_input() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn((192, 64), generator=gen)
    x = torch.randn((2, 3, 128), generator=gen)[..., ::2]  # [2, 3, 64], last dim strided
    out = linear_weight_left(x, weight)
    assert out.shape == (2, 3, 192)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_weight_left_leaves_other_dtypes_many_rows_and_long_single_rows_to_the_library() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn((256, 128), generator=gen)
    for x, w in (
        (torch.randn((4, 128), generator=gen).bfloat16(), weight.bfloat16()),
        (torch.randn((FEW_ROWS + 5, 128), generator=gen), weight),
        # one row against a weight no wider than long: BLAS's matrix-vector kernel
        (torch.randn((1, 256), generator=gen), weight.T.contiguous()),
    ):
        assert torch.equal(linear_weight_left(x, w), F.linear(x, w))


def test_weight_left_is_the_library_on_one_thread() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn((3072, 576), generator=gen), torch.randn((4, 576), generator=gen)
    two = linear_weight_left(x, weight)
    torch.set_num_threads(1)
    assert torch.equal(linear_weight_left(x, weight), F.linear(x, weight))
    assert torch.equal(two, (weight @ x.T).T)  # on two threads: the weight-left product


def test_the_cpu_engine_runs_the_weight_left_op_where_the_probe_finds_it_faster(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kernels import cpu_linear

    assert select_dense_ops("cpu") is CPU_DENSE_OPS and CPU_DENSE_OPS.linear is linear_cpu
    assert select_dense_ops("meta") is DEFAULT_DENSE_OPS
    for preference in ("torch", "naive"):
        assert select_attention_backend("cpu", preference, torch.float32).dense is CPU_DENSE_OPS
    # the batch-invariant mode keeps its padded op (a row's bits must not follow the batch)
    assert select_attention_backend("cpu", "torch", torch.float32, batch_invariant=True).dense.linear is not linear_cpu
    # the op follows the probe's answer: rows where the two forms give other bits tell them apart
    gen = torch.Generator().manual_seed(6)
    weight, x = torch.randn((3072, 576), generator=gen), torch.randn((2, 576), generator=gen)
    left, library = linear_weight_left(x, weight), F.linear(x, weight)
    assert not torch.equal(left, library)
    for pays, expected in ((True, left), (False, library)):
        monkeypatch.setattr(cpu_linear, "weight_left_pays", lambda threads, pays=pays: pays)
        assert torch.equal(linear_cpu(x, weight), expected)


def test_the_probe_takes_the_weight_left_form_only_past_its_margin() -> None:
    assert weight_left_wins(1.0, 0.5) and weight_left_wins(1.25, 1.0)
    assert not weight_left_wins(1.2, 1.0) and not weight_left_wins(0.3, 0.8)
    library_ms, left_ms = probe_weight_left(rounds=1)
    assert library_ms > 0 and left_ms > 0
    assert not weight_left_pays(1)  # one thread: never probed, never taken
