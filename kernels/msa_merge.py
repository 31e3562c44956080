"""The split merge of Multi-Segment Attention (MSA), as Triton kernels and helpers.

A launch whose tiles split their KV (:class:`~kernels.msa_plan.MSAPlan`) leaves per-split
partial states; they are merged here, by the merge kernel (:func:`_msa_reduce_kernel`, a
second launch) or, in the batch-invariant mode, by the last program of a tile inside the walk's
own launch (:func:`_fold_tile_chunks`). Every batch-invariant merge folds chunk by chunk
through :func:`_fold_chunk`, so a row has the same bits whichever path merged it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_partial(b_acc, b_m, b_l):
    """A KV split's normalised output and log-sum-exp (base 2); an empty row gives ``(0, m)``."""
    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    return b_acc / b_l_safe[:, None], b_m + tl.log2(b_l_safe)


@triton.jit
def _merged_output(b_acc, b_w):
    """The merged output of a running state ``(acc, w)`` (zero where ``w`` is)."""
    b_w = tl.where(b_w == 0.0, 1.0, b_w)
    return b_acc / b_w[:, None]


@triton.jit
def _fold_chunk(b_macc, b_ml, b_mm, b_acc, b_m, b_l):
    """Folds one fixed chunk's unnormalised state ``(acc, m, l)`` into the running merge
    ``(macc, ml, mm)`` of the batch-invariant mode; start from ``(0, 0, -inf)``.

    NOTE: the in-program walk, the split walk's single-chunk tiles and the split merge kernel
    all fold through this one function, chunk by chunk in position order, so a row's output
    has the same bits whichever of them computed it. The partials stay unnormalised: no
    division or logarithm per chunk.
    """
    b_mm_new = tl.maximum(b_mm, b_m)
    b_alpha = tl.exp2(b_mm - b_mm_new)
    b_beta = tl.exp2(b_m - b_mm_new)
    b_ml = b_ml * b_alpha + b_l * b_beta
    b_macc = b_macc * b_alpha[:, None] + b_acc * b_beta[:, None]
    return b_macc, b_ml, b_mm_new


@triton.jit
def _chunk_state(p_op, p_ml, i_s, n_split, stride_ps, stride_ls, stat_off, m_o, m_t):
    """Chunk ``i_s``'s unnormalised state ``(acc, m, l)`` of the batch-invariant split merge;
    past ``n_split`` nothing is loaded (the fold skips it)."""
    # NOTE: compared as a vector: the interpreter makes a scalar comparison's ``&`` an int32 mask
    m_ts = m_t & ((tl.zeros(m_t.shape, dtype=tl.int32) + i_s) < n_split)
    # NOTE: ".cg" (L2, the point of coherence): the fused merge reads states other programs
    # of the same launch wrote (see _msa_fwd_kernel's FUSED_MERGE)
    b_o = tl.load(p_op + i_s * stride_ps, mask=m_o & m_ts[:, None], other=0.0, cache_modifier=".cg")
    b_m = tl.load(p_ml + i_s * stride_ls, mask=m_ts, other=float("-inf"), cache_modifier=".cg")
    b_l = tl.load(p_ml + i_s * stride_ls + stat_off, mask=m_ts, other=0.0, cache_modifier=".cg")
    return b_o, b_m, b_l


@triton.jit
def _fold_if(fold, b_macc, b_ml, b_mm, b_acc, b_m, b_l):
    """:func:`_fold_chunk` when ``fold``; the running merge unchanged otherwise (an empty
    chunk folded in would turn a ``-0.0`` into ``+0.0``)."""
    if fold:
        b_macc, b_ml, b_mm = _fold_chunk(b_macc, b_ml, b_mm, b_acc, b_m, b_l)
    return b_macc, b_ml, b_mm


@triton.jit
def _fold_chunks(p_op, p_ml, n_split, stride_ps, stride_ls, stat_off, m_o, m_t, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The batch-invariant merge of ``n_split`` chunk states of rows ``[R, BLOCK_D]``
    (pointers ``p_op`` to chunk 0's acc, ``p_ml`` to its m): ``(acc, w)``, folded one chunk at
    a time in chunk order from ``(0, 0, -inf)``.

    NOTE: the chunk states are folded one at a time in chunk order (the bits), but loaded
    eight at a time, all before the first fold: one chunk a loop turn made the merge a chain of
    dependent loads (H200: 120 us of a 330 us decode at 128k keys).
    """
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_w = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for i_s0 in range(0, n_split, 8):
        b_o0, b_m0, b_l0 = _chunk_state(p_op, p_ml, i_s0 + 0, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o1, b_m1, b_l1 = _chunk_state(p_op, p_ml, i_s0 + 1, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o2, b_m2, b_l2 = _chunk_state(p_op, p_ml, i_s0 + 2, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o3, b_m3, b_l3 = _chunk_state(p_op, p_ml, i_s0 + 3, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o4, b_m4, b_l4 = _chunk_state(p_op, p_ml, i_s0 + 4, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o5, b_m5, b_l5 = _chunk_state(p_op, p_ml, i_s0 + 5, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o6, b_m6, b_l6 = _chunk_state(p_op, p_ml, i_s0 + 6, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_o7, b_m7, b_l7 = _chunk_state(p_op, p_ml, i_s0 + 7, n_split, stride_ps, stride_ls, stat_off, m_o, m_t)
        b_acc, b_w, b_m = _fold_chunk(b_acc, b_w, b_m, b_o0, b_m0, b_l0)
        b_acc, b_w, b_m = _fold_if(i_s0 + 1 < n_split, b_acc, b_w, b_m, b_o1, b_m1, b_l1)
        b_acc, b_w, b_m = _fold_if(i_s0 + 2 < n_split, b_acc, b_w, b_m, b_o2, b_m2, b_l2)
        b_acc, b_w, b_m = _fold_if(i_s0 + 3 < n_split, b_acc, b_w, b_m, b_o3, b_m3, b_l3)
        b_acc, b_w, b_m = _fold_if(i_s0 + 4 < n_split, b_acc, b_w, b_m, b_o4, b_m4, b_l4)
        b_acc, b_w, b_m = _fold_if(i_s0 + 5 < n_split, b_acc, b_w, b_m, b_o5, b_m5, b_l5)
        b_acc, b_w, b_m = _fold_if(i_s0 + 6 < n_split, b_acc, b_w, b_m, b_o6, b_m6, b_l6)
        b_acc, b_w, b_m = _fold_if(i_s0 + 7 < n_split, b_acc, b_w, b_m, b_o7, b_m7, b_l7)
    return b_acc, b_w


@triton.jit
def _fold_tile_chunks(
    o, o_part, lse_part, i_row0, n_q, i_kvh, n_chunks,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stat_off,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
):
    """The split merge of one tile and KV head inside the walk's launch: for each of the
    tile's ``n_q`` tokens, the ``G`` query heads' ``n_chunks`` chunk states folded
    (:func:`_fold_chunks`) and written to ``o``. Rows ``[G_PAD, D]`` a token: the walk's
    64-row tile would hold 16 times the registers for a decode's 4 real rows."""
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, D)
    m_g = o_g < G
    o_h = i_kvh * G + o_g
    for i_tok in range(0, n_q):
        i_t = (i_row0 + i_tok).to(tl.int64)
        p_op = o_part + i_t * stride_pt + o_h[:, None] * stride_ph + o_d[None, :]
        p_ml = lse_part + i_t * stride_lt + o_h
        b_acc, b_w = _fold_chunks(p_op, p_ml, n_chunks, stride_ps, stride_ls, stat_off, m_g[:, None], m_g, G_PAD, D)
        p_o = o + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, _merged_output(b_acc, b_w).to(o.dtype.element_ty), mask=m_g[:, None])


# NOTE: ``num_splits`` is only a loop bound; left specialized, a launch with 16 or 32 splits (a
# value divisible by 16) compiled a second binary mid-benchmark, after the warm-up.


@triton.jit(do_not_specialize=["num_splits"])
def _msa_reduce_kernel(
    o,
    o_part,
    lse_part,
    tiles,
    chunk,
    p_chunk,
    num_splits,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stat_off,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DYN_CHUNK: tl.constexpr,
    PART_BY_ROW: tl.constexpr,
    PAD_ROWS: tl.constexpr,
):
    """Merges the split partials of one (q-tile, q head, ``BLOCK_D`` columns): o_part
    ``[S, R, HQ, D]`` -> o.

    Partials are normalised outputs with their log-sum-exp in ``lse_part [S, R, HQ]``, merged
    ``BLOCK_S`` splits a load, or, with ``PART_BY_ROW`` (the batch-invariant mode),
    unnormalised chunk states: ``m`` in ``lse_part`` and ``l`` ``stat_off`` elements after it,
    loaded eight chunks at a time and folded one chunk at a time in chunk order. With
    ``PAD_ROWS`` a padding tile (``n_q = 0``) writes zeros to its row ``row0``.
    """
    if DYN_CHUNK:
        chunk = tl.load(p_chunk)
    i_tile, i_h, i_dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_row0 = tl.load(tiles + i_tile * 4 + 1)
    n_q = tl.load(tiles + i_tile * 4 + 2)
    i_pos0 = tl.load(tiles + i_tile * 4 + 3)
    n_split = tl.minimum(tl.cdiv(i_pos0 + n_q, chunk), num_splits)

    o_tok = tl.arange(0, BLOCK_M)
    o_d = i_dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    m_t = o_tok < n_q
    m_o = m_t[:, None] & (o_d < D)[None, :]
    o_t = (i_row0 + o_tok).to(tl.int64)
    if PART_BY_ROW:
        o_pt = o_t
    else:
        o_pt = (i_tile * BLOCK_M + o_tok).to(tl.int64)

    if PART_BY_ROW:
        p_op = o_part + o_pt[:, None] * stride_pt + i_h * stride_ph + o_d[None, :]
        p_ml = lse_part + o_pt * stride_lt + i_h
        b_acc, b_w = _fold_chunks(p_op, p_ml, n_split, stride_ps, stride_ls, stat_off, m_o, m_t, BLOCK_M, BLOCK_D)
    else:
        # NOTE: BLOCK_S splits per load, folded as one online-softmax step: one split a loop
        # turn made the merge a chain of dependent loads (measured on the H200: +2-7% of the
        # copy rate for decodes split 13-50 ways, python -m kernels.bench --decode-sweep).
        b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        b_w = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        o_s = tl.arange(0, BLOCK_S)
        for i_s0 in range(0, n_split, BLOCK_S):
            m_s = (i_s0 + o_s) < n_split
            p_op = o_part + (i_s0 + o_s)[:, None, None] * stride_ps + o_pt[None, :, None] * stride_pt
            b_o = tl.load(
                p_op + i_h * stride_ph + o_d[None, None, :], mask=m_s[:, None, None] & m_o[None, :, :], other=0.0
            )
            p_ml = lse_part + (i_s0 + o_s)[:, None] * stride_ls + o_pt[None, :] * stride_lt + i_h
            b_lse = tl.load(p_ml, mask=m_s[:, None] & m_t[None, :], other=float("-inf"))
            # rows past the tile's tokens: any finite value (their output is not stored)
            b_lse = tl.where(m_t[None, :], b_lse, 0.0)
            b_m_new = tl.maximum(b_m, tl.max(b_lse, axis=0))
            b_alpha = tl.exp2(b_m - b_m_new)
            b_beta = tl.exp2(b_lse - b_m_new[None, :])
            b_w = b_w * b_alpha + tl.sum(b_beta, axis=0)
            b_acc = b_acc * b_alpha[:, None] + tl.sum(b_o * b_beta[:, :, None], axis=0)
            b_m = b_m_new
    b_out = _merged_output(b_acc, b_w)
    p_o = o + o_t[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
    # a tile within one chunk was written by the forward kernel itself
    m_o = m_o & ((o_tok * 0 + n_split) > 1)[:, None]
    if PAD_ROWS:
        # a padding tile (n_q = 0, no chunk) writes zeros to its row: b_out is zero there
        m_o = m_o | (((o_tok == 0) & ((o_tok * 0 + n_q) == 0))[:, None] & (o_d < D)[None, :])
    tl.store(p_o, b_out.to(o.dtype.element_ty), mask=m_o)


# Head-dimension columns per program of the split merge.
_MERGE_D = 32


def _merge_splits_per_load(block_m: int, num_splits: int) -> int:
    """Splits the merge kernel loads at once: the widest load, ``BLOCK_S x BLOCK_M`` rows of
    :data:`_MERGE_D` fp32 within 256 rows (64 registers a thread over 4 warps), is 64 splits
    for decode tiles (4 rows) and four for 64-row prefill tiles; a launch of fewer splits loads
    a quarter or half of that, the narrowest of the three that holds them all.

    NOTE: no wider than the splits need: masked rows of a load still cost their instructions
    (H200, 4 decodes at 8k keys in 13 splits: the merge took 6.5 us loading 64 a turn, 5.1
    loading 16). Three widths, not every power of two: each is a compiled variant, and one
    first met mid-run compiles inside the run's timings.
    """
    widest = max(1, min(64, 256 // block_m))
    for width in (max(1, widest // 4), max(1, widest // 2)):
        if num_splits <= width:
            return width
    return widest
