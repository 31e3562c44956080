"""Processors that only mask: packed masks, and rows sampled with them where their logits are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asymcache_core.sampler import (
    FAILED,
    NOTHING_ALLOWED,
    AllowedTokensMask,
    BadWordsMask,
    MinTokensMask,
    Sampler,
)
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.token_masks import (
    all_words,
    apply_keep,
    clear_tokens,
    keep_only,
    keep_words,
    masks_only,
    pack_keep,
    stacked_keep,
)

VOCAB = 300  # not a multiple of 32: the last word is partial


def _unpack(words: np.ndarray, vocab: int = VOCAB) -> torch.Tensor:
    return torch.isfinite(apply_keep(torch.zeros(1, vocab), [0], words[None, :])[0])


def test_packed_masks_hold_the_tokens_they_keep():
    gen = np.random.default_rng(0)
    keep = gen.random(VOCAB) < 0.3
    words = pack_keep(keep)
    assert words.dtype == np.int32 and len(words) == 10
    assert torch.equal(_unpack(words), torch.from_numpy(keep))
    assert _unpack(all_words(VOCAB)).all()
    cleared = clear_tokens(all_words(VOCAB), [0, 31, 32, 299, 5000, -1])
    assert _unpack(cleared).logical_not().nonzero().flatten().tolist() == [0, 31, 32, 299]
    # the mask applies to the rows named, rows it leaves alone keep their values
    logits = torch.randn(3, VOCAB)
    out = apply_keep(logits.clone(), [2, 0], np.stack([pack_keep(keep), all_words(VOCAB)]))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[0], logits[0])
    assert torch.equal(torch.isfinite(out[2]), torch.from_numpy(keep))


def _processors() -> list:
    return [
        MinTokensMask(4, frozenset({2, 299})),
        AllowedTokensMask((5, 9, 40, 41, 299, 700)),
        BadWordsMask([[7], [3, 8], [1, 2, 6]]),
    ]


@pytest.mark.parametrize("outputs", [[], [3], [1, 2], [0, 1, 2, 3, 1, 2], [9, 9, 3]])
def test_each_masking_processor_keeps_what_its_rewrite_leaves(outputs):
    for processor in _processors():
        row = processor(list(outputs), torch.zeros(VOCAB))
        words = processor.keep_words(list(outputs), VOCAB)
        kept = _unpack(words) if words is not None else torch.ones(VOCAB, dtype=torch.bool)
        assert torch.equal(kept, torch.isfinite(row)), (processor, outputs)
    combined = keep_words(_processors(), list(outputs), VOCAB)
    row = torch.zeros(VOCAB)
    for processor in _processors():
        row = processor(list(outputs), row)
    assert torch.equal(_unpack(combined), torch.isfinite(row))
    assert masks_only(_processors()) and not masks_only([]) and not masks_only([lambda out, row: row])


class _HostOnly:
    """Wraps a processor without its ``keep_words``: its rows take the host path."""

    def __init__(self, processor) -> None:
        self.processor = processor

    def __call__(self, out, row):
        return self.processor(out, row)


class _Broken(AllowedTokensMask):
    def keep_words(self, output_token_ids, vocab):
        raise RuntimeError("no mask today")


def test_masked_rows_sample_where_their_logits_are_as_the_host_path_does():
    """Greedy and seeded random rows with masking processors (one, two, none that binds this
    step) give the host path's tokens in a batch with plain rows and a rewriting row; the model's
    log probabilities stay raw; a processor that raises fails its row alone."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    procs = _processors()
    rows = [
        SamplingParams(logits_processors=(procs[0],)),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, logits_processors=(procs[1],), logprobs=2),
        SamplingParams(temperature=1.0, seed=6, logits_processors=(procs[2], procs[0]), presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=7),
        SamplingParams(logits_processors=(lambda out, row: row * 2,)),
        SamplingParams(temperature=0.9, seed=8, logits_processors=(procs[0],)),  # past min_tokens: no mask
        SamplingParams(logits_processors=(procs[1],), logprobs=1),
        SamplingParams(logits_processors=(_Broken((1, 2)),)),
    ]
    outputs = [[1, 2], [3], [1, 2], [], [5], [0, 1, 2, 3, 4], [], []]
    ids = [f"r{i}" for i in range(8)]
    host = [
        SamplingParams(**{**p.__dict__, "logits_processors": tuple(_HostOnly(q) for q in p.logits_processors)})
        for p in rows
    ]
    device, by_host = Sampler(0), Sampler(0)
    to_host: list[list[int]] = []
    on_host = device._sample_on_host

    def spy(logits, host, *args):
        to_host.append(list(host))
        return on_host(logits, host, *args)

    device._sample_on_host = spy  # type: ignore[method-assign]
    got = device.sample(logits, ids, rows, outputs)
    assert to_host == [[4]]  # only the row that rewrites its logits copied them to the host
    want = by_host.sample(logits, ids, host[:7] + [rows[7]], outputs)
    assert got[:7] == want[:7]
    assert got[7] == FAILED and "no mask today" in device.take_failures()["r7"]
    assert got[1] in {5, 9, 40, 41, 299} and got[6] in {5, 9, 40, 41, 299}
    assert device.take_logprobs() == by_host.take_logprobs()


@pytest.mark.gpu
def test_masked_rows_on_cuda_keep_to_their_masks_and_match_the_host_path_greedy():
    logits = (torch.randn(4, 128_256, generator=torch.Generator().manual_seed(9)) * 3).cuda()
    allowed = AllowedTokensMask(tuple(range(0, 128_256, 7)))
    rows = [
        SamplingParams(logits_processors=(allowed,)),
        SamplingParams(logits_processors=(MinTokensMask(8, frozenset({int(logits[1].argmax())})),)),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, logits_processors=(allowed,)),
        SamplingParams(temperature=0.8, seed=2),
    ]
    host = [
        SamplingParams(**{**p.__dict__, "logits_processors": tuple(_HostOnly(q) for q in p.logits_processors)})
        for p in rows
    ]
    ids, outputs = ["a", "b", "c", "d"], [[], [1], [], []]
    got = Sampler(0).sample(logits, ids, rows, outputs)
    want = Sampler(0).sample(logits, ids, host, outputs)
    assert got[:2] == want[:2] and got[0] % 7 == 0 and got[2] % 7 == 0
    assert got[1] != int(logits[1].argmax())


def test_keep_only_and_the_batchs_stacked_masks():
    words = keep_only([3, 299, 299, VOCAB + 4, -1], VOCAB)
    kept = np.unpackbits(words.view(np.uint8), bitorder="little")
    assert np.flatnonzero(kept).tolist() == [3, 299]  # ids outside the vocabulary ignored
    a, b = all_words(VOCAB), keep_only([7], VOCAB)
    # positions within the rows given, rows without a mask (or keeping all: None) left out
    positions, stacked = stacked_keep({4: a, 6: None, 9: b}, [9, 6, 4, 2])
    assert positions == [0, 2] and np.array_equal(stacked, np.stack([b, a]))
    assert stacked_keep({6: None}, [6, 2]) is None


def test_single_token_finds_the_one_kept_token_or_none():
    from asymcache_core.token_masks import single_token

    for token in (0, 5, 31, 32, 63, 70, VOCAB - 1):  # 31: the int32 word's sign bit
        assert single_token(keep_only([token], VOCAB)) == token
    for tokens in ([], [3, 5], [31, 32], [0, VOCAB - 1]):
        assert single_token(keep_only(tokens, VOCAB)) is None


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]),
])
def test_a_row_masked_whole_fails_greedy_or_random_on_either_path(device):
    """argmax over a row of -inf picks token 0: a row whose masks leave nothing fails instead
    (NOTHING_ALLOWED), on the device path and the host path, greedy and at random, alone."""
    logits = (torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4)) * 3).to(device)
    nothing = AllowedTokensMask((5,))
    forbid_5 = MinTokensMask(8, frozenset({5}))  # the one allowed token is the one min_tokens bans
    rows = [
        SamplingParams(logits_processors=(nothing, forbid_5)),
        SamplingParams(temperature=0.8, seed=1, logits_processors=(nothing, forbid_5)),
        SamplingParams(logits_processors=(nothing,)),
        SamplingParams(temperature=0.8, seed=2),
    ]
    host = [SamplingParams(**{**p.__dict__, "logits_processors": tuple(_HostOnly(q) for q in p.logits_processors)})
            for p in rows]
    for params in (rows, host):
        sampler = Sampler(0)
        got = sampler.sample(logits, ["a", "b", "c", "d"], params, [[], [], [], []])
        assert got[:3] == [FAILED, FAILED, 5] and got[3] != FAILED
        assert sampler.take_failures() == {"a": NOTHING_ALLOWED, "b": NOTHING_ALLOWED}
