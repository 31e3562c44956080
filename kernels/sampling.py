"""A categorical draw per row of logits, keyed by a counter: the Gumbel-max race.

A row's token is ``argmax_v (x_v / T + G_v)`` over the tokens kept by its cut
(``x_v / T >= cut``), with ``G_v = -log(-log(u_v))`` independent Gumbel draws: it lands on
``v`` with probability ``softmax(x / T)_v`` renormalized over the kept tokens (vLLM's sampler
draws the same way, as ``argmax(p / Exp(1))``), and needs neither the softmax nor its max. Here
``u_v`` is a counter-based hash of the row's two 32-bit keys and of ``v``, not the output of a
generator: a row's draw is a function of its keys, logits, temperature and cut only, never of
the other rows of the batch nor of a draw before it, so one launch serves rows of any seeds, and
a token recomputed after an eviction is drawn again the same.

- :func:`gumbel_argmax_triton`: one launch over a ``(row, chunk)`` grid (``CHUNK`` tokens a
  program) that reads the logits once and writes each chunk's best score and index; the row's
  token is the best among them (ties to the lower index, as ``torch.argmax``).
- :func:`gumbel_argmax_naive`: its torch twin (the same integer hash and float32 steps), for
  any device; the tests compare the two.
- :func:`row_keys_array`: the rows' keys from their 64-bit seeds and the indices of their
  draws (:func:`row_keys`: one row).

Shapes: ``logits [N, V]`` (any float dtype, computed in float32), ``temperature [N]`` and
``cut [N]`` float32 (``-inf``: every token kept), ``keys [N, 2]`` int64 holding 32-bit values.
A logit that is NaN is never drawn; a row with nothing left scores ``-inf`` everywhere.

NOTE: the hash works on 32-bit values held in int64, and multiplies by 16-bit halves so that no
product overflows: the same bits on the CPU, under the interpreter and compiled. The logs and
the division are the exactly rounded ones torch runs (libdevice's ``log``, ``div_rn``): the
winners are short draws (``u`` near 1, ``-log(u)`` near 0), where an approximate log loses
every digit, and so the kernel draws the twin's tokens on the same device.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None

#: under Triton's interpreter (the CPU tests), whose ``tl.log`` is numpy's: libdevice is not there
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: the two multipliers of the 32-bit mix (Wellons' "lowbias32"), split in 16-bit halves
_M1_LO, _M1_HI = 0x7FEB352D & 0xFFFF, 0x7FEB352D >> 16
_M2_LO, _M2_HI = 0x846CA68B & 0xFFFF, 0x846CA68B >> 16
_MASK32 = 0xFFFFFFFF
#: vocabulary entries per program of the Triton race
CHUNK = 2048


def _mix32_array(x: np.ndarray) -> np.ndarray:
    """The 32-bit mix (Wellons' "lowbias32", a bijection of ``[0, 2**32)``) of uint64 values.

    NOTE: uint64 products wrap modulo 2**64, whose low 32 bits are the 32-bit product's.
    """
    x = x & _MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


def row_keys_array(seeds: list[int], draws: list[int]) -> np.ndarray:
    """The two 32-bit keys of each row's draw: ``[N, 2]`` int64.

    Args:
        seeds: each row's seed in ``[0, 2**64)``.
        draws: which of the row's draws (its output token's index).
    """
    seed = np.array(seeds, dtype=np.uint64)
    draw = np.array(draws, dtype=np.uint64)
    mask = np.uint64(_MASK32)
    d = _mix32_array(draw & mask) ^ _mix32_array((draw >> np.uint64(32)) ^ np.uint64(0x9E3779B9))
    k0 = _mix32_array((seed & mask) ^ d)
    # NOTE: the second key depends on the whole seed and draw too (a uniform can be taken from
    # it alone)
    k1 = _mix32_array(((seed >> np.uint64(32)) & mask) ^ _mix32_array(k0 ^ np.uint64(0x85EBCA6B)))
    return np.stack([k0, k1], axis=1).astype(np.int64)


def row_keys(seed: int, draw: int) -> tuple[int, int]:
    """:func:`row_keys_array` of one row."""
    k0, k1 = row_keys_array([seed], [draw])[0].tolist()
    return k0, k1


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


def gumbel_scores_naive(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """The race's scores ``[N, V]`` float32: ``x / T + G`` where kept, ``-inf`` elsewhere."""
    scaled = logits.float() / temperature[:, None]
    kept = scaled >= cut[:, None]  # NOTE: False for a NaN logit
    gumbel = -torch.log(-torch.log(race_uniforms_naive(keys, logits.shape[-1])))
    return torch.where(kept, scaled + gumbel, float("-inf"))


def gumbel_argmax_naive(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """The reference race: ``[N]`` int64 tokens."""
    return gumbel_scores_naive(logits, temperature, cut, keys).argmax(dim=-1)


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
        p_logits,
        p_temperature,
        p_cut,
        p_keys,
        p_score,
        p_index,
        V,
        s_logits_n,
        S: tl.constexpr,
        BLOCK_V: tl.constexpr,
        M1_LO: tl.constexpr,
        M1_HI: tl.constexpr,
        M2_LO: tl.constexpr,
        M2_HI: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        i_n = tl.program_id(0)
        i_s = tl.program_id(1)
        k0 = tl.load(p_keys + i_n * 2)
        k1 = tl.load(p_keys + i_n * 2 + 1)
        b_t = tl.load(p_temperature + i_n)
        b_cut = tl.load(p_cut + i_n)
        o_v = i_s * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_x = tl.load(p_logits + i_n * s_logits_n + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        b_x = tl.math.div_rn(b_x, b_t)
        h = _mix32(o_v.to(tl.int64) ^ k0, M1_LO, M1_HI, M2_LO, M2_HI)
        h = _mix32(h ^ k1, M1_LO, M1_HI, M2_LO, M2_HI)
        b_u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if INTERPRETED:
            b_g = -tl.log(-tl.log(b_u))
        else:
            b_g = -libdevice.log(-libdevice.log(b_u))
        b_score = tl.where(m_v & (b_x >= b_cut), b_x + b_g, float("-inf"))
        i_best = tl.argmax(b_score, axis=0, tie_break_left=True)
        tl.store(p_score + i_n * S + i_s, tl.max(b_score, axis=0))
        tl.store(p_index + i_n * S + i_s, i_s * BLOCK_V + i_best)


def gumbel_argmax_triton(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The race in one launch (plus a ``[N, V / CHUNK]`` argmax).

    Args:
        logits: ``[N, V]``, rows contiguous in their last dim.
        temperature: ``[N]`` float32, > 0.
        cut: ``[N]`` float32, the least scaled logit kept.
        keys: ``[N, 2]`` int64 (see :func:`row_keys`), on the same device.

    Returns:
        ``[N]`` int64 tokens, and ``[N]`` float32 best scores (``-inf``: nothing to draw).
    """
    if triton is None:  # pragma: no cover - guarded by the callers
        raise RuntimeError("gumbel_argmax_triton: triton is not installed")
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    splits = triton.cdiv(vocab, CHUNK)
    score = torch.empty((n, splits), dtype=torch.float32, device=logits.device)
    index = torch.empty((n, splits), dtype=torch.int64, device=logits.device)
    _race_kernel[(n, splits)](
        logits, temperature.contiguous(), cut.contiguous(), keys.contiguous(), score, index, vocab, logits.stride(0),
        S=splits, BLOCK_V=CHUNK, M1_LO=_M1_LO, M1_HI=_M1_HI, M2_LO=_M2_LO, M2_HI=_M2_HI, INTERPRETED=_INTERPRETED,
    )
    best, chunk = score.max(dim=-1, keepdim=True)
    return index.gather(1, chunk).squeeze(1), best.squeeze(1)
