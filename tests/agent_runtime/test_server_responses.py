"""OpenAI's Responses API (``POST /v1/responses``) through the ``openai`` client, against the
chat completions of the same conversation on the same server (greedy: the same tokens)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.agent_runtime.live_server import MODEL, TOOLS, leave_stream_early

#: The chat tools in the Responses API's flat form.
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "Name a colour of the sky."


def _chat(oa, messages, **kw):
    return oa.chat.completions.create(model=MODEL, temperature=0, messages=messages, **kw)


def test_text_reply_equals_the_chat_completion(live, oa):
    # NOTE: 6 tokens compare the two replies token for token as 12 did, at half the steps
    resp = oa.responses.create(model=MODEL, temperature=0, input=QUESTION, instructions="Answer in one word.", max_output_tokens=6)
    chat = _chat(oa, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}],
                 max_tokens=6)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output[0].content[0].type == "output_text" and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    short = oa.responses.create(model=MODEL, temperature=0, input=QUESTION, instructions="Answer in one word.", max_output_tokens=1)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output[-1].status == "incomplete"  # the item cut off is incomplete too
    assert short.usage.input_tokens_details.cached_tokens > 0  # the same prompt's blocks, cached
    streamed = list(oa.responses.create(model=MODEL, temperature=0, input=QUESTION, instructions="Answer in one word.",
                                        max_output_tokens=1, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [i.status for i in done] == ["incomplete"] and streamed[-1].response.output[-1].status == "incomplete"
    live.check()


def test_a_tool_loop_in_items(live, oa):
    first = oa.responses.create(model=MODEL, temperature=0, input=[{"role": "user", "content": "What is in notes.txt?"}],
                                tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "read_file"},
                                max_output_tokens=48)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "read_file" and calls[0].call_id
    assert json.loads(calls[0].arguments)["path"] in ("notes.txt", "todo.md")
    assert calls[0].id.startswith("fc_") and calls[0].status == "completed"
    # the next turn: the items as the client keeps them, the call's output appended
    items = [{"role": "user", "content": "What is in notes.txt?"},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Buy milk."}]
    # NOTE: the second turn's reply is compared token for token with the chat's: 6 tokens do
    # that as 16 did, at fewer steps for both
    second = oa.responses.create(model=MODEL, temperature=0, input=items, tools=FLAT_TOOLS, tool_choice="none",
                                 max_output_tokens=6)
    chat = _chat(oa, [{"role": "user", "content": "What is in notes.txt?"},
                      {"role": "assistant", "content": first.output_text or None,
                       "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                       "function": {"name": "read_file", "arguments": calls[0].arguments}}]},
                      {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Buy milk."}],
                 tools=TOOLS, tool_choice="none", max_tokens=6)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # the turn's prompt starts with the first turn's prompt and the tokens it generated
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    live.check()


def test_streamed_events_add_up_to_the_response(live, oa):
    want = oa.responses.create(model=MODEL, temperature=0, input=QUESTION, max_output_tokens=6)
    events = list(oa.responses.create(model=MODEL, temperature=0, input=QUESTION, max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if want.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and text.strip() == want.output_text
    final = events[-1].response
    assert final.usage.output_tokens == want.usage.output_tokens and final.output[0].content[0].text == text
    # a forced call streams as a function_call item
    events = list(oa.responses.create(model=MODEL, temperature=0, input="Read todo.md.", tools=FLAT_TOOLS, stream=True,
                                      tool_choice={"type": "function", "name": "read_file"}, max_output_tokens=48))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "read_file" and json.loads(done[0].arguments)["path"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[-1].type == "function_call"
    assert final.output[-1].arguments == done[0].arguments
    # the call streams as it is written: its item announced with its name, then its arguments
    # piece by piece, which join to the non-streamed response's
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[-1].type == "function_call" and added[-1].name == "read_file" and added[-1].arguments == ""
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments
    whole = oa.responses.create(model=MODEL, temperature=0, input="Read todo.md.", tools=FLAT_TOOLS, max_output_tokens=48,
                                tool_choice={"type": "function", "name": "read_file"})
    assert whole.output[-1].arguments == done[0].arguments and added[-1].call_id == final.output[-1].call_id
    live.check()


def test_a_client_leaving_a_stream_frees_its_request(live):
    body = {"model": MODEL, "input": "Count from one to one hundred.", "max_output_tokens": 400, "stream": True}
    leave_stream_early(live, "/v1/responses", body, "response.output_text.delta")


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto", "budget": 8}}, "reasoning.budget"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # thinking alone is no conversation
    ({"input": [{"type": "reasoning", "content": "x"}, {"role": "user", "content": "hi"}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),  # not "input.str", a member of the field's union
    ({"input": None}, "input"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_bad_bodies_are_400s_naming_the_field(live, fields, param):
    r = httpx.post(f"{live.base}/v1/responses", json={"model": MODEL, "input": "hi", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(f"{param}:"), r.text
    assert live.engine(lambda e: e.has_unfinished()) is False


def test_off_values_of_unserved_fields_are_accepted(live, oa):
    resp = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False, truncation="disabled",
                               include=["reasoning.encrypted_content"], extra_body={"reasoning": None})
    assert resp.status == "incomplete" and resp.store is False
    live.check()


def test_a_jobs_turns_travel_in_the_body(live, oa):
    # NOTE: greedy (the server samples at temperature 1 by default): a sampled call's arguments
    # may be written otherwise than the history renders them, and fewer tokens would hit
    first = oa.responses.create(model=MODEL, input="List the files.", tools=FLAT_TOOLS, max_output_tokens=32,
                                tool_choice={"type": "function", "name": "list_files"}, temperature=0,
                                extra_body={"job_id": "resp-job-1"})
    call = first.output[-1]
    assert call.type == "function_call"
    # the turn ended in a call of the job's: Continuum decided on its pause
    decision = live.engine(lambda e: live.runtime.controller.decisions[-1])
    assert decision.job_id == "resp-job-1" and decision.tool == "list_files"
    assert decision.context_tokens == first.usage.input_tokens + first.usage.output_tokens
    items = [{"role": "user", "content": "List the files."}, *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "notes.txt todo.md"}]
    last = oa.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=8,
                               extra_body={"job_id": "resp-job-1", "is_last_step": True})
    prev = first.usage.input_tokens + first.usage.output_tokens
    assert last.usage.input_tokens_details.cached_tokens >= (prev - 16) // 16 * 16 > 0
    assert live.engine(lambda e: e.pins.num_pinned_blocks) == 0  # the last step released the job
    live.check()


def test_a_json_schema_format_constrains_the_reply(live, oa):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["blue", "red"]}},
              "required": ["colour"], "additionalProperties": False}
    resp = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24,
                               text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert json.loads(resp.output_text)["colour"] in ("blue", "red")
    live.check()


def test_a_chain_of_stored_responses_is_served_as_its_whole_input(live, oa):
    ask = [{"role": "user", "content": "What is in notes.txt?"}]
    first = oa.responses.create(model=MODEL, temperature=0, input=ask, instructions="Use the tools.", tools=FLAT_TOOLS,
                                tool_choice={"type": "function", "name": "read_file"}, max_output_tokens=48)
    assert first.store is True and first.previous_response_id is None
    call = first.output[-1]
    assert call.type == "function_call"
    # a stored response's chain is a job (its first response's id: this engine gives no implicit
    # jobs, having no job admission): its call's pause was Continuum's to decide, under that id
    decision = live.engine(lambda e: live.runtime.controller.decisions[-1])
    assert decision.job_id == first.id and decision.tool == "read_file" and not live.runtime.implicit_jobs
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "Buy milk."}]
    # NOTE: the two replies below are compared token for token: 6 tokens do that as 16 did
    second = oa.responses.create(model=MODEL, temperature=0, previous_response_id=first.id, input=result,
                                 instructions="Use the tools.", tools=FLAT_TOOLS, tool_choice="none",
                                 max_output_tokens=6)
    whole = oa.responses.create(model=MODEL, temperature=0, input=[*ask, *[i.model_dump(exclude_none=True) for i in first.output],
                                                    *result],
                                instructions="Use the tools.", tools=FLAT_TOOLS, tool_choice="none",
                                max_output_tokens=6, store=False)
    assert second.previous_response_id == first.id and whole.store is False
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    # the chain's KV was kept: the second turn's prompt hit the first turn's blocks
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16 > 0
    # instructions are not carried over: without them the prompt is shorter by the system turn
    bare = oa.responses.create(model=MODEL, temperature=0, previous_response_id=first.id, input=result, tools=FLAT_TOOLS,
                               tool_choice="none", max_output_tokens=1)
    assert bare.usage.input_tokens < second.usage.input_tokens
    # a chain goes on from any stored response, streamed too
    events = list(oa.responses.create(model=MODEL, temperature=0, previous_response_id=second.id, stream=True,
                                      input="And in todo.md?", max_output_tokens=4))
    third = events[-1].response
    assert third.previous_response_id == second.id and third.store is True
    assert oa.responses.retrieve(third.id).output[0].content[0].text == third.output_text
    live.check()


def test_stored_responses_are_read_and_deleted(live, oa):
    resp = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, metadata={"run": "7"})
    got = oa.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    gone = httpx.delete(f"{live.base}/v1/responses/{resp.id}", timeout=60)
    assert gone.status_code == 200 and gone.json() == {"id": resp.id, "object": "response.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{live.base}/v1/responses/{resp.id}", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    r = httpx.post(f"{live.base}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", "previous_response_id": resp.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert r.json()["error"]["code"] == "previous_response_not_found"
    unstored = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    assert httpx.get(f"{live.base}/v1/responses/{unstored.id}", timeout=60).status_code == 404
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def test_a_stored_responses_input_items_are_listed(live, oa):
    """``GET /v1/responses/{id}/input_items`` (the SDK's ``responses.input_items.list``): the
    chain's items and the request's own input, not its output, with ids that stay the same along
    the chain; OpenAI's paging (newest first by default, ``limit``, ``after``, ``order``)."""
    ask = [{"role": "user", "content": "What is in notes.txt?"}]
    first = oa.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, max_output_tokens=48,
                                tool_choice={"type": "function", "name": "read_file"})
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Buy milk."}
    second = oa.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=FLAT_TOOLS,
                                 tool_choice="none", max_output_tokens=2)
    mine = list(oa.responses.input_items.list(first.id, order="asc"))
    assert [(i.type, i.role) for i in mine] == [("message", "user")]
    assert mine[0].content[0].type == "input_text" and mine[0].content[0].text == ask[0]["content"]
    chain = list(oa.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in chain] == ["message", *[o.type for o in first.output], "function_call_output"]
    assert chain[0].id == mine[0].id and chain[-1].call_id == call.call_id and chain[-1].id.startswith("fco_")
    assert len({i.id for i in chain}) == len(chain)
    newest = httpx.get(f"{live.base}/v1/responses/{second.id}/input_items", params={"limit": 1}, timeout=60).json()
    assert newest["object"] == "list" and newest["has_more"] is True
    assert [i["id"] for i in newest["data"]] == [chain[-1].id] == [newest["first_id"]] == [newest["last_id"]]
    rest = httpx.get(f"{live.base}/v1/responses/{second.id}/input_items", timeout=60,
                     params={"limit": 100, "after": newest["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == [i.id for i in reversed(chain[:-1])] and rest["has_more"] is False
    for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")):
        r = httpx.get(f"{live.base}/v1/responses/{second.id}/input_items", params=params, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(f"{live.base}/v1/responses/resp_nope/input_items", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    live.check()


def test_stored_turns_that_name_no_job_leave_no_job_behind(smollm):
    """Where the engine gives implicit jobs (job admission on), a Responses client naming no job
    is followed by them, as a chat client is: one that re-sends its whole history each turn
    (store on, OpenAI's default, no ``previous_response_id``) continues one job, whose answers
    end it, so the job gate does not pile up jobs nothing ends; a chain through
    ``previous_response_id`` continues it too."""
    import openai

    from agent_runtime.presets import resolve_preset
    from agent_runtime.runtime import AgentRuntime
    from agent_runtime.server import create_app
    from tests.agent_runtime.live_server import serving
    from tests.conftest import make_engine

    preset = resolve_preset("asymcache+continuum")
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024, **preset.engine_overrides), policy=preset)
    history = [{"role": "user", "content": "Name a colour."}]
    try:
        assert runtime.implicit_jobs
        with serving(create_app(runtime, MODEL)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            for turn in range(3):
                resp = client.responses.create(model=MODEL, input=history, max_output_tokens=3)
                assert resp.store is True
                history += [resp.output[-1].model_dump(exclude_none=True),
                            {"role": "user", "content": f"Another ({turn})."}]
            chained = client.responses.create(model=MODEL, previous_response_id=resp.id, input="And one more.",
                                              max_output_tokens=3)
            assert chained.previous_response_id == resp.id
            stats = runtime.call_threadsafe(lambda e: e.stats()).result(timeout=30)
            gate = runtime.call_threadsafe(lambda e: set(e.job_admission.jobs)).result(timeout=30)
    finally:
        runtime.close_sync()
        runtime.engine.close()
    assert (stats.implicit_jobs_started_total, stats.implicit_jobs_matched_total) == (1, 3)
    assert gate == set() and stats.jobs_admitted == 0


def test_a_streamed_call_cut_off_is_incomplete_and_not_continued(live, oa):
    """A forced call the length limit cuts off mid-arguments: its stream announced it (the call
    streams as written), the response marks it incomplete, and a turn that continues the
    response is served (the cut-off call, whose arguments are no JSON, is not in its chain)."""
    for limit in range(10, 20):
        events = list(oa.responses.create(model=MODEL, input="Read todo.md.", tools=FLAT_TOOLS, stream=True,
                                          tool_choice={"type": "function", "name": "read_file"},
                                          max_output_tokens=limit, temperature=0))
        final = events[-1].response
        calls = [i for i in final.output if i.type == "function_call"]
        if calls and calls[0].arguments not in ("", "{"):
            break
    assert final.status == "incomplete" and calls[0].status == "incomplete", final.output
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0].arguments)
    assert not any("<tool_call>" in getattr(i, "content", [None])[0].text for i in final.output if i.type == "message")
    nxt = oa.responses.create(model=MODEL, previous_response_id=final.id, input="Never mind.", max_output_tokens=2)
    assert nxt.status in ("completed", "incomplete")
    items = list(oa.responses.input_items.list(nxt.id, order="asc"))
    assert [i.type for i in items] == ["message", "message"]
    live.check()
