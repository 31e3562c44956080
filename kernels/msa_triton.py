"""Multi-Segment Attention (MSA) and the KV store as Triton kernels.

Same contract as :func:`kernels.reference.msa_naive`: packed queries ``q`` are ``[T, HQ, D]``,
the paged caches ``[num_blocks, block_size, HKV, D]``, the output ``[T, HQ, D]``. A query at
absolute position ``p`` attends to the keys at positions ``<= p`` of its own sequence, read
through ``meta.block_tables[seq]``.

The launch plans (tiles, KV splits, the batch-invariant mode's fixed chunks) are built on the
host by :mod:`kernels.msa_plan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import MSAMetadata
from kernels.msa_plan import MSAConfig, MSAPlan, plan_msa

_LOG2E = 1.4426950408889634
# Fill value of masked scores: finite, so a row masked over a whole tile yields no NaN; the
# rescale exp2(-1e30 - m) = 0 erases it as soon as the row sees a real key.
_MASKED = tl.constexpr(-1.0e30)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


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


@triton.jit
def _msa_fwd_kernel(
    q,
    k_cache,
    v_cache,
    o,
    o_part,
    lse_part,
    block_tables,
    tiles,
    merge_counts,
    scale_log2,
    chunk,
    p_chunk,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stat_off,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    DYN_CHUNK: tl.constexpr,
    CHUNK_MERGE: tl.constexpr,
    PART_BY_ROW: tl.constexpr,
    IEEE: tl.constexpr,
    PREFETCH: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PAD_ROWS: tl.constexpr,
):
    """MSA forward for one (q-tile, KV head, KV split).

    Rows are ``r = token * G_PAD + g``: the tile's ``BLOCK_M`` tokens times the ``G`` query
    heads of KV head ``i_kvh``. q ``[T, HQ, D]``, caches ``[NB, PAGE, HKV, D]``; without
    ``SPLIT`` writes o ``[T, HQ, D]``, with it o_part ``[S, R, HQ, D]`` (fp32, normalised) and
    lse_part ``[S, R, HQ]`` (base 2), where ``R = num_tiles * BLOCK_M``: tile ``i`` owns partial
    rows ``i * BLOCK_M ..``, so a launch over a few of the step's tokens needs partials for
    those only (with ``PART_BY_ROW``, partial rows are the packed rows, ``R = T``). With
    ``DYN_CHUNK`` the keys per split are read from ``p_chunk`` (a graph replay sets them for
    its batch) instead of ``chunk``. With ``CHUNK_MERGE`` (no ``SPLIT``) one program walks the
    whole context as consecutive chunks of ``chunk`` keys and folds their states itself
    (:func:`_invariant_walk`), exactly as the split merge would: the batch-invariant mode's
    reduction order. With ``SPLIT`` and ``PART_BY_ROW`` (the batch-invariant split) a program
    may walk several chunks (every ``S``-th); partials are indexed by chunk, ``S`` being the
    grid's splits, and hold unnormalised states: acc in o_part, m in lse_part and l
    ``stat_off`` elements after it; with ``FUSED_MERGE`` the last of a (tile, KV head)'s
    programs to finish folds them itself (:func:`_fold_tile_chunks`, counted in
    ``merge_counts``) and no merge kernel runs. With ``PAD_ROWS`` (a launch whose output no
    merge kernel writes: no ``SPLIT``, or ``FUSED_MERGE``) a padding tile (``n_q = 0``) writes
    zeros to its row ``row0``. The grid is ``(tile, KV head, split)``, or with ``HEADS_FIRST``
    ``(KV head, tile, split)``: the GPU starts programs along the first axis
    (``MSAPlan.heads_first``).
    """
    if DYN_CHUNK:
        chunk = tl.load(p_chunk)
    if HEADS_FIRST:
        i_kvh, i_tile, n_kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    else:
        i_tile, i_kvh, n_kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    i_split = tl.program_id(2)
    i_seq = tl.load(tiles + i_tile * 4 + 0)
    i_row0 = tl.load(tiles + i_tile * 4 + 1)
    n_q = tl.load(tiles + i_tile * 4 + 2)
    i_pos0 = tl.load(tiles + i_tile * 4 + 3)

    BLOCK_R: tl.constexpr = BLOCK_M * G_PAD
    o_r = tl.arange(0, BLOCK_R)
    o_tok = o_r // G_PAD
    o_g = o_r % G_PAD
    o_d = tl.arange(0, D)
    m_r = (o_tok < n_q) & (o_g < G)
    o_h = i_kvh * G + o_g
    o_t = (i_row0 + o_tok).to(tl.int64)
    o_pos = i_pos0 + o_tok

    p_q = q + o_t[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)

    ctx_end = i_pos0 + n_q
    p_bt = block_tables + i_seq.to(tl.int64) * stride_bt
    m_o = m_r[:, None]
    o_zero_r = o_r * 0  # per-row copies of the tile's scalars, for the store masks
    # a padding tile's (n_q = 0) row: zeros there with PAD_ROWS
    m_pad = (o_tok == 0) & (o_g < G) & ((o_zero_r + n_q) == 0)
    p_o = o + o_t[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
    if CHUNK_MERGE:
        b_out = _invariant_walk(
            b_q, p_bt, k_cache, v_cache, i_kvh, i_pos0, o_d, o_pos, ctx_end, chunk, scale_log2,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, BLOCK_R, D, IEEE, PREFETCH,
        )
        if PAD_ROWS:
            m_o = (m_r | m_pad)[:, None]  # a padding tile's walk is empty: its output is zero
        tl.store(p_o, b_out.to(o.dtype.element_ty), mask=m_o)
    elif SPLIT and PART_BY_ROW:
        # batch-invariant split: program i_split walks chunks i_split, i_split + S, ... of its
        # tile's context and stores each chunk's unnormalised state (acc, m, l) at that chunk's
        # index; the merge folds them in chunk order, as the in-program walk does. A context
        # of one chunk is folded and written here.
        # NOTE: the one-chunk case is its own branch, not a test inside the chunk loop: there
        # its second accumulator (the fold) stayed live across the loop, and the program
        # spilled 104 bytes a thread; as a branch, none (python -m kernels.offline_compile,
        # Triton 3.6, sm_90).
        n_tile_chunks = tl.cdiv(ctx_end, chunk)
        if n_tile_chunks == 1:
            if i_split == 0:
                b_acc, b_m, b_l = _attend_range(
                    b_q, p_bt, k_cache, v_cache, i_kvh, 0, ctx_end, i_pos0, o_d, o_pos, ctx_end,
                    scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    PAGE, BLOCK_N, BLOCK_R, D, IEEE, PREFETCH,
                )
                b_macc, b_ml, _ = _fold_chunk(
                    tl.zeros([BLOCK_R, D], dtype=tl.float32), tl.zeros([BLOCK_R], dtype=tl.float32),
                    tl.full([BLOCK_R], float("-inf"), dtype=tl.float32), b_acc, b_m, b_l,
                )
                tl.store(p_o, _merged_output(b_macc, b_ml).to(o.dtype.element_ty), mask=m_o)
        else:
            for i_c in range(i_split, n_tile_chunks, tl.num_programs(2)):
                i_lo = i_c * chunk
                b_acc, b_m, b_l = _attend_range(
                    b_q, p_bt, k_cache, v_cache, i_kvh, i_lo, tl.minimum(i_lo + chunk, ctx_end), i_pos0,
                    o_d, o_pos, ctx_end, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb,
                    stride_vs, stride_vh, PAGE, BLOCK_N, BLOCK_R, D, IEEE, PREFETCH,
                )
                p_op = o_part + i_c * stride_ps + o_t[:, None] * stride_pt + o_h[:, None] * stride_ph + o_d[None, :]
                tl.store(p_op, b_acc, mask=m_o)
                p_ml = lse_part + i_c * stride_ls + o_t * stride_lt + o_h
                tl.store(p_ml, b_m, mask=m_r)
                tl.store(p_ml + stat_off, b_l, mask=m_r)
            if FUSED_MERGE:
                # NOTE: the last of the tile's programs that walked a chunk merges, so a decode
                # step needs no second launch per layer (a graph node of ~2 us at batch 1).
                # Every thread's stores are done (barrier) before one thread counts this
                # program with release semantics; the one that counts last acquires and reads
                # the partials past L1; it resets the count for the next launch.
                n_parts = tl.minimum(tl.num_programs(2), n_tile_chunks)
                if i_split < n_parts:
                    tl.debug_barrier()
                    p_count = merge_counts + i_tile * n_kv_heads + i_kvh
                    if tl.atomic_add(p_count, 1, sem="acq_rel") == n_parts - 1:
                        _fold_tile_chunks(
                            o, o_part, lse_part, i_row0, n_q, i_kvh, n_tile_chunks,
                            stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                            stat_off, G, G_PAD, D,
                        )
                        tl.atomic_xchg(p_count, 0, sem="relaxed")
        if PAD_ROWS:
            m_pad = m_pad & ((o_zero_r + i_split) == 0)
            tl.store(p_o, tl.zeros([BLOCK_R, D], dtype=o.dtype.element_ty), mask=m_pad[:, None])
    else:
        i_lo = i_split * chunk
        i_hi = tl.minimum(i_lo + chunk, ctx_end)
        b_acc, b_m, b_l = _attend_range(
            b_q, p_bt, k_cache, v_cache, i_kvh, i_lo, i_hi, i_pos0, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, BLOCK_R, D, IEEE, PREFETCH,
        )
        if SPLIT:
            # NOTE: splits are per launch, but a tile whose context fits in one chunk has
            # nothing to merge: it writes its output directly and the merge skips it. Only the
            # long-context tiles pay for partials.
            n_tile_splits = tl.cdiv(ctx_end, chunk)
            b_o, b_lse = _chunk_partial(b_acc, b_m, b_l)
            m_part = ((o_zero_r + n_tile_splits) > 1) & ((o_zero_r + i_split) < n_tile_splits)
            o_pt = (i_tile * BLOCK_M + o_tok).to(tl.int64)
            p_op = o_part + i_split * stride_ps + o_pt[:, None] * stride_pt
            p_op = p_op + o_h[:, None] * stride_ph + o_d[None, :]
            tl.store(p_op, b_o, mask=m_o & m_part[:, None])
            p_lse = lse_part + i_split * stride_ls + o_pt * stride_lt + o_h
            tl.store(p_lse, b_lse, mask=m_r & m_part)
            m_direct = ((o_zero_r + n_tile_splits) == 1) & ((o_zero_r + i_split) == 0)
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o & m_direct[:, None])
        else:
            b_o = b_acc / b_l[:, None]
            if PAD_ROWS:
                b_o = tl.where(m_pad[:, None], 0.0, b_o)
                m_o = (m_r | m_pad)[:, None]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o)


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


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copies token ``i_t``'s k, v ``[H, D]`` into its slot; negative slots are skipped."""
    i_t = tl.program_id(0)
    i_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    i_blk = i_slot // PAGE
    i_in = i_slot % PAGE
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = (o_h < H) & (o_h * 0 + i_slot >= 0)
    m_hd = m_h[:, None] & (o_d < D)[None, :]
    b_k = tl.load(k + i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :], mask=m_hd)
    b_v = tl.load(v + i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :], mask=m_hd)
    p_kc = k_cache + i_blk * stride_kcb + i_in * stride_kcs + o_h[:, None] * stride_kch
    p_vc = v_cache + i_blk * stride_vcb + i_in * stride_vcs + o_h[:, None] * stride_vch
    tl.store(p_kc + o_d[None, :], b_k.to(k_cache.dtype.element_ty), mask=m_hd)
    tl.store(p_vc + o_d[None, :], b_v.to(v_cache.dtype.element_ty), mask=m_hd)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


def msa_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: MSAConfig | None = None,
) -> torch.Tensor:
    """Multi-Segment Attention over a paged KV cache: every segment of the step, holes and
    decodes included, in one call (one launch per tile class, :class:`MSAStepPlan`).

    Args:
        q: ``[T, HQ, D]`` packed queries (last dim contiguous).
        k_cache: ``[num_blocks, block_size, HKV, D]``.
        v_cache: same shape as ``k_cache``.
        meta: the step's segments (:class:`~kernels.metadata.MSAMetadata`); its ``plan``, when
            set (:func:`plan_msa` once per step, or a graph's :func:`decode_graph_plan`), is
            used as is.
        scale: softmax scale.
        out: optional ``[T, HQ, D]`` buffer to write into (tests poison it first).
        config: optional launch configuration (benchmarks): one launch of every segment;
            chosen per tile class when ``None``. Ignored when ``meta.plan`` is set.

    Returns:
        ``[T, HQ, D]`` in ``q``'s dtype; rows of tokens that belong to no segment are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    plan = meta.plan
    if plan is None:
        plan = plan_msa(meta, num_q_heads, num_kv_heads, head_dim, q.device, config, dtype=q.dtype)
    if out is None:
        out = torch.empty_like(q) if plan.covered_rows >= num_tokens else torch.zeros_like(q)
    elif plan.covered_rows < num_tokens:
        out.zero_()
    if num_tokens == 0 or plan.num_tiles == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("msa_triton: caches need a contiguous last dimension")
    assert out.stride(-1) == 1, "msa_triton: out needs a contiguous last dimension"
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"msa_triton: head_dim must be a power of two >= 16, got {head_dim}")
    for launch in plan.launches:
        if launch.num_tiles:
            _launch(q, k_cache, v_cache, out, meta.block_tables, launch, scale)
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    plan: MSAPlan,
    scale: float,
) -> None:
    """Runs one launch of a plan (and its split merge) into ``out``."""
    _, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    cfg, tiles, num_tiles = plan.config, plan.tiles, plan.num_tiles
    chunk, num_splits = plan.chunk, plan.num_splits
    block_d = triton.next_power_of_2(head_dim)
    # NOTE: ``split_path`` at one split compiles the split path (whose KV loop does not spill
    # where the unsplit one does: msa_plan._WIDE_KV_ROWS) but writes no partial: every tile's
    # context fits its one chunk, so it stores its output directly and no merge runs.
    partials = num_splits > 1
    split = partials or cfg.split_path
    assert not (split and not partials and (plan.invariant or plan.pad_rows)), "msa_triton: split_path is for library launches"
    part_by_row = plan.invariant
    if partials:
        # partial rows are tile-local (tile i owns rows i * block_m ..) or, in the
        # batch-invariant mode, the packed rows: see _msa_fwd_kernel
        part_rows = q.shape[0] if part_by_row else num_tiles * cfg.block_m
        slots = plan.partial_slots
        o_part = torch.empty((slots, part_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        # per partial row: lse, or in the batch-invariant mode m then (at stat_off) l
        stats = 2 if part_by_row else 1
        lse_part = torch.empty((stats, slots, part_rows, num_q_heads), dtype=torch.float32, device=q.device)
        stat_off = lse_part.stride(0) if part_by_row else 0
        lse_part = lse_part[0]
    else:
        o_part = out
        lse_part = out
        stat_off = 0
    bt = block_tables
    dyn_chunk = plan.chunk_buffer is not None
    # NOTE: without a chunk buffer the pointer argument is unused; ``tiles`` stands in for it.
    p_chunk = plan.chunk_buffer if dyn_chunk else tiles
    fused_merge = partials and part_by_row and plan.merge_counts is not None
    if fused_merge:
        assert plan.merge_counts.numel() >= num_tiles * num_kv_heads, "msa_triton: merge_counts too small"
    grid = (num_kv_heads, num_tiles, num_splits) if plan.heads_first else (num_tiles, num_kv_heads, num_splits)
    _msa_fwd_kernel[grid](
        q, k_cache, v_cache, out, o_part, lse_part, bt, tiles,
        plan.merge_counts if fused_merge else tiles,
        float(scale) * _LOG2E, chunk, p_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        o_part.stride(0), o_part.stride(1) if partials else 0, o_part.stride(2) if partials else 0,
        lse_part.stride(0), lse_part.stride(1) if partials else 0, stat_off,
        PAGE=page, G=group, G_PAD=triton.next_power_of_2(group), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, D=head_dim, SPLIT=split, DYN_CHUNK=dyn_chunk,
        CHUNK_MERGE=plan.invariant and not split, PART_BY_ROW=part_by_row, IEEE=q.dtype == torch.float32,
        PREFETCH=_prefetch_block_ids(cfg.block_m, group, chunk_merge=plan.invariant and not split),
        FUSED_MERGE=fused_merge, HEADS_FIRST=plan.heads_first, PAD_ROWS=plan.pad_rows and (fused_merge or not split),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partials and not fused_merge:
        # NOTE: the merge splits the head dimension over programs: its loads of many splits
        # (chunk states) at a time stay within the registers, and a decode's few (tile, head)
        # pairs get 4x the programs
        merge_d = min(block_d, _MERGE_D)
        _msa_reduce_kernel[(num_tiles, num_q_heads, triton.cdiv(head_dim, merge_d))](
            out, o_part, lse_part, tiles, chunk, p_chunk, plan.partial_slots,
            out.stride(0), out.stride(1),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), stat_off,
            BLOCK_M=cfg.block_m, D=head_dim, BLOCK_D=merge_d,
            # the batch-invariant fold loads eight chunk states a turn whatever BLOCK_S says:
            # a fixed value keeps it to one compiled variant
            BLOCK_S=1 if part_by_row else _merge_splits_per_load(cfg.block_m, plan.partial_slots),
            DYN_CHUNK=dyn_chunk, PART_BY_ROW=part_by_row, PAD_ROWS=plan.pad_rows, num_warps=4,
        )


# Head-dimension columns per program of the split merge.
_MERGE_D = 32
# Tiles of at least this many rows (tokens x padded query heads) may load their block ids a
# turn ahead: see _prefetch_block_ids.
_PREFETCH_ROWS = 64


def _prefetch_block_ids(block_m: int, group: int, chunk_merge: bool) -> bool:
    """Whether a launch's walks load each tile's block ids a turn ahead (:func:`_tile_blocks`).

    Yes for tiles of at least :data:`_PREFETCH_ROWS` rows, except the batch-invariant
    in-program walk (``chunk_merge``).

    NOTE: the carried ids keep the next tile's K/V copies in flight, for a third buffer of
    shared memory. Measured on the H200 (2026-12-02): it pays where an SM holds one program
    either way or where few programs run (library prefill tiles, 2-11% in ``python -m
    kernels.bench``, 3% on an 8k prefill step; the batch-invariant split decodes, 5-16% in
    ``--decode-floor``). It loses where the buffer halves the programs an SM holds, whose number
    is what hides their latency: the library's 4-token decode tiles (up to 25% slower at batch
    >= 4) and the batch-invariant in-program walk (131 instead of 98 KB: an 8k prefill chunk
    after 24k keys 8% slower).
    """
    return block_m * triton.next_power_of_2(group) >= _PREFETCH_ROWS and not chunk_merge


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


def compiled_keys() -> dict[str, set[str]] | None:
    """Specialization keys Triton has compiled so far in this process, per kernel of this module.

    Each new combination of constexprs (and of integer-argument specializations) compiles on
    first use, about a second on a GPU. ``None`` where the Triton build keeps no per-device
    kernel cache (the CPU interpreter).
    """
    keys: dict[str, set[str]] = {}
    for fn in (_msa_fwd_kernel, _msa_reduce_kernel, _store_kv_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        # NOTE: Triton 3.x keeps ``device -> (kernel cache, ...)``; the cache maps one
        # specialization key to its compiled kernel.
        keys[fn.__name__] = {str(key) for entry in caches.values() for key in entry[0]}
    return keys


def compiled_variants() -> int | None:
    """How many binaries :func:`compiled_keys` holds: a benchmark compares this count before and
    after a run to tell whether compiles landed inside it."""
    keys = compiled_keys()
    return None if keys is None else sum(len(k) for k in keys.values())


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes this step's K/V ``[T, HKV, D]`` into their slots of the paged caches.

    Args:
        k: ``[T, HKV, D]`` new keys (last dim contiguous).
        v: ``[T, HKV, D]`` new values.
        k_cache: ``[num_blocks, block_size, HKV, D]``, written in place.
        v_cache: same shape as ``k_cache``.
        slot_mapping: ``[T]`` int64 flat slots (``block * block_size + offset``); a negative
            slot (padding) is skipped.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, D=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


__all__ = ["compiled_keys", "compiled_variants", "msa_triton", "store_kv_triton"]
