"""The Responses API's store: bounded, least recently used first; chains as items; reasoning
items back into the conversation (no server here: the routes' tests are in
``test_server_responses.py``)."""

from __future__ import annotations

import pytest

from agent_runtime.reasoning import reasoning_tokens, reply_parser
from agent_runtime.server.errors import APIError
from agent_runtime.server.openai_responses import input_messages
from agent_runtime.server.response_store import (
    ResponseStore,
    StoredResponse,
    chain_items,
    new_response_id,
)


def _stored(text: str) -> StoredResponse:
    body = {"id": new_response_id("0" * 32), "output": [{"type": "message", "role": "assistant",
                                                          "content": [{"type": "output_text", "text": text}]}]}
    return StoredResponse(body, ({"role": "user", "content": "q"}, *body["output"]), job_id=body["id"])


def test_the_store_drops_the_least_recently_used_first():
    store = ResponseStore(2)
    a, b, c = _stored("a"), _stored("b"), _stored("c")
    store.put(a)
    store.put(b)
    assert store.get(a.id) is a  # a is now the most recently used
    store.put(c)
    assert len(store) == 2 and store.get(b.id) is None and store.get(a.id) is a and store.get(c.id) is c
    assert store.delete(a.id) and not store.delete(a.id) and len(store) == 1
    with pytest.raises(APIError) as missing:
        store.require(a.id, "previous_response_id")
    assert missing.value.status == 400 and missing.value.param == "previous_response_id"
    assert missing.value.code == "previous_response_not_found"
    with pytest.raises(APIError) as unread:
        store.require(a.id)
    assert unread.value.status == 404 and unread.value.code == "response_not_found"


def test_a_store_of_no_size_keeps_nothing_and_sizes_are_checked():
    store = ResponseStore(0)
    store.put(_stored("a"))
    assert not store.enabled and len(store) == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="^responses_store_size: must be an integer >= 0"):
            ResponseStore(bad)  # type: ignore[arg-type]


def test_a_chain_is_its_items_then_the_new_input():
    prev = _stored("Blue.")
    items = chain_items(prev, "And at night?")
    assert items[:-1] == list(prev.items) and items[0] is prev.items[0] and items[-1] == {"type": "message", "role": "user",
                                                             "content": "And at night?"}
    assert chain_items(None, [{"role": "user", "content": "x"}]) == [{"role": "user", "content": "x"}]
    messages = input_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2] == {"role": "assistant", "content": "Blue."}


def test_reasoning_items_go_back_as_the_next_assistant_messages_thinking():
    items = [
        {"role": "user", "content": "Read notes."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use "},
                                                                        {"type": "reasoning_text", "text": "a tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "read_file", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Answer."}]},  # a summary only
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ]
    messages = input_messages(items)
    assert messages[1]["reasoning_content"] == "Use a tool." and messages[1]["content"] is None
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # one turn's calls, one message
    assert messages[3] == {"role": "assistant", "content": "Done.", "reasoning_content": "Answer."}


def test_reasoning_tokens_are_the_blocks_but_its_tags():
    text = "<think>abc</think>Blue."
    pieces = ["<think>", "abc", "</think>", "Blue", "."]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    # NOTE: vLLM's count_reasoning_tokens leaves <think> and </think> out
    assert reasoning_tokens(text, ids, "qwen3", decode) == 1
    assert reasoning_tokens("<think>abc", ids[:2], "qwen3", decode) == 1  # never closed: all of them but the tag
    # no tags: all thinking with qwen3's thinking on (Thinking-2507 opens it in the prompt), 0 off
    tail = lambda i: "".join(pieces[3 + k] for k in range(len(i)))  # noqa: E731
    assert reasoning_tokens("Blue.", ids[3:], "qwen3", tail) == 2
    assert reasoning_tokens("Blue.", ids[3:], reply_parser("qwen3", {"enable_thinking": False}), tail) == 0
    assert reasoning_tokens(text, ids, None, decode) == 0 and reasoning_tokens(text, ids, "qwen3", None) == 0
