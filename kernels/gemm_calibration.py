"""The engine's batch-invariant linear op: cuBLAS where it was checked to give the Triton
matmul's bits, the Triton matmul with the fastest tiling elsewhere.

cuBLAS's kernels that do not split ``K`` walk it in the order of
:func:`kernels.batch_invariant.matmul_triton`, so they give the same bits, and they are faster on
large batches; the ones it picks for a few rows split ``K``. :class:`BatchInvariantLinear` runs
cuBLAS for exactly the (weight shape, rows) it has checked, bit for bit, on this device and
library (every row count from a threshold up, :meth:`BatchInvariantLinear.calibrate`, raced
against the Triton tilings where both give the bits), and the Triton kernel for all others.
The checks are kept in a JSON store keyed by :func:`library_key`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.batch_invariant import Tiling, _add_bias, _as_rows, matmul_triton
from kernels.cache_paths import locked_store, read_json_store, write_json_store

# Tilings :meth:`BatchInvariantLinear.calibrate` times per row bucket (16-bit operands) on the
# shapes the library leaves to Triton at a few rows: the best tiling differs by shape (on the
# H200 the table's choice at 32 rows took 1.34x cuBLAS's time on Llama-3.1-8B's o and down
# projections, the best per shape 0.99-1.15x), and the bits do not. Up to 16 rows, 512-long K
# tiles with two warps stream a weight fastest from HBM (H200, scripts/gpu_gemv_cold.py,
# 2026-12-04: the down projection at one row in 30.2 us where the 128-long tiles took 33.1,
# cuBLAS's split-K 31.1); at 32 rows 32-wide column tiles with two warps (32.7 against 35.0).
_FEW_ROWS: tuple[Tiling, ...] = (
    (16, 16, 512, 2, 4), (16, 32, 512, 2, 4), (16, 16, 128, 2, 6), (16, 32, 128, 4, 6), (16, 32, 256, 2, 4),
)
_TUNE_CANDIDATES: dict[int, tuple[Tiling, ...]] = {
    8: _FEW_ROWS,
    16: _FEW_ROWS,
    32: ((32, 32, 256, 2, 5), (32, 32, 256, 2, 4), (32, 32, 256, 4, 4), (32, 16, 256, 2, 5), (32, 32, 128, 4, 6)),
    64: ((64, 32, 128, 4, 6), (64, 16, 128, 4, 5), (32, 32, 256, 4, 4), (64, 64, 128, 4, 4)),
    128: ((64, 64, 128, 4, 4), (64, 32, 128, 4, 6), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)),
    256: ((128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (128, 64, 64, 8, 4)),
}
#: Version of the tiling search kept in the store: an entry tuned by another version is tuned
#: again (2: weights timed from HBM, cycled through copies; the candidates above).
_TUNING_VERSION = 2
#: Copies of a weight the search cycles through sum to at least this many times the device's L2
#: cache, so that every timed call reads its weight from HBM, as a step does (a step streams
#: every layer's weights: none is in L2 when its projection runs).
_COLD_L2_MULTIPLE = 2
#: At most this many copies (a tiny weight is timed from L2 whatever the copies).
_MAX_COPIES = 16


def graph_time_us(fn: Callable[[], object], reps: int = 10) -> float:
    """GPU time of one call of ``fn`` (microseconds): the best of three replays of a CUDA
    graph of ``reps`` calls, so host launch time does not count."""
    fn()  # compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(x, weight, config=tiling or None) -> x @ weight.T``: the order-defining kernel.
ReferenceFn = Callable[..., torch.Tensor]
#: ``fn -> microseconds per call``: how the calibration times a tiling.
TimerFn = Callable[[Callable[[], object]], float]
#: Row counts compared per device-side batch of :meth:`BatchInvariantLinear.calibrate` (one
#: host sync each).
_CALIBRATION_CHUNK = 128
#: A Triton tiling takes rows the library gives the same bits for only when it runs in at most
#: this share of the library's time: timing noise must not flip the choice between starts.
_RACE_MARGIN = 0.95


def library_key(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """What decides which kernel the library picks, besides the shape: the device and the
    library builds, and torch's settings that change cuBLAS's choices."""
    key: dict[str, object] = {"torch": torch.__version__, "dtype": str(dtype), "device": device.type}
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        key.update(
            name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            blas=str(torch.backends.cuda.preferred_blas_library()),
            reduced_bf16=matmul.allow_bf16_reduced_precision_reduction,
            reduced_fp16=matmul.allow_fp16_reduced_precision_reduction,
            tf32=matmul.allow_tf32,
        )
    return key


class BatchInvariantLinear:
    """The batch-invariant linear op of an engine: ``(x, weight, bias) -> x @ weight.T + bias``.

    Every row's bits are those of :func:`matmul_triton` (one accumulator per output, ``K``
    ascending) whatever the number of rows. A call runs the library's GEMM (``library``,
    cuBLAS) when :meth:`calibrate` found, for that weight shape and dtype, that the library
    gives those bits at this row count and every larger one up to the calibrated bound; the
    Triton kernel otherwise (any other shape, fewer rows, more rows than calibrated, inputs not
    16-byte aligned), with the tiling the calibration timed fastest for that shape and row
    bucket where it timed one.

    Invariant: :attr:`library_rows` only holds thresholds checked on this process's device and
    library (the disk store is keyed by :func:`library_key`); :attr:`tilings` only holds
    tilings whose bits were checked equal to the reference's.

    Args:
        device: where the op runs.
        library: the fast GEMM whose bits are checked (``F.linear``; tests pass others).
        reference: the order-defining kernel (:func:`matmul_triton`), called as
            ``reference(x, weight, config=tiling)`` (``config=None``: its own choice).
        timer: times a call for the tiling search (:func:`graph_time_us` on CUDA); ``None``
            (the default off CUDA): no search.
        candidates: ``row bound -> tilings`` to time (:data:`_TUNE_CANDIDATES`), 16-bit
            operands only (float32's K tiles are bounded by shared memory).
        cache_bytes: the last-level cache the timed weights must not fit in
            (:meth:`_weight_copies`); ``None``: the device's L2 on CUDA, none elsewhere.
    """

    def __init__(
        self,
        device: torch.device | str,
        library: LinearFn | None = None,
        reference: ReferenceFn | None = None,
        timer: TimerFn | None = None,
        candidates: dict[int, tuple[Tiling, ...]] | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        if cache_bytes is None:
            cache_bytes = 0
            if self.device.type == "cuda":
                props = torch.cuda.get_device_properties(self.device)
                cache_bytes = int(getattr(props, "L2_cache_size", 0))
        self.cache_bytes = cache_bytes
        self.library = library or F.linear
        self.reference = reference or matmul_triton
        self.timer = timer if timer is not None else (graph_time_us if self.device.type == "cuda" else None)
        self.candidates = dict(_TUNE_CANDIDATES if candidates is None else candidates)
        #: ``(N, K, dtype) -> (first row count, last row count)`` served by the library
        self.library_rows: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {}
        #: ``(N, K, dtype) -> ((row bound, tiling), ...)`` ascending: the Triton tiling per bucket
        self.tilings: dict[tuple[int, int, torch.dtype], tuple[tuple[int, Tiling], ...]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        lead, rows = _as_rows(x)
        span = self.library_rows.get((n, k, x.dtype))
        if span is not None and weight.stride(-1) == 1:
            if span[0] <= rows.shape[0] <= span[1] and rows.stride(0) == k and rows.data_ptr() % 16 == 0:
                return _add_bias(self.library(rows, weight), bias).reshape(*lead, n)
        config = None
        for bound, tiling in self.tilings.get((n, k, x.dtype), ()):
            if rows.shape[0] <= bound:
                config = tiling
                break
        return _add_bias(self.reference(rows, weight, config=config), bias).reshape(*lead, n)

    def calibrate(
        self, shapes: dict[tuple[int, int], int], dtype: torch.dtype, store: Path | None = None, seed: int = 0
    ) -> dict[tuple[int, int], tuple[int, int] | None]:
        """Finds, per weight shape, the row counts at which the library gives the reference
        bits, and the fastest reference tiling for the row counts it does not.

        For each ``(N, K) -> max_rows``, every row count from ``max_rows`` down is compared bit
        for bit (random inputs, each row count its own GEMM call: the library picks its kernel
        per call) until the first that differs; the library may then serve the counts above it.
        Exhaustive, so a count is served by the library only if that very call was checked.
        Below that count, each row bucket of :attr:`candidates` gets the candidate tiling
        :attr:`timer` finds fastest at the bucket's largest count (a candidate whose bits
        differ from the reference's is never kept). Above it, the buckets race: from the
        lowest up, while a bucket's fastest tiling beats the library by :data:`_RACE_MARGIN`
        at the bucket's largest count, Triton serves that bucket too (:meth:`_race_library`:
        both give the same bits there, so only time decides). Results are kept in ``store`` (a JSON file
        keyed by :func:`library_key`, under its lock), so a process on the same device and libraries
        skips the work, and processes calibrating at once check each shape once. Run it before any CUDA graph capture.

        Args:
            shapes: ``(N, K) -> the most rows a call will have``.
            dtype: the activations' and weights' dtype.
            store: the JSON file of earlier results; ``None``: none kept.
            seed: the random inputs' seed.

        Returns:
            ``(N, K) -> (first, last)`` row counts the library serves, ``None`` where none.
        """
        key = json.dumps(library_key(self.device, dtype), sort_keys=True)
        # NOTE: under the store's lock, so that processes calibrating one device type at once
        # (replicas, ranks) check each shape once: the others wait, then read its entry
        with locked_store(store):
            saved = read_json_store(store).get(key)
            saved = saved if isinstance(saved, dict) else {}
            found: dict[tuple[int, int], tuple[int, int] | None] = {}
            gen = torch.Generator().manual_seed(seed)
            for (n, k), max_rows in shapes.items():
                entry = saved.get(f"{n}x{k}")
                if entry is None or entry["max_rows"] < max_rows:
                    entry = {"bits_first": self._first_library_rows(n, k, max_rows, dtype, gen), "max_rows": max_rows}
                if entry.get("tuning") != _TUNING_VERSION:
                    # NOTE: a store written before the race kept the bits' threshold as "first"
                    bits_first = entry.get("bits_first", entry.get("first", max_rows + 1))
                    tilings = self._tune_tilings(n, k, min(bits_first - 1, max_rows), dtype, gen)
                    first, tilings = self._race_library(n, k, bits_first, max_rows, dtype, gen, tilings)
                    entry.update(bits_first=bits_first, first=first, tilings=tilings, tuning=_TUNING_VERSION)
                first = entry["first"]
                saved[f"{n}x{k}"] = entry
                span = (first, max_rows) if first <= max_rows else None
                found[(n, k)] = span
                if span is not None:
                    self.library_rows[(n, k, dtype)] = span
                else:
                    self.library_rows.pop((n, k, dtype), None)
                self.tilings[(n, k, dtype)] = tuple((int(b), tuple(t)) for b, t in entry["tilings"])  # type: ignore[misc]
            if store is not None:
                data = read_json_store(store)
                kept = data.get(key)
                data[key] = {**(kept if isinstance(kept, dict) else {}), **saved}
                write_json_store(store, data)
        return found

    def _first_library_rows(self, n: int, k: int, max_rows: int, dtype: torch.dtype, gen: torch.Generator) -> int:
        """The smallest row count from which every count up to ``max_rows`` gives the
        reference bits (``max_rows + 1``: none)."""
        weight = (torch.randn((n, k), generator=gen) / k**0.5).to(self.device, dtype)
        x = torch.randn((max_rows, k), generator=gen).to(self.device, dtype)
        ref = self.reference(x, weight)
        first = max_rows + 1
        top = max_rows
        while top >= 1:
            counts = range(top, max(0, top - _CALIBRATION_CHUNK), -1)
            # NOTE: one flag per count on the device, one host sync per chunk.
            differs = torch.stack([(self.library(x[:m], weight) != ref[:m]).any() for m in counts]).cpu()
            for m, bad in zip(counts, differs.tolist(), strict=True):
                if bad:
                    return first
                first = m
            top -= _CALIBRATION_CHUNK
        return first

    def _race_library(
        self, n: int, k: int, first: int, max_rows: int, dtype: torch.dtype, gen: torch.Generator,
        tilings: list[list[object]],
    ) -> tuple[int, list[list[object]]]:
        """The library's row counts after racing it against the Triton tilings.

        Args:
            first: the first row count from which the library gives the reference bits.
            tilings: ``[[row bound, tiling], ...]`` tuned below ``first``.

        Returns:
            ``(first row count the library serves, tilings)``: the buckets of
            :attr:`candidates` from the one holding ``first`` up, in ascending order, go to
            the bucket's fastest tiling while it beats the library by :data:`_RACE_MARGIN` at
            the bucket's largest count (up to ``max_rows``); the first bucket it does not beat
            stops the race. No timer or 32-bit operands: no race.

        NOTE: measured on the H200 (2026-12-04): at a few rows cuBLAS runs Llama-3.1-8B's QKV
        projection (6144 x 4096) with 64-row weight tiles, 96 programs for 132 SMs; the bits are
        the Triton kernel's, so the faster of the two may serve those rows.
        """
        if self.timer is None or dtype.itemsize == 4 or first > max_rows:
            return first, tilings
        weight = (torch.randn((n, k), generator=gen) / k**0.5).to(self.device, dtype)
        x = torch.randn((max_rows, k), generator=gen).to(self.device, dtype)
        copies = self._weight_copies(weight)
        chosen = [list(entry) for entry in tilings]
        for bound in sorted(self.candidates):
            top = min(bound, max_rows)
            if top < first:
                continue
            rows = x[:top]
            library_us = self.timer(_cycled(lambda w, rows=rows: self.library(rows, w), copies))
            fastest = self._fastest_tiling(rows, copies, bound)
            if fastest is None or fastest[0] > _RACE_MARGIN * library_us:
                break
            chosen = [entry for entry in chosen if entry[0] != bound] + [[bound, list(fastest[1])]]
            first = top + 1
            if first > max_rows:
                break
        return first, sorted(chosen, key=lambda entry: entry[0])  # type: ignore[arg-type, return-value]

    def _tune_tilings(
        self, n: int, k: int, top_rows: int, dtype: torch.dtype, gen: torch.Generator
    ) -> list[list[object]]:
        """``[[row bound, tiling], ...]`` for the buckets that reach row counts ``<= top_rows``
        (the ones Triton serves): per bucket the candidate fastest at its largest count among
        those giving the reference's bits; empty without a timer or for 32-bit operands."""
        if self.timer is None or dtype.itemsize == 4 or top_rows < 1:
            return []
        weight = (torch.randn((n, k), generator=gen) / k**0.5).to(self.device, dtype)
        x = torch.randn((top_rows, k), generator=gen).to(self.device, dtype)
        copies = self._weight_copies(weight)
        chosen: list[list[object]] = []
        low = 0
        for bound in sorted(self.candidates):
            if low >= top_rows:
                break
            fastest = self._fastest_tiling(x[: min(bound, top_rows)], copies, bound)
            if fastest is not None:
                chosen.append([bound, list(fastest[1])])
            low = bound
        return chosen

    def _fastest_tiling(
        self, rows: torch.Tensor, copies: list[torch.Tensor], bound: int
    ) -> tuple[float, Tiling] | None:
        """``(microseconds, tiling)`` of the candidate of bucket ``bound`` that :attr:`timer`
        finds fastest on ``rows`` among those giving the reference's bits (``None``: none).
        Each timed call reads the next of ``copies`` (equal weights, :meth:`_weight_copies`)."""
        assert self.timer is not None
        weight = copies[0]
        ref = self.reference(rows, weight)
        timed = []
        for tiling in self.candidates[bound]:
            if not torch.equal(self.reference(rows, weight, config=tiling), ref):
                continue  # NOTE: never expected (tilings keep the order); never kept either
            call = _cycled(lambda w, tiling=tiling: self.reference(rows, w, config=tiling), copies)
            timed.append((self.timer(call), tiling))
        return min(timed) if timed else None

    def _weight_copies(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """``weight`` and enough copies of it that cycling through them reads each from memory,
        not from the cache (together at least :data:`_COLD_L2_MULTIPLE` times
        :attr:`cache_bytes`, at most :data:`_MAX_COPIES`); only ``weight`` without a cache or
        when the copies do not fit in free memory."""
        nbytes = weight.numel() * weight.element_size()
        count = min(_MAX_COPIES, max(1, -(-_COLD_L2_MULTIPLE * self.cache_bytes // max(nbytes, 1))))
        copies = [weight]
        try:
            copies += [weight.clone() for _ in range(count - 1)]
        except torch.OutOfMemoryError:
            # NOTE: timed from L2 then: the choice may favour another tiling, never other bits
            return [weight]
        return copies


def _cycled(call: Callable[[torch.Tensor], object], copies: list[torch.Tensor]) -> Callable[[], object]:
    """``call`` of the next of ``copies`` at each call (equal weights, read in turn)."""
    cycle = itertools.cycle(copies)
    return lambda: call(next(cycle))


__all__ = ["BatchInvariantLinear", "graph_time_us", "library_key"]
