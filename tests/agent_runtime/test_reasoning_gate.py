"""Constrained replies that wait for the thinking to end (vLLM's structured-output reasoning
gate): the gate on its own (a recording grammar, then xgrammar's on SmolLM2's tokenizer), then
SmolLM2 behind a template that opens the block in the prompt (it never closes one itself, so a
thinking budget closes it), through the Python API and chat completions."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from agent_runtime.grammar_cache import GrammarCache
from agent_runtime.grammar_processor import GrammarLogitsProcessor
from agent_runtime.reasoning import stream_split
from agent_runtime.reasoning_gate import ReasoningGate, gated_processor
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from asymcache_core.token_masks import keep_only, masks_only
from tests.agent_runtime.live_server import MODEL, TOOLS, serving
from tests.agent_runtime.test_reasoning import THINKING_PROMPT_TEMPLATE
from tests.conftest import make_engine

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Why is the sky blue? Answer in JSON."}]


class RecordingGrammar:
    """A grammar that keeps one token (the length of what it was handed) and records it."""

    failed = False
    is_terminated = False

    def __init__(self) -> None:
        self.handed: list[list[int]] = []

    def keep_words(self, content: list[int], vocab: int) -> np.ndarray:
        self.handed.append(list(content))
        return keep_only((len(content),), vocab)

    def forced_tokens(self, content: list[int], limit: int) -> list[int]:
        self.handed.append(list(content))
        return [len(content)][:limit]

    def __call__(self, content: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.handed.append(list(content))
        logits[:] = float("-inf")
        logits[len(content)] = 0.0
        return logits


@pytest.mark.parametrize(("parser", "text", "content_from"), [
    ("deepseek_r1", "ok.</think>\n\n{\"a\": 1}", "\n\n{"),
    ("deepseek_r1", "<think>x</think>y<tool_call>", "y<tool_call>"),
    ("qwen3", "hmm\n<tool_call>\n{\"name\"", "<tool_call>"),  # a tool call ends it: the call is content
    ("qwen3", "a</think>b<tool_call>", "b<tool_call>"),
    ("qwen3", "<think>so.\n</think>{\"a\"", "{\"a\""),
    ("deepseek_r1", "a tool call <tool_call> is not an end here", None),
    ("qwen3", "never closed </thi", None),
])
def test_the_grammar_starts_where_the_split_reads_the_content(smollm, parser, text, content_from):
    tokenizer = smollm.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    grammar = RecordingGrammar()
    gate = gated_processor(grammar, parser, tokenizer)
    assert isinstance(gate, ReasoningGate) and masks_only([gate])
    vocab = 64
    for n in range(len(ids) + 1):
        out = ids[:n]
        logits = torch.zeros(vocab)
        if gate.passes(out):
            # thinking: nothing masked, nothing forced, the grammar not asked
            assert gate.keep_words(out, vocab) is None and gate.forced_tokens(out, 4) == []
            assert torch.equal(gate(out, logits.clone()), logits) and not grammar.handed
        else:
            content = out[gate.grammar_start:]
            assert np.array_equal(gate.keep_words(out, vocab), keep_only((len(content),), vocab))
            assert gate.forced_tokens(out, 4) == [len(content)]
            assert int(gate(out, logits).argmax()) == len(content)
            assert grammar.handed[-1] == content
    reasoning, start = stream_split(text, parser, final=True)
    if content_from is None:
        assert gate.grammar_start is None and start is None
        return
    # the split and the gate agree: the grammar reads the content from its first token
    assert text[start:].startswith(content_from)
    assert tokenizer.decode(ids[gate.grammar_start:], skip_special_tokens=False) == text[start:]


def test_the_gate_follows_the_ids_it_is_handed(smollm):
    tokenizer = smollm.tokenizer
    closed = tokenizer.encode("a.</think>{", add_special_tokens=False)
    gate = gated_processor(RecordingGrammar(), "deepseek_r1", tokenizer)
    assert not gate.passes(closed) and gate.grammar_start == closed.index(tokenizer.encode("{")[0])
    # another pass over the request (a recomputed output): read afresh
    thinking = tokenizer.encode("a.</thi", add_special_tokens=False)
    assert gate.passes(thinking) and gate.grammar_start is None
    assert gated_processor(closed, None, tokenizer) is closed  # no parser: constrained from the start
    with pytest.raises(ValueError, match="^reasoning_parser: one of"):
        ReasoningGate(RecordingGrammar(), "mistral", str)


def test_xgrammars_mask_applies_from_the_contents_first_token(smollm):
    tokenizer, vocab = smollm.tokenizer, smollm.config.vocab_size
    compiled = GrammarCache().json_schema_grammar(tokenizer, SCHEMA, vocab)
    gate = gated_processor(GrammarLogitsProcessor(compiled, vocab_size=vocab), "deepseek_r1", tokenizer)
    thinking = tokenizer.encode("Rayleigh scattering, I think.\n</think>", add_special_tokens=False)
    assert gate.passes(thinking[:-1]) and gate.forced_tokens(thinking[:-1], 8) == []
    # the close: the grammar's first mask, as a fresh request's, then the mask of what follows
    fresh = GrammarLogitsProcessor(compiled, vocab_size=vocab)
    assert np.array_equal(gate.keep_words(thinking, vocab), fresh.keep_words([], vocab))
    after = thinking + tokenizer.encode('{"answer": "blue', add_special_tokens=False)
    assert np.array_equal(gate.keep_words(after, vocab), fresh.keep_words(after[len(thinking):], vocab))
    assert not np.array_equal(gate.keep_words(after, vocab), gate.keep_words(thinking, vocab))
    assert not gate.failed and not gate.is_terminated


def _runtime(smollm) -> AgentRuntime:
    return AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_PROMPT_TEMPLATE,
                        reasoning_parser="deepseek_r1")


def test_smollm2_thinks_freely_then_writes_the_constrained_reply(smollm):
    runtime = _runtime(smollm)
    try:
        free = asyncio.run(runtime.chat(ASK, max_tokens=12))
        # SmolLM2 never closes the block: its JSON-constrained reply is its free thinking
        waiting = asyncio.run(runtime.chat(ASK, max_tokens=12, response_format=FORMAT))
        # the budget closes the block after 6 tokens: from there the reply is the schema's
        capped = asyncio.run(runtime.chat(ASK, max_tokens=48, response_format=FORMAT, thinking_token_budget=6))
        called = asyncio.run(runtime.chat(ASK, max_tokens=40, tools=TOOLS, tool_choice="required",
                                          thinking_token_budget=6))
        # constrained in the thinking too (vLLM's include_reasoning false): JSON from the first token
        at_once = asyncio.run(runtime.chat(ASK, max_tokens=48, response_format=FORMAT, constrain_thinking=True))
        with pytest.raises(ValueError, match="^thinking_token_budget: not with a reply constrained from its first"):
            asyncio.run(runtime.chat(ASK, max_tokens=8, response_format=FORMAT, constrain_thinking=True,
                                     thinking_token_budget=4))
        with pytest.raises(ValueError, match="^constrain_thinking: must be true or false"):
            asyncio.run(runtime.chat(ASK, max_tokens=8, response_format=FORMAT, constrain_thinking="yes"))
        with serving(create_app(runtime, MODEL, override_generation_config={"temperature": 0})) as base:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 48, "response_format": FORMAT,
                    "thinking_token_budget": 6}
            chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json=body).json()
            hidden = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                **body, "include_reasoning": False, "thinking_token_budget": None}).json()
        idle = runtime.call_threadsafe(lambda e: e.has_unfinished()).result()
    finally:
        runtime.close_sync()
        runtime.engine.close()
    assert waiting.token_ids == free.token_ids and not waiting.parsed.content
    assert capped.token_ids[:6] == free.token_ids[:6]
    assert capped.parsed.reasoning.strip() == runtime.engine.tokenizer.decode(free.token_ids[:6]).strip()
    assert set(json.loads(capped.parsed.content)) == {"answer"}
    assert called.parsed.reasoning and called.parsed.tool_calls[0].name in ("list_files", "read_file")
    assert at_once.token_ids[:6] != free.token_ids[:6]
    assert set(json.loads(runtime.engine.tokenizer.decode(at_once.token_ids, skip_special_tokens=True))) == {"answer"}
    message = chat["choices"][0]["message"]
    assert message["content"] == capped.parsed.content and message["reasoning_content"] == capped.parsed.reasoning
    # the server's include_reasoning false is constrain_thinking: the API's reply, its thinking left out
    assert hidden["choices"][0]["message"].get("reasoning_content") is None
    assert hidden["usage"]["completion_tokens"] == len(at_once.token_ids)
    assert idle is False
