"""The top-p search's Triton kernel against its sorting twin.

- CPU: the kernel under ``TRITON_INTERPRET=1``.
- GPU (``-m gpu``): the compiled kernel at real vocabulary sizes, and the sampling path on CUDA.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.top_p import BLOCK_V, FEW, top_p_cut_naive

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _case(rows: int, vocab: int, device: str, seed: int = 0) -> Case:
    """Rows from flat to peaked with top-p from 1e-6 to 0.999, and the edge rows: a masked tail,
    a NaN, a min-p-style cut, ties at the boundary, negative zeros, a ``+inf``, nothing kept,
    and a row without top-p."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * (0.02 + 8 * torch.rand(rows, 1, generator=gen))
    temperature = 0.3 + 1.2 * torch.rand(rows, generator=gen)
    top_p = 0.05 + 0.9 * torch.rand(rows, generator=gen)
    cut = torch.full((rows,), float("-inf"))
    logits[0, vocab // 3 :] = float("-inf")
    logits[1, 5] = float("nan")
    cut[2] = float((logits[2] / temperature[2]).max()) - 1.0
    logits[3] = torch.tensor([3.0, 3.0, 3.0, 1.0]).repeat(vocab // 4 + 1)[:vocab]  # ties
    top_p[3] = 0.5
    logits[4] = torch.where(torch.arange(vocab) % 2 == 0, -0.0, 0.0)
    top_p[4] = 0.3
    logits[5, 7] = float("inf")
    logits[6] = float("-inf")
    top_p[7] = 1.0
    top_p[8], top_p[9] = 1e-6, 0.999
    return logits.to(device), temperature.to(device), cut.to(device), top_p.to(device)


def _valid(found: torch.Tensor, case: Case) -> torch.Tensor:
    """Rows whose cut is a top-p cut in float64: a kept value, the mass above it below ``p``
    and the mass from it up reaching ``p`` (within 1e-5: float32 sums in two orders may part a
    tie group there); the edge rows of :func:`_case` checked apart."""
    logits, temperature, cut, top_p = (t.cpu() for t in case)
    scaled = torch.nan_to_num(logits.float() / temperature[:, None], nan=float("-inf"), posinf=float("inf")).double()
    kept = scaled >= cut[:, None].double()
    probs = torch.softmax(torch.where(kept, scaled, float("-inf")), dim=-1)
    c = found.cpu().double()[:, None]
    above = torch.where(scaled > c, probs, 0.0).sum(dim=-1)
    from_it = torch.where(scaled >= c, probs, 0.0).sum(dim=-1)
    is_value = ((scaled == c) & kept).any(dim=-1)
    p = top_p.double()
    return is_value & (above < p + 1e-5) & ((from_it >= p - 1e-5) | (c.squeeze(1) == scaled.amax(dim=-1)))


def _check(found: torch.Tensor, case: Case) -> None:
    expected = top_p_cut_naive(*case)
    found, expected = found.cpu(), expected.cpu()
    plain = torch.ones(len(found), dtype=torch.bool)
    plain[[5, 6, 7]] = False  # +inf, nothing kept, no top-p
    assert _valid(found, case)[plain].all()
    assert int((found == expected).sum()) >= 0.9 * len(found)  # bit-equal to the sort nearly always
    logits, temperature, cut, top_p = (t.cpu() for t in case)
    assert float(found[3]) == pytest.approx(3.0 / float(temperature[3]))  # the tie group stays whole
    assert float(found[4]) == 0.0
    assert found[5] == float("inf") and found[6] == float("-inf") and found[7] == float("-inf")
    assert expected[5] == float("inf") and expected[6] == float("-inf") and expected[7] == float("-inf")
    assert float(found[8]) == float((logits[8] / temperature[8]).max())  # the most likely token stays


@pytest.mark.parametrize("vocab", [100, BLOCK_V, 3 * FEW + 17])
def test_top_p_search_matches_the_sort_interpreted(interp_top_p: ModuleType, vocab: int) -> None:
    case = _case(12, vocab, "cpu", seed=vocab)
    _check(interp_top_p.top_p_cut_triton(*case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49_152, 128_256, 151_936])
def test_top_p_search_matches_the_sort_gpu(compiled_top_p: ModuleType, vocab: int) -> None:
    case = _case(64, vocab, "cuda", seed=vocab)
    _check(compiled_top_p.top_p_cut_triton(*case), case)


@pytest.mark.gpu
def test_top_p_without_top_k_on_cuda_keeps_what_the_sort_keeps() -> None:
    """``row_cuts`` takes the search on CUDA for top-p rows without a top-k (min-p before it),
    and in a batch where other rows have a top-k (their cut before the search's)."""
    from asymcache_core.batched_sampling import row_cuts
    from asymcache_core.sampling_params import SamplingParams

    logits = torch.randn(6, 128_256, generator=torch.Generator().manual_seed(2)) * 3
    alone = [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02 if i % 2 else 0.0) for i in range(6)]
    mixed = [SamplingParams(temperature=0.7, top_p=0.9, top_k=40 if i % 3 == 0 else 0) for i in range(6)]
    for params in (alone, mixed):
        temperature, cut = row_cuts(logits.cuda(), params)
        cpu_temperature, cpu_cut = row_cuts(logits, params)
        assert torch.equal(cut.cpu(), cpu_cut) and torch.equal(temperature.cpu(), cpu_temperature)


def test_top_p_search_without_cuts_divides_nothing_and_narrows_to_few_tokens(interp_top_p: ModuleType) -> None:
    """Rows without a cut give the same cuts whether the kernel divides each token by the
    temperature or not (``has_cut``); a flat row wider than ``FEW`` passes over the whole row
    a few times, then reads the tokens it copied out."""
    case = _case(12, 3 * FEW + 17, "cpu", seed=5)
    logits, temperature, cut, top_p = case
    cut = torch.full_like(cut, float("-inf"))
    stats = torch.zeros(12, 260, dtype=torch.int32)
    plain = interp_top_p.top_p_cut_triton(logits, temperature, cut, top_p, has_cut=False, stats=stats)
    assert torch.equal(plain, interp_top_p.top_p_cut_triton(logits, temperature, cut, top_p, has_cut=True))
    _check(plain, (logits, temperature, cut, top_p))
    passes, full, copied, done = stats[9, :4].tolist()  # a plain row, top-p 0.999
    assert done == 1 and 0 < copied <= FEW and 1 <= full < passes
