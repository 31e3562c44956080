"""The endpoints' handlers; chat and text completions share one response path.

Both completions endpoints validate their body (:mod:`agent_runtime.protocol`), submit through
the runtime, and then answer with :func:`_respond`: a JSON body once the request finished, or
the one SSE path of :mod:`agent_runtime.server.completion_stream` (chunks from an
endpoint-specific encoder, then the optional usage chunk and ``[DONE]``; a client that goes
away has its request aborted, so its KV blocks are freed). Only the body models (``CHAT``,
``COMPLETION`` there) and the choices (:class:`ChatChunks`, :class:`CompletionChunks`) differ
between the endpoints; every body is a response model of :mod:`agent_runtime.protocol`, and its
``model_dump()`` is what goes on the wire.
"""
from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import RequestError
from agent_runtime.reasoning import ReasoningCount
from agent_runtime.request_stream import RequestStream
from agent_runtime.server.body_parsing import (
    REQUEST_ID_HEADER,
    base_request_id,
    parse_json_body,
    parse_request,
)
from agent_runtime.server.choices import (
    ChatChunks,
    Chunks,
    CompletionChunks,
    choice_sampling_params,
    safe_text_len,
)
from agent_runtime.server.completion_stream import (
    CHAT,
    COMPLETION,
    Endpoint,
    UsageReport,
    reasoning_counters,
    sse_events,
    usage_of,
)
from agent_runtime.server.errors import APIError, from_value_error
from agent_runtime.server.frontend import check_logprobs, log_request
from agent_runtime.server.logprobs import TokenTexts
from agent_runtime.server.metrics import CONTENT_TYPE
from agent_runtime.server.request_fields import with_reasoning_effort
from agent_runtime.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_ending,
)
from agent_runtime.server.responses import (
    SSE_HEADERS,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from agent_runtime.server.state import AppState, app_state
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.sampling_params import SamplingParams

#: ``max_tokens`` of a text completion that gives none (OpenAI's and vLLM's 0.32 default: its
#: request model's), capped by the app's ``default_max_tokens`` when one is set.
COMPLETION_DEFAULT_MAX_TOKENS = 16
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


# ----------------------------------------------------------------------------------------------
# Small endpoints
# ----------------------------------------------------------------------------------------------


async def health(request: Request) -> dict[str, str]:
    """``GET /health``: ok while the engine runs, else 503."""
    app_state(request).require_runtime()
    return {"status": "ok"}


async def models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the served model, once per served name (vLLM's)."""
    state = app_state(request)
    state.check_auth(request)
    state.metrics.count("/v1/models", 200)
    return JSONResponse(ModelList(data=[_model_card(state, name) for name in state.served_names]).model_dump())


async def model(request: Request, model_id: str) -> JSONResponse:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the served model's card under that name,
    else a 404."""
    state = app_state(request)
    state.check_auth(request)
    if model_id not in state.served_names:
        served = ", ".join(repr(n) for n in state.served_names)
        raise APIError(404, f"The model {model_id!r} does not exist (this server serves {served})",
                       param="model", code="model_not_found")
    state.metrics.count("/v1/models/{model}", 200)
    return JSONResponse(_model_card(state, model_id).model_dump())


def _model_card(state: AppState, name: str) -> ModelCard:
    """The served model's card under ``name``: as vLLM's, with the engine's model and context
    limit."""
    runtime = state.runtime
    return ModelCard(id=name, created=state.created,
                     root=getattr(runtime, "model_name", None), max_model_len=getattr(runtime, "max_model_len", None))


async def version(request: Request) -> dict[str, str]:
    """``GET /version`` (vLLM's): the package's version."""
    from asymcache_core.version import package_version

    return {"version": package_version()}


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text, engine gauges and vLLM's request and step histograms
    read on the engine thread (one snapshot of both)."""
    state = app_state(request)
    stats, serving = await state.require_runtime().call(
        lambda engine: (engine.stats(), engine.serving_stats.snapshot())
    )
    return Response(state.metrics.render(stats, serving), media_type=CONTENT_TYPE)


def _check_template_trusted(state: AppState, req: ChatCompletionRequest | TokenizeRequest) -> None:
    """A 400 for a chat that brings its own template to a server not told to trust them."""
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(400, "chat_template: this server renders chats with its own template only; start it with "
                       "--trust-request-chat-template to serve templates sent in requests", param="chat_template")


async def tokenize(request: Request) -> JSONResponse:
    """``POST /tokenize``: the ids a prompt or a chat runs as (vLLM's endpoint)."""
    state, req = await parse_body(request, TokenizeRequest, model_required=False)
    _check_template_trusted(state, req)
    rt = state.require_runtime()
    try:
        ids = await rt.tokenize(req.prompt, messages=req.messages, tools=req.tools,
                                add_special_tokens=req.adds_special_tokens,
                                add_generation_prompt=req.chat_ending[0], continue_final_message=req.chat_ending[1],
                                **req.template_options())
    except ValueError as e:
        raise from_value_error(e, "prompt" if req.messages is None else "messages") from None
    state.metrics.count("/tokenize", 200)
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=rt.max_model_len, tokens=ids).model_dump())


async def detokenize(request: Request) -> JSONResponse:
    """``POST /detokenize``: the text of token ids (vLLM's endpoint)."""
    state, req = await parse_body(request, DetokenizeRequest, model_required=False)
    try:
        text = await state.require_runtime().detokenize(req.tokens)
    except ValueError as e:
        raise from_value_error(e, "tokens") from None
    state.metrics.count("/detokenize", 200)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


# ----------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state, req = await parse_body(request, ChatCompletionRequest)
    base_id = base_request_id(request.headers, req.request_id)
    _check_template_trusted(state, req)
    rt = state.require_runtime()
    params = _sampling_params(req, state.max_tokens_default(), state)
    if req.prompt_logprobs is not None and req.streaming:
        raise APIError(400, "prompt_logprobs: not served on a streamed chat completion (vLLM's body field); "
                       "use stream=false or /v1/completions", param="prompt_logprobs")
    texts = _token_texts(state, params, req.return_tokens_as_token_ids)
    log_request(state.frontend, f"{CHAT.id_prefix}-{base_id}", params, req)
    # NOTE: vLLM's get_chat_request_role: --response-role after a generation prompt, else the
    # role of the message the reply continues
    ending = chat_ending(req.add_generation_prompt, req.continue_final_message)
    role = state.frontend.response_role if ending[0] else str(req.messages[-1].get("role") or "assistant")
    try:
        streams, choice = await rt.start_chat_choices(
            req.messages,  # validated in depth by the runtime (ValueError names the field)
            choice_sampling_params(params, req.num_choices),
            tools=req.tools,
            tool_choice=req.tool_choice,
            response_format=req.response_format,
            structured_outputs=req.structured_outputs,
            job_id=req.job_id,
            is_last_step=req.last_step,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            add_generation_prompt=ending[0],
            continue_final_message=bool(req.continue_final_message),
            thinking_token_budget=req.thinking_token_budget,
            # NOTE: a stated max_tokens past the context is a 400, as vLLM's (none: up to the limit)
            strict_max_tokens=req.requested_max_tokens() is not None,
            # NOTE: vLLM's resolve_reasoning_ended: without the reasoning in the reply, the
            # constraint holds from the first token
            constrain_thinking=req.include_reasoning is False,
            **with_reasoning_effort(req.template_options(), req.reasoning_effort),
        )
    except ValueError as e:
        raise from_value_error(e, "messages") from None
    tools_possible = bool(req.tools) and choice != "none"
    thinking = rt.reply_reasoning_parser(bool(req.continue_final_message), req.chat_template_kwargs)
    chunks: list[Chunks] = [
        ChatChunks(s, i, texts, tools_possible, params.logprobs is not None, params.prompt_logprobs is not None,
                   raw_content=bool(req.continue_final_message), call_format=rt.tool_call_format,
                   reasoning_parser=thinking,
                   return_ids=req.return_token_ids is True,
                   include_reasoning=req.include_reasoning is not False, named_tool=choice == "named",
                   forced_tool=tools_possible and choice in ("required", "named"),
                   max_tool_calls=None if req.parallel_tool_calls is not False else 1, role=role)
        for i, s in enumerate(streams)
    ]
    counters = reasoning_counters(rt.engine, rt.reasoning_parser, len(chunks), split=thinking is not None)
    return await _respond(request, state, req, chunks, CHAT, base_id, counters)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state, req = await parse_body(request, CompletionRequest)
    base_id = base_request_id(request.headers, req.request_id)
    rt = state.require_runtime()
    params = _sampling_params(req, min(COMPLETION_DEFAULT_MAX_TOKENS, state.default_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS),
                              state)
    texts = _token_texts(state, params, req.return_tokens_as_token_ids)
    log_request(state.frontend, f"{COMPLETION.id_prefix}-{base_id}", params, req)
    chunks: list[Chunks] = []
    n = req.num_choices
    try:
        for given in req.prompts:
            # NOTE: a text is encoded here, once for all the prompt's choices, with the
            # tokenizer's special tokens unless the request says otherwise (vLLM's default)
            prompt = await rt.tokenize(given, add_special_tokens=req.adds_special_tokens) if isinstance(
                given, str) else given
            group: list[CompletionChunks] = []
            for choice_params in choice_sampling_params(params, n):
                # A job's non-last completion is followed by a tool pause (Continuum's API): pin
                # as after a tool call, attributing the pause to ``tool_name`` when the client
                # names it.
                stream = await rt.submit(
                    prompt, choice_params, job_id=req.job_id, is_last_step=req.last_step,
                    response_format=req.response_format, structured_outputs=req.structured_outputs,
                    pause_tool=(req.tool_name or "default") if req.job_id is not None and not req.last_step else None,
                    strict_max_tokens=req.requested_max_tokens() is not None,
                )
                group.append(CompletionChunks(
                    stream, len(chunks), texts, params.logprobs or 0,
                    return_ids=req.return_token_ids is True, report_logprobs=params.logprobs is not None,
                    report_prompt_logprobs=req.prompt_logprobs is not None, echo_only=req.echo_only,
                ))
                # NOTE: in ``chunks`` at once: whatever fails after (the next submit, the client
                # leaving) aborts every request submitted so far
                chunks.append(group[-1])
            if req.echo:
                # NOTE: the prompt as given, or as the engine runs it (token ids, or cut by
                # ``truncate_prompt_tokens``)
                echo = given if isinstance(given, str) and req.truncate_prompt_tokens is None else None
                echo = echo if echo is not None else await rt.detokenize(group[0].stream.prompt_token_ids)
                for chunk in group:
                    chunk.echo = echo
    except ValueError as e:
        _abort_all(chunks)
        raise from_value_error(e, "prompt") from None
    except BaseException:
        # NOTE: the client left (cancelled) between two submits: no choice may run on alone
        _abort_all(chunks)
        raise
    return await _respond(request, state, req, chunks, COMPLETION, base_id)


def _token_texts(state: AppState, params: SamplingParams, as_ids: bool | None) -> TokenTexts | None:
    """The token decoder when the response reports log probabilities (else None); with vLLM's
    ``return_tokens_as_token_ids``, tokens read ``token_id:<id>``."""
    if params.logprobs is None and params.prompt_logprobs is None:
        return None
    return TokenTexts(None) if as_ids else state.token_texts()


def _abort_all(chunks: list[Chunks]) -> None:
    for chunk in chunks:
        chunk.stream.abort()


async def parse_body(request: Request, model: type[RequestT], model_required: bool = True) -> tuple[AppState, RequestT]:
    """Auth, JSON, the served model (optional on the tokenizer routes, as in vLLM), then the
    body model; every failure an :class:`APIError`."""
    state = app_state(request)
    state.check_auth(request)
    try:
        body = parse_json_body(await request.body())
        # NOTE: the model is checked before the other fields: a wrong model is a 404 whatever
        # else the body holds.
        if model_required or body.get("model") is not None:
            state.check_model(body.get("model"))
        return state, parse_request(model, body)
    except RequestError as e:
        raise from_value_error(e, "prompt") from None


def _sampling_params(req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int,
                     state: AppState) -> SamplingParams:
    # NOTE: vLLM's --max-logprobs (its message), named as the request sends it (a chat's is
    # top_logprobs); before the sampling parameters, which allow at most MAX_LOGPROBS
    check_logprobs(state.frontend, req.requested_logprobs(), req.requested_prompt_logprobs(),
                   "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
    try:
        return req.sampling_params(default_max_tokens, state.sampling_defaults)
    except ValueError as e:
        raise from_value_error(e, "prompt") from None


# ----------------------------------------------------------------------------------------------
# The shared response path
# ----------------------------------------------------------------------------------------------


#: The characters an id keeps as they are in a response header: visible ASCII.
_HEADER_SAFE = "".join(map(chr, range(0x21, 0x7F)))


def request_id_header(base_id: str) -> dict[str, str]:
    """The ``X-Request-Id`` header that names a response's ``base_id``.

    Args:
        base_id: the id from :func:`~agent_runtime.server.body_parsing.base_request_id`.

    Returns:
        The header, to pass to the response.
    """
    # NOTE: a header is latin-1 text: an id with other characters (a body's request_id may hold
    # any) is sent percent-encoded, never a 500
    return {REQUEST_ID_HEADER: urllib.parse.quote(base_id, safe=_HEADER_SAFE)}


async def _respond(
    request: Request,
    state: AppState,
    req: ChatCompletionRequest | CompletionRequest,
    chunks: list[Chunks],
    endpoint: Endpoint,
    base_id: str,
    reasoning: list[ReasoningCount] | None = None,
) -> Response:
    """The response of a submitted completion (one stream per choice): one JSON body once every
    choice finished, or the SSE stream; either with ``base_id`` (:func:`~agent_runtime.server.body_parsing.base_request_id`) in
    ``X-Request-Id``; ``reasoning``: the chat choices' thinking counters (usage's
    ``completion_tokens_details``; None leaves it out)."""
    rid = f"{endpoint.id_prefix}-{base_id}"
    id_header = request_id_header(base_id)
    model, metrics = state.model_name, state.metrics
    forced = state.frontend.enable_force_include_usage
    if not req.streaming:
        finals = await await_finals(request, [c.stream for c in chunks])
        for final in finals:
            metrics.observe(final, one_choice=False)
        metrics.observe_choices(finals, req.num_choices)
        body = endpoint.response_model(
            id=rid, created=int(time.time()), model=model,
            choices=[c.final_choice(final) for c, final in zip(chunks, finals, strict=True)],
            usage=usage_of(finals, req.num_choices, generated=not getattr(req, "echo_only", False),
                           cache_writes=endpoint is CHAT, reasoning=reasoning),
            **chunks[0].response_fields(finals[0]),
        )
        metrics.count(endpoint.path, 200)
        return JSONResponse(body.model_dump(), headers=id_header)
    metrics.count(endpoint.path, 200)
    return StreamingResponse(
        # NOTE: vLLM's should_include_usage: --enable-force-include-usage turns on both
        sse_events(chunks, endpoint, rid, model, UsageReport(
            req.include_usage or forced, req.continuous_usage or forced, req.num_choices, reasoning),
                    metrics, not getattr(req, "echo_only", False)),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **id_header},
    )



async def await_finals(request: Request, streams: list[RequestStream]) -> list[StreamEvent]:
    """The final events of a non-streamed request's choices; aborts them all if the client
    goes away or one of them fails."""
    tasks = [asyncio.ensure_future(stream.result()) for stream in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
            if not pending or any(t.exception() is not None for t in done):
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                for stream in streams:
                    stream.abort()
    finally:
        for stream, task in zip(streams, tasks, strict=True):
            if not task.done():
                stream.abort()
                task.cancel()


async def finish_one(request: Request, state: AppState, stream: RequestStream, path: str
                     ) -> tuple[StreamEvent, AssistantTurn]:
    """The final event and the turn of a non-streamed one-choice request, observed and counted
    as a 200 of ``path`` (the Responses and Messages routes); aborts it if the client leaves."""
    final = (await await_finals(request, [stream]))[0]
    state.metrics.observe(final)
    state.metrics.count(path, 200)
    return final, build_turn(stream, final)


__all__ = [
    "await_finals", "chat_completions", "completions", "detokenize", "finish_one",
    "health", "metrics", "models", "parse_body", "request_id_header", "safe_text_len", "tokenize",
]
