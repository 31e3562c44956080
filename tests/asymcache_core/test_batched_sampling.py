"""Random sampling where the logits are: the masks, the keyed draw, and a row's independence
from the rest of its batch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from asymcache_core.batched_penalties import prompt_ids, with_penalties
from asymcache_core.batched_sampling import RowSettings, row_cuts, sample_rows
from asymcache_core.sampler import FAILED, NON_FINITE, Sampler, with_engine_processors
from asymcache_core.sampling_params import SamplingParams
from kernels.sampling import gumbel_argmax_naive, row_keys, row_keys_array

VOCAB = 64


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _kept(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    """Each row's tokens its cut keeps."""
    temperature, cut = row_cuts(logits, params)
    kept = logits / temperature[:, None] >= cut[:, None]
    return [set(row.nonzero().flatten().tolist()) for row in kept]


def _race(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return gumbel_argmax_naive(logits, torch.ones(n), torch.full((n,), float("-inf")), keys)


def _draw(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], draws: list[int]) -> list[int]:
    drawn = sample_rows(logits, RowSettings(params, seeds, draws))
    assert not drawn.failed.any()
    return drawn.tokens.tolist()


def test_keys_follow_seed_and_draw():
    keys = {row_keys(seed, draw) for seed in (0, 1, 2**63, 2**64 - 1) for draw in range(50)}
    assert len(keys) == 200 and all(0 <= k < 1 << 32 for pair in keys for k in pair)
    assert row_keys(5, 7) == row_keys(5, 7)
    seeds = [0, 1, 2**63, 2**64 - 1, 12345, 2**40 + 3]
    draws = [0, 7, 2**32 + 5, 1, 2**63, 99]
    assert row_keys_array(seeds, draws).tolist() == [list(row_keys(s, d)) for s, d in zip(seeds, draws, strict=True)]
    # the mix is a bijection: 65,536 draws of one seed give 65,536 distinct first keys
    many = row_keys_array([3] * (1 << 16), list(range(1 << 16)))
    assert len(set(many[:, 0].tolist())) == 1 << 16


def test_the_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    keys = torch.tensor([row_keys(9, d) for d in range(n)], dtype=torch.int64)
    logits = torch.log(probs).expand(n, 5)
    freq = torch.bincount(_race(logits, keys), minlength=5).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert freq[4] == 0.0  # a zero is never drawn
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all(), freq
    # a temperature flattens the odds: at T = 2 they follow sqrt(p), renormalized
    hot = gumbel_argmax_naive(logits, torch.full((n,), 2.0), torch.full((n,), float("-inf")), keys)
    expect = probs.double().sqrt() / probs.double().sqrt().sum()
    freq = torch.bincount(hot, minlength=5).double() / n
    assert ((freq - expect).abs() <= 5 * (expect * (1 - expect) / n).sqrt() + 1e-12).all(), freq


def test_the_cpu_draw_follows_the_probabilities_too():
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]]))
    p = SamplingParams(temperature=1.0)
    tokens = [_draw(logits, [p], [11], [d])[0] for d in range(8_000)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / len(tokens)
    assert (freq - torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64)).abs().max() < 0.03


def test_a_row_draws_the_same_alone_and_in_any_batch():
    logits = _logits(5)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.5, min_p=0.1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8, min_p=0.02),
    ]
    seeds, draws = [1, 2, 3, 4, 5], [0, 3, 9, 1, 2]
    together = _draw(logits, params, seeds, draws)
    alone = [_draw(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], draws[i : i + 1])[0] for i in range(5)]
    assert together == alone
    order = [4, 2, 0, 3, 1]
    shuffled = _draw(logits[order], [params[i] for i in order], [seeds[i] for i in order], [draws[i] for i in order])
    assert shuffled == [together[i] for i in order]


def test_masks_keep_what_vllm_keeps():
    logits = _logits(1, seed=3).expand(4, VOCAB).contiguous()
    order = logits[0].argsort(descending=True)
    params = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=1e-30),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=1.0),
    ]
    kept = _kept(logits, params)
    assert kept[0] == set(order[:3].tolist())
    assert kept[1] == {int(order[0])}  # the most likely token stays
    assert kept[2] == {int(order[0])}
    assert kept[3] == set(range(VOCAB))  # no mask: every token, though the batch sorts for the others
    top3 = set(order[:3].tolist())
    for draw in range(60):
        tokens = _draw(logits, params, [7] * 4, [draw] * 4)
        assert tokens[0] in top3 and tokens[1] == tokens[2] == int(order[0])


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert _kept(logits, [SamplingParams(temperature=1.0, top_p=0.8)]) == [{0, 1}]  # 0.5 + 0.3 reaches it
    assert _kept(logits, [SamplingParams(temperature=1.0, top_p=0.81)]) == [{0, 1, 2}]
    # after top-k, top-p counts the renormalized rest: 0.5 / 0.8 = 0.625 reaches 0.6
    assert _kept(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)]) == [{0}]
    # top-p after top-k sorts only the top-k, with the same cut as the whole sort
    flat = torch.randn(2, 3000, generator=torch.Generator().manual_seed(6))
    both = [SamplingParams(temperature=1.0, top_k=300, top_p=0.5), SamplingParams(temperature=0.5, top_k=40, top_p=0.9)]
    for row, p in enumerate(both):
        probs = torch.softmax(flat[row] / p.temperature, dim=-1)
        top, order = probs.topk(p.top_k)
        top = top / top.sum()
        count = int(((top.cumsum(0) - top) < p.top_p).sum())
        assert _kept(flat, both)[row] == set(order[:count].tolist())
    # min-p keeps tokens at least min_p times the most likely one
    assert _kept(logits, [SamplingParams(temperature=1.0, min_p=0.3)]) == [{0, 1, 2}]
    assert _kept(logits, [SamplingParams(temperature=1.0, min_p=0.31)]) == [{0, 1}]


def test_a_row_without_finite_logits_fails_alone_and_one_with_some_falls_back_to_them():
    logits = _logits(3)
    logits[1] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 5] = 2.0
    logits[2, 7] = float("nan")
    p = SamplingParams(temperature=1.0)
    drawn = sample_rows(logits, RowSettings([p] * 3, [1, 2, 3], [0, 0, 0]))
    assert drawn.failed.tolist() == [False, True, False]
    inf = _logits(1)
    inf[0, 11] = float("inf")
    assert _draw(inf, [p], [1], [0]) == [11]  # an infinite logit takes the draw
    assert 0 <= int(drawn.tokens[1]) < VOCAB and int(drawn.tokens[2]) == 5
    sampler = Sampler(0)
    tokens = sampler.sample(logits, ["a", "b", "c"], [p] * 3, [[], [], []])
    assert tokens[1] == FAILED and tokens[2] == 5 and tokens[0] != FAILED
    assert sampler.take_failures() == {"b": NON_FINITE}


def test_the_sampler_keys_each_row_by_its_seed_and_the_token_index():
    logits = _logits(1, seed=5).expand(2, VOCAB).contiguous()
    sampler = Sampler(0)
    seeded = SamplingParams(temperature=1.0, seed=42)
    # the same seed and index draw the same token whatever the request; the index moves it
    first = sampler.sample(logits, ["a", "b"], [seeded, seeded], [[], []])
    assert first[0] == first[1]
    runs = {tuple(sampler.sample(logits[:1], ["a"], [seeded], [[0] * n])) for n in range(40)}
    assert len(runs) > 5
    # unseeded rows take their seed from the engine seed and the request id: stable per request
    free = SamplingParams(temperature=1.0)
    assert Sampler(0).row_seed("x", free) == Sampler(0).row_seed("x", free) != Sampler(1).row_seed("x", free)
    assert Sampler(0).row_seed("x", free) != Sampler(0).row_seed("y", free)
    assert Sampler(0).row_seed("x", SamplingParams(seed=-1)) == 2**64 - 1


def test_a_host_row_and_a_device_row_with_the_same_draw_agree_when_the_processor_passes():
    """A processor that rewrites nothing sends its row to the host; a row without it samples on
    the device path: on one device both draw by the same keys, so the same token."""
    logits = _logits(1, seed=8)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    host = SamplingParams(temperature=0.8, top_p=0.9, seed=4, logits_processors=(lambda out, row: row,))
    for n in range(10):
        assert Sampler(0).sample(logits, ["a"], [p], [[1] * n]) == Sampler(0).sample(logits.clone(), ["a"], [host], [[1] * n])


@pytest.mark.parametrize("greedy_rows", [(0,), (1, 2), ()])
def test_sample_on_device_mixes_greedy_and_random_rows(greedy_rows):
    logits = _logits(3, seed=2)
    params = [SamplingParams() if i in greedy_rows else SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    drawn = Sampler(0).sample_on_device(logits, ["a", "b", "c"], params, [0, 0, 0])
    for i in range(3):
        if i in greedy_rows:
            assert int(drawn.tokens[i]) == int(logits[i].argmax())
        else:
            assert int(drawn.tokens[i]) == _draw(logits[i : i + 1], [params[i]], [i], [0])[0]


@pytest.mark.parametrize("shift", [0, 32])
def test_seeds_that_differ_in_either_half_draw_differently(shift):
    """Seeds 1..40 (or the same in the seed's high half) on a flat row, one draw each."""
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(temperature=1.0)
    tokens = {_draw(logits, [p], [s << shift], [0])[0] for s in range(1, 41)}
    assert len(tokens) > 20
    keys = torch.tensor([row_keys(s << shift, 0) for s in range(1, 41)], dtype=torch.int64)
    assert len(set(_race(torch.zeros(40, VOCAB), keys).tolist())) > 20


def test_top_p_on_a_flat_row_widens_past_the_first_candidates():
    """On a CPU top-p looks at the most likely 256 tokens first and widens while a row's cut
    lies beyond them: the kept set is the whole sort's."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5000, generator=gen) * torch.tensor([[0.1], [6.0], [0.1]])  # flat, peaked, flat
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0)]
    kept = _kept(logits, params)
    full = torch.softmax(logits, dim=-1)
    for row in range(2):
        sorted_probs, order = full[row].sort(descending=True)
        count = int(((sorted_probs.cumsum(0) - sorted_probs) < 0.9).sum())
        assert kept[row] == set(order[:count].tolist())
    assert len(kept[0]) > 2048 and len(kept[1]) < 256
    assert kept[2] == set(range(5000))  # no top-p: untouched


def _reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """What vLLM's masks keep, spelled out with whole sorts: top-k, then min-p against the most
    likely token, then top-p over what is left, renormalized."""
    scaled = torch.nan_to_num(row / p.temperature, nan=float("-inf"))
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if p.top_k > 0:
        keep &= scaled >= scaled.sort(descending=True).values[min(p.top_k, scaled.numel()) - 1]
    if p.min_p > 0.0:
        keep &= scaled >= scaled.max() + math.log(p.min_p)
    if p.top_p < 1.0:
        left = torch.where(keep, scaled, float("-inf"))
        probs, order = torch.softmax(left, dim=-1).sort(descending=True)
        count = max(1, int(((probs.cumsum(0) - probs) < p.top_p).sum()))
        keep &= scaled >= left[order[count - 1]]
    return set(keep.nonzero().flatten().tolist())


def test_cuts_match_the_whole_sort_on_random_rows_and_settings():
    """Mixed batches of random settings over rows from flat to peaked: every row's kept set is
    the reference's, whichever shortcut its batch takes (the top-k-bounded top-p, the CPU's
    widening top-p)."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        rows = 1 + trial % 5
        logits = torch.randn(rows, 3000, generator=gen) * (0.05 + 8 * torch.rand(rows, 1, generator=gen))
        params = []
        for _ in range(rows):
            pick = torch.rand(4, generator=gen).tolist()
            params.append(SamplingParams(
                temperature=0.3 + 1.5 * pick[0],
                top_k=[0, 1, 5, 40, 600][int(pick[1] * 5)] if trial % 3 else 50,
                top_p=1.0 if pick[2] < 0.3 else 0.05 + 0.9 * pick[2],
                min_p=0.0 if pick[3] < 0.6 else 0.2 * pick[3],
            ))
        kept = _kept(logits, params)
        for i in range(rows):
            assert kept[i] == _reference_kept(logits[i], params[i]), (trial, i, params[i])


def test_a_logit_bias_applies_where_the_logits_are_and_leaves_the_log_probabilities_raw():
    logits = _logits(3, seed=9)
    params = [
        SamplingParams(logit_bias={"30": 100}),  # greedy: forced
        SamplingParams(temperature=1.0, seed=2, logit_bias={5: -100, 6: 100, 10_000: 5}),  # out of range: ignored
        SamplingParams(temperature=1.0, seed=3, logprobs=1, logit_bias={7: 100}),
    ]
    assert all(Sampler.on_device(p) for p in params)
    assert Sampler.on_device(SamplingParams(presence_penalty=0.5))  # penalties too
    # the engine makes min_tokens a processor: such a row goes to the host
    assert not Sampler.on_device(with_engine_processors(SamplingParams(min_tokens=2), frozenset({0})))
    assert not Sampler.on_device(SamplingParams(logits_processors=(lambda out, row: row,)))
    sampler = Sampler(0)
    drawn = sampler.sample_on_device(logits, ["a", "b", "c"], params, [0, 0, 0])
    assert drawn.tokens.tolist() == [30, 6, 7]
    tokens = sampler.sample(logits, ["a", "b", "c"], params, [[], [], []])
    assert tokens == [30, 6, 7]
    entry = sampler.take_logprobs()["c"]
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits[2], dim=-1)[7]), abs=1e-5)


def _reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The penalties of one row spelled out with sets and ``bincount`` (the sampler's own code
    before 2026-12-06)."""
    vocab = row.numel()
    row = row.clone()
    if p.logit_bias:
        row.index_add_(0, torch.tensor([t for t in p.logit_bias if t < vocab]),
                       torch.tensor([v for t, v in p.logit_bias.items() if t < vocab]))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output), minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def test_penalties_where_the_logits_are_give_the_reference_bits():
    """:func:`with_penalties` on a batch against the reference row by row, on random histories;
    a token still in flight (``pending``) counts as if it were on the host."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, logit_bias={3: 2.5, 70: 1.0}),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, temperature=1.0),
        SamplingParams(),
        SamplingParams(presence_penalty=1.9),
        SamplingParams(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2, logit_bias={0: -5.0}),
    ]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 0, 3, 1, 12)]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (20, 4, 7, 2, 0, 30)]
    prompt_tensors = [prompt_ids(prompt, VOCAB, logits.device) for prompt in prompts]
    got = with_penalties(logits, params, outputs, prompt_tensors)
    for i, p in enumerate(params):
        assert torch.equal(got[i], _reference_penalties(logits[i], p, prompts[i], outputs[i])), i
    # the last output token of each row still in flight (rows without output have none)
    pending = torch.tensor([out[-1] if out else -1 for out in outputs])
    held = with_penalties(logits, params, [out[:-1] for out in outputs], prompt_tensors, pending)
    assert torch.equal(held, got)
    # every row penalized (rewritten all at once, no gather): the same reference bits
    every = [SamplingParams(repetition_penalty=1.2 + 0.1 * i, presence_penalty=0.5, frequency_penalty=0.25 * i)
             for i in range(len(params))]
    whole = with_penalties(logits, every, [out[:-1] for out in outputs], prompt_tensors, pending)
    for i, p in enumerate(every):
        assert torch.equal(whole[i], _reference_penalties(logits[i], p, prompts[i], outputs[i])), i
    assert with_penalties(logits, [SamplingParams(temperature=1.0)], None, None) is logits  # nothing to do
    # a prompt id out of the vocabulary is left out; the sampler keeps each request's ids
    assert prompt_ids([5, 5, VOCAB + 3, -1, 2], VOCAB, logits.device).tolist() == [2, 5]
    row = torch.zeros(1, VOCAB)
    row[0, 1], row[0, 9] = 5.0, 4.0
    sampler = Sampler(0)
    rep = [SamplingParams(repetition_penalty=1.5)]
    assert sampler.sample_on_device(row, ["r"], rep, [0], [[]], [[1, 2, 3]]).tokens.tolist() == [9]  # 5 / 1.5 < 4
    assert set(sampler._prompts) == {"r"}
    # a request's prompt ids are built once: a later call's list is not read again
    assert sampler.sample_on_device(row, ["r"], rep, [0], [[]], [[9, 9]]).tokens.tolist() == [9]
    sampler.forget("r")
    assert sampler._prompts == {}
    assert sampler.sample_on_device(row, ["r"], rep, [0], [[]], [[9, 9]]).tokens.tolist() == [1]


@pytest.mark.gpu
def test_device_rows_sample_without_waiting_for_the_device() -> None:
    """Rows with penalties, bias, top-p alone (the search), min-p and top-k sample on CUDA
    without a synchronization (one would stop async scheduling's overlap): no call waits."""
    device = torch.device("cuda")
    vocab = 128_256
    logits = torch.randn(4, vocab, device=device) * 3
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, seed=1),
        SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05, frequency_penalty=0.3, logit_bias={5: 2.0}, seed=2),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=0.5, seed=4),
    ]
    prompts = [prompt_ids(list(range(i, 3000 + i)), vocab, device) for i in range(4)]
    outputs = [[7, 8, 9], [], [1], [2, 2]]
    pending = torch.tensor([11, -1, 12, 13], device=device)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NOTE: torch warns that the mode is on
            torch.cuda.set_sync_debug_mode("error")
        penalized = with_penalties(logits, params, outputs, prompts, pending)
        drawn = sample_rows(penalized, RowSettings(params, [1, 2, 3, 4], [3, 0, 1, 2]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not drawn.failed.any()


@pytest.mark.gpu
def test_a_top_p_rows_cut_is_the_same_sorted_alone_or_searched_in_a_batch() -> None:
    """On CUDA a step of few top-p-only rows sorts (below ``SEARCH_MIN_ROWS``) and a larger one
    searches: each row's cut, so its token, is the same either way."""
    from asymcache_core import batched_sampling

    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(8, 128_256, generator=gen) * torch.tensor([0.5, 1, 2, 3, 5, 8, 12, 20])[:, None]).cuda()
    params = [SamplingParams(temperature=0.5 + 0.1 * i, top_p=0.8 + 0.02 * i, seed=i) for i in range(8)]
    assert 1 < batched_sampling.SEARCH_MIN_ROWS <= len(params)
    _, searched = row_cuts(logits, params)
    for i in range(len(params)):
        _, alone = row_cuts(logits[i : i + 1], params[i : i + 1])
        assert torch.equal(alone[0], searched[i]), i
