"""Top-p (nucleus) cuts without sorting the vocabulary: a search for the cut's value.

A row's top-p keeps its most likely tokens until their probability reaches ``p`` (the token
that reaches it included, the most likely token always). Sorted descending, ``x_1 >= x_2 >= ...``
with probabilities ``q_i``, that is every token at or above ``x_c``, ``c`` the last index whose
mass before it, ``q_1 + ... + q_{c-1}``, is below ``p``. In terms of values: with
``S(t) = sum of q over the tokens above t``, ``S(t) < p`` holds exactly for ``t >= x_c`` (ties
included), so the cut is the least float32 ``t`` with ``S(t) < p``, and a search over the 2**32
float32 values finds it without an order of the tokens.

- :func:`top_p_cut_triton`: one program a row. A pass finds the row's largest and least kept
  logits; then each pass evaluates ``S`` (and how many tokens lie above) at 8 points inside the
  interval left and keeps the gap between the last point where ``S >= p`` and the first where
  ``S < p``: 9-fold narrower a pass, the points spread over the values while the interval is
  wide and over the float32 values (as ordered integers) after. Once the interval holds at most
  ``FEW`` tokens, the pass copies them out and the passes after read those alone: ~4 passes
  over a 128k-token row, where a torch sort is most of a sampled step's extra time
  (BENCHMARKS.md, "Random sampling on the device").
- :func:`top_p_cut_naive`: its torch twin, the sort and its cumulative sum, for any device.

The search runs on the raw logits: dividing by the temperature keeps their order (ties may
merge), so the least raw logit ``x*`` with ``S < p`` gives the scaled cut ``x* / T`` (the
tokens that divide to the same value are the scaled values' tie group, which the sort keeps
whole too), and no token is divided a pass. The probabilities are ``2 ** ((x - top) * log2(e) / T)``.

Shapes: ``logits [N, V]`` (any float dtype, computed in float32), ``temperature [N]`` (> 0),
``cut [N]`` (the least scaled logit the row's other masks keep; ``-inf``: every token) and
``top_p [N]`` float32. Returns each row's cut ``[N]`` float32: the least scaled logit its top-p
keeps over what ``cut`` keeps, renormalized; ``-inf`` for a row with ``top_p >= 1`` or with
nothing kept, ``+inf`` for a row with a ``+inf`` logit (only those stay). NaN logits are never
kept.

NOTE: the two sum the probabilities in their own order (and round their exponentials apart),
so where a row's mass reaches ``p`` within float32 rounding at a tie group's edge they may cut
one group apart; anywhere else they agree exactly.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: vocabulary entries a program reads at once
BLOCK_V = 2048
#: tokens of the interval left copied out, for the passes after to read alone
FEW = 2048


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` in float32, NaN as ``-inf`` (never kept, so it must not set a
    cut either); infinities stay."""
    return torch.nan_to_num(
        logits.float() / temperature[:, None], nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")
    )


def cut_of_sorted(top: torch.Tensor, norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p cut of rows whose kept scaled logits ``top`` are sorted descending (``-inf``
    past them; ``norm``: the log of each row's whole mass, ``[N, 1]``); ``-inf`` for a row
    with ``top_p >= 1``."""
    probs = torch.exp(top - norm)
    before = probs.cumsum(dim=-1) - probs
    # NOTE: the most likely token always stays (a tiny top_p rounds to 0); NaN probabilities
    # (a +inf logit, or nothing kept) count as not reaching p: the first token stays, +inf or -inf
    count = (before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    found = top.gather(1, count - 1).squeeze(1)
    return torch.where(top_p < 1.0, found, float("-inf"))


def top_p_cut_naive(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The reference: each row sorted, its cumulative probabilities, the first token that
    reaches ``top_p`` (see the module's docstring for shapes and edge rows)."""
    scaled = scaled_logits(logits, temperature)
    top = torch.where(scaled >= cut[:, None], scaled, float("-inf")).sort(dim=-1, descending=True).values
    return cut_of_sorted(top, torch.logsumexp(top, dim=-1, keepdim=True), top_p)


if triton is not None:

    @triton.jit
    def _ordered(b_x):
        """float32 -> int32 whose order is the floats' (-0.0 just below 0.0)."""
        b_bits = b_x.to(tl.int32, bitcast=True)
        return tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)

    @triton.jit
    def _value(key):
        """The inverse of :func:`_ordered`."""
        b_bits = key.to(tl.int32)
        return tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_kept(p_row, o_v, V, b_t, b_cut, HAS_CUT: tl.constexpr, INTERPRETED: tl.constexpr):
        """The raw logits kept (``-inf`` elsewhere): not NaN, and at or above the cut once
        divided by the temperature (divided only where some row has a cut)."""
        m_v = o_v < V
        b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        m_kept = m_v & (b_x == b_x)
        if HAS_CUT:
            if INTERPRETED:
                b_scaled = b_x / b_t
            else:
                b_scaled = tl.math.div_rn(b_x, b_t)
            m_kept = m_kept & (b_scaled >= b_cut)
        return tl.where(m_kept, b_x, float("-inf"))

    @triton.jit
    def _point(lo, hi, v_lo, v_hi, wide, J: tl.constexpr):
        """The ``J``-th of the 8 points of a pass inside ``(lo, hi)``, as an int32 key."""
        by_value = _ordered(v_lo + (v_hi - v_lo) * (J / 9.0)).to(tl.int64)
        by_key = lo + ((hi - lo) * J) // 9
        return tl.where(wide, by_value, by_key).to(tl.int32)

    @triton.jit
    def _tally(b_key, b_e, point, b_s, b_c):
        m_above = b_key > point
        return b_s + tl.where(m_above, b_e, 0.0), b_c + m_above.to(tl.int32)

    @triton.jit
    def _tally_points(
        b_key, b_e, t1, t2, t3, t4, t5, t6, t7, t8,
        b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8,
        b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8,
    ):
        """The mass and count of the tokens above each of the 8 points, added to their sums.

        NOTE: 8 one-dimensional sums, not one ``[points, BLOCK]`` tile: the tile's layout held
        each token in several warps (a version with a ``[16, BLOCK]`` tile, dividing each token
        by the temperature too, took 1.5-2.4x as long a call on an H100)."""
        b_s1, b_c1 = _tally(b_key, b_e, t1, b_s1, b_c1)
        b_s2, b_c2 = _tally(b_key, b_e, t2, b_s2, b_c2)
        b_s3, b_c3 = _tally(b_key, b_e, t3, b_s3, b_c3)
        b_s4, b_c4 = _tally(b_key, b_e, t4, b_s4, b_c4)
        b_s5, b_c5 = _tally(b_key, b_e, t5, b_s5, b_c5)
        b_s6, b_c6 = _tally(b_key, b_e, t6, b_s6, b_c6)
        b_s7, b_c7 = _tally(b_key, b_e, t7, b_s7, b_c7)
        b_s8, b_c8 = _tally(b_key, b_e, t8, b_s8, b_c8)
        return b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8, b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8

    @triton.jit
    def _narrow(point, s, c, bound, lo, hi, s_hi, n_lo, n_hi):
        """One point's verdict: below the bound, the interval ends there (the least such point
        wins, the points visited from the top down); else it starts there (the largest wins,
        visited from the bottom up)."""
        below = s < bound
        return (
            tl.where(below, lo, point.to(tl.int64)),
            tl.where(below, point.to(tl.int64), hi),
            tl.where(below, s, s_hi),
            tl.where(below, n_lo, c),
            tl.where(below, c, n_hi),
        )

    @triton.jit
    def _top_p_kernel(
        p_logits,
        p_temperature,
        p_cut,
        p_top_p,
        p_out,
        p_few_key,
        p_few_e,
        p_stats,
        V,
        s_logits_n,
        BLOCK: tl.constexpr,
        CAP: tl.constexpr,
        HAS_CUT: tl.constexpr,
        STATS: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        i_n = tl.program_id(0)
        p_row = p_logits + i_n.to(tl.int64) * s_logits_n
        p_row_key = p_few_key + i_n.to(tl.int64) * CAP
        p_row_e = p_few_e + i_n.to(tl.int64) * CAP
        b_t = tl.load(p_temperature + i_n)
        b_cut = tl.load(p_cut + i_n)
        b_p = tl.load(p_top_p + i_n)
        o_b = tl.arange(0, BLOCK)
        # the row's largest and least kept logits, and how many are kept
        b_hi = tl.full([BLOCK], float("-inf"), tl.float32)
        b_lo = tl.full([BLOCK], float("inf"), tl.float32)
        b_n = tl.zeros([BLOCK], tl.int32)
        for i_v in range(0, V, BLOCK):
            b_x = _load_kept(p_row, i_v + o_b, V, b_t, b_cut, HAS_CUT, INTERPRETED)
            b_hi = tl.maximum(b_hi, b_x)
            b_lo = tl.minimum(b_lo, tl.where(b_x > float("-inf"), b_x, float("inf")))
            b_n += (b_x > float("-inf")).to(tl.int32)
        top = tl.max(b_hi, axis=0)
        least = tl.min(b_lo, axis=0)
        finite = (top > float("-inf")) & (top < float("inf"))
        shift = tl.where(finite, top, 0.0)
        scale = 1.4426950408889634 / b_t
        # the search: S(hi) < p always (nothing lies above the top); S(lo) >= p or lo is just
        # below the least kept logit, so the answer lies in (lo, hi]. Along: S(hi) and how
        # many tokens lie above lo and above hi; the mass is summed by the first pass
        hi = _ordered(top).to(tl.int64)
        lo = _ordered(least).to(tl.int64) - 1
        lo = tl.where(finite & (b_p < 1.0), lo, hi - 1)
        # NOTE: each carried scalar starts from its own expression: compiled (Triton 3.6), two
        # names bound to one value before the loop lost an assignment inside it
        s_hi = b_p * 0.0
        bound = b_p * 0.0 + 1.0
        n_lo = tl.sum(b_n, axis=0)
        n_hi = n_lo * 0
        # once the interval holds at most CAP tokens they are copied out, and the passes after
        # read those alone (S is then s_few, at the interval's top then, plus their part)
        few = n_lo * 0
        n_few = n_lo * 0
        s_few = b_p * 0.0 + 2.0
        passes = n_lo * 0
        full = n_lo * 0
        while hi - lo > 1:
            passes += 1
            # NOTE: the points lie strictly inside (lo, hi) whenever hi - lo >= 2, so each pass
            # shrinks it; spread evenly over the values while it is wide (fewer tokens left
            # after a pass than over the float32 values), over the float32 values after
            v_lo = _value(lo)
            v_hi = _value(hi)
            wide = (hi - lo > 4194304) & (v_hi - v_lo <= 4096.0)
            t1 = _point(lo, hi, v_lo, v_hi, wide, 1)
            t2 = _point(lo, hi, v_lo, v_hi, wide, 2)
            t3 = _point(lo, hi, v_lo, v_hi, wide, 3)
            t4 = _point(lo, hi, v_lo, v_hi, wide, 4)
            t5 = _point(lo, hi, v_lo, v_hi, wide, 5)
            t6 = _point(lo, hi, v_lo, v_hi, wide, 6)
            t7 = _point(lo, hi, v_lo, v_hi, wide, 7)
            t8 = _point(lo, hi, v_lo, v_hi, wide, 8)
            b_s1 = tl.zeros([BLOCK], tl.float32)
            b_s2 = tl.zeros([BLOCK], tl.float32)
            b_s3 = tl.zeros([BLOCK], tl.float32)
            b_s4 = tl.zeros([BLOCK], tl.float32)
            b_s5 = tl.zeros([BLOCK], tl.float32)
            b_s6 = tl.zeros([BLOCK], tl.float32)
            b_s7 = tl.zeros([BLOCK], tl.float32)
            b_s8 = tl.zeros([BLOCK], tl.float32)
            b_c1 = tl.zeros([BLOCK], tl.int32)
            b_c2 = tl.zeros([BLOCK], tl.int32)
            b_c3 = tl.zeros([BLOCK], tl.int32)
            b_c4 = tl.zeros([BLOCK], tl.int32)
            b_c5 = tl.zeros([BLOCK], tl.int32)
            b_c6 = tl.zeros([BLOCK], tl.int32)
            b_c7 = tl.zeros([BLOCK], tl.int32)
            b_c8 = tl.zeros([BLOCK], tl.int32)
            b_z = tl.zeros([BLOCK], tl.float32)
            if few == 1:
                for i_f in range(0, n_few, BLOCK):
                    m_f = i_f + o_b < n_few
                    # NOTE: volatile: the copies were stored by this program, and a cached
                    # or read-only path may not see them (it did not, compiled for an H100)
                    b_key = tl.load(p_row_key + i_f + o_b, mask=m_f, other=-2147483647, volatile=True)
                    b_e = tl.load(p_row_e + i_f + o_b, mask=m_f, other=0.0, volatile=True)
                    (b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8,
                     b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8) = _tally_points(
                        b_key, b_e, t1, t2, t3, t4, t5, t6, t7, t8,
                        b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8,
                        b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8,
                    )
                base = s_few
            else:
                copy = n_lo - n_hi <= CAP
                full += 1
                o_few = n_lo * 0
                for i_v in range(0, V, BLOCK):
                    b_x = _load_kept(p_row, i_v + o_b, V, b_t, b_cut, HAS_CUT, INTERPRETED)
                    b_e = tl.exp2((b_x - shift) * scale)
                    b_z += b_e
                    b_key = _ordered(b_x)
                    (b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8,
                     b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8) = _tally_points(
                        b_key, b_e, t1, t2, t3, t4, t5, t6, t7, t8,
                        b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, b_s7, b_s8,
                        b_c1, b_c2, b_c3, b_c4, b_c5, b_c6, b_c7, b_c8,
                    )
                    if copy:
                        m_in = (b_key > lo) & (b_key <= hi)
                        o_in = o_few + tl.cumsum(m_in.to(tl.int32), axis=0) - 1
                        tl.store(p_row_key + o_in, b_key, mask=m_in)
                        tl.store(p_row_e + o_in, b_e, mask=m_in)
                        o_few += tl.sum(m_in.to(tl.int32), axis=0)
                if passes == 1:
                    bound = b_p * tl.sum(b_z, axis=0)
                if copy:
                    few = n_lo * 0 + 1
                    n_few = o_few
                    s_few = s_hi
                    # NOTE: the passes after read what other threads of the program wrote
                    tl.debug_barrier()
                base = 0.0 * s_hi
            s1 = base + tl.sum(b_s1, axis=0)
            s2 = base + tl.sum(b_s2, axis=0)
            s3 = base + tl.sum(b_s3, axis=0)
            s4 = base + tl.sum(b_s4, axis=0)
            s5 = base + tl.sum(b_s5, axis=0)
            s6 = base + tl.sum(b_s6, axis=0)
            s7 = base + tl.sum(b_s7, axis=0)
            s8 = base + tl.sum(b_s8, axis=0)
            c1 = tl.sum(b_c1, axis=0)
            c2 = tl.sum(b_c2, axis=0)
            c3 = tl.sum(b_c3, axis=0)
            c4 = tl.sum(b_c4, axis=0)
            c5 = tl.sum(b_c5, axis=0)
            c6 = tl.sum(b_c6, axis=0)
            c7 = tl.sum(b_c7, axis=0)
            c8 = tl.sum(b_c8, axis=0)
            # the least point below the bound ends the interval: visited from the top down
            # (a point's verdict on lo is kept only if it is not below, so order does not matter
            # for lo as long as the largest not-below point comes last: bottom up)
            new_lo, new_hi, s_hi, n_lo, n_hi = lo, hi, s_hi, n_lo, n_hi
            _, new_hi, s_hi, _, n_hi = _narrow(t8, s8, c8, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t7, s7, c7, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t6, s6, c6, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t5, s5, c5, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t4, s4, c4, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t3, s3, c3, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t2, s2, c2, bound, lo, new_hi, s_hi, n_lo, n_hi)
            _, new_hi, s_hi, _, n_hi = _narrow(t1, s1, c1, bound, lo, new_hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t1, s1, c1, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t2, s2, c2, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t3, s3, c3, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t4, s4, c4, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t5, s5, c5, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t6, s6, c6, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t7, s7, c7, bound, new_lo, hi, s_hi, n_lo, n_hi)
            new_lo, _, _, n_lo, _ = _narrow(t8, s8, c8, bound, new_lo, hi, s_hi, n_lo, n_hi)
            if STATS:
                p_trace = p_stats + i_n * 260 + 4 + passes * 16 - 16
                tl.store(p_trace, lo.to(tl.int32))
                tl.store(p_trace + 1, hi.to(tl.int32))
                tl.store(p_trace + 2, new_lo.to(tl.int32))
                tl.store(p_trace + 3, new_hi.to(tl.int32))
                tl.store(p_trace + 4, t1)
                tl.store(p_trace + 5, t8)
                tl.store(p_trace + 6, s1.to(tl.int32, bitcast=True))
                tl.store(p_trace + 7, s8.to(tl.int32, bitcast=True))
                tl.store(p_trace + 8, bound.to(tl.int32, bitcast=True))
                tl.store(p_trace + 9, base.to(tl.int32, bitcast=True))
                tl.store(p_trace + 10, few)
                tl.store(p_trace + 11, n_few)
                tl.store(p_trace + 12, c1)
                tl.store(p_trace + 13, c8)
            lo = new_lo
            hi = new_hi
        if INTERPRETED:
            found = _value(hi) / b_t
        else:
            found = tl.math.div_rn(_value(hi), b_t)
        if STATS:
            tl.store(p_stats + i_n * 260, passes)
            tl.store(p_stats + i_n * 260 + 1, full)
            tl.store(p_stats + i_n * 260 + 2, n_few)
            tl.store(p_stats + i_n * 260 + 3, few)
        tl.store(p_out + i_n, tl.where(b_p < 1.0, found, float("-inf")))


def top_p_cut_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    top_p: torch.Tensor,
    has_cut: bool = True,
    num_warps: int = 16,
    block: int = BLOCK_V,
    stats: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The search in one launch, a program a row (see the module's docstring).

    Args:
        logits: ``[N, V]``, rows contiguous in their last dim.
        temperature: ``[N]`` float32, > 0.
        cut: ``[N]`` float32.
        top_p: ``[N]`` float32 in ``(0, 1]``.
        has_cut: whether some row's ``cut`` is finite (else no token is divided: the caller
            knows it without waiting for the device).
        num_warps: warps a program.
        block: tokens a program reads at once (a power of two).
        stats: ``[N, 260]`` int32 to fill with each row's passes, passes over the whole row,
            tokens copied out and whether they were, then 16 ints a pass (the interval before
            and after, the first and last points, their sums' bits, the bound's...): the
            benchmark's and the debugging's, or ``None``.
        scratch: ``[N, FEW]`` int32 and float32 for the tokens copied out (the tests'), or
            ``None`` (new ones).

    Returns:
        ``[N]`` float32, each row's top-p cut.
    """
    if triton is None:  # pragma: no cover - guarded by the callers
        raise RuntimeError("top_p_cut_triton: triton is not installed")
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if scratch is None:
        scratch = (torch.empty((n, FEW), dtype=torch.int32, device=logits.device),
                   torch.empty((n, FEW), dtype=torch.float32, device=logits.device))
    few_key, few_e = scratch
    _top_p_kernel[(n,)](
        logits, temperature.contiguous(), cut.contiguous(), top_p.contiguous(), out, few_key, few_e,
        out if stats is None else stats, vocab, logits.stride(0),
        BLOCK=block, CAP=FEW, HAS_CUT=has_cut, STATS=stats is not None, INTERPRETED=_INTERPRETED, num_warps=num_warps,
    )
    return out
