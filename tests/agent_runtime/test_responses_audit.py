"""The Responses API against what a user of OpenAI's (and of vLLM's ``/v1/responses``) expects,
through the ``openai`` client: background responses (``background: true``, read back while they
run, streamed again from a sequence number, cancelled), fields the API echoes, and the fields it
refuses with a 400 naming them."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, failing_steps, serving

LONG = {"model": MODEL, "input": "Write a detailed essay about the history of Rome.", "max_output_tokens": 400,
        "temperature": 0}


def _wait_until_done(oa: openai.OpenAI, response_id: str, timeout: float = 120) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = oa.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def _idle(live) -> bool:
    deadline = time.monotonic() + 10
    while live.engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live.engine(lambda e: e.has_unfinished()) is False


def test_a_background_response_answers_at_once_and_is_read_back_as_the_foreground_one(live, oa):
    body = {"model": MODEL, "input": "Name a colour of the sky.", "max_output_tokens": 6, "temperature": 0}
    queued = oa.responses.create(**body, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == [] and queued.usage is None
    done = _wait_until_done(oa, queued.id)
    fore = oa.responses.create(**body)
    assert fore.background is False
    assert done.id == queued.id and done.background is True and done.status == fore.status
    assert done.output_text == fore.output_text and done.usage.output_tokens == fore.usage.output_tokens
    # a finished background response is continued as any stored one
    nxt = oa.responses.create(model=MODEL, previous_response_id=done.id, input="And at night?", max_output_tokens=2)
    items = list(oa.responses.input_items.list(nxt.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[1].content[0].text == done.output_text
    # a finished one cannot be cancelled, nor a foreground one (OpenAI's and vLLM's 400)
    for rid in (done.id, fore.id):
        with pytest.raises(openai.BadRequestError) as err:
            oa.responses.cancel(rid)
        assert err.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        oa.responses.cancel("resp_nope")
    live.check()


def test_cancelling_a_background_response_aborts_its_request(live, oa):
    queued = oa.responses.create(**LONG, background=True)
    deadline = time.monotonic() + 60
    while oa.responses.retrieve(queued.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert oa.responses.retrieve(queued.id).status == "in_progress"
    # a turn cannot continue a response still running
    r = httpx.post(f"{live.base}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", "previous_response_id": queued.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    cancelled = oa.responses.cancel(queued.id)
    assert cancelled.id == queued.id and cancelled.status == "cancelled"
    assert _idle(live)  # its engine request was aborted: nothing runs, its blocks are back
    time.sleep(0.3)
    assert oa.responses.retrieve(queued.id).status == "cancelled"  # the run did not store it after all
    assert oa.responses.cancel(queued.id).status == "cancelled"  # cancelling again changes nothing
    live.check()


def test_deleting_a_running_background_response_stops_it(live, oa):
    queued = oa.responses.create(**LONG, background=True)
    gone = httpx.delete(f"{live.base}/v1/responses/{queued.id}", timeout=60)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert _idle(live)
    time.sleep(0.3)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(queued.id)  # the run did not store it again
    live.check()


def test_a_streamed_background_response_is_streamed_again_from_a_sequence_number(live, oa):
    events = list(oa.responses.create(model=MODEL, input="Name a colour of the sky.", max_output_tokens=6,
                                      temperature=0, background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.background is True
    assert events[-1].type in ("response.completed", "response.incomplete")
    rid = events[0].response.id
    stored = oa.responses.retrieve(rid)
    assert stored.status == events[-1].response.status and stored.output_text == events[-1].response.output_text
    again = list(oa.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in again] == list(range(4, len(events)))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
    # only a streamed background response can be streamed again
    fore = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    r = httpx.get(f"{live.base}/v1/responses/{fore.id}", params={"stream": "true"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = httpx.get(f"{live.base}/v1/responses/{rid}", params={"stream": "true", "starting_after": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    live.check()


def test_a_client_leaving_a_background_stream_leaves_the_run_going(live, oa):
    with httpx.stream("POST", f"{live.base}/v1/responses", json={**LONG, "max_output_tokens": 24, "background": True,
                                                                   "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                rid = json.loads(line[6:])["response"]["id"]
                break
    done = _wait_until_done(oa, rid)
    assert done.status == "incomplete" and done.usage.output_tokens == 24
    live.check()


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True, "store": False}, "background"),
    ({"background": "yes"}, "background"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content", "message.input_image.image_url"]}, "include[1]"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    # a call's arguments are named as the item that holds them, not as the chat message it becomes
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{bad",
                                                   "call_id": "c"}]}, "input[1].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "[1]", "call_id": "c"}]}, "input[0].arguments"),
])
def test_bad_bodies_are_400s_naming_the_field(live, fields, param):
    r = httpx.post(f"{live.base}/v1/responses", json={"model": MODEL, "input": "hi", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(f"{param}:"), r.text
    assert _idle(live)


def test_a_server_storing_nothing_refuses_background_responses(live):
    with serving(create_app(live.runtime, MODEL, responses_store_size=0)) as base:
        r = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": "hi", "background": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    assert "responses-store-size" in r.json()["error"]["message"]


def test_max_tool_calls_is_echoed(oa):
    """OpenAI's ``max_tool_calls`` caps calls of built-in tools; none is served, so it caps
    nothing, and the response says what was asked (it was a 400)."""
    resp = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, max_tool_calls=3)
    assert resp.max_tool_calls == 3 and resp.background is False


def test_a_server_shutting_down_stops_its_background_runs(live):
    """The app's shutdown cancels the runs still going: their requests are aborted, not left
    running on an engine that outlives the app."""
    with serving(create_app(live.runtime, MODEL)) as base:
        r = httpx.post(f"{base}/v1/responses", json={**LONG, "background": True}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "queued"
        time.sleep(0.3)
        assert live.engine(lambda e: e.has_unfinished()) is True
    assert _idle(live)
    live.check()


def test_a_cancel_goes_to_the_replica_that_stores_the_response():
    """Behind ``serve --replicas`` the gateway sends a cancel where the response is stored, as
    it sends its reads and deletes."""
    from agent_runtime.server.job_router import RESPONSE_KEY, needs_home
    from agent_runtime.server.response_store import new_response_id

    digest = "ab" * 16
    rid = new_response_id(digest)
    assert needs_home("POST", f"/v1/responses/{rid}/cancel", None) == RESPONSE_KEY + digest
    assert needs_home("GET", f"/v1/responses/{rid}", None) == RESPONSE_KEY + digest
    assert needs_home("POST", f"/v1/responses/{rid}/other", None) is None


def test_logprobs_are_the_chat_completions_and_stream_with_their_deltas(live, oa):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (vLLM's and OpenAI's):
    the message's ``output_text`` carries its tokens' log probabilities, the same as the chat
    completion of the same conversation reports; streamed, each text delta carries its tokens',
    and the done event and the final part the whole list."""
    ask = {"model": MODEL, "input": "Name a colour of the sky.", "max_output_tokens": 6, "temperature": 0}
    resp = oa.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask["input"]}], max_tokens=6,
                                      temperature=0, logprobs=True, top_logprobs=2)
    got = resp.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert resp.top_logprobs == 2 and len(got) == resp.usage.output_tokens == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert (mine.token, mine.bytes) == (theirs.token, theirs.bytes)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert len(mine.top_logprobs) == 2
    assert "".join(lp.token for lp in got).startswith(resp.output_text)
    events = list(oa.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(len(e.logprobs) >= 1 for e in deltas)
    assert "".join(lp.token for e in deltas for lp in e.logprobs).startswith("".join(e.delta for e in deltas))
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in got]
    assert events[-1].response.output[0].content[0].logprobs == got
    # without the include (and no top_logprobs) the part's logprobs stay empty
    plain = oa.responses.create(**ask)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 0
    # top_logprobs alone asks for them too, with alternatives
    alone = oa.responses.create(**ask, top_logprobs=1)
    assert [len(lp.top_logprobs) for lp in alone.output[0].content[0].logprobs] == [1] * len(got)
    live.check()


def test_a_reply_cut_off_after_a_complete_call_is_incomplete_without_the_cut_off_text(live, oa):
    """``tool_choice: required`` lets the model write one call after another; the length limit
    cutting off the second one (greedy SmolLM2: after 40 tokens, ``<tool_call`` of it) leaves
    the response ``incomplete`` (it was ``completed``: the turn reports ``tool_calls``) with the
    complete call, and no message holding the cut-off call's text (it held ``<tool_call``)."""
    tool = {"type": "function", "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    ask = {"model": MODEL, "input": "Read notes.txt", "tools": [tool], "tool_choice": "required",
           "max_output_tokens": 40, "temperature": 0}
    raw = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask["input"]}], max_tokens=40,
                                     temperature=0, tools=[{"type": "function", "function": {
                                         k: v for k, v in tool.items() if k != "type"}}], tool_choice="required")
    # the chat route: the complete call, and no markup of the cut-off one as content
    assert raw.choices[0].message.content is None and len(raw.choices[0].message.tool_calls) == 1
    assert raw.choices[0].finish_reason == "tool_calls"
    resp = oa.responses.create(**ask)
    events = list(oa.responses.create(**ask, stream=True))
    for got in (resp, events[-1].response):
        assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
        assert [(i.type, i.status, i.name) for i in got.output] == [("function_call", "completed", "read_file")]
        assert json.loads(got.output[0].arguments) == json.loads(raw.choices[0].message.tool_calls[0].function.arguments)
    assert events[-1].type == "response.incomplete"
    assert not [e for e in events if e.type == "response.output_text.delta"]
    # the chain goes on from the complete call
    nxt = oa.responses.create(model=MODEL, previous_response_id=resp.id, max_output_tokens=2, input=[
        {"type": "function_call_output", "call_id": resp.output[0].call_id, "output": "Buy milk."}])
    assert [i.type for i in oa.responses.input_items.list(nxt.id, order="asc")] == [
        "message", "function_call", "function_call_output"]
    live.check()


def test_background_runs_count_against_the_bound_on_completions_in_flight(smollm):
    """A background response runs on after its request answered; the bound on completions in
    flight (``max_num_seqs`` + ``--max-queue-len``) counts it all the same, so background
    requests cannot pile up past it: the next is a 429 until one ends."""
    from agent_runtime.runtime import AgentRuntime
    from tests.conftest import make_engine

    runtime = AgentRuntime(make_engine(smollm, max_model_len=512, max_num_seqs=1))
    try:
        with serving(create_app(runtime, MODEL, max_queue_len=0)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            first = client.responses.create(**LONG, background=True)
            for body in ({**LONG, "background": True}, {**LONG, "max_output_tokens": 1}):
                r = httpx.post(f"{base}/v1/responses", json=body, timeout=60)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert client.responses.cancel(first.id).status == "cancelled"
            second = client.responses.create(**{**LONG, "max_output_tokens": 2}, background=True)
            assert _wait_until_done(client, second.id).status == "incomplete"
            assert client.responses.create(**{**LONG, "max_output_tokens": 1}).status == "incomplete"
        assert runtime.call_threadsafe(lambda e: e.has_unfinished()).result(timeout=30) is False
    finally:
        runtime.close_sync()
        runtime.engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_background_response_whose_request_fails_is_stored_failed(live, oa, stream):
    """A step fault fails a background request: its stored response says ``failed`` with the
    error (it never stays ``in_progress``), streamed ones after an ``error`` and a
    ``response.failed`` event; nothing is left running."""
    with failing_steps(live, 27):
        body = {"model": MODEL, "input": "Count to ten.", "max_output_tokens": 27, "background": True}
        if stream:
            events = list(oa.responses.create(**body, stream=True))
            assert [e.type for e in events][-2:] == ["error", "response.failed"]
            rid = events[0].response.id
        else:
            rid = oa.responses.create(**body).id
        failed = _wait_until_done(oa, rid)
    assert failed.status == "failed" and "injected forward-pass fault" in failed.error.message
    assert failed.error.code == "server_error"
    assert _idle(live)
    live.check()
