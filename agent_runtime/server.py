"""OpenAI-compatible HTTP server over an :class:`~agent_runtime.runtime.AgentRuntime`.

Endpoints: ``POST /v1/chat/completions`` (tools, ``tool_choice`` auto/none/required/named,
SSE streaming, usage with ``prompt_tokens_details.cached_tokens``), ``POST /v1/completions``
(prompt text or token ids, streaming), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text). Continuum's ``job_id`` and ``is_last_step`` travel in the request body (the
openai client's ``extra_body``). Non-standard body fields also accepted: ``top_k``,
``ignore_eos``. ``temperature`` defaults to 0 (greedy), so agent runs are reproducible.

Every client error is a 4xx with OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``; a client that disconnects mid-stream has its request aborted (its blocks freed).
The app is built by :func:`create_app` (no module-level state); :func:`serve` runs it with
uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from agent_runtime.policies import PolicySpec
from agent_runtime.runtime import AgentRuntime, RequestStream, StreamEvent, build_turn
from agent_runtime.tool_parsing import to_openai_tool_calls
from asymcache_core.sampling_params import SamplingParams

_TOOL_OPEN = "<tool_call>"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status.
        message: human-readable message.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the offending request field, if any.
        code: a machine-readable code, if any.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body.

        Returns:
            ``{"error": {"message", "type", "param", "code"}}``.
        """
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response.

        Returns:
            The JSON response.
        """
        return JSONResponse(self.body(), status_code=self.status)


def _from_value_error(exc: ValueError, prompt_param: str) -> APIError:
    """Map a ``"field: message"`` ValueError (engine, runtime, SamplingParams) to a 400."""
    text = str(exc)
    head = text.split(":", 1)[0].strip() if ":" in text else ""
    param: str | None = head if head and " " not in head else None
    code: str | None = None
    if param == "prompt":
        param = prompt_param
        if "max_model_len" in text:
            code = "context_length_exceeded"
    elif param == "num_kv_blocks":
        param, code = "max_tokens", "context_length_exceeded"
    return APIError(400, text, param=param, code=code)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


@dataclass
class Histogram:
    """A Prometheus histogram (cumulative buckets rendered at scrape time).

    Attributes:
        buckets: upper bounds (seconds), ascending.
    """

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Add one observation.

        Args:
            value: seconds.
        """
        if not math.isfinite(value):
            return
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def render(self, name: str, help_text: str) -> list[str]:
        """Prometheus text lines.

        Args:
            name: metric name.
            help_text: HELP text.

        Returns:
            The lines.
        """
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for bound, c in zip(self.buckets, self.counts, strict=True):
            acc += c
            lines.append(f'{name}_bucket{{le="{bound}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


@dataclass
class ServerMetrics:
    """What ``/metrics`` reports besides the engine's own counters (one per app)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(_TPOT_BUCKETS))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0
    aborted: int = 0

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe(self, final: StreamEvent) -> None:
        out = final.output
        if out.finish_reason == "abort":
            self.aborted += 1
            return
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        self.prompt_tokens += out.num_prompt_tokens
        self.cached_tokens += m.cached_tokens
        self.completion_tokens += len(out.token_ids)
        if final.metrics is not None:
            self.recomputed_tokens += final.metrics.recomputed_tokens


def _engine_snapshot(engine: Any) -> dict[str, float]:
    """Engine gauges and counters (runs on the engine thread)."""
    stats = engine.stats().as_dict()
    # NOTE: the peak and the request count are not exported; /metrics keeps its earlier names.
    stats.pop("kv_blocks_peak_in_use")
    stats.pop("requests_total")
    return stats


def render_metrics(metrics: ServerMetrics, engine: Mapping[str, float], model: str) -> str:
    """Prometheus text exposition.

    Args:
        metrics: the server's counters.
        engine: :func:`_engine_snapshot` values.
        model: model name (a label).

    Returns:
        The text.
    """
    p = "asymcache_"
    lines = [f"# HELP {p}requests_total HTTP requests by endpoint and status.", f"# TYPE {p}requests_total counter"]
    for (endpoint, status), n in sorted(metrics.requests.items()):
        lines.append(f'{p}requests_total{{endpoint="{endpoint}",status="{status}",model="{model}"}} {n}')
    lines += metrics.ttft.render(f"{p}time_to_first_token_seconds", "Time to first token.")
    lines += metrics.tpot.render(f"{p}time_per_output_token_seconds", "Mean time per output token after the first.")
    counters = {
        "prompt_tokens_total": (metrics.prompt_tokens, "Prompt tokens of finished requests."),
        "cache_hit_tokens_total": (metrics.cached_tokens, "Prompt tokens served from the KV cache."),
        "recomputed_tokens_total": (metrics.recomputed_tokens, "Tokens computed again (evicted history, holes, preemption)."),
        "completion_tokens_total": (metrics.completion_tokens, "Generated tokens."),
        "aborted_requests_total": (metrics.aborted, "Requests aborted (client disconnects included)."),
    }
    for name, (value, help_text) in counters.items():
        lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} counter", f"{p}{name} {value}"]
    for name, value in engine.items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# TYPE {p}{name} {kind}", f"{p}{name} {value}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Request parsing
# ----------------------------------------------------------------------------------------------


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"Invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _sampling_params(body: Mapping[str, Any], default_max_tokens: int, chat: bool) -> SamplingParams:
    """SamplingParams from an OpenAI body; every bad field is a 400 naming it."""
    key = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        key, max_tokens = "max_completion_tokens", body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise APIError(400, f"{key}: must be an integer >= 1, got {max_tokens!r}", param=key)
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {n!r}", param="n")
    temperature = body.get("temperature", 0.0)
    temperature = 0.0 if temperature is None else temperature
    if not _is_num(temperature) or not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature: must be a number in [0, 2], got {temperature!r}", param="temperature")
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_num(top_p) or not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p: must be a number in (0, 1], got {top_p!r}", param="top_p")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None else top_k
    if not _is_int(top_k) or top_k < -1:
        raise APIError(400, f"top_k: must be an integer >= -1, got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(400, f"seed: must be an integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    if stop is None:
        stop_t: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stop_t = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 16:
        stop_t = tuple(stop)
    else:
        raise APIError(400, "stop: must be a string or a list of up to 16 non-empty strings", param="stop")
    if stop_t and any(not s for s in stop_t):
        raise APIError(400, "stop: stop strings must be non-empty", param="stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos: must be a boolean", param="ignore_eos")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
            seed=seed, stop=stop_t, ignore_eos=ignore_eos,
        )
    except ValueError as e:
        raise _from_value_error(e, "prompt") from None


def _job_fields(body: Mapping[str, Any]) -> tuple[str | None, bool]:
    job_id = body.get("job_id")
    if job_id is not None and (not isinstance(job_id, str) or not job_id or len(job_id) > 256):
        raise APIError(400, "job_id: must be a non-empty string of at most 256 characters", param="job_id")
    last = body.get("is_last_step", False)
    if last is None:
        last = False
    if not isinstance(last, bool):
        raise APIError(400, "is_last_step: must be a boolean", param="is_last_step")
    return job_id, last


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "stream: must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise APIError(400, "stream_options: must be an object", param="stream_options")
    return stream, bool(opts.get("include_usage", False))


def _usage(final: StreamEvent) -> dict[str, Any]:
    out = final.output
    prompt, completion = out.num_prompt_tokens, len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.cached_tokens},
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _safe_text_len(text: str, hold_tool_tag: bool) -> int:
    """How much of ``text`` may be streamed as content now.

    Holds back a trailing replacement character (an incomplete UTF-8 sequence the next token
    completes) and, when tool calls are possible, everything from a ``<tool_call>`` tag on (or
    a trailing piece that may become one), which is sent as ``tool_calls`` at the end instead.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    if hold_tool_tag:
        at = text.find(_TOOL_OPEN)
        if at >= 0:
            return min(end, at)
        for k in range(min(len(_TOOL_OPEN) - 1, end), 0, -1):
            if _TOOL_OPEN.startswith(text[end - k : end]):
                return end - k
    return end


async def _await_final(request: Request, stream: RequestStream) -> StreamEvent:
    """The final event of a non-streamed request; aborts it if the client goes away."""
    task = asyncio.ensure_future(stream.result())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                stream.abort()
    finally:
        if not task.done():
            stream.abort()
            task.cancel()


# ----------------------------------------------------------------------------------------------
# App
# ----------------------------------------------------------------------------------------------


RuntimeSource = AgentRuntime | Any | Callable[[], Any]


def _as_runtime(obj: Any) -> tuple[AgentRuntime, bool]:
    """An AgentRuntime from a runtime or an engine; the flag says whether we built it."""
    if isinstance(obj, AgentRuntime):
        return obj, False
    if hasattr(obj, "add_request") and hasattr(obj, "step"):
        cfg = obj.config
        # A bare engine: pin across tool pauses exactly when it runs Continuum's program FCFS.
        pinning = cfg.priority == "program"
        spec = PolicySpec(
            cfg.eviction_policy + ("+continuum" if pinning else ""),
            {"eviction_policy": cfg.eviction_policy, "priority": cfg.priority},
            pinning,
        )
        return AgentRuntime(obj, policy=spec), True
    raise TypeError("runtime_or_engine_factory: expected an AgentRuntime, an Engine, or a factory of one")


def create_app(
    runtime_or_engine_factory: RuntimeSource,
    model_name: str,
    api_key: str | None = None,
    *,
    default_max_tokens: int = 512,
) -> FastAPI:
    """Build the OpenAI-compatible app.

    Args:
        runtime_or_engine_factory: an :class:`AgentRuntime` (used as is, never closed by the
            app), an ``Engine`` (wrapped in a runtime the app owns), or a zero-argument callable
            returning either (called at startup; what it builds is closed at shutdown).
        model_name: the ``model`` clients must send (and ``/v1/models`` lists).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        default_max_tokens: ``max_tokens`` when a request gives none.

    Returns:
        The FastAPI app.
    """
    holder: dict[str, Any] = {"runtime": None, "owned": False}
    source = runtime_or_engine_factory
    if isinstance(source, AgentRuntime) or (hasattr(source, "add_request") and hasattr(source, "step")):
        holder["runtime"], holder["owned"] = _as_runtime(source)
        factory: Callable[[], Any] | None = None
    elif callable(source):
        factory = source
    else:
        raise TypeError("runtime_or_engine_factory: expected an AgentRuntime, an Engine, or a factory of one")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if holder["runtime"] is None and factory is not None:
            built = await asyncio.to_thread(factory)
            holder["runtime"], _ = _as_runtime(built)
            holder["owned"] = True  # whatever the factory built is ours to close
        try:
            yield
        finally:
            rt = holder["runtime"]
            if rt is not None and holder["owned"]:
                await rt.close()

    app = FastAPI(title="AsymCache OpenAI-compatible server", lifespan=lifespan)
    metrics = ServerMetrics()
    app.state.metrics = metrics
    app.state.holder = holder
    created = int(time.time())

    def runtime() -> AgentRuntime:
        rt = holder["runtime"]
        if rt is None or rt.closed:
            raise APIError(503, "The engine is not running", type="server_error", code="engine_unavailable")
        return rt

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key")

    def check_model(body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            raise APIError(400, "model: required", param="model")
        if model != model_name:
            raise APIError(
                404, f"The model {model!r} does not exist (this server serves {model_name!r})",
                param="model", code="model_not_found",
            )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.count(request.url.path, exc.status)
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        metrics.count(request.url.path, 500)
        return APIError(500, f"Internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        runtime()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        metrics.count("/v1/models", 200)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "asymcache"}],
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        snap = await runtime().call(_engine_snapshot)
        return PlainTextResponse(
            render_metrics(metrics, snap, model_name), media_type="text/plain; version=0.0.4"
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        body = await _json_body(request)
        check_model(body)
        rt = runtime()
        params = _sampling_params(body, default_max_tokens, chat=True)
        job_id, last = _job_fields(body)
        stream_mode, include_usage = _stream_flags(body)
        try:
            stream, choice = await rt.start_chat(
                body.get("messages"),  # validated by the runtime (ValueError names the field)
                tools=body.get("tools"),
                tool_choice=body.get("tool_choice"),
                params=params,
                job_id=job_id,
                is_last_step=last,
            )
        except ValueError as e:
            raise _from_value_error(e, "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tools_possible = bool(body.get("tools")) and choice != "none"
        if not stream_mode:
            final = await _await_final(request, stream)
            metrics.observe(final)
            turn = build_turn(stream, final)
            metrics.count("/v1/chat/completions", 200)
            return JSONResponse({
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "message": turn.message, "finish_reason": turn.finish_reason,
                             "logprobs": None}],
                "usage": _usage(final),
            })
        metrics.count("/v1/chat/completions", 200)
        return StreamingResponse(
            _chat_sse(stream, rid, model_name, tools_possible, include_usage, metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body = await _json_body(request)
        check_model(body)
        rt = runtime()
        prompt = _completion_prompt(body.get("prompt"))
        params = _sampling_params(body, min(16, default_max_tokens), chat=False)
        job_id, last = _job_fields(body)
        stream_mode, include_usage = _stream_flags(body)
        tool_name = body.get("tool_name")
        if tool_name is not None and not isinstance(tool_name, str):
            raise APIError(400, "tool_name: must be a string", param="tool_name")
        return_ids = body.get("return_token_ids", False) is True
        try:
            # A job's non-last completion is followed by a tool pause (Continuum's API): pin as
            # after a tool call, attributing the pause to ``tool_name`` when the client names it.
            stream = await rt.submit(
                prompt, params, job_id=job_id, is_last_step=last,
                pause_tool=(tool_name or "default") if job_id is not None and not last else None,
            )
        except ValueError as e:
            raise _from_value_error(e, "prompt") from None
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if not stream_mode:
            final = await _await_final(request, stream)
            metrics.observe(final)
            metrics.count("/v1/completions", 200)
            out = final.output
            choice: dict[str, Any] = {"index": 0, "text": out.text, "logprobs": None,
                                      "finish_reason": out.finish_reason}
            if return_ids:
                choice["token_ids"] = list(out.token_ids)
                choice["prompt_token_ids"] = list(stream.prompt_token_ids)
            return JSONResponse({
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": _usage(final),
            })
        metrics.count("/v1/completions", 200)
        return StreamingResponse(
            _completion_sse(stream, rid, model_name, include_usage, metrics, return_ids),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


def _completion_prompt(prompt: Any) -> str | list[int]:
    """A ``/v1/completions`` prompt: a string, token ids, or a one-element batch of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "prompt: batches are not supported; send one prompt per request", param="prompt")
    raise APIError(400, "prompt: must be a non-empty string or a list of token ids", param="prompt")


async def _chat_sse(
    stream: RequestStream,
    rid: str,
    model: str,
    tools_possible: bool,
    include_usage: bool,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    """SSE chunks of a chat completion; aborts the request if the client goes away."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({
            "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        })

    sent = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in stream:
            text = event.output.text
            upto = _safe_text_len(text, tools_possible) if not event.output.finished else len(text)
            if event.output.finished:
                break
            if upto > sent:
                yield chunk({"content": text[sent:upto]})
                sent = upto
        final = stream.final
        assert final is not None
        metrics.observe(final)
        turn = build_turn(stream, final)
        if turn.parsed.tool_calls:
            # Text before the tags was streamed already; only a reply that is all tags
            # around some content (nothing sent yet) still owes its content.
            if sent == 0 and turn.parsed.content:
                yield chunk({"content": turn.parsed.content})
            calls = [{"index": i, **c} for i, c in enumerate(to_openai_tool_calls(turn.parsed.tool_calls))]
            yield chunk({"tool_calls": calls})
        else:
            text = final.output.text
            if len(text) > sent:
                yield chunk({"content": text[sent:]})
        yield chunk({}, turn.finish_reason)
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": _usage(final)})
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (the generator is cancelled or closed mid-stream): free the KV.
        if stream.final is None:
            metrics.aborted += 1
            stream.abort()


async def _completion_sse(
    stream: RequestStream,
    rid: str,
    model: str,
    include_usage: bool,
    metrics: ServerMetrics,
    return_ids: bool = False,
) -> AsyncIterator[str]:
    """SSE chunks of a text completion; aborts the request if the client goes away."""
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, ids: list[int] | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if return_ids:
            choice["token_ids"] = ids or []
        return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [choice]})

    sent = 0
    try:
        async for event in stream:
            text = event.output.text
            upto = len(text) if event.output.finished else _safe_text_len(text, False)
            piece = text[sent:upto] if upto > sent else ""
            sent = max(sent, upto)
            new_ids = list(event.output.new_token_ids)
            if event.output.finished:
                yield chunk(piece, event.output.finish_reason, new_ids)
            elif piece or (return_ids and new_ids):
                yield chunk(piece, None, new_ids)
        final = stream.final
        assert final is not None
        metrics.observe(final)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": _usage(final)})
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (the generator is cancelled or closed mid-stream): free the KV.
        if stream.final is None:
            metrics.aborted += 1
            stream.abort()


def serve(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    policy: str = "vllm-apc",
    num_kv_blocks: int | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Load the model, build the runtime for ``policy`` and serve it with uvicorn (blocking).

    Args:
        model: model spec (see :class:`asymcache_core.EngineConfig`).
        host: bind address.
        port: TCP port.
        api_key: require this bearer key on ``/v1/*``.
        policy: serving policy name (:mod:`agent_runtime.policies`).
        num_kv_blocks: KV pool size (None: from memory).
        max_model_len: context limit (None: the model's).
        served_model_name: the name clients send (default: ``model``).
        log_level: uvicorn log level.
        **engine_kwargs: further engine settings.

    Raises:
        ValueError: bad policy or engine settings (raised before the server starts).
    """
    import uvicorn

    runtime = AgentRuntime.from_model(
        model, policy, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, **engine_kwargs
    )
    app = create_app(lambda: runtime, served_model_name or model, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        runtime.close_sync()
