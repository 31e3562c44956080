"""OpenAI's Responses API (``POST /v1/responses``), the one the OpenAI Agents SDK and Codex speak,
served by the chat machinery.

A request's ``input`` items become chat messages (:func:`chat_form`): ``instructions`` the system
message, ``message`` items their role's message, consecutive ``function_call`` items the tool
calls of one assistant message (after the text the model wrote before them, so the next turn's
prompt repeats the tokens it generated and its KV stays reusable), ``function_call_output``
items tool messages. Function ``tools`` and ``tool_choice`` become the chat's (constrained
decoding included), ``text.format`` its ``response_format``, and Continuum's ``job_id`` /
``is_last_step`` travel in the body as on chat completions. The reply comes back as output
items: a ``message`` with one ``output_text`` part, then one ``function_call`` item per call;
streamed, as the API's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``).

Stored responses (:mod:`agent_runtime.server.response_store`): a response is kept unless the
request says ``store: false`` (OpenAI's default), a request may continue one
(``previous_response_id``: its chain's items come first; its ``instructions`` are not carried
over), ``GET`` / ``DELETE /v1/responses/{id}`` read and forget one, and ``GET
/v1/responses/{id}/input_items`` lists its input items. A chain is one agent job, its KV pinned
across the tool calls between its turns: the ``job_id`` its first request named; else, where the
engine gives implicit jobs (job admission on), the implicit job a chat client naming none gets,
which an answer without a tool call ends; else its first response's id.

With a reasoning parser (``serve --reasoning-parser``), the thinking comes first as a
``reasoning`` item (``reasoning_text`` content, streamed as ``response.reasoning_text.delta``);
``reasoning`` input items go back into the next assistant message's ``reasoning_content``.

The request's ``reasoning.effort`` is the chat template's ``reasoning_effort`` variable, as vLLM
passes it (gpt-oss's template reads it; others ignore it); ``reasoning.summary`` is accepted and
echoed, but the reasoning item carries the thinking itself, never a summary.

``background: true`` (a stored response) answers at once with the response ``queued``; the
request runs on (:mod:`agent_runtime.server.responses_background`), ``GET`` reads it as it goes
(streamed again with ``stream=true``) and ``POST /v1/responses/{id}/cancel`` stops it.
``max_tool_calls`` caps calls of built-in tools, none of which is served: it is echoed.

An input whose last item is a ``message`` with status ``in_progress`` or ``incomplete`` is
continued (vLLM's ``continue_final_message``): the output message holds the rest of it. A
``function_call_output`` must answer a ``function_call`` before it (OpenAI's 400 otherwise).

``include: ["message.output_text.logprobs"]`` (or ``top_logprobs`` above 0) gives the message's
``output_text`` its tokens' log probabilities, and each text delta those of its tokens.

Not served (a 400 naming the field, never ignored): ``conversation``, built-in tools, non-text
inputs, the other ``include`` values (but ``reasoning.encrypted_content``: reasoning is sent in
the clear), ``truncation: auto``, ``prompt``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import ContextLengthError
from agent_runtime.reasoning import reasoning_tokens
from agent_runtime.server import responses_background as background
from agent_runtime.server.completion_stream import token_decoder
from agent_runtime.server.errors import APIError, from_value_error
from agent_runtime.server.frontend import check_logprobs, log_request
from agent_runtime.server.job_router import response_digest, routing_key
from agent_runtime.server.request_fields import with_reasoning_effort
from agent_runtime.server.response_store import (
    ResponseStore,
    StoredResponse,
    chain_digest,
    chain_items,
    input_items_page,
    new_response_id,
    with_item_ids,
)
from agent_runtime.server.responses import SSE_HEADERS
from agent_runtime.server.responses_input import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    check_call_outputs,
    continues_final_message,
    input_messages,
)
from agent_runtime.server.responses_output import (
    ResponseEnvelope,
    error_event,
    final_output,
    response_events,
    text_logprobs,
)
from agent_runtime.server.serving import finish_one, parse_body
from agent_runtime.server.state import app_state
from agent_runtime.server.streamed_text import StreamedText, without_cut_off_call
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.tool_call_stream import HermesCallStream

PATH = "/v1/responses"


# ----------------------------------------------------------------------------------------------
# The routes
# ----------------------------------------------------------------------------------------------


#: The chat's field names, as the Responses body spells them.
_CHAT_PARAMS = (("messages", "input"), ("response_format.json_schema", "text.format"),
                ("response_format", "text.format"), ("tool_choice.function", "tool_choice"))
_FUNCTION_PARAM = re.compile(r"^tools\[(\d+)\]\.function(\.|$)")


def _as_responses_error(error: APIError) -> APIError:
    """``error`` with its ``param`` named as the Responses body names it (the chat's checks ran
    on the converted request: ``messages`` is ``input``, ``response_format`` ``text.format``,
    ``tools[i].function.x`` ``tools[i].x``)."""
    param = error.param
    if param is None:
        return error
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            param = ours if chat == "messages" else ours + param[len(chat):]
            break
    param = _FUNCTION_PARAM.sub(lambda m: f"tools[{m.group(1)}]{m.group(2)}", param)
    if param != "input" and error.message.startswith(f"{error.param}:"):
        # NOTE: the message names the field as the param does (a chat message's index is kept:
        # it says which rendered message)
        error.message = param + error.message[len(error.param):]
    error.param = param
    return error


class _Chain:
    """What storing a request's response needs: the chain's items through its input, its job,
    and the store (None: not stored)."""

    def __init__(self, store: ResponseStore | None, items: list[Mapping[str, Any]], job_id: str | None) -> None:
        self.store = store
        # NOTE: ids given once: a background response is stored before it finishes, and its
        # input items keep their ids
        self.items = with_item_ids(items)
        self.job_id = job_id

    def keep(self, body: dict[str, Any]) -> None:
        """Store the finished response ``body`` (if the request asked to)."""
        if self.store is not None:
            self.store.put(StoredResponse(body, (*self.items, *body["output"]), self.job_id))


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    state, req = await parse_body(request, ResponsesRequest)
    rt = state.require_runtime()
    responses = state.responses
    previous = None
    if req.previous_response_id is not None:
        previous = responses.require(req.previous_response_id, "previous_response_id")
        if previous.body.get("status") in background.RUNNING:
            raise APIError(400, f"previous_response_id: response {previous.id!r} is still {previous.body['status']}; "
                           "a turn continues it once it has finished", param="previous_response_id")
    stored = req.store is not False and responses.enabled
    if req.background and not stored:
        # NOTE: a background response is only ever read back from the store (OpenAI's rule)
        why = "store: false" if req.store is False else "a server that stores no responses (--responses-store-size 0)"
        raise APIError(400, f"background: a background response must be stored; not with {why}", param="background")
    # NOTE: a chain's ids carry the digest of its first request's routing key (replicas route by it)
    digest = (response_digest(previous.id) if previous is not None else
              chain_digest(routing_key({"job_id": req.job_id, "input": req.input, "instructions": req.instructions})))
    assert digest is not None, "a stored response's id is this server's"
    response_id = new_response_id(digest)
    # NOTE: a chain is a job: the one its client named; else where the engine gives implicit
    # jobs, theirs (an answer ends it: an id of the server's own, which nothing ends, would hold
    # the job gate's reservation until its idle timeout); else its first response's id, so
    # Continuum's pins still hold its KV across its tool calls
    job_id = req.job_id or (previous.job_id if previous is not None else
                            None if rt.implicit_jobs or not stored else response_id)
    try:
        check_logprobs(state.frontend, req.top_logprobs, None, "top_logprobs")
        params = req.sampling_params(state.max_tokens_default(), state.sampling_defaults)
        log_request(state.frontend, response_id, params, req)
        input_messages(req.input)  # NOTE: its own items first, so that an error names input[i] as sent
        items = chain_items(previous, req.input)
        check_call_outputs(items, 1 if isinstance(req.input, str) else len(req.input))
        messages = input_messages(items, req.instructions)
        # NOTE: a partial message last is continued (vLLM's continue_final_message): the reply
        # is the rest of that message, not a thinking block
        continues = continues_final_message(req.input)
        tools = chat_tools(req.tools)
        choice = chat_tool_choice(req.tool_choice)
        fmt = chat_response_format(req.text)
        streams, choice = await rt.start_chat_choices(
            messages, [params], tools=tools, tool_choice=choice, response_format=fmt, job_id=job_id,
            is_last_step=bool(req.is_last_step), parallel_tool_calls=req.parallel_tool_calls is not False,
            strict_max_tokens=req.max_output_tokens is not None,
            add_generation_prompt=not continues, continue_final_message=continues,
            **with_reasoning_effort({}, req.reasoning.effort if req.reasoning else None),
        )
    except ContextLengthError as e:
        raise _as_responses_error(from_value_error(
            ContextLengthError(e.prompt_tokens, e.max_tokens, e.max_model_len, param="max_output_tokens"), "input"
        )) from None
    except ValueError as e:
        raise _as_responses_error(from_value_error(e, "input")) from None
    decode = token_decoder(rt.engine)
    # NOTE: a Responses request has no template variables of its own: the runtime's defaults
    # decide qwen3's enable_thinking (vLLM's _effective_chat_template_kwargs)
    thinking = rt.reply_reasoning_parser(continues, None)
    envelope = ResponseEnvelope(response_id, req, state.model_name, params, stored,
                                lambda text, ids: reasoning_tokens(text, ids, thinking, decode),
                                state.token_texts() if req.reports_logprobs else None)
    chain = _Chain(responses if stored else None, items, job_id)
    stream = streams[0]
    tools_possible = bool(tools) and choice != "none"

    def finished(final: StreamEvent, turn: AssistantTurn) -> dict[str, Any]:
        # NOTE: a continuation is the text as generated, not stripped: its first character may
        # be the blank after the partial message's last word
        content = final.output.text if continues and not turn.parsed.tool_calls else turn.message.get("content")
        text = without_cut_off_call(content or "", final.output.finish_reason == "length",
                                    tools_possible, rt.tool_call_format)
        # NOTE: the message's logprobs are the whole reply's tokens', as vLLM reports them
        logprobs = (text_logprobs(final.output.logprobs or [], envelope.texts) if envelope.texts is not None
                    else None)
        return envelope.body("completed", final_output(turn, text, logprobs), final, turn.finish_reason)

    def events(keep: Callable[[dict[str, Any]], None], on_failed: Callable[[dict[str, Any]], None] | None = None
               ) -> AsyncIterator[str]:
        text = StreamedText(tools_possible, rt.tool_call_format, thinking)
        calls = (HermesCallStream(None if req.parallel_tool_calls is not False else 1)
                 if tools_possible and rt.tool_call_format == "hermes" else None)
        return response_events(stream, envelope, text, state.metrics, keep, calls, on_failed)

    if req.background:
        async def work(run: background.BackgroundRun, keep: Callable[[dict[str, Any]], None]) -> None:
            if req.stream:
                async for frame in events(keep, on_failed=keep):
                    run.write(frame)
                return
            final = await stream.result()
            state.metrics.observe(final)
            keep(finished(final, build_turn(stream, final)))

        queued = StoredResponse(envelope.body("queued", []), chain.items, job_id)
        run = background.start(responses, state.background, queued, stream, work, chain.keep)
        state.metrics.count(PATH, 200)
        if req.stream:
            return StreamingResponse(run.replay(), media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(dict(queued.body))
    if not req.stream:
        final, turn = await finish_one(request, state, stream, PATH)
        body = finished(final, turn)
        chain.keep(body)
        return JSONResponse(body)
    state.metrics.count(PATH, 200)
    return StreamingResponse(events(chain.keep), media_type="text/event-stream", headers=SSE_HEADERS)


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response; with ``stream=true``, a streamed
    background response's events (after ``starting_after``, a sequence number).

    NOTE: a response not created with ``background: true`` is stored once it has finished, as
    vLLM's ``responses_full_generator`` stores it: until then it is a 404 (vLLM's too)."""
    state = app_state(request)
    response_id = request.path_params["response_id"]
    query = request.query_params
    if query.get("stream", "false").lower() in ("true", "1"):
        frames = background.replay_or_404(state.responses, state.background, response_id,
                                          query.get("starting_after"))
        state.metrics.count(PATH, 200)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    found = state.responses.require(response_id)
    state.metrics.count(PATH, 200)
    return JSONResponse(dict(found.body))


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{response_id}/cancel``: stop a background response's run."""
    state = app_state(request)
    body = await background.cancel(state.responses, state.background, request.path_params["response_id"])
    state.metrics.count(PATH, 200)
    return JSONResponse(body)


async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{response_id}/input_items``: the input items of a stored response
    (``limit``, ``order``, ``after``: OpenAI's paging)."""
    state = app_state(request)
    found = state.responses.require(request.path_params["response_id"])
    query = request.query_params
    limit = query.get("limit", "20")
    if not limit.isdigit():
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit!r}", param="limit")
    page = input_items_page(found, int(limit), query.get("order", "desc"), query.get("after"))
    state.metrics.count(PATH, 200)
    return JSONResponse(page)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: forget a stored response (its chain's earlier
    responses stay)."""
    state = app_state(request)
    response_id = request.path_params["response_id"]
    found = state.responses.require(response_id)
    if found.body.get("status") in background.RUNNING:
        # NOTE: its run stops first: a run that finished later would store it again
        await background.cancel(state.responses, state.background, response_id)
    state.responses.delete(response_id)
    state.metrics.count(PATH, 200)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


__all__ = [
    "PATH", "ResponsesRequest", "cancel_response", "chat_response_format", "chat_tool_choice", "chat_tools",
    "create_response",
    "delete_response", "error_event", "get_response", "input_messages", "list_input_items",
]
