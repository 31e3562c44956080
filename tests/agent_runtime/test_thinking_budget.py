"""A cap on a reasoning model's thinking: the processor on its own (a character tokenizer), then
SmolLM2 behind a template that opens the block in the prompt (it never closes one itself), through
the Python API, chat completions (vLLM's ``thinking_token_budget``) and Anthropic's Messages
(``thinking.budget_tokens``)."""

from __future__ import annotations

import asyncio
import json

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
from tests.agent_runtime.live_server import MODEL, TOOLS, serving
from tests.agent_runtime.test_reasoning import THINKING_PROMPT_TEMPLATE
from tests.conftest import make_engine

#: greedy defaults (vLLM's --override-generation-config): these tests compare replies
GREEDY = {"temperature": 0}

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
    # qwen3 (thinking on): the reply opens the block itself (its tag counts), or the template
    # opened it (Thinking-2507): the reply starts in its thinking either way
    assert _generate(_budget(10, "qwen3"), "<think>xyzxyzxyz", 24).startswith("<think>xyz" + FORCED_CLOSE)
    plain = "no thinking here at all"
    assert _generate(_budget(2, "qwen3"), plain, len(plain)) == "no" + FORCED_CLOSE + plain[2 + len(FORCED_CLOSE):]
    # a tool call written straight out of the thinking ends it (vLLM's qwen3_config): untouched
    called = "ab<tool_call>xyzxyzxyz"
    assert _generate(_budget(14, "qwen3"), called, len(called)) == called
    assert _generate(_budget(14, "deepseek_r1"), called, len(called)) != called
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
        with serving(create_app(runtime, MODEL, override_generation_config=GREEDY)) as base:
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
                    "tool_choice": "required", "include_reasoning": False}).json()["error"],
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
    # thinking all the way: no empty text block after it (Anthropic refuses one sent back)
    assert [b["type"] for b in adaptive["content"]] == ["thinking"]
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


def test_anthropic_thinking_settings_reach_the_template(smollm):
    """``thinking: disabled`` turns the template's ``enable_thinking`` off (an Anthropic client
    cannot send template variables), ``enabled`` on; count_tokens renders the same prompt.
    Without a reasoning parser ``enabled`` is served as text (vLLM's way); with a forced tool it
    is refused (Anthropic's rule)."""
    from tests.agent_runtime.test_chat_template_options import THINKING_TEMPLATE

    ask = [{"role": "user", "content": "hi"}]
    seen: dict[str, tuple[list[int], dict]] = {}
    for parser in ("qwen3", None):
        runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_TEMPLATE,
                               reasoning_parser=parser)
        try:
            with serving(create_app(runtime, MODEL)) as base:
                for kind in ("disabled", "enabled", None):
                    body: dict = {"model": MODEL, "messages": ask, "max_tokens": 6}
                    if kind is not None:
                        body["thinking"] = {"type": kind, **({"budget_tokens": 2} if kind == "enabled" else {})}
                    reply = httpx.post(f"{base}/v1/messages", timeout=60, json=body)
                    counted = httpx.post(f"{base}/v1/messages/count_tokens", timeout=60,
                                         json={k: v for k, v in body.items() if k != "max_tokens"})
                    assert reply.status_code == 200 and counted.status_code == 200, (parser, kind, reply.text)
                    seen[f"{parser}:{kind}"] = (counted.json()["input_tokens"], reply.json())
                forced = httpx.post(f"{base}/v1/messages", timeout=60, json={
                    "model": MODEL, "messages": ask, "max_tokens": 6, "thinking": {"type": "adaptive"},
                    "tools": [{"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}})
        finally:
            runtime.close_sync()
            runtime.engine.close()
        assert forced.status_code == 400 and forced.json()["error"]["message"].startswith("thinking:")
    prompt = runtime.engine.tokenizer.encode
    off, on, default = (seen[f"qwen3:{k}"][0] for k in ("disabled", "enabled", None))
    # the empty think block of enable_thinking=False is in the prompt, and only there
    assert off == default + len(prompt("<think>\n\n</think>\n\n")) and on == default
    # disabled: the reply opens after the closed block: text only; no empty text block anywhere
    for key, (_, message) in seen.items():
        kinds = [b["type"] for b in message["content"]]
        assert all(b["text"] for b in message["content"] if b["type"] == "text") or kinds == ["text"], (key, kinds)
    assert [b["type"] for b in seen["qwen3:disabled"][1]["content"]] == ["text"]
    # no parser: enabled is served, all text (the budget has nothing to cap)
    assert [b["type"] for b in seen["None:enabled"][1]["content"]] == ["text"]


def test_a_prefill_continues_as_text_under_a_reasoning_parser(smollm):
    """A prefilled assistant message is continued as its answer: the continuation is one text
    block, once, streamed or not (not thinking, and not thinking and text both)."""
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_PROMPT_TEMPLATE,
                           reasoning_parser="deepseek_r1")
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer"}]
    try:
        with serving(create_app(runtime, MODEL, override_generation_config=GREEDY)) as base:
            body = {"model": MODEL, "messages": convo, "max_tokens": 6}
            whole = httpx.post(f"{base}/v1/messages", timeout=60, json=body).json()
            with httpx.stream("POST", f"{base}/v1/messages", timeout=60, json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        runtime.close_sync()
        runtime.engine.close()
    assert [b["type"] for b in whole["content"]] == ["text"] and whole["content"][0]["text"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert starts == ["text"] and streamed == whole["content"][0]["text"]
