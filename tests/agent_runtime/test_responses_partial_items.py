"""Responses input items as vLLM 0.32 (``entrypoints/openai/responses``) and OpenAI read them: a
partial message last is continued (``should_continue_final_message``: ``continue_final_message``
rather than a generation prompt), its continuation is one message with it in the next turn's
prompt, a thinking block no message follows is a message of its own, and a
``function_call_output`` must answer a call before it (OpenAI's 400, and vLLM's Harmony path's).

The item-level tests need no server; the route's use a live server over SmolLM2 (its outputs
compared with the chat completion of the same chat)."""

from __future__ import annotations

import json

import httpx
import pytest

from agent_runtime.server.response_store import chain_items
from agent_runtime.server.responses_input import (
    check_call_outputs,
    continues_final_message,
    input_messages,
)
from tests.agent_runtime.live_server import MODEL

USER = {"role": "user", "content": "What is the capital of France?"}
PREFIX = "The capital of France is"


def _assistant(text: str, status: str | None = None) -> dict[str, object]:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return item if status is None else {**item, "status": status}


def _call(call_id: str) -> dict[str, object]:
    return {"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": "{}"}


def _output(call_id: object) -> dict[str, object]:
    return {"type": "function_call_output", "call_id": call_id, "output": "x"}


# -- the items ---------------------------------------------------------------------------------


@pytest.mark.parametrize("items,continued", [
    ([USER, _assistant(PREFIX, "in_progress")], True),
    ([USER, _assistant(PREFIX, "incomplete")], True),
    ([USER, _assistant(PREFIX, "completed")], False),
    ([USER, _assistant(PREFIX)], False),
    ([_assistant(PREFIX, "in_progress"), USER], False),  # only the last item counts
    ([USER, {**_call("c1"), "status": "in_progress"}], False),  # calls are never continued
    ("Hi.", False),
    ([], False),
])
def test_which_inputs_are_continued(items, continued):
    assert continues_final_message(items) is continued


def test_a_partial_reasoning_item_last_is_a_400_naming_its_status():
    reasoning = {"type": "reasoning", "status": "in_progress", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Hmm"}]}
    with pytest.raises(ValueError, match=r"^input\[1\]\.status: continuing a reasoning item is not served"):
        continues_final_message([USER, reasoning])
    assert continues_final_message([USER, {**reasoning, "status": "completed"}]) is False


def test_a_continuation_is_one_message_with_the_partial_one():
    items = [USER, _assistant(PREFIX, "in_progress"), _assistant(" Paris."), {"role": "user", "content": "Thanks."}]
    assert input_messages(items)[1:] == [{"role": "assistant", "content": f"{PREFIX} Paris."},
                                         {"role": "user", "content": "Thanks."}]
    # two finished messages stay two, as they were written
    assert len(input_messages([USER, _assistant("A."), _assistant("B.")])) == 3


def test_thinking_no_message_follows_is_a_message_of_its_own():
    thinking = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]}
    # cut off in its thinking, then the user spoke again: not the next turn's thinking
    messages = input_messages([USER, thinking, {"role": "user", "content": "Go on."}, _assistant("Paris.")])
    assert messages[1:] == [{"role": "assistant", "content": "", "reasoning_content": "Think."},
                            {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Paris."}]
    assert input_messages([USER, thinking])[-1] == {"role": "assistant", "content": "", "reasoning_content": "Think."}


def test_a_call_output_must_answer_a_call_before_it():
    check_call_outputs([USER, _call("c1"), _output("c1")], 3)
    # the call in the chain, its output in the request's own input
    chain = chain_items(None, [USER, _call("c1")])
    check_call_outputs([*chain, _output("c1")], 1)
    with pytest.raises(ValueError, match=r"^input\[0\]\.call_id: no tool call found for function call output "
                                         r"with call_id 'c2'$"):
        check_call_outputs([*chain, _output("c2")], 1)
    with pytest.raises(ValueError, match=r"^input\[0\]\.call_id: .* 'c1'$"):
        check_call_outputs([_output("c1"), _call("c1")], 2)  # its call comes after it


# -- the route -----------------------------------------------------------------------------------


def _post(live, **body: object) -> httpx.Response:
    return httpx.post(f"{live.base}/v1/responses", json={"model": MODEL, **body}, timeout=120)


def _events(text: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


PARTIAL = [USER, _assistant(PREFIX, "in_progress")]


def test_a_partial_message_is_continued_as_the_chat_continues_it(live, oa):
    chat = oa.chat.completions.create(
        model=MODEL, messages=[USER, {"role": "assistant", "content": PREFIX}], temperature=0, max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    got = oa.responses.create(model=MODEL, input=PARTIAL, temperature=0, max_output_tokens=3)
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.output_text == chat.choices[0].message.content and got.output_text
    # the same items finished: a new assistant turn (its generation prompt), another prompt
    fresh = oa.responses.create(model=MODEL, input=[USER, _assistant(PREFIX)], temperature=0, max_output_tokens=1)
    assert fresh.usage.input_tokens != got.usage.input_tokens
    live.check()


def test_a_streamed_continuation_and_the_turn_after_it(live, oa):
    events = _events(_post(live, input=PARTIAL, temperature=0, max_output_tokens=3, stream=True).text)
    got = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and text == got["output"][0]["content"][0]["text"]
    # the next turn's prompt has the message whole, as the model wrote it
    nxt = oa.responses.create(model=MODEL, previous_response_id=got["id"], input="Thanks.", max_output_tokens=1)
    whole = oa.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[USER, {"role": "assistant", "content": PREFIX + text},
                                             {"role": "user", "content": "Thanks."}])
    assert nxt.usage.input_tokens == whole.usage.prompt_tokens
    live.check()


@pytest.mark.parametrize("body,param", [
    ({"input": [USER, _output("call_1")]}, "input[1].call_id"),
    ({"input": [USER, {"type": "reasoning", "status": "in_progress", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "Hmm"}]}]}, "input[1].status"),
])
def test_items_that_cannot_be_served_are_400s_naming_them(live, body, param):
    r = _post(live, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert not live.engine(lambda e: e.has_unfinished())
