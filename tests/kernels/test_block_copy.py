"""The block gather/scatter kernels of the host tier against their torch twins, bit for bit."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def _case(device: str, dtype: torch.dtype, piece: int, layers_kv: int = 6, num_blocks: int = 40, n: int = 9):
    gen = torch.Generator().manual_seed(piece + n)
    cache = torch.randn(layers_kv, num_blocks, piece, generator=gen).to(dtype).to(device)
    ids = torch.randperm(num_blocks, generator=gen)[:n].to(device)
    return cache, ids


def _check(mod: ModuleType, device: str, dtype: torch.dtype, piece: int, programs: int, block: int = 4096) -> None:
    launch = mod.CopyLaunch(programs, block, 4)
    cache, ids = _case(device, dtype, piece)
    n = ids.numel()
    # a staging buffer larger than the blocks moved: rows past ``n`` must stay untouched
    staging = torch.full((n + 3, cache.shape[0], piece), 7.0, dtype=dtype, device=device)
    expected = staging.clone()
    mod.gather_blocks_torch(cache, ids, expected)
    mod.gather_blocks_triton(cache, ids, staging, launch)
    assert torch.equal(staging, expected)
    dispatched = torch.full_like(staging, 7.0)
    mod.gather_blocks(cache, ids, dispatched, None)  # ``None``: the twin
    assert torch.equal(dispatched, expected)
    assert torch.equal(staging[n:], torch.full_like(staging[n:], 7.0))

    # scatter: fresh contents into the same blocks; every other block unchanged
    source = torch.randn(n, cache.shape[0], piece, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    ours, theirs = cache.clone(), cache.clone()
    mod.scatter_blocks_triton(source, ids, ours, launch)
    mod.scatter_blocks_torch(source, ids, theirs)
    assert torch.equal(ours, theirs)
    via_dispatch = cache.clone()
    mod.scatter_blocks(source, ids, via_dispatch, launch)
    assert torch.equal(via_dispatch, theirs)
    untouched = torch.ones(cache.shape[1], dtype=torch.bool)
    untouched[ids.cpu()] = False
    assert torch.equal(ours[:, untouched.to(device)], cache[:, untouched.to(device)])
    # the round trip gives the staging rows back
    back = torch.zeros_like(source)
    mod.gather_blocks_triton(ours, ids, back, launch)
    assert torch.equal(back, source)


# pieces: a power of two below one load, one that is not (SmolLM2: 16 x 3 x 64 = 3,072), and
# one of several loads with a remainder; programs: fewer than the pieces, and more
@pytest.mark.parametrize("piece,programs,block", [(256, 4, 4096), (3072, 1, 1024), (9000, 7, 4096), (64, 200, 16)])
def test_block_copy_interpreter(interp_copy: ModuleType, piece: int, programs: int, block: int) -> None:
    _check(interp_copy, "cpu", torch.float32, piece, programs, block)


def test_block_copy_rejects_mismatched_shapes(interp_copy: ModuleType) -> None:
    cache, ids = _case("cpu", torch.float32, 64)
    with pytest.raises(ValueError, match="does not hold"):
        interp_copy.gather_blocks_triton(cache, ids, torch.zeros(2, cache.shape[0], 64))
    with pytest.raises(ValueError, match="contiguous"):
        interp_copy.gather_blocks_triton(cache[:, :, ::2], ids, torch.zeros(ids.numel(), cache.shape[0], 32))


def test_block_copy_empty_is_a_no_op(interp_copy: ModuleType) -> None:
    cache, _ = _case("cpu", torch.float32, 64)
    staging = torch.zeros(2, cache.shape[0], 64)
    interp_copy.gather_blocks_triton(cache, torch.zeros(0, dtype=torch.long), staging)
    assert not staging.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "piece,programs,block", [(16 * 8 * 128, 32, 4096), (16 * 8 * 128, 132, 16384), (3072, 5, 1024), (9000, 64, 4096)]
)
def test_block_copy_gpu(compiled_copy: ModuleType, dtype: torch.dtype, piece: int, programs: int, block: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(compiled_copy, "cuda", dtype, piece, programs, block)
