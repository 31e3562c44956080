"""Agent runtime: jobs and tool loops over the embedded engine, Continuum pins, OpenAI server.

Public API (imported lazily, so that e.g. ``agent_runtime.presets`` works on machines without
FastAPI or xgrammar)::

    from agent_runtime import AgentRuntime, resolve_preset, builtin_registry
    runtime = AgentRuntime.from_model("smollm2-135m", policy="continuum")
    job = runtime.job(tools=builtin_registry("."))
    result = await job.run("What does README.md say?", max_turns=4, tool_choice=["required"])
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it (a constant table, resolved on first access).
_EXPORTS: dict[str, str] = {
    "AgentRuntime": "agent_runtime.runtime",
    "AsyncEngine": "agent_runtime.engine_client",
    "RequestStream": "agent_runtime.request_stream",
    "Job": "agent_runtime.job",
    "AssistantTurn": "agent_runtime.types",
    "JobMetrics": "agent_runtime.types",
    "JobResult": "agent_runtime.types",
    "StreamEvent": "agent_runtime.types",
    "ToolCallRecord": "agent_runtime.types",
    "TurnMetrics": "agent_runtime.types",
    "TurnRecord": "agent_runtime.types",
    "ChatCompletionRequest": "agent_runtime.protocol",
    "CompletionRequest": "agent_runtime.protocol",
    "ServingPreset": "agent_runtime.presets",
    "preset_names": "agent_runtime.presets",
    "resolve_preset": "agent_runtime.presets",
    "Tool": "agent_runtime.tools",
    "ToolRegistry": "agent_runtime.tools",
    "ToolResult": "agent_runtime.tools",
    "builtin_registry": "agent_runtime.builtin_tools",
    "ParsedMessage": "asymcache_core.tool_parsing",
    "ParsedToolCall": "asymcache_core.tool_parsing",
    "parse_tool_calls": "asymcache_core.tool_parsing",
    "ChatRenderer": "asymcache_core.chat_template",
    "GrammarCache": "agent_runtime.grammar_cache",
    "make_tool_call_processor": "agent_runtime.grammar_cache",
    "create_app": "agent_runtime.server",
    "serve": "agent_runtime.server",
    "AsymCacheClient": "agent_runtime.client",
    "AsyncAsymCacheClient": "agent_runtime.client",
    "AsymCacheAPIError": "agent_runtime.client",
    "run_agent": "agent_runtime.commands",
    "run_chat": "agent_runtime.commands",
    "run_serve": "agent_runtime.commands",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
