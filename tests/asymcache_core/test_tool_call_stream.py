"""Hermes tool calls streamed piece by piece: the pieces of each call, joined, are the finished
reply's parse (its id, name and exact arguments text), however the text was cut."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from asymcache_core.tool_call_stream import CallPiece, HermesCallStream, merged_pieces
from asymcache_core.tool_parsing import parse_hermes

CALL_A = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a \\"b\\" }{.txt", "lines": [1, 2]}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'


def _stream(text: str, cuts: list[int], max_calls: int | None = None) -> tuple[list[CallPiece], HermesCallStream]:
    ids = (f"call_{i}" for i in itertools.count())
    stream = HermesCallStream(max_calls, make_id=lambda: next(ids))
    pieces: list[CallPiece] = []
    for cut in cuts:
        pieces += stream.feed(text[:cut])
    parsed = parse_hermes(text).tool_calls
    if max_calls is not None:
        parsed = parsed[:max_calls]
    return pieces + stream.finish(text, parsed), stream


def _joined(pieces: list[CallPiece]) -> dict[int, tuple[str | None, str | None, str]]:
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for p in pieces:
        if p.id is not None:
            assert p.index not in calls, "a call is announced once"
            calls[p.index] = (p.id, p.name, p.arguments)
        else:
            call_id, name, args = calls[p.index]
            calls[p.index] = (call_id, name, args + p.arguments)
    return calls


@pytest.mark.parametrize("text", [
    CALL_A, "I will read it.\n" + CALL_A, CALL_A + "\n" + CALL_B,
    '<tool_call>\n{"name":"f","arguments":{"x":"caf\u00e9 \\u00e9","n":{"m":[{}]}}}</tool_call>',
])
def test_pieces_join_to_the_parse_however_the_text_is_cut(text: str) -> None:
    parsed = parse_hermes(text).tool_calls
    rng = random.Random(7)
    for cuts in ([len(text)], list(range(1, len(text) + 1)), sorted(rng.sample(range(1, len(text)), 9)) + [len(text)]):
        pieces, stream = _stream(text, cuts)
        calls = _joined(pieces)
        assert [calls[i][1] for i in range(len(calls))] == [c.name for c in parsed]
        for i, call in enumerate(parsed):
            assert calls[i][2] == call.arguments_json() == call.raw_arguments
            assert json.loads(calls[i][2]) == call.arguments
        assert [calls[i][0] for i in range(len(calls))] == stream.streamed_ids()


def test_arguments_stream_as_they_come_and_stop_at_their_end() -> None:
    head = '<tool_call>\n{"name": "read_file", "arguments": '
    stream = HermesCallStream(make_id=lambda: "call_x")
    assert stream.feed(head[:-3]) == []  # the head is not complete
    assert stream.feed(head) == []  # the arguments' brace is not there yet
    assert stream.feed(head + '{"pa') == [CallPiece(0, "call_x", "read_file", ""), CallPiece(0, None, None, '{"pa')]
    assert stream.feed(head + '{"path": "x"') == [CallPiece(0, None, None, 'th": "x"')]
    # a split UTF-8 character waits for its next token
    assert stream.feed(head + '{"path": "x\ufffd') == []
    # the call object's own brace and the closing tag are not the arguments'
    assert stream.feed(head + '{"path": "x"}}\n</tool') == [CallPiece(0, None, None, "}")]
    assert stream.feed(head + '{"path": "x"}}\n</tool_call>') == []


def test_calls_the_stream_cannot_follow_come_whole_at_the_end() -> None:
    odd = '<tool_call>\n{"arguments": {"path": "a"}, "name": "read_file"}\n</tool_call>'
    for text in (odd, odd + "\n" + CALL_B, CALL_B + "\n" + odd):
        pieces, stream = _stream(text, list(range(1, len(text) + 1)))
        calls = _joined(pieces)
        parsed = parse_hermes(text).tool_calls
        assert [(calls[i][1], json.loads(calls[i][2])) for i in range(len(calls))] == [
            (c.name, c.arguments) for c in parsed]
        assert stream.stopped
    # one call kept (parallel_tool_calls: false): the second is never announced
    text = CALL_A + "\n" + CALL_B
    pieces, _ = _stream(text, list(range(1, len(text) + 1)), max_calls=1)
    assert set(_joined(pieces)) == {0}


def test_a_call_cut_off_keeps_what_was_sent() -> None:
    text = CALL_A[:60]
    pieces, stream = _stream(text, list(range(1, len(text) + 1)))
    assert parse_hermes(text).tool_calls == [] and len(stream.calls) == 1
    assert _joined(pieces)[0][2] == text[text.index('"arguments": ') + len('"arguments": '):]


@pytest.mark.parametrize("text", [
    # the markup inside an argument's string is text, to the stream and the parse alike
    '<tool_call>\n{"name": "write", "arguments": {"text": "use <tool_call> tags </tool_call>"}}\n</tool_call>',
    # a model that left a closing tag out: the next call opens
    '<tool_call>\n{"name": "f", "arguments": {"p": 1}}\n' + CALL_B,
    # generation stopped inside the closing tag
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_',
    # keys after the arguments are the call object's: the arguments' text is as written
    '<tool_call>\n{"name": "f", "arguments": {"a":1,"s":"\\u00e9"}, "id": "call_9"}\n</tool_call>',
])
def test_the_stream_and_the_parse_read_calls_alike(text: str) -> None:
    parsed = parse_hermes(text).tool_calls
    assert parsed and "tool_" not in parse_hermes(text).content
    for cuts in ([len(text)], list(range(1, len(text) + 1))):
        calls = _joined(_stream(text, cuts)[0])
        assert [(calls[i][1], calls[i][2]) for i in range(len(calls))] == [
            (c.name, c.arguments_json()) for c in parsed]


def test_a_call_the_parse_refuses_shifts_none_of_the_others() -> None:
    """A head announced, then an object the parse refuses: it stays as sent, and the parsed calls
    come at the next indexes, whole (never a parsed call taken for the refused one)."""
    bad = '<tool_call>\n{"name": "bad", "arguments": {"a": 1}, }\n</tool_call>\n'
    good = '<tool_call>\n{"name": "g", "arguments": {"b": "x"}}\n</tool_call>'
    text = bad + good
    pieces, stream = _stream(text, list(range(1, len(text) + 1)))
    calls = _joined(pieces)
    assert [c.name for c in parse_hermes(text).tool_calls] == ["g"]
    assert calls[0][1] == "bad" and (calls[1][1], calls[1][2]) == ("g", '{"b": "x"}')
    one, _ = _stream(text, list(range(1, len(text) + 1)), max_calls=1)
    assert [(c[1], c[2]) for c in _joined(one).values()] == [("bad", '{"a": 1}'), ("g", '{"b": "x"}')]


def test_merged_pieces_join_each_calls_run_and_keep_calls_apart() -> None:
    pieces = [
        CallPiece(0, "call_a", "read_file", ""),
        CallPiece(0, None, None, '{"pa'),
        CallPiece(0, None, None, 'th": 1}'),
        CallPiece(1, "call_b", "list_files", "{"),
        CallPiece(1, None, None, "}"),
    ]
    assert merged_pieces(pieces) == [
        CallPiece(0, "call_a", "read_file", '{"path": 1}'),
        CallPiece(1, "call_b", "list_files", "{}"),
    ]
    # one entry a call even where its pieces are not next to each other
    apart = [CallPiece(0, None, None, "x"), CallPiece(1, None, None, "y"), CallPiece(0, None, None, "z")]
    assert merged_pieces(apart) == [CallPiece(0, None, None, "xz"), CallPiece(1, None, None, "y")]
    assert merged_pieces([]) == []
