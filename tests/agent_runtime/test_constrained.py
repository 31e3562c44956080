"""Constrained tool calls with xgrammar on SmolLM2's real tokenizer and a real forward pass."""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Literal

import pydantic
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from agent_runtime.constrained import needs_constraint, tool_call_json_schema  # noqa: E402
from agent_runtime.grammar_cache import GrammarCache, make_tool_call_processor  # noqa: E402
from agent_runtime.grammar_processor import GrammarLogitsProcessor  # noqa: E402
from agent_runtime.tools import Tool  # noqa: E402
from asymcache_core.chat_template import render_chat  # noqa: E402
from asymcache_core.sampling_params import LogitsProcessor  # noqa: E402
from asymcache_core.tool_parsing import parse_hermes  # noqa: E402

VOCAB = 49152


def get_weather(
    city: Annotated[str, pydantic.Field(max_length=40)], unit: Literal["celsius", "fahrenheit"]
) -> str:
    """Get the current weather of a city.

    Args:
        city: the city name.
        unit: temperature unit.
    """
    return f"{city}: 20 {unit}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend.
        b: second addend.
    """
    return a + b


class Point(pydantic.BaseModel):
    x: int
    y: int


def move(to: Point, speed: float = 1.0) -> str:
    """Move to a point."""
    return f"moved to {to}"


TOOLS = {t.name: t for t in (Tool.from_function(get_weather), Tool.from_function(add))}
SCHEMAS = [t.openai_schema() for t in TOOLS.values()]


@pytest.fixture(scope="module")
def tokenizer(hf_smollm_tokenizer: Any) -> Any:
    """transformers' tokenizer of the packaged GGUF (the session's shared copy)."""
    return hf_smollm_tokenizer


@pytest.fixture(scope="module")
def model(hf_smollm: Any) -> Any:
    """transformers' model of the packaged GGUF, float32 (the session's shared copy)."""
    return hf_smollm


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache(max_threads=2)


def greedy_generate(
    model: Any, tokenizer: Any, prompt: str, processor: GrammarLogitsProcessor, max_new: int = 60
) -> list[int]:
    """Greedy decoding with a KV cache, the processor applied to every step's logits."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    # transformers renamed past_key_values to cache (5.2x); accept both.
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    past = None
    with torch.inference_mode():
        for _ in range(max_new):
            res = model(input_ids=ids, use_cache=True, **{cache_kw: past})
            past = getattr(res, cache_kw)
            logits = res.logits[0, -1].float().clone()
            logits = processor(list(out), logits)
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok == tokenizer.eos_token_id:
                break
            ids = torch.tensor([[tok]])
    return out


def _check_call(tokenizer: Any, out: list[int], allowed: set[str]) -> tuple[str, dict]:
    assert out[-1] == tokenizer.eos_token_id, "generation did not finish within the budget"
    text = tokenizer.decode(out[:-1])
    msg = parse_hermes(text)
    assert len(msg.tool_calls) == 1 and msg.content == "", text
    call = msg.tool_calls[0]
    assert call.name in allowed
    TOOLS[call.name].args_model.model_validate(call.arguments)  # raises if invalid
    return call.name, call.arguments


def test_forced_named_function_with_real_model(
    model: Any, tokenizer: Any, cache: GrammarCache
) -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    prompt = render_chat(tokenizer, messages, tools=SCHEMAS)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    proc = make_tool_call_processor(cache, tokenizer, SCHEMAS, choice, vocab_size=VOCAB)
    assert isinstance(proc, LogitsProcessor)
    out = greedy_generate(model, tokenizer, prompt, proc)
    name, args = _check_call(tokenizer, out, {"get_weather"})
    assert args["unit"] in ("celsius", "fahrenheit")
    proc(out, torch.zeros(VOCAB))  # let it see the EOS
    assert proc.is_terminated and not proc.failed


def test_required_any_tool_with_real_model(model: Any, tokenizer: Any, cache: GrammarCache) -> None:
    messages = [{"role": "user", "content": "Please add 17 and 25."}]
    prompt = render_chat(tokenizer, messages, tools=SCHEMAS)
    proc = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    assert proc is not None
    out = greedy_generate(model, tokenizer, prompt, proc)
    _check_call(tokenizer, out, set(TOOLS))


def _allowed(proc: GrammarLogitsProcessor, out: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.isfinite(proc(out, torch.zeros(vocab)))


def test_processor_follows_grammar_and_resyncs(tokenizer: Any, cache: GrammarCache) -> None:
    proc = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    assert proc is not None
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    toks = tokenizer.encode(text, add_special_tokens=False)
    out: list[int] = []
    for t in toks:
        assert bool(_allowed(proc, out)[t]), (t, tokenizer.decode(out))
        out.append(t)
    # Grammar complete: only EOS is allowed.
    allowed = _allowed(proc, out)
    assert allowed.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    # After EOS (e.g. ignore_eos), still only EOS.
    out.append(tokenizer.eos_token_id)
    assert _allowed(proc, out).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert proc.is_terminated and not proc.failed

    # Preemption: the list shrank; the processor replays it from scratch.
    prefix = toks[:5]
    fresh = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    assert fresh is not None
    assert torch.equal(_allowed(proc, prefix), _allowed(fresh, prefix))
    assert not proc.is_terminated
    # A replaced last token (same length, different content) also resyncs.
    other = tokenizer.encode('<tool_call>\n{"name": "get', add_special_tokens=False)
    alt = toks[: len(other) - 1] + [other[-1]] if len(other) <= len(toks) else other
    fresh2 = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    assert fresh2 is not None
    assert torch.equal(_allowed(proc, alt), _allowed(fresh2, alt))


def test_off_grammar_token_forces_eos_and_padded_vocab(tokenizer: Any, cache: GrammarCache) -> None:
    compiled = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    proc = GrammarLogitsProcessor(compiled, vocab_size=VOCAB + 64)
    first = _allowed(proc, [], VOCAB + 64)
    assert not first[VOCAB:].any()  # padded rows beyond the tokenizer are never allowed
    bad = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert not bool(first[bad])
    assert _allowed(proc, [bad], VOCAB + 64).nonzero().flatten().tolist() == [
        tokenizer.eos_token_id
    ]
    assert proc.failed


def test_mask_matches_xgrammar_kernel(tokenizer: Any, cache: GrammarCache) -> None:
    compiled = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    proc = GrammarLogitsProcessor(compiled)
    prefix = tokenizer.encode('<tool_call>\n{"name": "', add_special_tokens=False)
    ours = proc(prefix, torch.randn(VOCAB))
    matcher = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    ref = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref[0]))


def test_schema_building_and_cache(tokenizer: Any) -> None:
    cache = GrammarCache(max_threads=1, max_grammars=2)
    g1 = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", VOCAB)
    assert cache.tool_call_grammar(tokenizer, SCHEMAS, "required", VOCAB) is g1
    assert len(cache) == 1
    cache.tool_call_grammar(
        tokenizer, SCHEMAS, {"type": "function", "function": {"name": "add"}}, VOCAB
    )
    cache.json_schema_grammar(tokenizer, {"type": "object"}, VOCAB)
    assert len(cache) == 2  # bounded: the oldest was dropped

    assert needs_constraint("required") and needs_constraint({"function": {"name": "x"}})
    assert not needs_constraint("auto") and not needs_constraint(None)
    assert make_tool_call_processor(cache, tokenizer, SCHEMAS, "auto") is None
    with pytest.raises(ValueError, match="unknown tool"):
        tool_call_json_schema(SCHEMAS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tools"):
        tool_call_json_schema([], "required")

    # Nested models: the tool's $defs are hoisted so references still resolve.
    move_schema = Tool.from_function(move).openai_schema()
    schema = tool_call_json_schema([move_schema], "required")
    assert "move__Point" in schema["$defs"]
    assert schema["properties"]["arguments"]["properties"]["to"]["$ref"] == "#/$defs/move__Point"
    compiled = cache.tool_call_grammar(tokenizer, [move_schema], "required", VOCAB)
    matcher = xgr.GrammarMatcher(compiled)
    good = '<tool_call>\n{"name": "move", "arguments": {"to": {"x": 1, "y": 2}, "speed": 2.5}}\n</tool_call>'
    assert matcher.accept_string(good) and matcher.is_completed()
    bad = xgr.GrammarMatcher(compiled)
    assert not bad.accept_string('<tool_call>\n{"name": "move", "arguments": {"to": {"x": "a"')


def test_grammar_mask_words_match_the_rewritten_row(tokenizer: Any, cache: GrammarCache) -> None:
    """``keep_words`` (the device path's mask) keeps exactly what ``__call__`` leaves finite,
    along a tool call, after it ends, off the grammar, and for a padded vocabulary."""
    from asymcache_core.token_masks import apply_keep

    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    toks = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    bad = tokenizer.encode("hello", add_special_tokens=False)[0]
    for vocab in (VOCAB, VOCAB + 64):
        compiled = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
        by_call, by_words = GrammarLogitsProcessor(compiled, vocab), GrammarLogitsProcessor(compiled, vocab)
        for out in [toks[:k] for k in range(0, len(toks) + 1, 3)] + [[bad], [bad, 7]]:
            row = _allowed(by_call, out, vocab)
            words = by_words.keep_words(out, vocab)
            masked = apply_keep(torch.zeros(1, vocab), [0], words[None, :])
            assert torch.equal(torch.isfinite(masked[0]), row), (vocab, out)


def test_forced_tokens_are_those_the_grammar_allows_alone(tokenizer: Any, cache: GrammarCache) -> None:
    """Walking a forced call token by token: wherever the mask keeps one token (not EOS), the
    processor's ``forced_tokens`` gives exactly the run of such tokens from there, and taking
    them leaves it where walking would (jump-forward is exact)."""
    choice = {"type": "function", "function": {"name": "add"}}
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    toks = tokenizer.encode(text, add_special_tokens=False)
    walker = make_tool_call_processor(cache, tokenizer, SCHEMAS, choice, vocab_size=VOCAB)
    alone: list[int | None] = []
    for i in range(len(toks)):
        kept = _allowed(walker, toks[:i]).nonzero().flatten().tolist()
        alone.append(kept[0] if len(kept) == 1 and kept[0] != tokenizer.eos_token_id else None)
    assert sum(t is not None for t in alone) >= 2  # the call's fixed text forces some tokens
    for i in range(len(toks)):
        run = []
        while i + len(run) < len(toks) and alone[i + len(run)] is not None:
            run.append(alone[i + len(run)])
        jumper = make_tool_call_processor(cache, tokenizer, SCHEMAS, choice, vocab_size=VOCAB)
        assert jumper.forced_tokens(toks[:i], 64) == run == toks[i : i + len(run)], i
        if run:
            # the taken tokens are the request's: its next mask is the walker's after them
            assert torch.equal(_allowed(jumper, toks[: i + len(run)]), _allowed(walker, toks[: i + len(run)]))
    capped = make_tool_call_processor(cache, tokenizer, SCHEMAS, choice, vocab_size=VOCAB)
    first = next(i for i, t in enumerate(alone) if t is not None)
    assert capped.forced_tokens(toks[:first], 1) == [alone[first]]
    # the grammar complete: EOS is the one token left, and it is never jumped over
    done = make_tool_call_processor(cache, tokenizer, SCHEMAS, choice, vocab_size=VOCAB)
    assert done.forced_tokens(toks, 64) == []


def test_required_with_parallel_calls_takes_one_or_more(tokenizer: Any, cache: GrammarCache) -> None:
    """OpenAI's ``parallel_tool_calls`` (on by default) under ``"required"``: one call or more,
    joined as the parser reads them; off, or for a named function, exactly one."""
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    many = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", VOCAB, parallel=True)
    single = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", VOCAB)
    named = cache.tool_call_grammar(tokenizer, SCHEMAS, {"type": "function", "function": {"name": "add"}}, VOCAB,
                                    parallel=True)
    assert named is not many and single is not many

    def accepts(compiled: Any, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(many, one) and accepts(many, two) and accepts(many, two + "\n" + one)
    assert len(parse_hermes(two).tool_calls) == 2
    assert accepts(single, one) and not accepts(single, two)
    assert accepts(named, one) and not accepts(named, one + "\n" + one)
    for wrong in ("", one + "\n", one + "\n\n" + one, one + " " + one, one + "\nhello"):
        assert not accepts(many, wrong), wrong
    # Free whitespace stays out of the repeated calls too (the text the parser renders back).
    assert not accepts(many, one + '\n<tool_call>\n{"name":"add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    # Llama's bare objects, joined by "; " as render_llama3_json_tool_calls writes them.
    llama = cache.tool_call_grammar(tokenizer, SCHEMAS, "required", VOCAB, call_format="llama3_json",
                                    parallel=True)
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert accepts(llama, call) and accepts(llama, call + "; " + call) and not accepts(llama, call + ";" + call)

    # The processor: after a finished call, EOS and the separator's first token are allowed.
    proc = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB, parallel=True)
    assert proc is not None
    toks = tokenizer.encode(one, add_special_tokens=False)
    allowed = set(_allowed(proc, toks).nonzero().flatten().tolist())
    assert tokenizer.eos_token_id in allowed and len(allowed) > 1
    strict = make_tool_call_processor(cache, tokenizer, SCHEMAS, "required", vocab_size=VOCAB)
    assert strict is not None
    assert _allowed(strict, toks).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
