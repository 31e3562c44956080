"""Our ``llama3_json`` parse (:func:`asymcache_core.llama3_calls.parse_llama3_json`) against
vLLM 0.32's own parser (``vllm/tool_parsers/llama_tool_parser.py``,
``Llama3JsonToolParser.extract_tool_calls``) on the same texts: the same calls (names and
arguments' text), and without calls the same content. With calls vLLM's non-streamed content is
empty while its stream sends the text before the first call as content; ours is that text in both
forms (asserted here on vLLM's stream). No model is loaded."""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

from asymcache_core.llama3_calls import parse_llama3_json

CALL = '{"name": "read_file", "parameters": {"path": "todo.md"}}'


class _Tokenizer:
    """All the parser reads of a tokenizer: a vocabulary with Llama's ``<|python_tag|>``."""

    def get_vocab(self) -> dict[str, int]:
        return {"<|python_tag|>": 7}


def _theirs(text: str) -> Any:
    return Llama3JsonToolParser(_Tokenizer()).extract_tool_calls(text, None)  # type: ignore[arg-type]


def _same(text: str) -> None:
    theirs, ours = _theirs(text), parse_llama3_json(text)
    assert [(c.function.name, c.function.arguments) for c in theirs.tool_calls] == [
        (c.name, c.arguments_json()) for c in ours.tool_calls], text
    assert theirs.tools_called == bool(ours.tool_calls)
    if not theirs.tools_called:
        assert ours.content == theirs.content, text


@pytest.mark.parametrize("text", [
    CALL, "<|python_tag|>" + CALL, " " + CALL + "\n", CALL + "; " + CALL, CALL + ";" + CALL,
    "[" + CALL + ", " + CALL + "]", "Sure: " + CALL + " done", "<tool_call>" + CALL + "</tool_call>",
    '{"name": "f", "arguments": {"a": [1, {"b": 2}]}, "parameters": {}}', '{"name": "f", "parameters": null}',
    '{"name": "f", "parameters": "{\\"a\\": 1}"}', '{"name": "f", "parameters": [1, 2]}',
    '{"name": "f", "parameters": {"s": "é\\u00e9 {"}}', '{"id": "x", "name": "f", "parameters": {}}',
    '{"name": "f"}', '{"parameters": {}}', '{"name": 1, "parameters": {}}', '{"function": {"name": "f", "arguments": {}}}',
    CALL + " then {braces}", "use {x} " + CALL, CALL + '; {"a": 1}', CALL + "; " + CALL[:-5], CALL[:-1],
    CALL + CALL, "plain words ", "", "{", "}", '{"name": "f", "parameters": {}}}', '{"name": "f", "parameters": NaN}',
])
def test_the_same_calls_and_content_as_vllm(text: str) -> None:
    _same(text)


def test_random_texts_read_as_vllm_reads_them() -> None:
    pieces = ['{', '}', '[', ']', '"name"', '"parameters"', '"arguments"', ':', ',', ';', ' ', '"f"', '"g h"',
              '1', 'null', 'x', '<|python_tag|>', '{"a": 1}', CALL, '"{"', '\\"']
    rng = random.Random(32)
    for _ in range(400):
        _same("".join(rng.choice(pieces) for _ in range(rng.randint(0, 14))))


def test_vllms_stream_sends_the_text_before_a_call_as_content() -> None:
    """What vLLM's stream sends before it knows a call starts: a reply that does not open with
    ``{`` (or the python tag) is all content; one that does, none."""
    for text, content in (("Sure: " + CALL, "Sure: " + CALL), (CALL, "")):
        parser, sent, names = Llama3JsonToolParser(_Tokenizer()), "", []
        for k in range(1, len(text) + 1):
            delta = parser.extract_tool_calls_streaming(text[: k - 1], text[:k], text[k - 1], [], [], [], None)  # type: ignore[arg-type]
            sent += (delta.content or "") if delta is not None else ""
            names += [tc.function.name for tc in (delta.tool_calls if delta is not None else [])
                      if tc.function and tc.function.name]
        assert sent == content and names == ([] if content else ["read_file"])
    # ours: the text before the call is the content, streamed or not; the call is a call
    ours = parse_llama3_json("Sure: " + CALL)
    assert ours.content == "Sure:" and [c.name for c in ours.tool_calls] == ["read_file"]
