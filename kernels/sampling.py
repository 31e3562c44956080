"""A categorical draw per row, keyed by a counter: the exponential race.

A row's token is ``argmax_v p_v / E_v`` with ``E_v = -log(u_v)`` independent Exp(1) draws: the
first of ``V`` exponential clocks of rates ``p_v`` to ring, which lands on ``v`` with
probability ``p_v / sum(p)`` (the Gumbel-max trick in another form; vLLM's sampler draws the
same way). Here ``u_v`` is a counter-based hash of the row's two 32-bit keys and of ``v``, not
the output of a generator: a row's draw is a function of its keys and its probabilities only,
never of the other rows of the batch nor of a draw before it, so one launch serves rows of any
seeds, and a token recomputed after an eviction is drawn again the same.

- :func:`exponential_race_triton`: one launch, the vocabulary split into chunks of
  ``CHUNK`` tokens over a ``(row, chunk)`` grid; each program writes its chunk's best score and
  index, and the row's token is the first chunk's best among the best (ties to the lower index,
  as ``torch.argmax``).
- :func:`exponential_race_naive`: its torch twin (the same integer hash and float32 steps),
  for any device; the tests compare the two.
- :func:`row_keys`: a row's keys from its 64-bit seed and the index of its draw.

Shapes: ``probs [N, V]`` float32 (rows need not sum to one; a zero is never drawn),
``keys [N, 2]`` int64 holding 32-bit values.

NOTE: the hash works on 32-bit values held in int64, and multiplies by 16-bit halves so that no
product overflows: the same bits on the CPU, under the interpreter and compiled.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None

#: the two multipliers of the 32-bit mix (Wellons' "lowbias32"), split in 16-bit halves
_M1_LO, _M1_HI = 0x7FEB352D & 0xFFFF, 0x7FEB352D >> 16
_M2_LO, _M2_HI = 0x846CA68B & 0xFFFF, 0x846CA68B >> 16
_MASK32 = 0xFFFFFFFF
#: vocabulary entries per program of the Triton race
CHUNK = 2048


def mix32(x: int) -> int:
    """The 32-bit mix of ``x`` (a bijection of ``[0, 2**32)``)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: int, draw: int) -> tuple[int, int]:
    """The two 32-bit keys of draw number ``draw`` of a row seeded with ``seed``.

    Args:
        seed: the row's seed in ``[0, 2**64)``.
        draw: which of the row's draws (its output token's index).
    """
    d = mix32(draw & _MASK32) ^ mix32((draw >> 32) ^ 0x9E3779B9)
    k0 = mix32((seed & _MASK32) ^ d)
    # NOTE: the second key depends on the whole seed and draw too (a 32-bit generator seed can
    # be taken from it alone)
    return k0, mix32(((seed >> 32) & _MASK32) ^ mix32(k0 ^ 0x85EBCA6B))


def _mul32_torch(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32_torch(x, _M1_LO, _M1_HI)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, _M2_LO, _M2_HI)
    return x ^ (x >> 16)


def race_uniforms_naive(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's uniforms ``u [N, V]`` in ``(0, 1)``, float32: ``mix(mix(v ^ k0) ^ k1)``'s top
    24 bits, centred in their interval."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    h = _mix32_torch(_mix32_torch(v ^ keys[:, :1]) ^ keys[:, 1:])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def exponential_race_naive(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The reference race: ``[N]`` int64 tokens of ``probs [N, V]`` keyed by ``keys [N, 2]``."""
    exp_draws = -torch.log(race_uniforms_naive(keys, probs.shape[-1]))
    return (probs.float() / exp_draws).argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _mul32(x, lo: tl.constexpr, hi: tl.constexpr):
        return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _mix32(x, m1_lo: tl.constexpr, m1_hi: tl.constexpr, m2_lo: tl.constexpr, m2_hi: tl.constexpr):
        x = x ^ (x >> 16)
        x = _mul32(x, m1_lo, m1_hi)
        x = x ^ (x >> 15)
        x = _mul32(x, m2_lo, m2_hi)
        return x ^ (x >> 16)

    @triton.jit
    def _race_kernel(
        p_probs,
        p_keys,
        p_score,
        p_index,
        V,
        s_probs_n,
        S: tl.constexpr,
        BLOCK_V: tl.constexpr,
        M1_LO: tl.constexpr,
        M1_HI: tl.constexpr,
        M2_LO: tl.constexpr,
        M2_HI: tl.constexpr,
    ):
        i_n = tl.program_id(0)
        i_s = tl.program_id(1)
        k0 = tl.load(p_keys + i_n * 2)
        k1 = tl.load(p_keys + i_n * 2 + 1)
        o_v = i_s * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_p = tl.load(p_probs + i_n * s_probs_n + o_v, mask=m_v, other=0.0).to(tl.float32)
        h = _mix32(o_v.to(tl.int64) ^ k0, M1_LO, M1_HI, M2_LO, M2_HI)
        h = _mix32(h ^ k1, M1_LO, M1_HI, M2_LO, M2_HI)
        b_u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        b_score = b_p / -tl.log(b_u)
        b_score = tl.where(m_v, b_score, -1.0)
        i_best = tl.argmax(b_score, axis=0, tie_break_left=True)
        tl.store(p_score + i_n * S + i_s, tl.max(b_score, axis=0))
        tl.store(p_index + i_n * S + i_s, i_s * BLOCK_V + i_best)


def exponential_race_triton(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race in one launch (plus a ``[N, V / CHUNK]`` argmax): ``[N]`` int64 tokens.

    Args:
        probs: ``[N, V]`` float32 (or half), rows contiguous in their last dim.
        keys: ``[N, 2]`` int64 (see :func:`row_keys`), on the same device.
    """
    if triton is None:  # pragma: no cover - guarded by the callers
        raise RuntimeError("exponential_race_triton: triton is not installed")
    n, vocab = probs.shape
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    splits = triton.cdiv(vocab, CHUNK)
    score = torch.empty((n, splits), dtype=torch.float32, device=probs.device)
    index = torch.empty((n, splits), dtype=torch.int64, device=probs.device)
    _race_kernel[(n, splits)](
        probs, keys.contiguous(), score, index, vocab, probs.stride(0), S=splits, BLOCK_V=CHUNK,
        M1_LO=_M1_LO, M1_HI=_M1_HI, M2_LO=_M2_LO, M2_HI=_M2_HI,
    )
    return index.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
