"""Measures the engine's own forward steps and fits a :class:`LatencyModel`.

The grid covers prefill/hole chunks of several sizes at several context depths and decode
batches. Each point is one packed step through the same model and attention backend the engine
uses, timed after a warm-up (median of ``repeats``). The fit is the piecewise-linear model of
:mod:`asymcache_core.latency_model`, with the knee chosen by grid search.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from asymcache_core.latency_model import LatencyModel, segment_attn_pairs


@dataclass(frozen=True)
class ProfilePoint:
    """One measured step: ``num_tokens`` tokens, ``attn_pairs`` query-key pairs, its latency."""

    kind: str
    num_tokens: int
    context: int
    batch: int
    attn_pairs: float
    latency_s: float


@dataclass(frozen=True)
class ProfileGrid:
    """Which steps to measure."""

    chunk_tokens: tuple[int, ...] = (1, 16, 64, 128, 256, 512)
    contexts: tuple[int, ...] = (0, 512, 1536)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    # NOTE: two depths or more, so that the fit can tell a decode's per-key cost (memory-bound)
    # from its per-token cost.
    decode_contexts: tuple[int, ...] = (512, 2048)
    max_decode_kv_tokens: int = 16384
    repeats: int = 3

    @classmethod
    def for_device(cls, device_type: str, repeats: int = 3) -> ProfileGrid:
        """The default grid of a device: GPUs stay under-used up to far larger chunks."""
        if device_type == "cuda":
            return cls(
                chunk_tokens=(1, 64, 256, 512, 1024, 2048, 4096),
                contexts=(0, 2048, 8192),
                decode_batches=(1, 8, 32, 64),
                decode_contexts=(4096, 16384),
                max_decode_kv_tokens=262144,
                repeats=repeats,
            )
        return cls(repeats=repeats)

    def points(self) -> list[tuple[str, int, int, int]]:
        """``(kind, tokens, context, batch)`` of every step in the grid."""
        pts = [("chunk", t, c, 1) for c in self.contexts for t in self.chunk_tokens]
        pts += [
            ("decode", b, c, b)
            for c in self.decode_contexts
            for b in self.decode_batches
            if b * c <= self.max_decode_kv_tokens
        ]
        return pts

    def num_blocks_needed(self, block_size: int) -> int:
        """KV blocks that :func:`measure` needs for the largest point of the grid."""
        blocks = [-(-(c + 1) // block_size) * b for kind, _, c, b in self.points() if kind == "decode"]
        blocks += [-(-(c + t) // block_size) for kind, t, c, _ in self.points() if kind == "chunk"]
        return max(blocks) + 1


def measure(engine, grid: ProfileGrid, progress: Callable[[int, int], None] | None = None) -> list[ProfilePoint]:
    """Times every grid point with the engine's model runner (no scheduler involved).

    Args:
        engine: an :class:`~asymcache_core.engine.Engine` with a real model runner.
        grid: what to measure.
        progress: called with ``(done, total)`` after each point.
    """
    from asymcache_core.cuda_graphs import DecodeBatch
    from kernels.metadata import build_msa_metadata

    runner = engine.runner
    cfg = engine.model_config
    bs = engine.block_size
    device = runner.device
    vocab = engine.model_config.vocab_size
    points = grid.points()
    results: list[ProfilePoint] = []
    for i, (kind, tokens, context, batch) in enumerate(points):
        per_seq = 1 if kind == "decode" else tokens
        ctx_len = context + per_seq
        blocks_per_seq = -(-ctx_len // bs)
        if blocks_per_seq * batch > engine.num_blocks:
            raise ValueError(
                f"num_kv_blocks: profiling needs {blocks_per_seq * batch} blocks, pool has {engine.num_blocks}"
            )
        tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(batch)]
        segments, slots, positions = [], [], []
        for s in range(batch):
            segments.append((s, len(positions), per_seq, context))
            for p in range(context, context + per_seq):
                positions.append(p)
                slots.append(tables[s][p // bs] * bs + p % bs)
        meta = build_msa_metadata(tables, segments, slots, bs, device)
        ids = torch.randint(0, vocab, (len(positions),)).to(device)
        pos = torch.tensor(positions).to(device)
        rows = torch.tensor([segments[s][1] + per_seq - 1 for s in range(batch)]).to(device)
        graphs = getattr(runner, "decode_graphs", None)
        if kind == "decode" and graphs is not None and batch <= graphs.max_batch:
            # NOTE: the engine replays decode-only steps as CUDA graphs: time what it runs.
            kind = "graph"
            forward = functools.partial(graphs.run, DecodeBatch(ids.tolist(), positions, slots, tables))
        else:
            meta = runner.backend.prepare(meta, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            forward = functools.partial(runner.model, ids, pos, runner.kv_caches, meta, runner.backend, rows)
            pieces = getattr(runner, "mixed_graphs", None)
            if pieces is not None and pieces.size_for(len(positions)) is not None:
                # NOTE: likewise, steps up to the largest piecewise size replay graph pieces.
                forward = functools.partial(pieces.run, ids.tolist(), positions, slots, meta, rows)

        times = []
        with torch.inference_mode():
            for rep in range(grid.repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                forward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep > 0:  # the first run warms caches and compiles kernels
                    times.append(time.perf_counter() - start)
        pairs = batch * segment_attn_pairs(per_seq, context)
        results.append(ProfilePoint(kind, tokens, context, batch, pairs, float(np.median(times))))
        if progress is not None:
            progress(i + 1, len(points))
    return results


def _decode_keys(p: ProfilePoint) -> float:
    """Keys the decodes of a point read (``K``). A one-token chunk samples its token like a
    decode, and the engine prices it as one (``SchedulerOutput.decode_kv_tokens``)."""
    one_token_each = p.kind in ("decode", "graph") or p.num_tokens == p.batch
    return float(p.batch * (p.context + 1)) if one_token_each else 0.0


def fit(points: list[ProfilePoint], model: str = "", device: str = "cpu", source: str = "profile") -> LatencyModel:
    """Fits ``floor + per_token * max(0, T - knee) + per_attn * A + per_decode_kv * K``
    (least squares, knee by search).

    Points of kind ``graph`` (decode steps replayed as CUDA graphs) do not pay the eager floor:
    the curve is fitted on the other points, and what the graph points spend beyond its token and
    attention terms is fitted as ``decode_floor_s + per_decode_kv_s * K`` (without graph points,
    ``per_decode_kv_s`` is the eager fit's fourth column, fed by the eager decode points).

    Returns:
        The model with the lowest mean relative error; ``fit_error`` holds that error (over
        every point).
    """
    graph_points = [p for p in points if p.kind == "graph"]
    eager = [p for p in points if p.kind != "graph"]
    if not eager:  # graphs only: nothing to tell their floor from
        eager, graph_points = graph_points, []
    tokens = np.array([p.num_tokens for p in eager], dtype=float)
    pairs = np.array([p.attn_pairs for p in eager], dtype=float)
    keys = np.array([_decode_keys(p) for p in eager], dtype=float)
    lat = np.array([p.latency_s for p in eager], dtype=float)
    best: tuple[float, LatencyModel] | None = None
    for knee in sorted({0.0, *tokens.tolist()}):
        design = np.stack([np.ones_like(tokens), np.maximum(0.0, tokens - knee), pairs, keys], axis=1)
        # NOTE: relative weighting, so that the many small steps count as much as the big ones.
        weights = 1.0 / lat
        coef = _nonnegative_lstsq(design * weights[:, None], lat * weights)
        pred = design @ coef
        err = float(np.mean(np.abs(pred - lat) / lat))
        candidate = LatencyModel(
            floor_s=float(coef[0]), per_token_s=float(coef[1]), per_attn_s=float(coef[2]),
            knee_tokens=int(knee), source=source, model=model, device=device, fit_error=err,
            per_decode_kv_s=float(coef[3]),
        )
        if best is None or err < best[0] - 1e-9:
            best = (err, candidate)
    assert best is not None
    result = best[1]
    if graph_points:
        beyond = np.array([
            p.latency_s - (result.step_latency(p.num_tokens, p.attn_pairs) - result.floor_s)
            for p in graph_points
        ])
        floor, per_key = _line_fit(np.array([_decode_keys(p) for p in graph_points]), beyond)
        result = replace(result, decode_floor_s=max(floor, 1e-6), per_decode_kv_s=per_key)
        errors = [
            abs(result.step_latency(p.num_tokens, p.attn_pairs, p.kind == "graph", _decode_keys(p)) - p.latency_s)
            / p.latency_s
            for p in points
        ]
        result = replace(result, fit_error=float(np.mean(errors)))
    return result


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y ~ intercept + slope * x`` by least squares, the slope held
    >= 0 (with fewer than two distinct ``x``: the mean, slope 0). Unweighted, so the fitted line
    keeps the sum of ``y``."""
    if len(set(x.tolist())) < 2:
        return float(y.mean()), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(y.mean()), 0.0
    return float(intercept), float(slope)


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: columns that come out negative are dropped
    and the rest refitted (enough for these few columns). A column of zeros gets 0."""
    active = [c for c in range(a.shape[1]) if c == 0 or np.any(a[:, c])]
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [c for c, v in zip(active, sol, strict=True) if v >= 0]
    coef[0] = max(coef[0], 1e-6)
    return coef


#: Longest pause between two live steps counted as the serving loop's host time: past it the
#: engine had nothing to run (every job in a tool pause). NOTE: the H200 bench logs of
#: 2026-12-03 put the loop's gaps at 0.15-0.4 ms and idle spells at tens of milliseconds on.
HOST_GAP_CUTOFF_S = 0.005


def calibrate(latency: LatencyModel, steps: list[dict], source: str = "calibrated") -> LatencyModel:
    """Refits a profile's floors, decode term and host gap to what live engine steps cost.

    A profile times forward passes alone; a live step also pays scheduling, input preparation
    and sampling, and mixes shapes the grid never ran. Given step records (``StepStats`` as
    written by ``asymcache bench --step-log``: ``num_tokens``, ``attn_pairs``, ``decode_only``,
    ``duration_s``, and ``decode_kv_tokens`` where the engine logged it):

    - decode-only steps: what they cost beyond the token and attention terms is fitted as
      ``decode_floor_s + per_decode_kv_s * K`` (a line over the keys their decodes read; in a
      decode-only step those are its ``attn_pairs``, so older logs serve as well);
    - other steps: the floor moves by their mean residual under the new decode term;
    - the host gap: the mean time from one step's end to the next one's start, over the
      gaps of at most :data:`HOST_GAP_CUTOFF_S` (longer ones are the engine idle, nothing to
      run, which the simulator reproduces itself); records without ``start`` leave it as it
      was. Logs of several runs may be concatenated: a jump between runs is no such gap.

    The token and attention terms stay, and the simulator's total time matches the live runs'.

    Args:
        latency: the profile to correct.
        steps: step records from one or more live runs on the profile's model and device.
        source: the result's ``source``.

    Raises:
        ValueError: no steps, or a record without the fields above (or with a ``start`` that
            is not a number).

    Returns:
        The corrected model; ``fit_error`` is its mean relative error on ``steps``.
    """
    if not steps:
        raise ValueError("steps: no step records to calibrate with")
    try:
        tokens = [int(s["num_tokens"]) for s in steps]
        pairs = [float(s["attn_pairs"]) for s in steps]
        decode = np.array([bool(s["decode_only"]) for s in steps])
        measured = np.array([float(s["duration_s"]) for s in steps])
        keys = np.array([
            float(s.get("decode_kv_tokens", s["attn_pairs"] if s["decode_only"] else 0.0)) for s in steps
        ])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"steps: each record needs num_tokens, attn_pairs, decode_only, duration_s ({exc})") from None
    bad = next((i for i, d in enumerate(measured) if not (math.isfinite(d) and d >= 0)), None)
    if bad is not None:
        # NOTE: a NaN would be fitted into the profile's floors, and every run priced with it fail
        raise ValueError(f"steps: record {bad + 1}'s duration_s must be a finite number >= 0, got {measured[bad]!r}")

    def predict(model: LatencyModel) -> np.ndarray:
        return np.array([
            model.step_latency(t, a, bool(d), k) for t, a, d, k in zip(tokens, pairs, decode, keys, strict=True)
        ])

    out = replace(latency, source=source)
    if decode.any():
        # what each decode-only step spends beyond the token and attention terms
        no_floor = replace(latency, floor_s=0.0, decode_floor_s=0.0, per_decode_kv_s=0.0)
        beyond = measured[decode] - predict(no_floor)[decode]
        decode_floor, per_key = _line_fit(keys[decode], beyond)
        out = replace(out, decode_floor_s=max(decode_floor, 0.0), per_decode_kv_s=per_key)
    if (~decode).any():
        residual = measured[~decode] - predict(out)[~decode]
        out = replace(out, floor_s=max(latency.floor_s + float(residual.mean()), 0.0))
    gaps = _host_gaps(steps)
    if gaps.size:
        out = replace(out, host_gap_s=float(gaps.mean()))
    error = float(np.mean(np.abs(predict(out) - measured) / np.maximum(measured, 1e-9)))
    return replace(out, fit_error=error)



def _host_gaps(steps: list[dict]) -> np.ndarray:
    """Seconds from each step's end to the next one's start, where both have ``start`` and
    the gap is within ``[0, HOST_GAP_CUTOFF_S]``."""
    gaps = []
    for before, after in itertools.pairwise(steps):
        if "start" not in before or "start" not in after:
            continue
        try:
            gap = float(after["start"]) - float(before["start"]) - float(before["duration_s"])
        except (TypeError, ValueError):
            raise ValueError(f"steps: start must be a number, got {after['start']!r} after {before['start']!r}") from None
        if 0.0 <= gap <= HOST_GAP_CUTOFF_S:
            gaps.append(gap)
    return np.array(gaps)
