"""Our ``qwen3`` split (:func:`agent_runtime.reasoning.split_reasoning` and the streamed
:func:`~agent_runtime.reasoning.stream_split`) against vLLM 0.32's own reasoning parser
(``vllm/parser/engine/registered_adapters.py`` ``Qwen3ParserReasoningAdapter`` over
``vllm/parser/qwen3.py`` ``Qwen3Parser``) on the same texts, with the template's
``enable_thinking`` on and off: the same reasoning and content (vLLM's empty ones are None).
vLLM's stream is fed a character at a time. With thinking off vLLM's stream drops ``</think>``
from the content while its ``extract_reasoning`` keeps the reply as generated; ours keeps it in
both (asserted on the non-streamed form only). No model is loaded."""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.parser.engine.registered_adapters import Qwen3ParserReasoningAdapter

from agent_runtime.reasoning import reply_content, reply_parser, split_reasoning, stream_split

CALL = '<tool_call>\n<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>'
TEXTS = [
    "<think>a</think>b", "a</think>b", "a", "<think>\n\n</think>\n\nhi", "x<think>y</think>z", "a</think>b</think>c",
    "a" + CALL, "a</think>" + CALL, "  <think>a</think>b", "a</think>", "", "</think>b", "a</think>b<think>c</think>d",
    "<thi", "a</thi", "a<tool_c", "<tool_call>", "a</think>b</thi",
]


class _Tokenizer:
    """All the parser reads of a tokenizer: Qwen3's special tokens (the text carries no ids)."""

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": 1, "</think>": 2, "<tool_call>": 3, "</tool_call>": 4, "<|im_start|>": 5, "<|im_end|>": 6}

    def decode(self, ids: Any) -> str:
        return ""


def _vllm(text: str, thinking: bool) -> tuple[tuple[str | None, str | None], tuple[str, str]]:
    """vLLM's non-streamed and streamed (reasoning, content) of ``text``."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    whole = Qwen3ParserReasoningAdapter(_Tokenizer(), **kwargs).extract_reasoning(text, None)  # type: ignore[arg-type]
    parser = Qwen3ParserReasoningAdapter(_Tokenizer(), **kwargs)  # type: ignore[arg-type]
    reasoning = content = ""
    deltas = [parser.extract_reasoning_streaming(text[:k], text[: k + 1], text[k], [], [], []) for k in range(len(text))]
    for delta in [*deltas, parser.finish_streaming()]:
        if delta is not None:
            reasoning, content = reasoning + (delta.reasoning or ""), content + (delta.content or "")
    return whole, (reasoning, content)


def _ours_streamed(text: str, parser: str) -> tuple[str, str]:
    reasoning = content = ""
    for k in range(len(text) + 1):
        thought, start = stream_split(text[:k], parser, final=k == len(text))
        assert thought.startswith(reasoning)  # type: ignore[union-attr]
        reasoning = thought or ""
        if start is not None:
            piece = reply_content(text[:k], start, parser, final=k == len(text))
            assert piece.startswith(content)
            content = piece
    return reasoning, content


def _same(text: str) -> None:
    (reasoning, content), streamed = _vllm(text, True)
    assert split_reasoning(text, "qwen3") == (reasoning, content or ""), text
    assert _ours_streamed(text, "qwen3") == streamed, text
    off = reply_parser("qwen3", {"enable_thinking": False})
    assert off is None and _vllm(text, False)[0] == (None, text), text


@pytest.mark.parametrize("text", TEXTS)
def test_the_same_split_as_vllm(text: str) -> None:
    _same(text)


def test_random_texts_split_as_vllm_splits_them() -> None:
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "think>", "a", " ", "\n", "b c",
              "<function=f>", "</function>"]
    rng = random.Random(3)
    for _ in range(400):
        _same("".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))))
