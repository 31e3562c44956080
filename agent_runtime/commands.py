"""Plain functions behind the CLI's ``serve``, ``agent`` and ``chat`` commands.

They validate their arguments first and raise ``ValueError`` with a one-line message naming
the bad argument (the CLI turns that into exit code 2), then do the work.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from agent_runtime.types import JobResult, TurnRecord
from asymcache_core.config import EngineConfig

DEFAULT_AGENT_SYSTEM_PROMPT = (
    "You are a careful software agent working inside a project directory. Use the tools to "
    "look at the files, then answer the user's question briefly."
)


#: The ``EngineConfig`` fields the commands take as ``**engine_settings`` (defaults: the
#: config's own): all but the model and the pool, which are their own arguments, and what the
#: serving preset sets.
ENGINE_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in fields(EngineConfig)
    if f.name not in ("model", "num_kv_blocks", "max_model_len", "eviction_policy", "priority")
)


def _check_engine(model: str, policy: str, num_kv_blocks: int | None = None, max_model_len: int | None = None,
                  settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Checks the model, the preset and every engine setting before anything loads.

    Returns:
        ``settings`` without the ``None`` values (those take the config's defaults).

    Raises:
        ValueError: one line naming the bad argument.
    """
    if not isinstance(model, str) or not model.strip():
        raise ValueError("model: must be a non-empty model name or path")
    preset = resolve_preset(policy)
    given = settings or {}
    unknown = sorted(set(given) - set(ENGINE_SETTINGS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an engine setting; known: {', '.join(ENGINE_SETTINGS)}")
    chosen = {name: value for name, value in given.items() if value is not None}
    profile = chosen.get("latency_profile")
    if profile is not None and not Path(profile).is_file():
        raise ValueError(f"latency_profile: no such file {profile!r}")
    # NOTE: the config checks every field (device present, chunking spelled right, ...) in
    # milliseconds, so a typo fails here and not after a model load of minutes.
    EngineConfig(model=model, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                 **chosen, **preset.engine_overrides)
    return chosen


def _build_runtime(model: str, policy: str, loaded: Any = None, **engine_kwargs: Any) -> AgentRuntime:
    """A runtime for ``model``; loading failures become ``ValueError: model: ...``."""
    try:
        return AgentRuntime.from_model(model, policy, loaded=loaded, **engine_kwargs)
    except ValueError:
        raise
    except (OSError, ImportError, KeyError, RuntimeError) as e:
        raise ValueError(f"model: cannot load {model!r}: {e}") from None


def check_listen_address(host: str, port: int) -> None:
    """Fails before the model loads where the server could not listen (uvicorn would exit with
    code 3 after the load, its reason in a log line).

    Raises:
        ValueError: ``host`` that does not resolve, or a ``port`` that is taken or not allowed.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"host: cannot resolve {host!r} ({exc})") from None
    with socket.socket(family, kind, proto) as probe:
        # NOTE: as uvicorn binds: a port left in TIME_WAIT is free, one with a listener is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(f"port: cannot listen on {host}:{port} ({exc.strerror})") from None


def run_serve(replicas: int = 1, **options: Any) -> None:
    """``asymcache serve``: the OpenAI-compatible server (blocks until interrupted).

    Args:
        replicas: engine replicas; above 1 they run on a local Ray cluster behind one
            endpoint (:func:`agent_runtime.server.replicas.serve_replicas`, the ``ray`` extra).
        **options: the fields of :class:`~agent_runtime.server.app.ServeOptions` (``model``,
            ``host``, ``port``, ``api_key``, ``policy``, ``num_kv_blocks``, ``max_model_len``,
            ``served_model_name``, ``log_level``, ``max_request_body_bytes``, ``max_queue_len``,
            ``shutdown_timeout``, ``ssl_keyfile``, ``ssl_certfile``, ``ssl_ca_certs``,
            ``ssl_cert_reqs``), or of
            :class:`~agent_runtime.server.frontend.FrontendOptions` (vLLM's frontend flags:
            ``allowed_origins``, ``root_path``, ``max_logprobs``, ...); every other name is one of
            :data:`ENGINE_SETTINGS` (``EngineConfig`` fields, e.g. ``device``, ``dtype``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``chunking``, ``tpot_slo_ms``,
            ``latency_profile`` (a JSON file from ``asymcache profile``), ``admit_full_prompt``,
            ``least_work_first``, ``least_work_patience``, ``enforce_eager``).

    Raises:
        ValueError: a bad argument (one line naming it), before the model loads.
    """
    # NOTE: the server's import is deferred: the agent and chat commands do not need FastAPI.
    from agent_runtime.server import ServeOptions, serve

    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas: must be an integer >= 1, got {replicas!r}")
    if replicas > 1 and importlib.util.find_spec("ray") is None:
        raise ValueError("replicas: more than one needs Ray Serve; install the ray extra (pip install 'asymcache[ray]')")
    opts = ServeOptions.from_kwargs(options)
    tls = (opts.ssl_keyfile, opts.ssl_certfile, opts.ssl_ca_certs, opts.ssl_cert_reqs)
    if replicas > 1 and (opts.frontend.serves_http_differently or any(tls)):
        # NOTE: Ray Serve's proxy, not this app, takes the connections of a replicated server
        raise ValueError("replicas: CORS, --root-path, --disable-fastapi-docs and TLS are served by one replica "
                         "only (Ray Serve's proxy takes the connections of several)")
    settings = _check_engine(opts.model, opts.policy, opts.num_kv_blocks, opts.max_model_len,
                             dict(opts.engine_settings))
    check_listen_address(opts.host, opts.port)
    try:
        if replicas > 1:
            from agent_runtime.server.replicas import serve_replicas

            serve_replicas(replace(opts, engine_settings=settings), replicas)
            return
        serve(replace(opts, engine_settings=settings))
    except (OSError, ImportError) as e:
        raise ValueError(f"model: cannot load {opts.model!r}: {e}") from None


def run_agent(
    task: str,
    workdir: str | Path,
    model: str = "smollm2-135m",
    max_turns: int = 8,
    policy: str = "asymcache+continuum",
    *,
    forced_tool_turns: int = 1,
    tool_choice: Sequence[str] | None = None,
    max_tokens: int = 256,
    tools: Sequence[str] | None = None,
    parallel_tool_calls: bool = False,
    print_fn: Callable[[str], None] = print,
    loaded: Any = None,
    num_kv_blocks: int | None = None,
    max_model_len: int | None = None,
    **engine_settings: Any,
) -> JobResult:
    """``asymcache agent``: a real tool loop on the local model with the built-in tools.

    The built-ins (``bash``, ``read_file``, ``list_files``, ``write_file``) are confined to
    ``workdir``; ``bash`` runs with rlimits and a scrubbed environment, and is sandboxed only
    where bubblewrap is installed (:func:`agent_runtime.builtin_tools.bash_sandbox` says which). Small models do
    not call tools unprompted, so the first ``forced_tool_turns`` turns are constrained to a
    tool call (``tool_choice="required"``); later turns are free.

    Args:
        task: the task for the agent.
        workdir: directory the tools work in.
        model: model spec.
        max_turns: LLM calls at most.
        policy: serving preset.
        forced_tool_turns: leading turns forced into a tool call (when ``tool_choice`` is None).
        tool_choice: one choice per leading turn, each ``auto``, ``none``, ``required`` or a
            tool's name (that call is forced); later turns are ``auto``.
        max_tokens: generated tokens per turn.
        tools: restrict to these built-in tool names (default: all four).
        parallel_tool_calls: a reply may make several calls, all run; off by default: one
            action a turn, as mini-swe-agent takes them (a small model forced to call tools and
            free to call several keeps calling them).
        print_fn: where each turn is printed.
        loaded: an already loaded model to share (tests).
        num_kv_blocks: KV pool size (None: from memory).
        max_model_len: context limit (None: the model's).
        **engine_settings: any of :data:`ENGINE_SETTINGS`.

    Returns:
        The job's result.

    Raises:
        ValueError: a bad argument (one line naming it).
    """
    from agent_runtime.builtin_tools import builtin_registry
    from agent_runtime.tools import ToolRegistry

    if not isinstance(task, str) or not task.strip():
        raise ValueError("task: must be a non-empty string")
    wd = Path(workdir)
    if not wd.is_dir():
        raise ValueError(f"workdir: {str(wd)!r} is not a directory")
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ValueError(f"max_turns: must be an integer >= 1, got {max_turns!r}")
    if not isinstance(forced_tool_turns, int) or forced_tool_turns < 0:
        raise ValueError(f"forced_tool_turns: must be an integer >= 0, got {forced_tool_turns!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens: must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls: must be true or false, got {parallel_tool_calls!r}")
    settings = _check_engine(model, policy, num_kv_blocks, max_model_len, engine_settings)
    registry = builtin_registry(wd.resolve())
    if tools is not None:
        unknown = [t for t in tools if t not in registry]
        if unknown or not tools:
            raise ValueError(f"tools: choose among {registry.names}, got {list(tools)!r}")
        chosen = ToolRegistry(max_output_chars=registry.max_output_chars)
        for name in tools:
            tool = registry.get(name)
            assert tool is not None
            chosen.register(tool)
        registry = chosen

    choices = _turn_choices(tool_choice, forced_tool_turns, registry.names)

    def show(record: TurnRecord) -> None:
        turn = record.turn
        m = turn.metrics
        head = (f"[turn {record.index + 1}] ttft={_fmt(m.ttft)} cached={m.cached_tokens}/{m.prompt_tokens}"
                f" recomputed={m.recomputed_tokens}" + (f" pinned {m.pinned_blocks} blocks for {m.ttl_s:g}s"
                                                        if m.pinned_blocks else ""))
        print_fn(head)
        if turn.parsed.content:
            print_fn(f"assistant: {turn.parsed.content}")
        for rec in record.tool_calls:
            print_fn(f"tool call: {rec.call.name}({rec.call.arguments_json()})")
            status = "error" if rec.result.is_error else "ok"
            print_fn(f"tool result ({status}, {rec.result.duration_s:.2f}s): {_clip(rec.result.content)}")
        if turn.parsed.tool_calls and not record.tool_calls:
            print_fn("(tool call not executed: out of turns)")

    async def main() -> JobResult:
        runtime = _build_runtime(model, policy, loaded, num_kv_blocks=num_kv_blocks,
                                 max_model_len=max_model_len, **settings)
        try:
            job = runtime.job(tools=registry, system_prompt=DEFAULT_AGENT_SYSTEM_PROMPT)
            result = await job.run(
                task, max_turns=max_turns, tool_choice=choices,
                max_tokens=max_tokens, on_turn=show, parallel_tool_calls=parallel_tool_calls,
            )
        finally:
            await runtime.close()
        jm = result.metrics
        print_fn(f"[done: {result.finish_reason}] turns={jm.num_turns} tool_calls={jm.num_tool_calls} "
                 f"jct={jm.jct_s:.2f}s cached={jm.cached_tokens} recomputed={jm.recomputed_tokens}")
        if result.answer:
            print_fn(f"answer: {result.answer}")
        return result

    return asyncio.run(main())


def _turn_choices(
    tool_choice: Sequence[str] | None, forced_tool_turns: int, names: Sequence[str]
) -> list[str | dict[str, Any]]:
    """Per-turn ``tool_choice`` values from ``auto``/``none``/``required``/tool names.

    Raises:
        ValueError: an entry that is none of those (names ``tool_choice``).
    """
    if tool_choice is None:
        return ["required"] * forced_tool_turns
    if isinstance(tool_choice, str):
        raise ValueError("tool_choice: give a sequence of per-turn choices, e.g. ['list_files', 'read_file']")
    out: list[str | dict[str, Any]] = []
    for entry in tool_choice:
        if entry in ("auto", "none", "required"):
            out.append(entry)
        elif entry in names:
            out.append({"type": "function", "function": {"name": entry}})
        else:
            raise ValueError(f"tool_choice: {entry!r} is not auto, none, required or one of {list(names)}")
    return out


def run_chat(
    model: str = "smollm2-135m",
    *,
    policy: str = "asymcache+continuum",
    max_tokens: int = 256,
    system_prompt: str | None = None,
    input_fn: Callable[[str], str] | None = None,
    print_fn: Callable[[str], None] = print,
    loaded: Any = None,
    num_kv_blocks: int | None = None,
    max_model_len: int | None = None,
    **engine_settings: Any,
) -> int:
    """``asymcache chat``: an interactive chat over stdin/stdout; ``/exit`` (or EOF) quits.

    The whole history is resent each turn under one job id, so the engine reuses its KV and
    each turn only prefills the new message.

    Args:
        model: model spec.
        policy: serving preset.
        max_tokens: generated tokens per reply.
        system_prompt: optional system message.
        input_fn: reads one line given a prompt (default: :func:`input`; EOF ends the chat).
        print_fn: writes one reply.
        loaded: an already loaded model to share (tests).
        num_kv_blocks: KV pool size (None: from memory).
        max_model_len: context limit (None: the model's).
        **engine_settings: any of :data:`ENGINE_SETTINGS`.

    Returns:
        The number of replies given.

    Raises:
        ValueError: a bad argument (one line naming it).
    """
    settings = _check_engine(model, policy, num_kv_blocks, max_model_len, engine_settings)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens: must be an integer >= 1, got {max_tokens!r}")
    read = input_fn or input

    async def main() -> int:
        runtime = _build_runtime(model, policy, loaded, num_kv_blocks=num_kv_blocks,
                                 max_model_len=max_model_len, **settings)
        replies = 0
        try:
            job = runtime.job()
            messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
            while True:
                try:
                    line = await asyncio.to_thread(read, "you> ")
                except EOFError:
                    break
                text = line.strip()
                if text in ("/exit", "/quit"):
                    break
                if not text:
                    continue
                messages.append({"role": "user", "content": text})
                turn = await job.chat(messages, max_tokens=max_tokens)
                messages.append({"role": "assistant", "content": turn.text})
                replies += 1
                m = turn.metrics
                print_fn(f"assistant> {turn.text.strip()}")
                print_fn(f"  (ttft {_fmt(m.ttft)}, cached {m.cached_tokens}/{m.prompt_tokens} prompt tokens)")
            await job.finish()
        finally:
            await runtime.close()
        return replies

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 0


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"


def _clip(text: str, limit: int = 300) -> str:
    one = text.replace("\n", "\\n")
    return one if len(one) <= limit else one[: limit - 3] + "..."
