"""OpenAI-compatible HTTP server over an :class:`~agent_runtime.runtime.AgentRuntime`.

Endpoints: ``POST /v1/chat/completions`` (tools, ``tool_choice`` auto/none/required/named,
SSE streaming, usage with ``prompt_tokens_details.cached_tokens``), ``POST /v1/completions``
(prompt text or token ids, streaming), ``POST /v1/responses`` (OpenAI's Responses API over the
chat machinery: :mod:`~agent_runtime.server.openai_responses`), Anthropic's ``POST /v1/messages``
and ``/v1/messages/count_tokens`` (:mod:`~agent_runtime.server.anthropic_messages`), vLLM's
``POST /tokenize`` and
``POST /detokenize``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text, ours and vLLM's metric names). Continuum's ``job_id`` and ``is_last_step``
travel in the request body (the openai client's ``extra_body``). Non-standard body fields also
accepted: ``top_k``, ``ignore_eos``. ``temperature`` defaults to 0 (greedy), so agent runs are
reproducible.

Every client error is a 4xx with OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``; a client that disconnects mid-stream has its request aborted (its blocks freed).

Modules: :mod:`~agent_runtime.server.app` (:func:`create_app`, :class:`ServeOptions`, :func:`serve`),
:mod:`~agent_runtime.server.state` (the per-app :class:`AppState`; no module-level state),
:mod:`~agent_runtime.server.serving` (the handlers and their shared SSE path),
:mod:`~agent_runtime.server.metrics` (``prometheus_client``), :mod:`~agent_runtime.server.errors`;
:mod:`~agent_runtime.server.replicas` runs N of these apps on Ray Serve behind one endpoint, routed
by :mod:`~agent_runtime.server.replica_router` under the rule of
:mod:`~agent_runtime.server.job_router` (``serve --replicas N``, the ``ray`` extra).
"""

from __future__ import annotations

from agent_runtime.server.app import ServeOptions, create_app, serve

__all__ = ["ServeOptions", "create_app", "serve"]
