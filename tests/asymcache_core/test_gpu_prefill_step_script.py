"""``scripts/gpu_prefill_step.py``: its FLOP count and its timed step, on the CPU."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from asymcache_core import Engine
from asymcache_core.loaders import load_model
from tests.conftest import load_script


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("gpu_prefill_step")


def test_step_flops_counts_linear_head_and_causal_pairs(script: ModuleType) -> None:
    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, seed=0)
    cfg = loaded.config
    segments = [(0, 5), (7, 3)]
    # brute force: every new token attends to every key at or before its position
    pairs = sum(before + i + 1 for before, n in segments for i in range(n))
    expect = (
        2.0 * 1000 * 8 + 2.0 * 50 * 2
        + 4.0 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * pairs
    )
    assert script.step_flops(cfg, segments, 1000, 50) == pytest.approx(expect)


@pytest.mark.parametrize("case", ["one prompt", "four prompts", "last chunk"])
def test_prefill_step_ms_times_one_full_step(script: ModuleType, case: str) -> None:
    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, seed=0)
    engine = Engine(
        model="dummy:tiny", device="cpu", loaded=loaded, num_kv_blocks=128, max_num_batched_tokens=64,
        max_model_len=512, batch_invariant=False,
    )
    ms = script.prefill_step_ms(engine, case, 64, torch.Generator().manual_seed(0), repeats=1)
    assert ms > 0
    # every prompt ran to its end: nothing is left waiting or running
    assert not engine.has_unfinished()
