"""The Gumbel-max race's Triton kernel against its torch twin.

- CPU: the kernel under ``TRITON_INTERPRET=1``.
- GPU (``-m gpu``): the compiled kernel, and the whole random-sampling path on CUDA against the
  twin's draws.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.sampling import CHUNK, gumbel_argmax_naive, gumbel_scores_naive, row_keys

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _case(rows: int, vocab: int, device: str, seed: int = 0) -> Case:
    """Logits with a NaN, a row with nothing but its last token, a row with nothing at all;
    temperatures from 0.3 to 1.5; cuts off, in the middle and at the top."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[0, vocab // 3 :] = float("-inf")  # a masked tail
    logits[1, 5] = float("nan")
    logits[-2, :] = float("-inf")
    logits[-2, vocab - 1] = 0.0  # the last token only, in the last chunk
    logits[-1, :] = float("-inf")  # nothing to draw
    temperature = 0.3 + 1.2 * torch.rand(rows, generator=gen)
    cut = torch.full((rows,), float("-inf"))
    cut[2] = 0.0
    cut[3] = float((logits[3] / temperature[3]).max())
    keys = torch.tensor([row_keys(seed * 1000 + r, r * 7) for r in range(rows)], dtype=torch.int64)
    return logits.to(device), temperature.to(device), cut.to(device), keys.to(device)


def _check(tokens: torch.Tensor, best: torch.Tensor, case: Case) -> None:
    logits, temperature, cut, keys = case
    scores = gumbel_scores_naive(*case)
    assert torch.equal(tokens[:-1], gumbel_argmax_naive(*case)[:-1])
    # NOTE: the interpreter's log is numpy's, torch's CPU log another: scores agree to the ulp
    torch.testing.assert_close(best, scores.max(dim=-1).values, rtol=1e-6, atol=0.0)
    assert int(tokens[-2]) == logits.shape[-1] - 1 and float(best[-1]) == float("-inf")
    assert int(tokens[3]) == int((logits[3] / temperature[3]).argmax())  # the cut at the top keeps one


@pytest.mark.parametrize("vocab", [100, CHUNK, 3 * CHUNK + 17])
def test_race_kernel_matches_its_twin_interpreted(interp_sampling: ModuleType, vocab: int) -> None:
    case = _case(7, vocab, "cpu", seed=vocab)
    _check(*interp_sampling.gumbel_argmax_triton(*case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49_152, 128_256, 151_936])
def test_race_kernel_matches_its_twin_gpu(compiled_sampling: ModuleType, vocab: int) -> None:
    case = _case(32, vocab, "cuda", seed=vocab)
    _check(*compiled_sampling.gumbel_argmax_triton(*case), case)


@pytest.mark.gpu
def test_random_rows_on_cuda_draw_by_the_kernel_and_stay_in_their_masks() -> None:
    from asymcache_core.batched_sampling import RowSettings, row_cuts, sample_rows
    from asymcache_core.sampling_params import SamplingParams

    logits = torch.randn(8, 128_256, generator=torch.Generator().manual_seed(1)).cuda() * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50 if i % 2 else 0, seed=i) for i in range(8)]
    drawn = sample_rows(logits, RowSettings(params, list(range(8)), [3] * 8))
    temperature, cut = row_cuts(logits, params)
    keys = torch.tensor([row_keys(i, 3) for i in range(8)], dtype=torch.int64, device="cuda")
    assert torch.equal(drawn.tokens, gumbel_argmax_naive(logits, temperature, cut, keys))
    assert not drawn.failed.any()
    picked = logits.gather(1, drawn.tokens[:, None]).squeeze(1) / temperature
    assert (picked >= cut).all()


@pytest.mark.gpu
def test_race_kernel_draws_each_token_with_its_probability_gpu(compiled_sampling: ModuleType) -> None:
    """The winners are short draws (u near 1): an approximate log there would skew the odds."""
    n = 40_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], device="cuda")
    keys = torch.tensor([row_keys(9, d) for d in range(n)], dtype=torch.int64, device="cuda")
    tokens, _ = compiled_sampling.gumbel_argmax_triton(
        torch.log(probs).expand(n, 5).contiguous(), torch.ones(n, device="cuda"),
        torch.full((n,), float("-inf"), device="cuda"), keys,
    )
    freq = torch.bincount(tokens, minlength=5).double().cpu() / n
    expected = probs.double().cpu()
    assert freq[4] == 0.0
    assert ((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12).all(), freq
