"""Our n-gram drafts (:func:`asymcache_core.speculative.ngram_drafts`) against vLLM 0.32's own
prompt lookup (``vllm/v1/spec_decode/ngram_proposer.py``
``_find_longest_matched_ngram_and_propose_tokens``) on random token sequences of a small
vocabulary (many repeats), for several lookup bounds and draft counts. No model is loaded."""

from __future__ import annotations

import random

import numpy as np
import pytest
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

from asymcache_core.speculative import ngram_drafts


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 3), (1, 3, 4), (2, 4, 5), (3, 3, 2), (2, 5, 8)])
def test_the_same_drafts_as_vllm(min_n: int, max_n: int, k: int) -> None:
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    for _ in range(500):
        tokens = np.array([rng.randrange(4) for _ in range(rng.randint(0, 40))], dtype=np.int32)
        ours = ngram_drafts(tokens, min_n, max_n, k)
        # NOTE: vLLM's function caps k by max_model_len - len(tokens): a large max_model_len
        theirs = _find_longest_matched_ngram_and_propose_tokens(tokens, min_n, max_n, 1 << 20, k)
        assert ours == theirs.tolist(), (tokens.tolist(), ours, theirs.tolist())


@pytest.mark.parametrize("schedule", [
    [[1, 4, 6], [5, 8, 3], [9, 16, 2]], [[1, 1, 4], [2, 64, 0]], [[1, 16, 3], [32, 128, 2]], [[1, 2, 9]],
])
def test_the_batch_size_schedule_is_vllms(schedule: list[list[int]]) -> None:
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from asymcache_core.speculative import SpeculativeConfig

    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                      "num_speculative_tokens_per_batch_size": schedule})
    lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=256, vllm_num_speculative_tokens=4)
    assert [config.drafts_at(b) for b in range(1, 257)] == lookup[1:]
