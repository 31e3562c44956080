"""Whole KV blocks between the paged cache and a block-major staging buffer, in one pass.

The host KV tier moves blocks through a device staging buffer: a block's pieces (one
``[block_size, H, D]`` slab per layer and K/V) lie ``num_blocks`` slabs apart in the cache, and
one device-host copy per run of blocks needs them side by side. These kernels gather the pieces
of a list of blocks into ``[n, L * 2, P]`` staging (``P = block_size * H * D``), or scatter them
back, reading and writing each byte once.

The grid is a fixed number of programs that stride over the pieces (four per SM by default),
each moving a whole 32 KiB piece per load with 8 warps. The copy runs beside a decode step and
takes SMs and memory bandwidth from it; what costs the step least is a copy that is done
soon. H200, batch-32 decode at 4k beside 512 MiB of copies each way, three runs of
``python scripts/gpu_host_tier.py --only-overlap --copy-launches ...``: the step took
1.16-1.57x its time alone with this launch, 1.66-2.37x with ``torch``'s ``index_select`` and
strided ``copy_`` (the twins here: a grid over every element, and two passes for a gather),
better in every run; alone, it gathers 64 blocks at 1.0-1.2 TB/s, the twins at 0.24-0.27.

Shapes: cache ``[LC, NB, P]`` (the ``[L, 2, NB, block_size, H, D]`` cache viewed with layer and
K/V merged), staging ``[n, LC, P]``, block ids ``[n]`` int64 on the device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency off CUDA
    triton = None


class CopyLaunch(NamedTuple):
    """A launch of the block-copy kernel: programs (they stride over the pieces; ``0``: four
    per SM of the device), elements a program moves per load, warps a program."""

    programs: int = 0
    block: int = 16384
    num_warps: int = 8


DEFAULT_LAUNCH = CopyLaunch()

if triton is not None:

    @triton.jit
    def _block_copy_kernel(
        cache,
        staging,
        block_ids,
        n_pieces,
        LC,
        stride_lc,
        stride_nb,
        P: tl.constexpr,
        BLOCK: tl.constexpr,
        TO_STAGING: tl.constexpr,
    ):
        """Copies pieces ``i_pid, i_pid + num_programs, ...`` of ``n_pieces = n * LC``; piece
        ``i`` is layer-and-K/V ``i % LC`` of block ``block_ids[i // LC]``."""
        i_pid = tl.program_id(0)
        o_p = tl.arange(0, BLOCK)
        for i_piece in range(i_pid, n_pieces, tl.num_programs(0)):
            i_blk = tl.load(block_ids + i_piece // LC)  # int64: the offsets below are too
            i_zero = i_blk * 0
            p_cache = cache + (i_zero + i_piece % LC) * stride_lc + i_blk * stride_nb
            p_stage = staging + (i_zero + i_piece) * P
            for i_0 in range(0, P, BLOCK):
                m_p = (i_0 + o_p) < P
                if TO_STAGING:
                    b_x = tl.load(p_cache + i_0 + o_p, mask=m_p)
                    tl.store(p_stage + i_0 + o_p, b_x, mask=m_p)
                else:
                    b_x = tl.load(p_stage + i_0 + o_p, mask=m_p)
                    tl.store(p_cache + i_0 + o_p, b_x, mask=m_p)


# Programs a launch runs per SM when its configuration leaves the number to the device.
PROGRAMS_PER_SM = 4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of ``device`` (one on the CPU, where the interpreter runs the kernel)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor) -> None:
    if cache.dim() != 3 or staging.dim() != 3:
        raise ValueError(f"cache [LC, NB, P] and staging [n, LC, P] expected, got {tuple(cache.shape)} and {tuple(staging.shape)}")
    if staging.shape[1:] != (cache.shape[0], cache.shape[2]) or staging.shape[0] < block_ids.numel():
        raise ValueError(f"staging {tuple(staging.shape)} does not hold {block_ids.numel()} blocks of cache {tuple(cache.shape)}")
    if cache.stride(2) != 1 or not staging.is_contiguous():
        raise ValueError("cache pieces and staging must be contiguous")


def _launch(cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor, to_staging: bool,
            launch: CopyLaunch) -> None:
    _check(cache, staging, block_ids)
    n_pieces = block_ids.numel() * cache.shape[0]
    if n_pieces == 0:
        return
    piece = cache.shape[2]
    block = min(launch.block, triton.next_power_of_2(piece))
    programs = launch.programs or PROGRAMS_PER_SM * _multiprocessors(cache.device)
    grid = (max(1, min(programs, n_pieces)),)
    _block_copy_kernel[grid](
        cache, staging, block_ids, n_pieces, cache.shape[0], cache.stride(0), cache.stride(1),
        P=piece, BLOCK=block, TO_STAGING=to_staging, num_warps=launch.num_warps,
    )


def gather_blocks_triton(
    cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, launch: CopyLaunch = DEFAULT_LAUNCH
) -> None:
    """``staging[j] = cache[:, block_ids[j]]`` for every ``j < len(block_ids)``.

    Args:
        cache: ``[LC, NB, P]``, each piece contiguous.
        block_ids: ``[n]`` int64 block ids, on the cache's device.
        staging: ``[>= n, LC, P]`` contiguous, the cache's dtype.
        launch: the launch configuration (its programs stride over the ``n * LC`` pieces).
    """
    _launch(cache, staging, block_ids, True, launch)


def scatter_blocks_triton(
    staging: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor, launch: CopyLaunch = DEFAULT_LAUNCH
) -> None:
    """``cache[:, block_ids[j]] = staging[j]`` for every ``j < len(block_ids)`` (the inverse of
    :func:`gather_blocks_triton`; ids must be distinct)."""
    _launch(cache, staging, block_ids, False, launch)


def gather_blocks_torch(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """The twin of :func:`gather_blocks_triton`: ``index_select`` then a strided copy."""
    _check(cache, staging, block_ids)
    staging[: block_ids.numel()].copy_(cache.index_select(1, block_ids).transpose(0, 1))


def scatter_blocks_torch(staging: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    """The twin of :func:`scatter_blocks_triton`: ``index_copy_`` from the transposed staging."""
    _check(cache, staging, block_ids)
    cache.index_copy_(1, block_ids, staging[: block_ids.numel()].transpose(0, 1))


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, launch: CopyLaunch | None = DEFAULT_LAUNCH
) -> None:
    """:func:`gather_blocks_triton` with ``launch``, or its torch twin when ``launch`` is ``None``."""
    if launch is None:
        gather_blocks_torch(cache, block_ids, staging)
    else:
        gather_blocks_triton(cache, block_ids, staging, launch)


def scatter_blocks(
    staging: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor, launch: CopyLaunch | None = DEFAULT_LAUNCH
) -> None:
    """:func:`scatter_blocks_triton` with ``launch``, or its torch twin when ``launch`` is ``None``."""
    if launch is None:
        scatter_blocks_torch(staging, block_ids, cache)
    else:
        scatter_blocks_triton(staging, block_ids, cache, launch)
