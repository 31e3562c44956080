"""Where our :class:`~agent_runtime.reasoning_gate.ReasoningGate` hands a reply to its grammar,
against where vLLM 0.32's structured outputs start it (``StructuredOutputManager.accept_tokens``
one token at a time: ``_get_constraint_bounds``), on random token sequences of a vocabulary whose
tags are single tokens, as Qwen3's and DeepSeek-R1's are: ``qwen3`` through vLLM's
``Qwen3ParserReasoningAdapter.find_reasoning_end`` (``</think>`` ends the thinking and the grammar
starts after it; ``<tool_call>`` is an implicit end, the grammar's first token), ``deepseek_r1``
through ``DeepSeekR1ReasoningParser.is_reasoning_end_streaming`` (the grammar starts after
``</think>``). The prompt holds no tag (vLLM's ``is_reasoning_end`` of it is False). Our gate
reads the decoded text, vLLM the token ids: a tag spelled in several tokens ends the thinking here
and not there, so the vocabulary spells no end tag but with its own token. No model is loaded."""

from __future__ import annotations

import random

import pytest
from vllm.parser.engine.registered_adapters import Qwen3ParserReasoningAdapter
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

from agent_runtime.reasoning_gate import ReasoningGate

VOCAB = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>",
         "a", " b", "\n", "<", "think", ">", "{", "}"]


class _Tokenizer:
    """What vLLM's parsers read of a tokenizer: the vocabulary (tags are single tokens)."""

    def get_vocab(self) -> dict[str, int]:
        return {piece: i for i, piece in enumerate(VOCAB)}

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


def _vllm_grammar_start(parser: str, ids: list[int]) -> int | None:
    """The index of the first token vLLM's grammar accepts (None: the reasoning never ended)."""
    if parser == "qwen3":
        adapter = Qwen3ParserReasoningAdapter(_Tokenizer(), chat_template_kwargs={"enable_thinking": True})  # type: ignore[arg-type]
        # a prompt that ends in the assistant turn's header: the reply starts in its thinking
        assert not adapter.is_reasoning_end([VOCAB.index("<|im_start|>")])
        for i, token in enumerate(ids):
            end = adapter.find_reasoning_end([token])
            if end is not None and end.offset == 0:
                return i if end.implicit else i + 1
        return None
    r1 = DeepSeekR1ReasoningParser(_Tokenizer())  # type: ignore[arg-type]
    for i, token in enumerate(ids):
        if r1.is_reasoning_end_streaming(ids[: i + 1], [token]):
            return i + 1
    return None


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_grammar_starts_where_vllms_does(parser: str) -> None:
    rng = random.Random(11)
    weights = [1 if piece.startswith("<") and len(piece) > 1 else 6 for piece in VOCAB]
    for _ in range(400):
        ids = rng.choices(range(len(VOCAB)), weights=weights, k=rng.randint(0, 12))
        gate = ReasoningGate(object(), parser, VOCAB.__getitem__)
        for n in range(len(ids) + 1):
            gate._advance(ids[:n])  # noqa: SLF001 - the state the masks are built from
        assert gate.grammar_start == _vllm_grammar_start(parser, ids), [VOCAB[i] for i in ids]
