"""Multi-Segment Attention (MSA) and the KV store as Triton kernels.

Same contract as :func:`kernels.reference.msa_naive`: packed queries ``q`` are ``[T, HQ, D]``,
the paged caches ``[num_blocks, block_size, HKV, D]``, the output ``[T, HQ, D]``. A query at
absolute position ``p`` attends to the keys at positions ``<= p`` of its own sequence, read
through ``meta.block_tables[seq]``.

Launch plan (all host side, no device sync):

- The segments of the step are cut into *q-tiles* of ``BLOCK_M`` tokens. A small int32 tile
  table ``[num_tiles, 4]`` (sequence row, first packed row, valid tokens, absolute position of
  the first token) is built from ``meta.host_segments`` and copied to the device; heavy tiles
  (longest causal context) come first, so the tail of the launch is short.
- One program handles one q-tile and one KV head, with the ``G = HQ // HKV`` query heads of that
  group stacked as rows (``BLOCK_M * G_PAD`` rows), so each K/V tile is loaded once per group.
  Keys are walked in ``BLOCK_N`` tiles up to the tile's causal end only: tiles wholly before the
  first query position run unmasked, the few on the diagonal run masked. Online softmax
  (flash attention) with fp32 accumulators, in base 2.
- When the tiles times KV heads cannot fill the GPU (long-context decode), the KV range is split
  into chunks over a third grid axis (split-K / flash decoding); each split writes a partial
  output and its log-sum-exp, and a second small kernel merges them.
- Short segments (decodes, one-block holes) and long ones (prefill chunks) are two tile
  classes, each launched with its own tile size and split (:class:`MSAStepPlan`): in a shared
  launch a decode row would take a prefill-sized tile and walk its context in one program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.metadata import MSAMetadata

_LOG2E = 1.4426950408889634
# Fill value of masked scores: finite, so a row masked over a whole tile yields no NaN; the
# rescale exp2(-1e30 - m) = 0 erases it as soon as the row sees a real key.
_MASKED = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class MSAConfig:
    """Tile sizes and launch parameters of one MSA launch.

    Attributes:
        block_m: query tokens per q-tile (rows are ``block_m * next_pow2(G)``).
        block_n: keys per KV tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loop.
        num_splits: KV splits (1: no split-K, the kernel writes the output directly).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int


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
def _attend_tile(
    b_q,
    b_acc,
    b_m,
    b_l,
    p_bt,
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
    """One KV tile ``[i_n, i_n + BLOCK_N)`` of online softmax for rows ``b_q [R, D]``."""
    o_n = i_n + tl.arange(0, BLOCK_N)
    if MASKED:
        m_n = o_n < ctx_end
        b_blk = tl.load(p_bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
    else:
        b_blk = tl.load(p_bt + o_n // PAGE).to(tl.int64)
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
):
    """Online softmax of rows ``b_q [R, D]`` over the keys ``[i_lo, i_hi)`` from a fresh state.

    Returns ``(acc [R, D], m [R], l [R])``: unnormalised output, running max (scaled, base 2)
    and sum of weights.
    """
    # KV tiles ending at or before the first query position are visible to every row.
    i_full = tl.maximum(i_lo, tl.minimum(i_hi, (i_pos0 + 1) // BLOCK_N * BLOCK_N))
    b_m = tl.full([BLOCK_R], _MASKED, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    for i_n in range(i_lo, i_full, BLOCK_N):
        b_acc, b_m, b_l = _attend_tile(
            b_q, b_acc, b_m, b_l, p_bt, k_cache, v_cache, i_kvh, i_n, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, False, IEEE,
        )
    for i_n in range(i_full, i_hi, BLOCK_N):
        b_acc, b_m, b_l = _attend_tile(
            b_q, b_acc, b_m, b_l, p_bt, k_cache, v_cache, i_kvh, i_n, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, True, IEEE,
        )
    return b_acc, b_m, b_l


@triton.jit
def _chunk_partial(b_acc, b_m, b_l):
    """A KV chunk's normalised output and log-sum-exp (base 2); an empty row gives ``(0, m)``."""
    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    return b_acc / b_l_safe[:, None], b_m + tl.log2(b_l_safe)


@triton.jit
def _merge_partial(b_acc, b_w, b_m, b_o, b_lse):
    """Folds one chunk partial ``(o, lse)`` into the running merge ``(acc, w, m)``.

    NOTE: the split merge kernel and the in-kernel chunk merge of the batch-invariant mode both
    call this one function, in chunk order, so a row's output is the same bits whichever of the
    two computed it.
    """
    b_m_new = tl.maximum(b_m, b_lse)
    b_alpha = tl.exp2(b_m - b_m_new)
    b_beta = tl.exp2(b_lse - b_m_new)
    b_w = b_w * b_alpha + b_beta
    b_acc = b_acc * b_alpha[:, None] + b_o * b_beta[:, None]
    return b_acc, b_w, b_m_new


@triton.jit
def _merged_output(b_acc, b_w):
    """The merged output of :func:`_merge_partial`'s running state."""
    b_w = tl.where(b_w == 0.0, 1.0, b_w)
    return b_acc / b_w[:, None]


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
    whole context as consecutive chunks of ``chunk`` keys and merges their partials itself,
    exactly as the split merge would: the batch-invariant mode's reduction order.
    """
    if DYN_CHUNK:
        chunk = tl.load(p_chunk)
    i_tile, i_kvh, i_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    p_o = o + o_t[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
    if CHUNK_MERGE:
        b_macc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        b_mw = tl.zeros([BLOCK_R], dtype=tl.float32)
        b_mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for i_c in range(0, ctx_end, chunk):
            b_acc, b_m, b_l = _attend_range(
                b_q, p_bt, k_cache, v_cache, i_kvh, i_c, tl.minimum(i_c + chunk, ctx_end), i_pos0,
                o_d, o_pos, ctx_end, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, PAGE, BLOCK_N, BLOCK_R, D, IEEE,
            )
            b_o, b_lse = _chunk_partial(b_acc, b_m, b_l)
            b_macc, b_mw, b_mm = _merge_partial(b_macc, b_mw, b_mm, b_o, b_lse)
        tl.store(p_o, _merged_output(b_macc, b_mw).to(o.dtype.element_ty), mask=m_o)
    else:
        i_lo = i_split * chunk
        i_hi = tl.minimum(i_lo + chunk, ctx_end)
        b_acc, b_m, b_l = _attend_range(
            b_q, p_bt, k_cache, v_cache, i_kvh, i_lo, i_hi, i_pos0, o_d, o_pos, ctx_end,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, BLOCK_N, BLOCK_R, D, IEEE,
        )
        if SPLIT:
            # NOTE: splits are per launch, but a tile whose context fits in one chunk has
            # nothing to merge: it writes its output directly and the merge skips it. Only the
            # long-context tiles pay for partials.
            n_tile_splits = tl.cdiv(ctx_end, chunk)
            b_o, b_lse = _chunk_partial(b_acc, b_m, b_l)
            o_zero = o_r * 0  # per-row copies of the tile's scalars, for the store masks
            m_part = ((o_zero + n_tile_splits) > 1) & ((o_zero + i_split) < n_tile_splits)
            if PART_BY_ROW:
                o_pt = o_t
            else:
                o_pt = (i_tile * BLOCK_M + o_tok).to(tl.int64)
            p_op = o_part + i_split * stride_ps + o_pt[:, None] * stride_pt
            p_op = p_op + o_h[:, None] * stride_ph + o_d[None, :]
            tl.store(p_op, b_o, mask=m_o & m_part[:, None])
            p_lse = lse_part + i_split * stride_ls + o_pt * stride_lt + o_h
            tl.store(p_lse, b_lse, mask=m_r & m_part)
            m_direct = ((o_zero + n_tile_splits) == 1) & ((o_zero + i_split) == 0)
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o & m_direct[:, None])
        else:
            b_o = b_acc / b_l[:, None]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o)


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
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DYN_CHUNK: tl.constexpr,
    PART_BY_ROW: tl.constexpr,
):
    """Merges the split partials of one (q-tile, q head): o_part ``[S, R, HQ, D]`` -> o."""
    if DYN_CHUNK:
        chunk = tl.load(p_chunk)
    i_tile, i_h = tl.program_id(0), tl.program_id(1)
    i_row0 = tl.load(tiles + i_tile * 4 + 1)
    n_q = tl.load(tiles + i_tile * 4 + 2)
    i_pos0 = tl.load(tiles + i_tile * 4 + 3)
    n_split = tl.minimum(tl.cdiv(i_pos0 + n_q, chunk), num_splits)

    o_tok = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_t = o_tok < n_q
    m_o = m_t[:, None] & (o_d < D)[None, :]
    o_t = (i_row0 + o_tok).to(tl.int64)
    if PART_BY_ROW:
        o_pt = o_t
    else:
        o_pt = (i_tile * BLOCK_M + o_tok).to(tl.int64)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_w = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i_s in range(0, n_split):
        b_lse = tl.load(lse_part + i_s * stride_ls + o_pt * stride_lt + i_h, mask=m_t, other=0.0)
        p_op = o_part + i_s * stride_ps + o_pt[:, None] * stride_pt + i_h * stride_ph
        b_o = tl.load(p_op + o_d[None, :], mask=m_o, other=0.0)
        b_acc, b_w, b_m = _merge_partial(b_acc, b_w, b_m, b_o, b_lse)
    b_out = _merged_output(b_acc, b_w)
    p_o = o + o_t[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
    # a tile within one chunk was written by the forward kernel itself
    tl.store(p_o, b_out.to(o.dtype.element_ty), mask=m_o & ((o_tok * 0 + n_split) > 1)[:, None])


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
# Host side
# --------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Hopper's opt-in shared memory per block (bytes); the CPU interpreter plans as for an H200.
_DEFAULT_SMEM = 232448
# Bytes of shared memory Triton uses beside the operand buffers (barriers, layout scratch).
_SMEM_SLACK = 8192


def _smem_limit(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or _DEFAULT_SMEM)
    return _DEFAULT_SMEM


def _smem_bytes(rows: int, block_n: int, num_stages: int, head_dim: int, elem_bytes: int) -> int:
    """Shared memory of one program: the q tile plus ``num_stages`` buffers of K and V tiles.

    NOTE: a conservative model of what Triton 3.6 allocates for this kernel on Hopper: float32
    programs of 256 rows, 64 keys and head_dim 128 asked for 262,400 bytes at 3 stages and
    263,168 at 2 (the q tile, 131,072, plus four 32,768-byte K/V buffers, plus barriers).
    """
    return elem_bytes * head_dim * (rows + 2 * max(num_stages, 2) * block_n)


def _fit_tile(
    rows: int, block_n: int, num_stages: int, head_dim: int, elem_bytes: int, limit: int
) -> tuple[int, int, int] | None:
    """Shrinks pipelining depth, then the KV tile, until a program of ``rows`` fits ``limit``
    bytes of shared memory; ``None`` when even 2 stages of 16-key tiles do not fit."""
    while _smem_bytes(rows, block_n, num_stages, head_dim, elem_bytes) + _SMEM_SLACK > limit:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            return None
    return rows, block_n, num_stages


def _tile_shape(
    rows: int, head_dim: int = 128, elem_bytes: int = 2, smem_limit: int = _DEFAULT_SMEM
) -> tuple[int, int, int, int]:
    """``(rows, block_n, num_warps, num_stages)`` for programs of up to ``rows`` query rows.

    ``rows`` comes back halved (down to 16) until the tile fits ``smem_limit``: float32 and wide
    heads need less pipelining, smaller KV tiles or fewer rows than bf16 at head_dim 128.
    """
    # Measured on the H200: decode-like tiles are bandwidth-bound and prefer
    # few warps; long segments prefer 256-row tiles on 8 warps.
    while True:
        block_n, num_stages = 64, 3
        fitted = _fit_tile(rows, block_n, num_stages, head_dim, elem_bytes, smem_limit)
        if fitted is not None or rows <= 16:
            break
        rows //= 2
    if fitted is None:
        raise ValueError(f"msa_triton: no tile of head_dim {head_dim} fits {smem_limit} bytes of shared memory")
    rows, block_n, num_stages = fitted
    num_warps = 2 if rows <= 16 else 4 if rows <= 64 else 8
    return rows, block_n, num_warps, num_stages


def _short_tile_splits(programs: int, max_ctx: int, num_sms: int) -> int:
    """KV splits of a launch of short tiles (decodes, one-block holes): they are
    bandwidth-bound and their merge is cheap, so ~3 programs per SM, in chunks of >= 512 keys."""
    if programs >= 3 * num_sms or max_ctx <= 1024:
        return 1
    return min(-(-3 * num_sms // programs), -(-max_ctx // 512))


def choose_config(
    meta: MSAMetadata,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> MSAConfig:
    """Picks tile sizes and the KV split from host metadata only (no device sync).

    Rows per program are ``block_m * next_pow2(G)``: 16 for decode-only steps (the smallest
    tensor-core tile), up to 256 once segments are long, fewer where the tile would not fit
    the device's shared memory in ``dtype``. Split-K turns on when the programs (q-tiles times
    KV heads) cannot fill the GPU and contexts are long: ~3 programs per SM for short tiles
    (up to 64 rows), two waves for prefill tiles.
    """
    return _config_for(meta.host_segments, num_q_heads, num_kv_heads, head_dim, device, dtype)


def _config_for(
    segments: tuple[tuple[int, int, int, int], ...] | list[tuple[int, int, int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> MSAConfig:
    """:func:`choose_config` for a launch over ``segments`` ``(seq, q_start, q_len, pos_start)``."""
    max_q_len = max((seg[2] for seg in segments), default=0)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    g_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    min_m = max(1, 16 // g_pad)
    max_m = max(min_m, min(128, 256 // g_pad))
    block_m = min(max(triton.next_power_of_2(max(max_q_len, 1)), min_m), max_m)
    rows, block_n, num_warps, num_stages = _tile_shape(
        block_m * g_pad, head_dim, _elem_bytes(dtype), _smem_limit(device)
    )
    block_m = max(1, rows // g_pad)
    num_tiles = sum(-(-seg[2] // block_m) for seg in segments)
    programs = max(num_tiles * num_kv_heads, 1)
    num_sms = _num_sms(device)
    num_splits = 1
    if rows <= 64:
        num_splits = _short_tile_splits(programs, max_ctx, num_sms)
    elif programs < 2 * num_sms:
        # compute-bound tiles (one 8-warp program per SM): split only long contexts, into
        # chunks of >= 4k keys, to fill two waves (measured: the merge costs more below that)
        num_splits = max(1, min(-(-2 * num_sms // programs), max_ctx // 4096))
    return MSAConfig(block_m, block_n, num_warps, num_stages, max(num_splits, 1))


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Keys per chunk of the batch-invariant mode's fixed KV split (a multiple of every KV tile):
# short enough that a decode at a 2k context still spreads over 4 programs per KV head.
INVARIANT_CHUNK = 512
# Largest float32 split-partial buffer (bytes) the batch-invariant mode spreads over programs;
# past it, each program merges its chunks itself (same bits, fewer programs).
_INVARIANT_PARTIAL_BYTES = 256 << 20
# Query rows per program of the batch-invariant mode: decode-sized and prefill-sized tiles.
_INVARIANT_ROWS = (64, 256)


def invariant_config(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    rows: int = _INVARIANT_ROWS[0],
) -> MSAConfig:
    """A launch configuration of the batch-invariant mode for a model's attention shape.

    What sets a query row's bits is kept the same for every launch of every step: the KV tile
    (``block_n``, the one that fits the largest tile in shared memory) and the chunks of
    :data:`INVARIANT_CHUNK` keys merged in order (``num_splits`` is set per launch by
    :func:`plan_msa`). The rows per program, warps and pipelining depth may follow the
    segments (``rows`` of 64 or 256): a row's dot products and softmax do not depend on them
    (the GPU tests check the bits of a row alone and inside prefill tiles).
    """
    g_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    elem, limit = _elem_bytes(dtype), _smem_limit(device)
    _, block_n, _, _ = _tile_shape(max(_INVARIANT_ROWS[-1], g_pad), head_dim, elem, limit)
    rows = max(rows, g_pad)
    fitted = _fit_tile(rows, block_n, 3, head_dim, elem, limit)
    while fitted is None or fitted[1] != block_n:
        rows //= 2
        fitted = _fit_tile(rows, block_n, 3, head_dim, elem, limit)
    rows, _, num_stages = fitted
    num_warps = 2 if rows <= 16 else 4 if rows <= 64 else 8
    return MSAConfig(max(1, rows // g_pad), block_n, num_warps, num_stages, 1)


@dataclass(frozen=True)
class MSAPlan:
    """One MSA launch, prepared on the host once per step and shared by every layer.

    Attributes:
        config: tile sizes and launch parameters.
        tiles: ``[num_tiles, 4]`` int32 device table ``(seq, row0, n_q, pos0)``; a tile with
            ``n_q = 0`` is padding and writes nothing.
        num_tiles: grid size along the tile axis.
        chunk: keys per KV split (a multiple of ``config.block_n``).
        num_splits: KV splits (grid axis 2); 1 writes the output directly.
        covered_rows: packed rows that some tile writes; when fewer than ``T``, the output is
            zeroed first (``0`` for graph plans, whose tiles change between replays).
        chunk_buffer: a graph plan's ``[1]`` int32 device buffer of the keys per split, which
            the kernels read at run time (``chunk`` is then only its largest value); ``None``:
            ``chunk`` is passed as is.
        invariant: the batch-invariant mode: ``chunk`` is :data:`INVARIANT_CHUNK` whatever the
            step, and the chunks of a context are merged in order, by the split merge when
            ``num_splits > 1`` (partials indexed by packed row) or inside each program
            otherwise.
    """

    config: MSAConfig
    tiles: torch.Tensor
    num_tiles: int
    chunk: int
    num_splits: int
    covered_rows: int
    chunk_buffer: torch.Tensor | None = None
    invariant: bool = False

    @property
    def launches(self) -> tuple[MSAPlan, ...]:
        """A single launch, so that any plan can be run as :class:`MSAStepPlan` is."""
        return (self,)


@dataclass(frozen=True)
class MSAStepPlan:
    """A step's MSA: one launch per tile class, all writing disjoint rows of one output.

    Decode rows and one-block holes (short segments) get their own launch, with small tiles
    and the KV split of a decode; the prefill segments get big tiles. In one shared launch a
    short segment would take a big tile (its rows mostly masked) and walk its whole context in
    one program per KV head: measured on the H200, one decode at 8k keys adds ~9 ms to a
    mixed step that way.

    Attributes:
        launches: the launches, heaviest class first.
    """

    launches: tuple[MSAPlan, ...]

    @property
    def num_tiles(self) -> int:
        return sum(launch.num_tiles for launch in self.launches)

    @property
    def covered_rows(self) -> int:
        """Packed rows that some launch writes."""
        return sum(launch.covered_rows for launch in self.launches)


def _split_chunk(max_ctx: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(chunk, num_splits)``: ``num_splits`` chunks of whole KV tiles covering ``max_ctx``."""
    chunk = -(-max(max_ctx, 1) // max(num_splits, 1))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-max(max_ctx, 1) // chunk)


def _plan_launch(
    segments: list[tuple[int, int, int, int]],
    cfg: MSAConfig,
    device: torch.device,
    num_kv_heads: int = 0,
    min_chunk: int = 4096,
) -> MSAPlan:
    """One launch over ``segments`` with ``cfg``: its tile table, heaviest tiles first.

    With ``num_kv_heads`` (automatic configs), no program walks more keys than its share of
    the launch: when one tile's causal context exceeds the keys per SM of the whole launch (a
    deep hole next to a prefill chunk at the start of its history), the KV split grows until
    that tile's chunks fit, in chunks of at least ``min_chunk`` keys. Tiles within one chunk
    still write their output directly (see ``_msa_fwd_kernel``).
    """
    rows: list[tuple[int, int, int, int]] = []
    for seq, q_start, q_len, pos_start in segments:
        for off in range(0, q_len, cfg.block_m):
            rows.append((seq, q_start + off, min(cfg.block_m, q_len - off), pos_start + off))
    rows.sort(key=lambda r: -(r[3] + r[2]))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device, non_blocking=True)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    chunk, num_splits = _split_chunk(max_ctx, cfg.num_splits, cfg.block_n)
    if num_kv_heads and rows:
        keys_per_sm = sum(r[3] + r[2] for r in rows) * num_kv_heads / _num_sms(device)
        balanced = -(-max(min_chunk, int(keys_per_sm)) // cfg.block_n) * cfg.block_n
        if balanced < chunk:
            chunk, num_splits = balanced, -(-max_ctx // balanced)
    return MSAPlan(cfg, table, len(rows), chunk, num_splits, sum(seg[2] for seg in segments))


def plan_msa(
    meta: MSAMetadata,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    config: MSAConfig | None = None,
    short_q_len: int = 16,
    min_split_keys: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    invariant: bool = False,
) -> MSAStepPlan:
    """Builds the step's launches: configs, and tile tables copied to ``device`` (no sync).

    Segments of at most ``short_q_len`` tokens (decodes, one-block holes) form their own launch
    when longer segments share the step (see :class:`MSAStepPlan`). Within a launch, a tile
    whose context is far deeper than the rest is split into chunks of at least
    ``min_split_keys`` keys (the H200 measurement: split-K on prefill tiles pays from ~4k keys
    a chunk). A forced ``config`` (benchmarks, tests) makes one launch of everything.
    ``dtype`` (of ``q``) bounds the tiles by the device's shared memory. ``invariant`` plans
    the batch-invariant mode: :func:`invariant_config` for every launch, the fixed chunk.
    """
    segments = list(meta.host_segments)
    if config is not None:
        return MSAStepPlan((_plan_launch(segments, config, device),))
    long = [seg for seg in segments if seg[2] > short_q_len]
    short = [seg for seg in segments if seg[2] <= short_q_len]
    classes = [c for c in (long, short) if c] or [segments]
    if invariant:
        num_tokens = sum(seg[2] for seg in segments)
        return MSAStepPlan(
            tuple(
                _plan_invariant_launch(
                    c,
                    invariant_config(
                        num_q_heads, num_kv_heads, head_dim, device, dtype,
                        _INVARIANT_ROWS[-1] if c is long else _INVARIANT_ROWS[0],
                    ),
                    device, num_q_heads, num_kv_heads, head_dim, num_tokens,
                )
                for c in classes
            )
        )
    launches = tuple(
        _plan_launch(
            c, _config_for(c, num_q_heads, num_kv_heads, head_dim, device, dtype), device, num_kv_heads,
            min_split_keys,
        )
        for c in classes
    )
    return MSAStepPlan(launches)


def _invariant_splits(
    programs: int, max_ctx: int, num_rows: int, num_q_heads: int, head_dim: int, device: torch.device
) -> int:
    """Grid splits of a batch-invariant launch: the fixed chunks spread over programs when the
    launch cannot fill the GPU and its partials stay small; 1 (in-program merge) otherwise.
    Either way the bits are the same: this only trades programs for partial traffic."""
    splits = -(-max(max_ctx, 1) // INVARIANT_CHUNK)
    # NOTE: from one program per SM on, walking the chunks in-program beat the split on the
    # H200 (a 32-sequence decode graph: 16.7 ms a step in-program, 19.8 ms split 64 ways).
    if splits <= 1 or programs >= _num_sms(device):
        return 1
    if splits * num_rows * num_q_heads * head_dim * 4 > _INVARIANT_PARTIAL_BYTES:
        return 1
    return splits


def _plan_invariant_launch(
    segments: list[tuple[int, int, int, int]],
    cfg: MSAConfig,
    device: torch.device,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
) -> MSAPlan:
    """One batch-invariant launch over ``segments``: ``cfg``'s tiles, the fixed chunk."""
    plan = _plan_launch(segments, cfg, device)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    splits = _invariant_splits(plan.num_tiles * num_kv_heads, max_ctx, num_tokens, num_q_heads, head_dim, device)
    return dataclasses.replace(plan, chunk=INVARIANT_CHUNK, num_splits=splits, invariant=True)


def decode_graph_plan(
    tiles: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    max_context: int,
    chunk_buffer: torch.Tensor | None = None,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    invariant: bool = False,
) -> MSAPlan:
    """A fixed launch for a CUDA-graph decode batch of ``tiles.shape[0]`` sequences.

    The launch may not depend on the step (a graph replays it as captured), so the tile table
    is a static buffer the caller refills before each replay (one ``(i, i, 1, ctx - 1)`` row per
    sequence, ``n_q = 0`` for padding), and the grid's KV splits are sized for ``max_context``:
    splits past a sequence's context do no work, and the merge reads only the splits a tile's
    context reaches. With ``chunk_buffer`` the keys per split are read at run time: the caller
    sets them with :func:`decode_graph_chunk` for the batch it replays, so the splits cover the
    batch's longest context rather than ``max_context``. With ``invariant`` the launch is the
    batch-invariant mode's (fixed chunk; ``chunk_buffer`` is left alone and not read).

    Args:
        tiles: ``[batch, 4]`` int32 device buffer.
        num_q_heads: query heads.
        num_kv_heads: KV heads.
        max_context: longest context a replay may see (the engine's ``max_model_len``).
        chunk_buffer: optional ``[1]`` int32 device buffer of the keys per split.
        head_dim: the heads' width (bounds the tile by shared memory).
        dtype: the queries' dtype.
        invariant: plan the batch-invariant mode.
    """
    batch = int(tiles.shape[0])
    programs = max(batch * num_kv_heads, 1)
    if invariant:
        cfg = invariant_config(num_q_heads, num_kv_heads, head_dim, tiles.device, dtype)
        splits = _invariant_splits(programs, max_context, batch, num_q_heads, head_dim, tiles.device)
        return MSAPlan(cfg, tiles, batch, INVARIANT_CHUNK, splits, 0, None, True)
    g_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    block_m = max(1, 16 // g_pad)
    rows, block_n, num_warps, num_stages = _tile_shape(
        block_m * g_pad, head_dim, _elem_bytes(dtype), _smem_limit(tiles.device)
    )
    block_m = max(1, rows // g_pad)
    splits = _short_tile_splits(programs, max_context, _num_sms(tiles.device))
    chunk, num_splits = _split_chunk(max_context, splits, block_n)
    cfg = MSAConfig(block_m, block_n, num_warps, num_stages, num_splits)
    if chunk_buffer is not None:
        chunk_buffer.fill_(chunk)
    return MSAPlan(cfg, tiles, batch, chunk, num_splits, 0, chunk_buffer)


def decode_graph_chunk(plan: MSAPlan, max_ctx: int) -> int:
    """Keys per split for a replay of a :func:`decode_graph_plan` launch whose longest context
    is ``max_ctx``: the plan's splits spread over that context, in whole KV tiles.

    NOTE: a graph sized for a 128k-token ``max_model_len`` at batch 8 has chunks of ~19k keys;
    on 10-20k-token contexts that left one program per (sequence, KV head) walking the whole
    context alone (measured on the H200). The grid stays as captured: only the chunk
    shrinks, and ``cdiv(max_ctx, chunk) <= num_splits`` still holds.
    """
    if plan.invariant:
        return plan.chunk
    chunk, _ = _split_chunk(max_ctx, plan.num_splits, plan.config.block_n)
    return min(plan.chunk, chunk)


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
    split = num_splits > 1
    part_by_row = plan.invariant
    if split:
        # partial rows are tile-local (tile i owns rows i * block_m ..) or, in the
        # batch-invariant mode, the packed rows: see _msa_fwd_kernel
        part_rows = q.shape[0] if part_by_row else num_tiles * cfg.block_m
        o_part = torch.empty((num_splits, part_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, part_rows, num_q_heads), dtype=torch.float32, device=q.device)
    else:
        o_part = out
        lse_part = out
    bt = block_tables
    dyn_chunk = plan.chunk_buffer is not None
    # NOTE: without a chunk buffer the pointer argument is unused; ``tiles`` stands in for it.
    p_chunk = plan.chunk_buffer if dyn_chunk else tiles
    _msa_fwd_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, o_part, lse_part, bt, tiles,
        float(scale) * _LOG2E, chunk, p_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        o_part.stride(0), o_part.stride(1) if split else 0, o_part.stride(2) if split else 0,
        lse_part.stride(0), lse_part.stride(1) if split else 0,
        PAGE=page, G=group, G_PAD=triton.next_power_of_2(group), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, D=head_dim, SPLIT=split, DYN_CHUNK=dyn_chunk,
        CHUNK_MERGE=plan.invariant and not split, PART_BY_ROW=part_by_row, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        _msa_reduce_kernel[(num_tiles, num_q_heads)](
            out, o_part, lse_part, tiles, chunk, p_chunk, num_splits,
            out.stride(0), out.stride(1),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            BLOCK_M=cfg.block_m, D=head_dim, BLOCK_D=block_d, DYN_CHUNK=dyn_chunk, PART_BY_ROW=part_by_row,
            num_warps=4,
        )


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


__all__ = [
    "MSAConfig",
    "MSAPlan",
    "INVARIANT_CHUNK",
    "MSAStepPlan",
    "choose_config",
    "decode_graph_chunk",
    "decode_graph_plan",
    "invariant_config",
    "msa_triton",
    "plan_msa",
    "store_kv_triton",
]
