"""Multi-Segment Attention (MSA) as a Triton kernel, and its launch.

Same contract as :func:`kernels.reference.msa_naive`: packed queries ``q`` are ``[T, HQ, D]``,
the paged caches ``[num_blocks, block_size, HKV, D]``, the output ``[T, HQ, D]``. A query at
absolute position ``p`` attends to the keys at positions ``<= p`` of its own sequence, read
through ``meta.block_tables[seq]``.

The launch plans (tiles, KV splits, the batch-invariant mode's fixed chunks) are built on the
host by :mod:`kernels.msa_plan`; the programs' walks over their KV are :mod:`kernels.msa_walk`,
the split merge :mod:`kernels.msa_merge`, the KV store :mod:`kernels.kv_store_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_store_triton import _store_kv_kernel
from kernels.metadata import MSAMetadata
from kernels.msa_config import MSAConfig, _num_sms
from kernels.msa_merge import (
    _MERGE_D,
    _chunk_partial,
    _fold_chunk,
    _fold_tile_chunks,
    _merge_splits_per_load,
    _merged_output,
    _msa_reduce_kernel,
)
from kernels.msa_plan import MSAPlan, plan_msa
from kernels.msa_walk import _attend_range, _invariant_walk

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


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
    # where the unsplit one does: msa_config._WIDE_KV_ROWS) but writes no partial: every tile's
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
        PREFETCH=_prefetch_block_ids(cfg.block_m, group, chunk_merge=plan.invariant and not split,
                                     one_wave=grid[0] * grid[1] * grid[2] <= _num_sms(q.device)),
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


# Tiles of at least this many rows (tokens x padded query heads) may load their block ids a
# turn ahead: see _prefetch_block_ids.
_PREFETCH_ROWS = 64


def _prefetch_block_ids(block_m: int, group: int, chunk_merge: bool, one_wave: bool = False) -> bool:
    """Whether a launch's walks load each tile's block ids a turn ahead (:func:`_tile_blocks`).

    Yes for tiles of at least :data:`_PREFETCH_ROWS` rows, and for smaller ones when the
    launch's programs fit one wave (``one_wave``: no more programs than SMs), except the
    batch-invariant in-program walk (``chunk_merge``).

    NOTE: the carried ids keep the next tile's K/V copies in flight, for a third buffer of
    shared memory. Measured on the H200 (2026-12-02): it pays where an SM holds one program
    either way or where few programs run (library prefill tiles, 2-11% in ``python -m
    kernels.bench``, 3% on an 8k prefill step; the batch-invariant split decodes, 5-16% in
    ``--decode-floor``). It loses where the buffer halves the programs an SM holds, whose number
    is what hides their latency: the library's 4-token decode tiles (up to 25% slower at batch
    >= 4) and the batch-invariant in-program walk (131 instead of 98 KB: an 8k prefill chunk
    after 24k keys 8% slower). In one wave an SM holds at most one program whatever its shared
    memory, so the small tiles gain there too (H100, 2026-12-07, the library's decodes as CUDA
    graphs, ``scripts/gpu_decode_prefetch.py``: 1 x 8k, 128 programs, 29.2 -> 24.0 us; 2 x 8k,
    256 programs, 0.97x; from 376 programs 1.02-1.21x slower).
    """
    if chunk_merge:
        return False
    return one_wave or block_m * triton.next_power_of_2(group) >= _PREFETCH_ROWS


def compiled_keys() -> dict[str, set[str]] | None:
    """Specialization keys Triton has compiled so far in this process, per kernel of an MSA step
    (the forward, the split merge and the KV store).

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


__all__ = ["compiled_keys", "compiled_variants", "msa_triton"]
