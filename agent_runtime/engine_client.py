"""The engine in its own thread, driven through a command queue; per-request async streams.

Threading model: the engine is not thread-safe, so exactly one thread (the *engine thread*,
started by :class:`AsyncEngine`) owns it. Everything else talks to it through a thread-safe
command queue: submitting a request, aborting one, or running a function against the engine
(:meth:`AsyncEngine.call`). Streamed outputs come back to the submitting event loop through
``loop.call_soon_threadsafe`` into an :class:`asyncio.Queue`, so many jobs (and the HTTP server)
await their tokens concurrently while the engine thread batches them into shared steps.

Grammar work (building the xgrammar logits processor) also runs on the engine thread, because
the engine decodes with the same tokenizer object; text prompts are encoded on a thread of
their own, with a private copy of the tokenizer (below). When a request
finishes, the :class:`~agent_runtime.output_processor.OutputProcessor` turns its output into the
final :class:`~agent_runtime.types.StreamEvent` on the engine thread too, before the next step.

This module is the engine thread's side (:class:`AsyncEngine`: the command queue and the loop);
the caller's side of a request (:class:`~agent_runtime.request_stream.RequestStream` and its
errors) is ``request_stream.py``, and text prompts are encoded off the engine thread by
:class:`~agent_runtime.prompt_encoder.PromptEncoder`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from agent_runtime.grammar_cache import GrammarCache, make_request_processor
from agent_runtime.output_processor import OutputOptions, OutputProcessor
from agent_runtime.prompt_encoder import PromptEncoder
from agent_runtime.protocol import ToolChoice, check_fits_context
from agent_runtime.reasoning_gate import gated_processor
from agent_runtime.request_stream import (
    EventSink,
    RequestConstraintsUnsatisfiable,
    RequestFailed,
    RequestStream,
)
from agent_runtime.types import StreamEvent
from asymcache_core import Engine
from asymcache_core.engine_checks import truncated_prompt
from asymcache_core.errors import EngineDeadError
from asymcache_core.request import RequestOutput
from asymcache_core.sampler import NOTHING_ALLOWED
from asymcache_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _within_pool(ids: list[int], params: SamplingParams, engine: Any) -> SamplingParams:
    """``params`` of a request that asks for the rest of the context (``max_tokens`` of at least
    ``max_model_len``: the servers' default, as vLLM's) cut to what the engine's KV pool holds
    beside the prompt, when the pool holds less than ``max_model_len``.

    NOTE: vLLM refuses to start with a pool smaller than one ``max_model_len`` sequence; this
    engine serves one, and "the rest of the context" then ends where the pool does, rather than
    the request being refused for blocks it would mostly never use. Other limits are kept as
    given (the engine rejects one the pool cannot hold).
    """
    pool_tokens = getattr(engine, "num_blocks", 0) * getattr(engine, "block_size", 0)
    limit = engine.max_model_len
    if params.max_tokens < limit or not 0 < pool_tokens < limit:
        return params
    kept = len(truncated_prompt(ids, params, limit))
    room = pool_tokens - kept
    if room < max(1, params.min_tokens) or kept + params.max_tokens <= pool_tokens:
        return params
    return replace(params, max_tokens=room)


@dataclass
class _Submit:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    response_format: dict[str, Any] | None
    options: OutputOptions
    sink: EventSink
    accepted: concurrent.futures.Future[tuple[str, list[int]]]
    strict_max_tokens: bool = False
    constrain_thinking: bool = False


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class _Active:
    submit: _Submit
    prompt_ids: list[int]


class _Stop:
    pass


_Command = _Submit | _Abort | _Call | _Stop


class AsyncEngine:
    """The engine thread and its command queue (the role of vLLM's ``AsyncLLM``).

    Args:
        engine: the engine (owned from now on: only the engine thread may touch it; use
            :meth:`call` to inspect it).
        processor: turns finished requests into final events (runs on the engine thread).
        idle_poll_s: how often the idle engine thread wakes to expire pins.
    """

    def __init__(self, engine: Engine, processor: OutputProcessor, *, idle_poll_s: float = 0.02) -> None:
        self.engine = engine
        self.processor = processor
        self._grammars = GrammarCache(max_threads=1)
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._active: dict[str, _Active] = {}
        self._ids = itertools.count()
        self._idle_poll_s = idle_poll_s
        self._closed = False
        tokenizer = getattr(engine, "tokenizer", None)
        self.encoder: PromptEncoder | None = (
            PromptEncoder(tokenizer, engine.max_model_len) if hasattr(tokenizer, "get_vocab") else None
        )
        self._thread = threading.Thread(target=self._run, name="asymcache-engine", daemon=True)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    async def close(self) -> None:
        """Abort what is in flight and stop the engine thread (idempotent)."""
        self._request_stop()
        await asyncio.to_thread(self._thread.join)

    def close_sync(self, timeout: float | None = 30.0) -> None:
        """:meth:`close` for code without an event loop.

        Args:
            timeout: seconds to wait for the engine thread.
        """
        self._request_stop()
        self._thread.join(timeout)

    def _request_stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._commands.put(_Stop())
            if self.encoder is not None:
                self.encoder.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("runtime: closed")

    # -- commands ------------------------------------------------------------------------------
    def call_threadsafe(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread, between steps.

        Args:
            fn: the function (must not block for long: it stalls every request).

        Returns:
            A future with its result or exception.

        Raises:
            RuntimeError: the engine thread is stopped.
        """
        self._check_open()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(fn, fut))
        return fut

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Async :meth:`call_threadsafe`.

        Args:
            fn: the function, given the engine.

        Returns:
            Its result.
        """
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def abort_nowait(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (no-op when unknown, finished or closed).

        Args:
            request_id: the engine request id.
        """
        if not self._closed:
            self._commands.put(_Abort(request_id))

    async def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        options: OutputOptions | None = None,
        request_id: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = None,
        response_format: Mapping[str, Any] | None = None,
        strict_max_tokens: bool = False,
        constrain_thinking: bool = False,
    ) -> RequestStream:
        """Queue one request and return its stream once the engine accepted it.

        Args:
            prompt: text (encoded on the engine thread) or token ids.
            params: sampling parameters.
            options: the job it belongs to and how its final output is processed.
            request_id: caller-chosen id.
            tools: tool schemas (for constrained decoding when ``tool_choice`` forces a call).
            tool_choice: ``required`` or a named function constrains decoding.
            response_format: a normalised ``response_format``
                (:func:`~agent_runtime.protocol.normalize_response_format`): JSON replies are
                constrained to it (None: free text).
            strict_max_tokens: reject a request whose prompt and ``params.max_tokens`` together
                pass the engine's ``max_model_len`` (the servers' rule, where the client gave
                ``max_tokens``) instead of stopping it at the limit.
            constrain_thinking: with ``options.reasoning_parser``, a constrained reply is
                constrained from its first token, its thinking too (False: from the end of its
                thinking on, vLLM's default: :mod:`agent_runtime.reasoning_gate`).

        Returns:
            The stream.

        Raises:
            ContextLengthError: ``strict_max_tokens`` and the request passes ``max_model_len``
                (:func:`~agent_runtime.protocol.check_fits_context`).
            ValueError: rejected by the engine or by the grammar builder (message names the field).
            RuntimeError: the engine thread is stopped.
        """
        self._check_open()
        if isinstance(prompt, str) and self.encoder is not None:
            prompt = await self.encoder.encode_async(prompt)
        loop = asyncio.get_running_loop()
        accepted: concurrent.futures.Future[tuple[str, list[int]]] = concurrent.futures.Future()
        sink = EventSink(loop)
        cmd = _Submit(
            prompt if isinstance(prompt, str) else list(prompt),
            params or SamplingParams(),
            request_id,
            [dict(t) for t in tools] if tools else None,
            tool_choice,
            dict(response_format) if response_format is not None else None,
            options or OutputOptions(),
            sink,
            accepted,
            strict_max_tokens,
            constrain_thinking,
        )
        self._commands.put(cmd)
        try:
            rid, prompt_ids = await asyncio.shield(asyncio.wrap_future(accepted))
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting: abort once it is in.
            accepted.add_done_callback(
                lambda f: self.abort_nowait(f.result()[0]) if f.exception() is None else None
            )
            raise
        # NOTE: the engine thread set the options' job before it accepted the request
        return RequestStream(self, rid, prompt_ids, sink, cmd.options.job_id)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        stopping = False
        while not stopping:
            try:
                # Busy: take what is queued and step at once. Idle: sleep until a command comes,
                # waking now and then so that expired pins are released on time.
                # NOTE: a stalled engine (everything waits for room or job admission) is idle
                # too: stepping it again at once would spin on the GIL the server shares.
                if engine.has_unfinished() and not engine.stalled:
                    cmd: _Command | None = self._commands.get_nowait()
                else:
                    cmd = self._commands.get(timeout=self._idle_poll_s)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    stopping = True
                else:
                    self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if stopping:
                break
            try:
                outputs = engine.step()
            except EngineDeadError as exc:
                # NOTE: no later step can run: fail what is in flight and close, so the server
                # answers 503 from now on instead of queueing requests nobody will run.
                logger.error("the engine is dead: %s", exc)
                self._closed = True
                self._fail_all(exc)
                break
            except Exception as exc:  # noqa: BLE001 - keep serving; fail the victims loudly
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._dispatch(out)
            self.processor.drop_forgotten(engine.job_stats.jobs)
        self._shutdown()

    def _handle(self, cmd: _Submit | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    cmd.future.set_exception(exc)
            return
        if isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            return
        if not cmd.accepted.set_running_or_notify_cancel():
            return  # the submitter cancelled before the engine saw it
        opts = cmd.options
        try:
            params = cmd.params
            if cmd.response_format is not None or cmd.tool_choice not in (None, "auto", "none"):
                processor = make_request_processor(
                    self._grammars, engine.tokenizer, cmd.tools or [], cmd.tool_choice,
                    cmd.response_format, vocab_size=engine.model_config.vocab_size,
                    call_format=opts.parse_format or "hermes", parallel=opts.max_tool_calls != 1,
                )
                if processor is not None:
                    # NOTE: vLLM's structured outputs wait for the reply's reasoning to end
                    gate = None if cmd.constrain_thinking else opts.reasoning_parser
                    processor = gated_processor(processor, gate, engine.tokenizer)
                    params = replace(params, logits_processors=(*params.logits_processors, processor))
            ids = engine.encode(cmd.prompt)
            if cmd.strict_max_tokens:
                check_fits_context(ids, params, engine.max_model_len)
            else:
                params = _within_pool(ids, params, engine)
            rid = cmd.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            rid = engine.add_request(
                ids, params, job_id=opts.job_id, request_id=rid, is_last_step=opts.is_last_step,
                joins_conversation=opts.joins_conversation, continues_job=opts.continues_job,
            )
            # NOTE: the request's own ids: ``truncate_prompt_tokens`` may have cut the encoded ones
            ids = engine.requests[rid].prompt_token_ids
            job = engine.requests[rid].job_id
            if job != opts.job_id:
                # NOTE: the engine gave a request that named no job its conversation's: the
                # Continuum hand-off (tool pauses, pins) follows it
                opts = cmd.options = replace(opts, job_id=job, implicit_job=True)
        except Exception as exc:  # noqa: BLE001 - rejected input goes back to the caller
            cmd.accepted.set_exception(exc)
            return
        self.processor.on_request_added(opts.job_id, engine.requests[rid].metrics.arrival_time)
        self._active[rid] = _Active(cmd, ids)
        cmd.accepted.set_result((rid, ids))

    def _dispatch(self, out: RequestOutput) -> None:
        active = self._active.get(out.request_id)
        if active is None:
            return
        if not out.finished:
            active.submit.sink.put(StreamEvent(out))
            return
        del self._active[out.request_id]
        if out.error is not None:
            failed = RequestConstraintsUnsatisfiable if out.error == NOTHING_ALLOWED else RequestFailed
            active.submit.sink.put(failed(out.error))
            return
        try:
            event = self.processor.finalize(active.submit.options, active.prompt_ids, out)
        except Exception:  # noqa: BLE001 - the output stands even if a decision failed
            logger.exception("finalizing %s failed", out.request_id)
            event = StreamEvent(out)
        active.submit.sink.put(event)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, active in list(self._active.items()):
            try:
                # NOTE: no abort output: its stream gets the failure now, and the id is free at
                # once for a client's retry (an output waiting for the next step held it)
                self.engine.abort(rid, emit=False)
            except Exception:  # noqa: BLE001 - best effort while failing
                logger.exception("abort of %s failed", rid)
            failure = exc if isinstance(exc, EngineDeadError) else RuntimeError(f"engine step failed: {exc!r}")
            active.submit.sink.put(failure)
        self._active.clear()

    def _shutdown(self) -> None:
        # Answer whatever is still queued, then abort what is in flight.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                cmd.accepted.set_exception(RuntimeError("runtime: closed"))
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(RuntimeError("runtime: closed"))
        for rid, active in list(self._active.items()):
            self.engine.abort(rid)
            active.submit.sink.put(RuntimeError("runtime: closed"))
        self._active.clear()
        try:
            self.engine.step()  # flush the aborts' outputs so the engine is left consistent
        except EngineDeadError:
            pass  # nothing left to flush into


__all__ = ["AsyncEngine"]
