"""A cap on a reasoning model's thinking: the processor on its own (a character tokenizer), then
SmolLM2 behind a template that opens the block in the prompt (it never closes one itself), through
the Python API, chat completions (vLLM's ``thinking_token_budget``) and Anthropic's Messages
(``thinking.budget_tokens``)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.thinking_budget import (
    FORCED_CLOSE,
    ThinkingBudget,
    check_thinking_budget,
    thinking_budget_processor,
)
from asymcache_core.token_masks import masks_only
from tests.agent_runtime.test_reasoning import THINKING_PROMPT_TEMPLATE
from tests.agent_runtime.test_server import MODEL, TOOLS, serving
from tests.conftest import make_engine

VOCAB = [chr(c) for c in range(32, 127)] + ["\n"]


def _generate(processor: ThinkingBudget, wanted: str, n: int) -> str:
    """Greedy decoding of a 'model' that always prefers the next character of ``wanted``."""
    out: list[int] = []
    for i in range(n):
        logits = torch.zeros(len(VOCAB))
        if i < len(wanted):
            logits[VOCAB.index(wanted[i])] = 5.0
        out.append(int(processor(list(out), logits).argmax()))
    return "".join(VOCAB[t] for t in out)


def _budget(budget: int, parser: str) -> ThinkingBudget:
    return ThinkingBudget(budget, parser, VOCAB.__getitem__, [VOCAB.index(c) for c in FORCED_CLOSE])


def test_the_block_is_closed_at_the_budget_and_only_then():
    # deepseek_r1: the prompt opened the block; 6 thinking tokens, then the close is forced
    assert _generate(_budget(6, "deepseek_r1"), "abcdefghijklmnop", 20)[:6 + len(FORCED_CLOSE)] == (
        "abcdef" + FORCED_CLOSE)
    # closed by the model within the budget: untouched
    natural = "ab</think>answer"
    assert _generate(_budget(12, "deepseek_r1"), natural, len(natural)) == natural
    # qwen3: the reply opens the block itself (its tag counts), or writes no block at all
    assert _generate(_budget(10, "qwen3"), "<think>xyzxyzxyz", 24).startswith("<think>xyz" + FORCED_CLOSE)
    plain = "no thinking here at all"
    assert _generate(_budget(2, "qwen3"), plain, len(plain)) == plain
    # budget 0: the reply closes the block at once
    assert _generate(_budget(0, "deepseek_r1"), "abc", len(FORCED_CLOSE)) == FORCED_CLOSE


def test_the_state_follows_the_ids_it_is_handed():
    processor = _budget(3, "deepseek_r1")
    a, b = VOCAB.index("a"), VOCAB.index("b")
    logits = torch.zeros(len(VOCAB))
    processor([a, a], logits)
    # another pass over the request (different ids): counted afresh, not from the old state
    assert torch.isfinite(processor([b], logits)).all()
    forced = processor([b, b, b], logits)
    assert torch.isfinite(forced).sum() == 1 and int(forced.argmax()) == VOCAB.index("\n")
    with pytest.raises(ValueError, match="^thinking_token_budget: must be an integer >= 0"):
        check_thinking_budget(-1)
    with pytest.raises(ValueError, match="^thinking.budget_tokens: must be an integer"):
        check_thinking_budget(True, "thinking.budget_tokens")


def test_the_budget_only_masks_and_its_mask_is_its_rewrite():
    """``keep_words`` keeps what ``__call__`` leaves finite: nothing masked while the block may
    go on, the forced token alone while it must close."""
    wanted = "abcdefghijklmnopqrstuvwxyz" * 3
    by_mask, by_call = _budget(6, "deepseek_r1"), _budget(6, "deepseek_r1")
    assert masks_only([by_mask])
    out: list[int] = []
    for i in range(6 + len(FORCED_CLOSE) + 3):
        logits = torch.zeros(len(VOCAB))
        logits[VOCAB.index(wanted[i])] = 5.0
        words = by_mask.keep_words(list(out), len(VOCAB))
        rewritten = by_call(list(out), logits.clone())
        if words is None:
            assert torch.equal(rewritten, logits)
        else:
            kept = torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little")[: len(VOCAB)] == 1)
            assert torch.equal(kept, torch.isfinite(rewritten)) and kept.sum() == 1
        out.append(int(rewritten.argmax()))
    assert "".join(VOCAB[t] for t in out).startswith("abcdef" + FORCED_CLOSE)


def test_a_budget_keeps_async_scheduling_overlapped_with_the_synchronous_tokens(smollm):
    """A request with a thinking budget samples in async scheduling's pipeline (its processor
    only masks): every step is launched while the one before runs, and the tokens, the forced
    close included, are the synchronous engine's."""
    from asymcache_core import SamplingParams
    from tests.asymcache_core.test_async_scheduling import LaunchCounter
    from tests.asymcache_core.test_step_faults import run_all

    prompt = smollm.tokenizer.encode("<think>\nWhy is the sky blue? Let me think.")
    outputs = {}
    for mode in (False, True):
        engine = make_engine(smollm, num_kv_blocks=64, async_scheduling=mode)
        counter = LaunchCounter(engine) if mode else None
        budget = thinking_budget_processor(3, "deepseek_r1", smollm.tokenizer)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, logits_processors=(budget,)))
        outputs[mode] = run_all(engine)[rid].token_ids
    assert outputs[True] == outputs[False]
    assert smollm.tokenizer.decode(outputs[True][3 : 3 + len(budget.forced)]) == FORCED_CLOSE
    assert counter is not None and counter.overlapped == counter.launches - 1


def test_smollm2s_thinking_is_capped_everywhere(smollm):
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_PROMPT_TEMPLATE,
                           reasoning_parser="deepseek_r1")
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    try:
        free = asyncio.run(runtime.chat(ask, max_tokens=24))
        capped = asyncio.run(runtime.chat(ask, max_tokens=24, thinking_token_budget=5))
        with serving(create_app(runtime, MODEL)) as base:
            chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 24, "thinking_token_budget": 5}).json()
            message = httpx.post(f"{base}/v1/messages", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 24,
                "thinking": {"type": "enabled", "budget_tokens": 5}}).json()
            adaptive = httpx.post(f"{base}/v1/messages", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 24, "thinking": {"type": "adaptive"}}).json()
            errors = {
                "forced call": httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": ask, "max_tokens": 24, "thinking_token_budget": 5, "tools": TOOLS,
                    "tool_choice": "required"}).json()["error"],
                "negative": httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": ask, "thinking_token_budget": -1}).json()["error"],
                "over max_tokens": httpx.post(f"{base}/v1/messages", timeout=60, json={
                    "model": MODEL, "messages": ask, "max_tokens": 24,
                    "thinking": {"type": "enabled", "budget_tokens": 24}}).json()["error"],
            }
            idle = runtime.call_threadsafe(lambda e: e.has_unfinished()).result()
    finally:
        runtime.close_sync()
        runtime.engine.close()
    # unbudgeted, SmolLM2 thinks for all 24 tokens: no content
    assert free.parsed.reasoning and not free.parsed.content
    # capped: the same first 5 tokens (greedy), the forced close, then an answer
    assert capped.parsed.reasoning is not None and capped.parsed.content
    capped_ids, free_ids = capped.token_ids, free.token_ids
    assert capped_ids[:5] == free_ids[:5] and capped_ids[5] != free_ids[5]
    assert capped.parsed.reasoning.strip() == runtime.engine.tokenizer.decode(free_ids[:5]).strip()
    assert chat["choices"][0]["message"]["content"] == capped.parsed.content
    assert chat["choices"][0]["message"]["reasoning_content"] == capped.parsed.reasoning
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][1]["text"] == capped.parsed.content
    assert [b["type"] for b in adaptive["content"]] == ["thinking", "text"] and not adaptive["content"][1]["text"]
    assert errors["forced call"]["param"] == "thinking_token_budget"
    assert errors["negative"]["message"].startswith("thinking_token_budget")
    assert errors["over max_tokens"]["message"].startswith("thinking.budget_tokens: must be less than max_tokens")
    assert idle is False


def test_a_budget_needs_a_reasoning_parser(smollm):
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024))
    ask = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(ValueError, match="^thinking_token_budget: needs a reasoning parser"):
            asyncio.run(runtime.chat(ask, max_tokens=4, thinking_token_budget=8))
        with serving(create_app(runtime, MODEL)) as base:
            r = httpx.post(f"{base}/v1/messages", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 4, "thinking": {"type": "sometimes"}})
    finally:
        runtime.close_sync()
        runtime.engine.close()
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("thinking.type:")
