"""Random MSA steps and their float64 oracle, shared by the MSA kernel tests (see
:func:`make_case`)."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata, build_msa_metadata
from kernels.reference import msa_naive

#: Shifts every case's inputs (``MSA_TEST_SEED``).
SEED = int(os.environ.get("MSA_TEST_SEED", "0"))


def case_seed(*parts: object) -> int:
    """A stable per-case seed (``hash`` of strings changes between processes)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


# (relative Frobenius error, max abs error) bounds against the float64 oracle.
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 2e-2),
    torch.bfloat16: (1.5e-2, 6e-2),
}


@dataclass
class Case:
    """One random MSA step: inputs, metadata and the float64 reference output."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: MSAMetadata
    scale: float
    ref: torch.Tensor
    covered: torch.Tensor  # [T] bool, token belongs to a segment


def _segments_for(
    gen: torch.Generator, ctx: int, kind: str, block_size: int, max_segs: int
) -> list[tuple[int, int]]:
    """``(pos_start, q_len)`` segments of one sequence of context ``ctx`` (sorted, disjoint)."""
    if kind == "decode":
        return [(ctx - 1, 1)]

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if kind == "prefill-full":
        return [(0, ctx)]
    suffix = randint(1, max(1, min(ctx - 1, 3 * block_size)))
    segs = [(ctx - suffix, suffix)]
    n_holes = randint(0, max_segs - 1)
    free_end = ctx - suffix
    for _ in range(n_holes):
        if free_end < 2:
            break
        start = randint(0, free_end - 1)
        if randint(0, 2) > 0:  # mostly block-aligned holes
            start = start // block_size * block_size
        length = randint(1, min(free_end - start, 2 * block_size + 5))
        segs.append((start, length))
        free_end = start - 1  # keep a gap of at least one cached token
    return sorted(segs)


def make_case(
    seed: int,
    *,
    kind: str,
    num_seqs: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_ctx: int,
    dtype: torch.dtype,
    device: str = "cpu",
    max_segs: int = 6,
    pad_tokens: int = 0,
    ctxs: list[int] | None = None,
    segs: list[list[tuple[int, int]]] | None = None,
) -> Case:
    """Builds a random step; ``kind`` is decode, prefill (holes + suffix), prefill-full or mixed.
    ``ctxs`` sets the sequences' contexts (``num_seqs`` of them) instead of drawing them, and
    ``segs`` each one's ``(pos_start, q_len)`` segments instead of drawing them for ``kind``."""
    gen = torch.Generator().manual_seed(seed + 7919 * SEED)
    drawn = torch.randint(2, max_ctx + 1, (num_seqs,), generator=gen).tolist()
    ctxs = drawn if ctxs is None else ctxs
    assert len(ctxs) == num_seqs
    kinds = [kind] * num_seqs
    if kind == "mixed":
        kinds = ["decode" if i % 2 == 0 else "prefill" for i in range(num_seqs)]
    blocks_per_seq = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that belong to nobody
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    valid = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for table, ctx in zip(tables, ctxs, strict=True):
        valid[table] = True
        valid[table[-1], ctx - (len(table) - 1) * block_size :] = False
    k_cache[~valid] = float("nan")  # nothing outside a context may leak into the result
    v_cache[~valid] = float("nan")

    seg_list = []  # (seq, pos_start, q_len)
    for s, (ctx, k) in enumerate(zip(ctxs, kinds, strict=True)):
        drawn_segs = _segments_for(gen, ctx, k, block_size, max_segs) if segs is None else segs[s]
        seg_list += [(s, p, n) for p, n in drawn_segs]
    order = torch.randperm(len(seg_list), generator=gen).tolist()
    segments, slots, q_start = [], [], 0
    for j in order:
        seq, pos, n = seg_list[j]
        segments.append((seq, q_start, n, pos))
        slots += [tables[seq][p // block_size] * block_size + p % block_size for p in range(pos, pos + n)]
        q_start += n
    covered = torch.ones(q_start + pad_tokens, dtype=torch.bool)
    if pad_tokens:
        covered[q_start:] = False
        slots += [-1] * pad_tokens
    num_tokens = q_start + pad_tokens
    q = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen, dtype=torch.float64)
    meta = build_msa_metadata(tables, segments, slots, block_size, device=device)
    scale = head_dim**-0.5
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    ref = msa_naive(q, k_cache, v_cache, meta, scale).cpu()

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    return Case(cast(q), cast(k_cache), cast(v_cache), meta, scale, ref, covered)


def check_close(out: torch.Tensor, case: Case, dtype: torch.dtype) -> None:
    """Fails unless every element was written and ``out`` matches the oracle within bounds."""
    out = out.detach().to("cpu", torch.float64)
    assert out.shape == case.ref.shape
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} elements not written/finite"
    ref = case.ref
    if not case.covered.all():
        assert (out[~case.covered] == 0).all(), "rows outside segments must be zero"
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    max_abs = float((out - ref).abs().max())
    rel_tol, abs_tol = TOL[dtype]
    assert rel <= rel_tol and max_abs <= abs_tol, f"rel {rel:.3g} (<= {rel_tol}), max abs {max_abs:.3g} (<= {abs_tol})"
