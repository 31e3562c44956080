"""The exponential race's Triton kernel against its torch twin.

- CPU: the kernel under ``TRITON_INTERPRET=1``.
- GPU (``-m gpu``): the compiled kernel, and the whole random-sampling path on CUDA against the
  twin's draws.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.sampling import CHUNK, exponential_race_naive, row_keys


def _case(rows: int, vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 4, dim=-1)
    probs[0, vocab // 3 :] = 0.0  # a masked tail
    probs[-1, :] = 0.0
    probs[-1, vocab - 1] = 1.0  # the last token only, in the last chunk
    keys = torch.tensor([row_keys(seed * 1000 + r, r * 7) for r in range(rows)], dtype=torch.int64)
    return probs.to(device), keys.to(device)


@pytest.mark.parametrize("vocab", [100, CHUNK, 3 * CHUNK + 17])
def test_race_kernel_matches_its_twin_interpreted(interp_sampling: ModuleType, vocab: int) -> None:
    probs, keys = _case(6, vocab, "cpu", seed=vocab)
    tokens = interp_sampling.exponential_race_triton(probs, keys)
    assert torch.equal(tokens, exponential_race_naive(probs, keys))
    assert int(tokens[-1]) == vocab - 1
    assert all(float(probs[r, int(t)]) > 0 for r, t in enumerate(tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49_152, 128_256, 151_936])
def test_race_kernel_matches_its_twin_gpu(compiled_sampling: ModuleType, vocab: int) -> None:
    probs, keys = _case(32, vocab, "cuda", seed=vocab)
    tokens = compiled_sampling.exponential_race_triton(probs, keys)
    assert torch.equal(tokens, exponential_race_naive(probs, keys))
    assert int(tokens[-1]) == vocab - 1


@pytest.mark.gpu
def test_random_rows_on_cuda_draw_by_the_kernel_and_stay_in_their_masks() -> None:
    from asymcache_core.batched_sampling import RowSettings, masked_probs, sample_rows
    from asymcache_core.sampling_params import SamplingParams

    logits = torch.randn(8, 128_256, generator=torch.Generator().manual_seed(1)).cuda() * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50 if i % 2 else 0, seed=i) for i in range(8)]
    settings = RowSettings(params, list(range(8)), [3] * 8)
    drawn = sample_rows(logits, settings)
    probs = masked_probs(logits, params)
    keys = torch.tensor([row_keys(i, 3) for i in range(8)], dtype=torch.int64, device="cuda")
    assert torch.equal(drawn.tokens, exponential_race_naive(probs, keys))
    assert not drawn.failed.any()
    assert (probs.gather(1, drawn.tokens[:, None]) > 0).all()
