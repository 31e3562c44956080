"""The batch-invariant linear and RMSNorm ops (:mod:`kernels.batch_invariant`, and the
calibrated linear op of :mod:`kernels.gemm_calibration`).

- CPU: the row-padded BLAS linear gives each row the same bits at every batch size and
  offset; the Triton matmul and RMSNorm under the interpreter against the float64 oracle;
  the calibrated linear's routing (library only where its bits were checked) with a library
  that differs on chosen row counts.
- GPU (``-m gpu``): the compiled Triton matmul and RMSNorm, bitwise per row across batch sizes
  (1 to 1,000 rows, several offsets), and accurate.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kernels.batch_invariant import linear_naive, linear_padded, rms_norm_naive
from kernels.dispatch import CPU_DENSE_OPS, select_dense_ops
from kernels.gemm_calibration import _TUNE_CANDIDATES, BatchInvariantLinear, library_key

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
    assert ops.name == "batch-invariant" and select_dense_ops("cpu") is CPU_DENSE_OPS
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((300, 576), generator=gen)
    weight = torch.randn(576, generator=gen)
    _rows_invariant(lambda rows: ops.rms_norm(rows, weight, 1e-5), x)
    err = (ops.rms_norm(x, weight, 1e-5).double() - rms_norm_naive(x.double(), weight.double(), 1e-5)).abs()
    assert float(err.max()) < 1e-5


class _FlakyLibrary:
    """``linear_padded``, one ulp off on the row counts in ``differs``; counts its calls."""

    def __init__(self, differs: set[int]) -> None:
        self.differs = differs
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        out = linear_padded(x, weight)
        if x.shape[0] in self.differs:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out


def test_calibrated_linear_serves_the_library_only_where_checked(tmp_path: Path) -> None:
    """Counts 5..40 match except 9: the library serves 10..40, the reference everything else,
    and every row keeps the reference's bits (bias added after rounding on both paths)."""
    library = _FlakyLibrary({1, 2, 3, 4, 9})
    reference_calls: list[int] = []

    def reference(x: torch.Tensor, weight: torch.Tensor, config: object = None) -> torch.Tensor:
        reference_calls.append(x.shape[0])
        return linear_padded(x, weight)

    op = BatchInvariantLinear("cpu", library=library, reference=reference)
    store = tmp_path / "gemm.json"
    found = op.calibrate({(24, 16): 40, (8, 16): 3}, torch.float32, store)
    assert found == {(24, 16): (10, 40), (8, 16): None}
    # exhaustive: every count from the top down to the first that differs was a call of its own
    assert set(range(9, 41)) <= set(library.calls) and {1, 2, 3} <= set(library.calls)
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn((24, 16), generator=gen), torch.randn(24, generator=gen)
    x = torch.randn((60, 16), generator=gen)
    full = linear_padded(x, weight) + bias
    for m in (1, 9, 10, 25, 40, 41, 60):
        library.calls.clear()
        reference_calls.clear()
        assert torch.equal(op(x[:m], weight, bias), full[:m])
        assert (library.calls, reference_calls) == (([m], []) if 10 <= m <= 40 else ([], [m]))
    # rows that are not 16-byte aligned never reach the library
    buf = torch.empty(20 * 16 + 1)
    misaligned = buf[1:].view(20, 16)
    misaligned.copy_(x[:20])
    assert misaligned.data_ptr() % 16 != 0
    library.calls.clear()
    assert torch.equal(op(misaligned, weight), linear_padded(x[:20], weight)) and library.calls == []
    # a second op on the same store reuses the checks; a larger bound checks again
    again = BatchInvariantLinear("cpu", library=_FlakyLibrary(set()), reference=reference)
    assert again.calibrate({(24, 16): 40}, torch.float32, store) == {(24, 16): (10, 40)}
    assert again.library.calls == []  # type: ignore[attr-defined]
    assert again.calibrate({(24, 16): 44}, torch.float32, store) == {(24, 16): (1, 44)}
    assert json.loads(store.read_text())[json.dumps(library_key(torch.device("cpu"), torch.float32), sort_keys=True)]


def test_calibrations_at_once_check_each_shape_once_and_keep_every_shape(tmp_path: Path) -> None:
    """A calibration that starts while another holds the store waits, then reads what that one
    found (no check of its own); one of another shape adds to the store, dropping nothing."""
    store = tmp_path / "gemm.json"
    started, release = threading.Event(), threading.Event()

    class _Held(_FlakyLibrary):
        def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            started.set()
            assert release.wait(30)
            return super().__call__(x, weight)

    def reference(x: torch.Tensor, weight: torch.Tensor, config: object = None) -> torch.Tensor:
        return linear_padded(x, weight)

    first = BatchInvariantLinear("cpu", library=_Held({1, 2}), reference=reference)
    second = BatchInvariantLinear("cpu", library=_FlakyLibrary(set()), reference=reference)
    results: dict[str, object] = {}
    a = threading.Thread(target=lambda: results.update(a=first.calibrate({(24, 16): 12}, torch.float32, store)))
    a.start()
    assert started.wait(30)
    b = threading.Thread(target=lambda: results.update(b=second.calibrate({(24, 16): 12}, torch.float32, store)))
    b.start()
    b.join(0.3)
    assert b.is_alive() and "b" not in results  # waits on the lock the first holds
    release.set()
    a.join(30)
    b.join(30)
    assert results == {"a": {(24, 16): (3, 12)}, "b": {(24, 16): (3, 12)}}
    assert second.library.calls == []  # type: ignore[attr-defined]
    second.calibrate({(8, 16): 4}, torch.float32, store)
    kept = json.loads(store.read_text())[json.dumps(library_key(torch.device("cpu"), torch.float32), sort_keys=True)]
    assert set(kept) == {"24x16", "8x16"}


def test_calibration_picks_the_fastest_tiling_with_the_reference_bits(tmp_path: Path) -> None:
    """Below the library's first row count, each row bucket gets the candidate tiling the timer
    finds fastest among those giving the reference's bits; calls then use it, and a second op
    reads the choices back from the store without timing anything."""
    fast_wrong, slow, fast, mid = (1, 1, 1, 1, 1), (2, 2, 2, 2, 2), (3, 3, 3, 3, 3), (4, 4, 4, 4, 4)
    times = {fast_wrong: 1.0, slow: 5.0, fast: 3.0, mid: 4.0}
    calls: list[tuple[int, object]] = []

    def reference(x: torch.Tensor, weight: torch.Tensor, config: object = None) -> torch.Tensor:
        calls.append((x.shape[0], config))
        out = linear_padded(x, weight)
        return (out.float() * 1.05).to(out.dtype) if config == fast_wrong else out

    def library(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append((x.shape[0], "library"))
        out = linear_padded(x, weight)
        return (out.float() * 1.05).to(out.dtype) if x.shape[0] <= 12 else out

    # the library is faster than every tiling where its bits are the reference's: it keeps them
    times["library"] = 2.0
    timed: list[object] = []

    def timer(fn: object) -> float:
        fn()  # type: ignore[operator]
        timed.append(calls[-1][1])
        return times[calls[-1][1]]  # type: ignore[index]

    candidates = {4: (slow, fast, fast_wrong), 8: (slow, mid), 16: (fast, mid), 64: (slow,)}
    op = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    store = tmp_path / "gemm.json"
    assert op.calibrate({(24, 16): 40}, torch.bfloat16, store) == {(24, 16): (13, 40)}
    # buckets up to 16 reach the 12 rows Triton serves; the one of 64 does not; the race of
    # the bucket of 16 (rows 13..16, the library's bits) against the library stopped there
    assert op.tilings[(24, 16, torch.bfloat16)] == ((4, fast), (8, mid), (16, fast))
    assert fast_wrong not in timed and timed.count(slow) == 2 and timed.count("library") == 1
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn((24, 16), generator=gen).bfloat16()
    x = torch.randn((50, 16), generator=gen).bfloat16()
    for m, config in ((3, fast), (7, mid), (12, fast), (41, None)):
        calls.clear()
        assert torch.equal(op(x[:m], weight), linear_padded(x[:m], weight))
        assert calls == [(m, config)]
    calls.clear()
    op(x[:20], weight)
    assert calls == [(20, "library")]
    again = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    timed.clear()
    again.calibrate({(24, 16): 40}, torch.bfloat16, store)
    assert again.tilings == op.tilings and timed == []
    # a slower library loses the buckets whose fastest tiling beats it, from the lowest up:
    # rows 13..40 have the library's bits, yet Triton serves them
    times["library"] = 10.0
    slow_library = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    assert slow_library.calibrate({(24, 16): 40}, torch.bfloat16) == {(24, 16): None}
    assert slow_library.tilings[(24, 16, torch.bfloat16)] == ((4, fast), (8, mid), (16, fast), (64, slow))
    for m, config in ((14, fast), (40, slow)):
        calls.clear()
        assert torch.equal(slow_library(x[:m], weight), linear_padded(x[:m], weight))
        assert calls == [(m, config)]
    # within the margin the library keeps its rows (timing noise must not flip them)
    times["library"] = 3.1
    close = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    assert close.calibrate({(24, 16): 40}, torch.bfloat16) == {(24, 16): (13, 40)}
    # a store written before the race (the bits' threshold as "first", no race) is raced again
    old_store = tmp_path / "old.json"
    old_store.write_text(json.dumps({
        json.dumps(library_key(torch.device("cpu"), torch.bfloat16), sort_keys=True):
            {"24x16": {"first": 13, "max_rows": 40, "tilings": [[4, list(fast)]]}}
    }))
    times["library"] = 10.0
    timed.clear()
    reread = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    assert reread.calibrate({(24, 16): 40}, torch.bfloat16, old_store) == {(24, 16): None}
    assert "library" in timed
    times["library"] = 2.0
    timed.clear()
    # float32 operands keep the default table: no search
    op32 = BatchInvariantLinear("cpu", library=library, reference=reference, timer=timer, candidates=candidates)
    op32.calibrate({(24, 16): 40}, torch.float32)
    assert op32.tilings[(24, 16, torch.float32)] == () and timed == []


def test_calibration_times_tilings_on_weight_copies_past_the_cache(tmp_path: Path) -> None:
    """A step reads each weight from memory, never from a cache it just filled: the timed calls
    cycle through equal copies that together exceed twice the cache, and a store tuned by the
    previous search (timed on one weight) is tuned again."""
    tiling = (5, 5, 5, 5, 5)
    seen: list[tuple[int, torch.Tensor]] = []

    def reference(x: torch.Tensor, weight: torch.Tensor, config: object = None) -> torch.Tensor:
        if config is not None:
            seen.append((weight.data_ptr(), weight))
        return linear_padded(x, weight)

    def timer(fn: object) -> float:
        for _ in range(12):
            fn()  # type: ignore[operator]
        return 1.0

    weight_bytes = 24 * 16 * 2
    op = BatchInvariantLinear(
        "cpu", library=lambda x, w: linear_padded(x, w) + 1, reference=reference, timer=timer,
        candidates={8: (tiling,)}, cache_bytes=weight_bytes + 1,
    )
    store = tmp_path / "gemm.json"
    op.calibrate({(24, 16): 8}, torch.bfloat16, store)
    timed = [w for _, w in seen[1:]]  # the first call checks the tiling's bits on the weight itself
    # ceil(2 * (bytes + 1) / bytes) = 3 copies, read in turn, all equal
    assert len({ptr for ptr, _ in seen[1:]}) == 3
    assert [w.data_ptr() for w in timed[:6]] == [w.data_ptr() for w in timed[:3]] * 2
    assert all(torch.equal(w, timed[0]) for w in timed)
    # no cache: the weight alone
    seen.clear()
    plain = BatchInvariantLinear(
        "cpu", library=lambda x, w: linear_padded(x, w) + 1, reference=reference, timer=timer,
        candidates={8: (tiling,)},
    )
    plain.calibrate({(24, 16): 8}, torch.bfloat16)
    assert len({ptr for ptr, _ in seen}) == 1
    # an entry of the previous search (no tuning version) is tuned again; this one is not
    key = json.dumps(library_key(torch.device("cpu"), torch.bfloat16), sort_keys=True)
    data = json.loads(store.read_text())
    assert data[key]["24x16"]["tuning"] == 2
    seen.clear()
    op.calibrate({(24, 16): 8}, torch.bfloat16, store)
    assert seen == []
    del data[key]["24x16"]["tuning"]
    store.write_text(json.dumps(data))
    op.calibrate({(24, 16): 8}, torch.bfloat16, store)
    assert seen


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


@pytest.mark.parametrize(
    "tiling", sorted({t for bucket in (8, 16, 32) for t in _TUNE_CANDIDATES[bucket]}), ids=str
)
def test_matmul_triton_interpreter_few_row_tilings(interp_dense: ModuleType, tiling: tuple[int, ...]) -> None:
    """Every few-row candidate tiling of the start-up search, 16-bit operands, with a ``K`` that
    is no multiple of its ``K`` tile (the long 512-element tiles end in a masked one) and a
    column tail: the product, within float16's rounding of the float64 one. (float16: this
    interpreter reads bfloat16 CPU tensors wrongly, whatever the kernel; the GPU tests run
    bfloat16.)"""
    gen = torch.Generator().manual_seed(sum(tiling))
    x = torch.randn((3, 600), generator=gen).half()
    weight = (torch.randn((40, 600), generator=gen) / 600**0.5).half()
    out = interp_dense.matmul_triton(x, weight, config=tiling)
    ref = linear_naive(x.double(), weight.double())
    assert out.dtype == torch.float16 and float((out.double() - ref).abs().max()) < 5e-3


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


@pytest.mark.gpu
def test_calibrated_linear_gpu_keeps_the_triton_bits(compiled_dense: ModuleType, tmp_path: Path) -> None:
    """cuBLAS where the calibration checked it, Triton elsewhere: every row count gives the
    Triton kernel's bits, and the split-K shapes of Llama-3.1-8B (o and down projections at
    a few rows) are left to Triton."""
    shapes = {(6144, 4096): 300, (4096, 4096): 300, (4096, 14336): 300}
    op = BatchInvariantLinear("cuda")
    found = op.calibrate(shapes, torch.bfloat16, tmp_path / "gemm.json")
    assert set(found) == set(shapes)
    gen = torch.Generator().manual_seed(7)
    for (n, k) in shapes:
        weight = (torch.randn((n, k), generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        x = torch.randn((303, k), generator=gen).to("cuda", torch.bfloat16)
        ref = compiled_dense.matmul_triton(x, weight)
        for m in (1, 2, 8, 31, 32, 33, 64, 100, 255, 256, 257, 300):
            for start in (0, 3):
                assert torch.equal(op(x[start : start + m], weight), ref[start : start + m]), (n, k, m, start)
