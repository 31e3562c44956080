"""Greedy parity of our engine with transformers' LlamaForCausalLM on the same SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import SamplingParams
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def hf_model(hf_smollm):
    """transformers' model on the same GGUF (the session's shared copy)."""
    return hf_smollm


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with HF's own forward (full recompute each step, no cache tricks)."""
    ids = torch.tensor([prompt])
    first_logits = None
    out: list[int] = []
    with torch.no_grad():
        past = None
        step_ids = ids
        for _ in range(new_tokens):
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            logits = res.logits[0, -1]
            if first_logits is None:
                first_logits = logits.clone()
            token = int(logits.argmax())
            out.append(token)
            past = res.past_key_values
            step_ids = torch.tensor([[token]])
    assert first_logits is not None
    return out, first_logits


def test_greedy_tokens_match_transformers(smollm, hf_model, chat_prompts):
    engine = make_engine(smollm)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ours = engine.generate(chat_prompts, params)
    for prompt, result in zip(chat_prompts, ours, strict=True):
        expected, _ = hf_greedy(hf_model, prompt, 32)
        assert result.token_ids == expected
    engine.check_integrity()


def test_first_logits_close_in_fp32(smollm, hf_model, chat_prompts):
    from asymcache_core.model_runner import ModelRunner  # noqa: F401  (the path under test)

    engine = make_engine(smollm)
    prompt = chat_prompts[0]
    _, hf_logits = hf_greedy(hf_model, prompt, 1)
    # Run the prompt through the engine one step and read the logits the runner computed.
    captured: list[torch.Tensor] = []
    sampler = engine.runner.sampler
    original = sampler.sample

    def spy(logits, *args, **kwargs):
        captured.append(logits.clone())
        return original(logits, *args, **kwargs)

    sampler.sample = spy  # type: ignore[method-assign]
    engine.generate([prompt], SamplingParams(max_tokens=1))
    ours = captured[0][0]
    assert torch.allclose(ours, hf_logits, atol=2e-3, rtol=1e-4), (ours - hf_logits).abs().max()
