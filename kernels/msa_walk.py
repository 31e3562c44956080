"""The walk of a Multi-Segment Attention (MSA) program over its KV, as Triton helpers.

One program attends a tile of query rows to the paged keys of its sequence: the block ids of
each KV tile (:func:`_tile_blocks`, a turn ahead with ``PREFETCH``), one tile's online softmax
(:func:`_attend_tile`), a range of tiles (:func:`_attend_range`), and the batch-invariant
mode's walk in fixed chunks folded in order (:func:`_invariant_walk`). The kernels that run
them are in :mod:`kernels.msa_triton`; the chunk fold is :mod:`kernels.msa_merge`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.msa_merge import _fold_chunk, _merged_output

# Fill value of masked scores: finite, so a row masked over a whole tile yields no NaN; the
# rescale exp2(-1e30 - m) = 0 erases it as soon as the row sees a real key.
_MASKED = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; ``IEEE`` keeps fp32 operands out of TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile_blocks(p_bt, i_n, ctx_end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block id of each key of the KV tile at ``i_n`` (0 past ``ctx_end``), ``[BLOCK_N]`` int64.

    NOTE: with ``PREFETCH`` the walks load a tile's ids one turn ahead and carry them into the
    next turn of their loop. Loaded in the turn that uses them, the K/V copies hang on a load of
    the same turn, and Triton's pipeliner (3.6 and 3.9) waits for every copy in flight at the
    top of each turn (TTGIR: ``async_wait {num = 0}``): one tile's copies in flight, the walk
    at the memory latency. Carried, the K/V copies of the next tile stay in flight while this
    one computes (``num = 2``), for a third buffer of shared memory.
    """
    o_n = i_n + tl.arange(0, BLOCK_N)
    return tl.load(p_bt + o_n // PAGE, mask=o_n < ctx_end, other=0).to(tl.int64)


@triton.jit
def _turn_blocks(p_bt, b_blk, i_n, ctx_end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """A walk's block ids at the turn of tile ``i_n``: ``(this tile's, those to carry into the
    next turn)``. ``b_blk`` is what the previous turn carried (the first tile's before the loop):
    with ``PREFETCH`` this tile's ids, and the next tile's are loaded now; without, they are
    loaded in this turn (what is carried is not used)."""
    if PREFETCH:
        return b_blk, _tile_blocks(p_bt, i_n + BLOCK_N, ctx_end, PAGE, BLOCK_N)
    b_blk = _tile_blocks(p_bt, i_n, ctx_end, PAGE, BLOCK_N)
    return b_blk, b_blk


@triton.jit
def _attend_tile(
    b_q,
    b_acc,
    b_m,
    b_l,
    b_blk,
    k_cache,
    v_cache,
    i_kvh,
    i_n,
    o_d,
    o_pos,
    ctx_end,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One KV tile ``[i_n, i_n + BLOCK_N)`` of online softmax for rows ``b_q [R, D]``; ``b_blk``
    is the tile's block ids (:func:`_tile_blocks`)."""
    o_n = i_n + tl.arange(0, BLOCK_N)
    if MASKED:
        m_n = o_n < ctx_end
    o_in = (o_n % PAGE).to(tl.int64)
    o_k = b_blk * stride_kb + o_in * stride_ks + i_kvh * stride_kh
    o_v = b_blk * stride_vb + o_in * stride_vs + i_kvh * stride_vh
    if MASKED:
        b_k = tl.load(k_cache + o_k[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(v_cache + o_v[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
    else:
        b_k = tl.load(k_cache + o_k[:, None] + o_d[None, :])
        b_v = tl.load(v_cache + o_v[:, None] + o_d[None, :])
    # [R, BLOCK_N] raw scores; the running max b_m is kept in scaled base-2 units
    b_s = _dot(b_q, tl.trans(b_k.to(b_q.dtype)), IEEE)
    if MASKED:
        m_s = (o_n[None, :] <= o_pos[:, None]) & m_n[None, :]
        b_s = tl.where(m_s, b_s, _MASKED)
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
    b_p = tl.exp2(b_s * scale_log2 - b_m_new[:, None])
    b_alpha = tl.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    b_acc += _dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), IEEE)
    return b_acc, b_m_new, b_l


@triton.jit
def _attend_range(
    b_q,
    p_bt,
    k_cache,
    v_cache,
    i_kvh,
    i_lo,
    i_hi,
    i_pos0,
    o_d,
    o_pos,
    ctx_end,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Online softmax of rows ``b_q [R, D]`` over the keys ``[i_lo, i_hi)`` from a fresh state;
    ``PREFETCH``: each tile's block ids loaded a turn ahead (:func:`_tile_blocks`).

    Returns ``(acc [R, D], m [R], l [R])``: unnormalised output, running max (scaled, base 2)
    and sum of weights.
    """
    # KV tiles ending at or before the first query position are visible to every row.
    i_full = tl.maximum(i_lo, tl.minimum(i_hi, (i_pos0 + 1) // BLOCK_N * BLOCK_N))
    b_m = tl.full([BLOCK_R], _MASKED, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    b_blk = _tile_blocks(p_bt, i_lo, ctx_end, PAGE, BLOCK_N)
    for i_n in range(i_lo, i_full, BLOCK_N):
        b_blk, b_blk_next = _turn_blocks(p_bt, b_blk, i_n, ctx_end, PAGE, BLOCK_N, PREFETCH)
        b_acc, b_m, b_l = _attend_tile(
            b_q, b_acc, b_m, b_l, b_blk, k_cache, v_cache, i_kvh, i_n, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, False, IEEE,
        )
        b_blk = b_blk_next
    for i_n in range(i_full, i_hi, BLOCK_N):
        b_blk, b_blk_next = _turn_blocks(p_bt, b_blk, i_n, ctx_end, PAGE, BLOCK_N, PREFETCH)
        b_acc, b_m, b_l = _attend_tile(
            b_q, b_acc, b_m, b_l, b_blk, k_cache, v_cache, i_kvh, i_n, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, True, IEEE,
        )
        b_blk = b_blk_next
    return b_acc, b_m, b_l


@triton.jit
def _chunk_start(i_n, chunk, b_macc, b_ml, b_mm, b_acc, b_m, b_l, BLOCK_R: tl.constexpr, D: tl.constexpr):
    """At the first KV tile of a fixed chunk past the first: the finished chunk folded into the
    running merge, and a fresh chunk state. Returns ``(macc, ml, mm, acc, m, l)``."""
    if (i_n > 0) & (i_n % chunk == 0):
        b_macc, b_ml, b_mm = _fold_chunk(b_macc, b_ml, b_mm, b_acc, b_m, b_l)
        b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        b_m = tl.full([BLOCK_R], _MASKED, dtype=tl.float32)
        b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    return b_macc, b_ml, b_mm, b_acc, b_m, b_l


@triton.jit
def _invariant_span(
    i_lo, i_hi, b_macc, b_ml, b_mm, b_acc, b_m, b_l, b_q, p_bt, k_cache, v_cache, i_kvh, o_d, o_pos,
    ctx_end, chunk, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The KV tiles ``[i_lo, i_hi)`` of :func:`_invariant_walk`: at each chunk's first tile the
    finished chunk is folded, then the tile attended (``MASKED``: with the causal mask).
    Returns ``(macc, ml, mm, acc, m, l)``."""
    b_blk = _tile_blocks(p_bt, i_lo, ctx_end, PAGE, BLOCK_N)
    for i_n in range(i_lo, i_hi, BLOCK_N):
        b_blk, b_blk_next = _turn_blocks(p_bt, b_blk, i_n, ctx_end, PAGE, BLOCK_N, PREFETCH)
        b_macc, b_ml, b_mm, b_acc, b_m, b_l = _chunk_start(
            i_n, chunk, b_macc, b_ml, b_mm, b_acc, b_m, b_l, BLOCK_R, D
        )
        b_acc, b_m, b_l = _attend_tile(
            b_q, b_acc, b_m, b_l, b_blk, k_cache, v_cache, i_kvh, i_n, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, MASKED, IEEE,
        )
        b_blk = b_blk_next
    return b_macc, b_ml, b_mm, b_acc, b_m, b_l


@triton.jit
def _invariant_walk(
    b_q, p_bt, k_cache, v_cache, i_kvh, i_pos0, o_d, o_pos, ctx_end, chunk, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The batch-invariant in-program merge: the whole context ``[0, ctx_end)`` as chunks of
    ``chunk`` keys, each an online softmax from a fresh state, folded in order.

    NOTE: one loop over the KV tiles (two: visible to every row, then masked), the fold and
    reset done at each chunk's first tile inside it, so the loads stay pipelined across chunk
    boundaries; a loop per chunk restarted the pipeline every ``chunk // BLOCK_N`` tiles
    (H200, 8k prefill through the engine: attention 1.39x the default mode's time with a loop
    per chunk and normalised partials, 1.22x with this walk).
    Returns the merged output ``[R, D]`` (float32).
    """
    b_macc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    b_ml = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    b_m = tl.full([BLOCK_R], _MASKED, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    i_full = tl.minimum(ctx_end, (i_pos0 + 1) // BLOCK_N * BLOCK_N)
    # tiles every row sees in full, then the tiles the causal mask cuts
    b_macc, b_ml, b_mm, b_acc, b_m, b_l = _invariant_span(
        0, i_full, b_macc, b_ml, b_mm, b_acc, b_m, b_l, b_q, p_bt, k_cache, v_cache, i_kvh, o_d, o_pos,
        ctx_end, chunk, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        PAGE, BLOCK_N, BLOCK_R, D, False, IEEE, PREFETCH,
    )
    b_macc, b_ml, b_mm, b_acc, b_m, b_l = _invariant_span(
        i_full, ctx_end, b_macc, b_ml, b_mm, b_acc, b_m, b_l, b_q, p_bt, k_cache, v_cache, i_kvh, o_d, o_pos,
        ctx_end, chunk, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        PAGE, BLOCK_N, BLOCK_R, D, True, IEEE, PREFETCH,
    )
    b_macc, b_ml, b_mm = _fold_chunk(b_macc, b_ml, b_mm, b_acc, b_m, b_l)
    return _merged_output(b_macc, b_ml)
