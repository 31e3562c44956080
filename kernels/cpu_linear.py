"""The CPU's linear op: the library's product, the weight as the GEMM's left operand, or
oneDNN's product on a weight packed once into its blocked layout, whichever a probe of this
process's machine finds fastest.

``F.linear(x, w)`` computes ``x [M, K] @ w[N, K]^T``. With a few rows (a decode step's batch)
MKL's GEMM re-packs the whole weight on every call and, on some machines, takes a slow path:

- the CPU machine of 2026-12-04: SmolLM2-135M's fused gate/up projection at 2 rows 1.21 ms
  with ``F.linear`` against 0.59 ms weight-left (two threads), its LM head at 16 rows 26.4
  against 18.6 ms; an AVX-512 Xeon of 2026-12-05: the weight-left form 2-3x *slower*;
- an AMD EPYC of 2026-12-06 (AVX2, one thread): the LM head at 3 rows 3.5 GB/s of weights read
  with ``F.linear`` against 11.9 GB/s with the packed oneDNN product, the gate/up projection
  5.3 against 11.7 GB/s (``python scripts/bench_cpu_linear.py``).

So :func:`linear_cpu`, the CPU engine's op, runs the forms :func:`few_row_forms` found fastest
for this process's thread count: oneDNN's for every row count where it clearly beats the others
at few rows and ties the library's at many (then a row's bits never depend on its batch), else
per row count below :data:`FEW_ROWS` the library's or the weight-left product, and the
library's from there. ``ASYMCACHE_CPU_LINEAR`` (``library``, ``weight-left`` or ``onednn``)
sets one form instead.

Shapes: activations ``[..., K]``, weights ``[N, K]`` (``nn.Linear`` layout), outputs
``[..., N]``. Every form is the same float32 math in another summation order: a row's bits may
differ from ``F.linear``'s in the last places, and between forms.

The engine's batch-invariant mode runs :func:`linear_invariant_cpu`: oneDNN's product where a
check of this machine (:func:`onednn_rows_invariant`, per weight shape, kept beside the probe's
forms) finds a row's bits independent of how many rows share the call, else the same-shape
BLAS calls of :func:`kernels.batch_invariant.linear_padded`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.batch_invariant import _as_rows, linear_padded
from kernels.cache_paths import cache_dir, kept_in_store

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


# The forms of the product, and the env variable that forces one of them.
FORMS = ("library", "weight-left", "onednn")
FORM_ENV = "ASYMCACHE_CPU_LINEAR"
# Lower bounds of the row-count buckets a form is chosen for (the last: FEW_ROWS rows and more),
# and the row count the probe times for each.
ROW_BUCKETS = (1, 2, 4, 8, 16, FEW_ROWS)
PROBE_ROWS = (1, 3, 6, 12, 24, 128)
# How much faster than the library's product another few-row form must run in the probe to be
# taken: a margin, so that a machine near the line does not switch forms (and bits) from one
# process to the next. oneDNN's form, taken for every row count or none, needs ONEDNN_MARGIN over
# the few-row forms it replaces (it costs nothing elsewhere: its many-row calls, prefill steps,
# must stay within TIE of the library's).
MARGIN = 1.25
ONEDNN_MARGIN = 1.1
TIE = 1.15

# The packed copy of a weight rides on the weight tensor itself (its data pointer and version
# with it): engines sharing a loaded model share the copies, and they go with the weights.
_PACKED_ATTR = "_asymcache_onednn_packed"


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build runs oneDNN's packed-weight linear op on the CPU."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(
            ops, "_reorder_linear_weight"
        )
    except (AttributeError, RuntimeError):
        return False


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` packed into oneDNN's blocked layout, once per weight (and again only if
    its storage or contents changed since)."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, _PACKED_ATTR, None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        setattr(weight, _PACKED_ATTR, cached)
    return cached[1]


def linear_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN on the packed weight (:func:`onednn_weight`), float32.

    NOTE: measured on the CPU machine of 2026-12-06 (AMD EPYC, one and two threads), a row's bits
    do not depend on how many rows share the call (1 to 600): used for every row count, this
    form keeps the CPU's linear layers batch-invariant, where the library's product changes
    bits below four rows.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]``, contiguous.
    """
    lead, rows = _as_rows(x)
    if rows.shape[0] == 0 or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), onednn_weight(weight), bias, "none", [], "")
    return out.reshape(*lead, weight.shape[0])


# Each form's op, by name.
FORM_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "library": F.linear, "weight-left": linear_weight_left, "onednn": linear_onednn,
}


def pick_form(times_ms: dict[str, float]) -> str:
    """The fastest of ``times_ms`` (one row count's probe) but oneDNN's, the library's unless
    another runs at least :data:`MARGIN` times faster."""
    others = {f: t for f, t in times_ms.items() if f != "onednn"}
    best = min(others, key=others.__getitem__)
    return best if others["library"] >= MARGIN * others[best] else "library"


def choose_forms(probe: dict[int, dict[str, float]]) -> tuple[str, ...]:
    """The form of each of :data:`ROW_BUCKETS` from a probe (:func:`probe_forms`).

    oneDNN's form is one for every row count or none (a row's bits then never follow the
    batch): taken where its few-row calls together run at least :data:`ONEDNN_MARGIN` times
    faster than the forms :func:`pick_form` would run instead, and its many-row call (prefill
    steps) within :data:`TIE` of the library's. Otherwise each few-row bucket runs its
    :func:`pick_form`, and many rows the library's product.
    """
    few = PROBE_ROWS[:-1]
    forms = tuple(pick_form(probe[rows]) for rows in few) + ("library",)
    if "onednn" in probe[few[0]]:
        onednn_ms = sum(probe[rows]["onednn"] for rows in few)
        chosen_ms = sum(probe[rows][form] for rows, form in zip(few, forms[:-1], strict=True))
        many = probe[PROBE_ROWS[-1]]
        if chosen_ms >= ONEDNN_MARGIN * onednn_ms and many["onednn"] <= TIE * many["library"]:
            return ("onednn",) * len(ROW_BUCKETS)
    return forms


def probe_forms(threads: int, rounds: int = 3) -> dict[int, dict[str, float]]:
    """Milliseconds a call of each form takes on this process's machine at :data:`PROBE_ROWS`
    rows (medians of alternating rounds): a gate/up- and a down-shaped weight (3,072 x 576 and
    576 x 1,536, a small model's MLP), three copies of each cycled (32 MB, past the per-core
    caches). The weight-left form only below :data:`FEW_ROWS` rows and on two or more threads
    (elsewhere it is the library's product).

    Returns:
        ``{rows: {form: ms}}``.
    """
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for shape in ((3072, 576), (576, 1536)) for _ in range(3)]
    result: dict[int, dict[str, float]] = {}
    for rows in PROBE_ROWS:
        forms = [
            f for f in FORMS
            if (f != "weight-left" or (threads >= 2 and rows < FEW_ROWS)) and (f != "onednn" or onednn_available())
        ]
        xs = {w.shape[1]: torch.randn((rows, w.shape[1]), generator=gen) for w in weights}
        times: dict[str, list[float]] = {f: [] for f in forms}
        for form in forms:  # warm-up (and the packing)
            for w in weights:
                FORM_OPS[form](xs[w.shape[1]], w)
        passes = 2
        for r in range(rounds if rows < FEW_ROWS else rounds + 2):
            for form in forms if r % 2 == 0 else reversed(forms):
                op = FORM_OPS[form]
                start = time.perf_counter()
                for _ in range(passes):
                    for w in weights:
                        op(xs[w.shape[1]], w)
                times[form].append((time.perf_counter() - start) / (passes * len(weights)) * 1e3)
        result[rows] = {f: statistics.median(t) for f, t in times.items()}
    return result


# The file in the cache folder that keeps each machine's probed forms.
STORE_NAME = "cpu-linear.json"


def machine_key(threads: int) -> str:
    """What decides the probe's answer besides noise: torch's build, the CPU (its model and
    instruction sets), the cores and the threads."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = hashlib.sha256(value.strip().encode()).hexdigest()[:16]
    except OSError:
        model = platform.processor()
    key = {"torch": torch.__version__, "cpu": model, "flags": flags, "cores": os.cpu_count(), "threads": threads}
    return json.dumps(key, sort_keys=True)


def _valid_forms(forms: object) -> bool:
    return (
        isinstance(forms, list) and len(forms) == len(ROW_BUCKETS) and all(f in FORMS for f in forms)
        and ("onednn" not in forms or onednn_available())
    )


def stored_forms(threads: int, store: Path | None) -> tuple[str, ...]:
    """The forms ``store`` (a JSON file) keeps for this machine (:func:`machine_key`), else
    :func:`choose_forms` of a :func:`probe_forms`, then kept there.

    NOTE: kept so that every process on a machine runs the same forms (the same bits) and
    probes once: a probe near its thresholds could answer differently from one process to the
    next. Processes starting together take a lock, so one probes and the others read. A store
    that cannot be read is probed over; one that cannot be written costs a probe per process.
    """
    forms = kept_in_store(store, machine_key(threads), _valid_forms, lambda: list(choose_forms(probe_forms(threads))))
    return tuple(forms)


# NOTE: cached per thread count for the process, as a device property is: the BLAS and the
# machine do not change under a running engine (a probe of ~1 s once a machine).
@functools.cache
def few_row_forms(threads: int) -> tuple[str, ...]:
    """The form :func:`linear_cpu` runs for each of :data:`ROW_BUCKETS` at ``threads`` threads:
    ``ASYMCACHE_CPU_LINEAR``'s where it is set (``weight-left``: below :data:`FEW_ROWS` rows),
    else those kept for this machine in the cache folder (:func:`stored_forms`).

    Raises:
        ValueError: ``ASYMCACHE_CPU_LINEAR`` names no form, or ``onednn`` where it is missing.
    """
    forced = os.environ.get(FORM_ENV, "").strip()
    if forced:
        if forced not in FORMS:
            raise ValueError(f"{FORM_ENV}: {forced!r} is not one of {', '.join(FORMS)}")
        if forced == "onednn" and not onednn_available():
            raise ValueError(f"{FORM_ENV}: this torch build has no oneDNN linear op")
        return (forced,) * (len(ROW_BUCKETS) - 1) + ("library" if forced == "weight-left" else forced,)
    return stored_forms(threads, cache_dir() / STORE_NAME)


def row_bucket(rows: int) -> int:
    """The index in :data:`ROW_BUCKETS` of ``rows`` (>= 1)."""
    index = 0
    while index + 1 < len(ROW_BUCKETS) and rows >= ROW_BUCKETS[index + 1]:
        index += 1
    return index


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU engine's linear op: float32 rows in the form :func:`few_row_forms` chose for
    their count; other dtypes ``F.linear``."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 0 or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    form = few_row_forms(torch.get_num_threads())[row_bucket(rows)]
    return FORM_OPS[form](x, weight, bias)


# Row counts at which :func:`onednn_rows_agree` checks a weight shape: every count to 16 (the
# small kernels), then both sides of each power of two to 512 (where blockings change).
INVARIANCE_ROWS = tuple(range(1, 17)) + tuple(m + d for m in (32, 64, 128, 256, 512) for d in (-1, 0, 1))


def onednn_rows_agree(out_features: int, in_features: int, rows: tuple[int, ...] = INVARIANCE_ROWS) -> bool:
    """Whether oneDNN's product (:func:`linear_onednn`) gives every row the same bits at each of
    ``rows`` rows in a call, and shifted within the call, on random data of one weight shape.

    Returns:
        True when every row agreed with the same row in a call of ``max(rows)`` rows.
    """
    if not onednn_available():
        return False
    # NOTE: the first forward step asks, inside inference mode, whose tensors cannot carry the
    # version a packed weight is keyed by: the check's own tensors are made outside it.
    with torch.inference_mode(False), torch.no_grad():
        gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
        weight = torch.randn((out_features, in_features), generator=gen)
        x = torch.randn((max(rows) + 3, in_features), generator=gen)
        full = linear_onednn(x, weight)
        for count in rows:
            for shift in (0, 3) if count in (1, 7, 64, 129) else (0,):
                if not torch.equal(linear_onednn(x[shift : shift + count], weight), full[shift : shift + count]):
                    return False
    return True


@functools.cache
def onednn_rows_invariant(threads: int, out_features: int, in_features: int) -> bool:
    """:func:`onednn_rows_agree` for this machine and thread count, kept in the cache folder's
    store beside the probed forms (:data:`STORE_NAME`): checked once a machine and shape."""
    key = f"{machine_key(threads)}|onednn-rows|{out_features}x{in_features}"
    return kept_in_store(
        cache_dir() / STORE_NAME, key, lambda kept: isinstance(kept, bool), lambda: onednn_rows_agree(out_features, in_features)
    )


def linear_invariant_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The batch-invariant mode's linear op on the CPU: oneDNN's product on the packed weight
    where this machine's check found its rows' bits independent of the row count
    (:func:`onednn_rows_invariant`, per weight shape), else same-shape BLAS calls
    (:func:`~kernels.batch_invariant.linear_padded`). The bias is added after the product is
    rounded, as every batch-invariant path adds it.

    NOTE: measured on an AMD EPYC (2026-12-06): oneDNN's path costs ~1x ``F.linear`` where the
    padded calls cost 1.5x at one row and 1.6x at many.
    """
    if (
        x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() > 0
        and onednn_rows_invariant(torch.get_num_threads(), *weight.shape)
    ):
        out = linear_onednn(x, weight)
        return out if bias is None else out + bias
    return linear_padded(x, weight, bias)


def check_invariant_linears(module: torch.nn.Module, threads: int) -> dict[tuple[int, int], bool]:
    """Runs (or reads back) :func:`onednn_rows_invariant` for every float32 linear weight shape
    of ``module``: the batch-invariant engine calls it at start-up, so that its first step does
    not stop for the checks.

    Returns:
        ``{(out_features, in_features): oneDNN's product used}``.
    """
    shapes = {
        tuple(sub.weight.shape) for sub in module.modules()
        if isinstance(sub, torch.nn.Linear) and sub.weight.dtype == torch.float32
    }
    return {shape: onednn_rows_invariant(threads, *shape) for shape in sorted(shapes)}


def packed_weight_bytes(module: torch.nn.Module, threads: int, batch_invariant: bool = False) -> int:
    """Bytes the packed copies of ``module``'s float32 linear weights will take once
    :func:`linear_cpu` (or, ``batch_invariant``, :func:`linear_invariant_cpu`) has run them: 0
    where neither runs the ``onednn`` form (the batch-invariant mode counts them wherever oneDNN
    is there, before its check has run)."""
    uses = onednn_available() if batch_invariant else "onednn" in few_row_forms(threads)
    if not uses:
        return 0
    seen: dict[int, int] = {}
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.weight.dtype == torch.float32:
            seen[id(sub.weight)] = sub.weight.numel() * sub.weight.element_size()
    return sum(seen.values())
