"""The commands that serve or run the model: ``generate``, ``serve``, ``chat`` and ``agent run``."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import typer

from eval.cli_app import (
    agent_app,
    app,
    clean_errors,
    engine_options,
    json_object,
    memory_sized_pool,
    read_config_file,
)


@app.command()
@clean_errors
@engine_options(exclude={"kv_memory_fraction"}, defaults={"num_kv_blocks": 256})
def generate(
    ctx: typer.Context,
    prompt: str = typer.Argument(..., help="A user message (rendered with the chat template)."),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Generate one chat answer with the embedded engine (printed as it is generated)."""
    from asymcache_core import Engine, SamplingParams
    from eval.cli_progress import showing_model_loads

    # NOTE: before the model loads; an empty message is refused as Engine.generate([""]) and
    # agent run "" refuse theirs
    if not prompt.strip():
        raise ValueError("prompt: must be a non-empty message")
    memory_sized_pool(ctx, engine_args)
    with showing_model_loads():
        engine = Engine(**engine_args)
    if engine.tokenizer is None:
        why = f" ({engine.loaded.tokenizer_source})" if engine.loaded is not None else ""
        raise ValueError(f"model: {engine.config.model!r} has no tokenizer{why}")
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    stream_answer(engine, text, SamplingParams(max_tokens=max_tokens, temperature=temperature), _write_stdout)
    typer.echo("")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_answer(engine: Any, prompt: str, params: Any, write: Callable[[str], None]) -> str:
    """Runs one request and writes its text as it grows (each step's new characters).

    Args:
        engine: an :class:`asymcache_core.Engine`.
        prompt: the rendered prompt.
        params: its :class:`asymcache_core.SamplingParams`.
        write: called with each new piece of text.

    Returns:
        The whole answer.

    Raises:
        ValueError: the request failed.
    """
    request_id = engine.add_request(prompt, params)
    shown = ""
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error:
                raise ValueError(f"generate: {out.error}")
            # NOTE: a stop string would cut text already shown; only growth is written.
            if out.text.startswith(shown) and len(out.text) > len(shown):
                write(out.text[len(shown):])
                shown = out.text
            if out.finished:
                return shown


def startup_line(ready: Mapping[str, Any], policy: str, seconds: float) -> str:
    """The line ``serve`` logs once its engine is built.

    Args:
        ready: the engine's ``engine_ready`` log fields (model, dtype, device,
            eviction_policy, kv_blocks, kv_gib).
        policy: the serving preset.
        seconds: since the command started.
    """
    return (
        f"serve: model {ready['model']}, dtype {ready['dtype']}, device {ready['device']}, "
        f"policy {policy} (eviction {ready['eviction_policy']}), "
        f"pool {ready['kv_blocks']} blocks ({ready['kv_gib']:.2f} GiB); loaded in {seconds:.1f} s"
    )


class StartupLine(logging.Handler):
    """Writes :func:`startup_line` to stderr when the engine reports itself ready.

    Args:
        policy: the serving preset.
        clock: time source (the start is read at construction).
    """

    def __init__(self, policy: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logging.INFO)
        self.policy = policy
        self.clock = clock
        self.started = clock()
        self.done = False

    def emit(self, record: logging.LogRecord) -> None:
        ready = getattr(record, "engine_ready", None)
        if ready is None or self.done:
            return
        self.done = True
        typer.echo(startup_line(ready, self.policy, self.clock() - self.started), err=True)

    @classmethod
    @contextlib.contextmanager
    def listening(cls, policy: str, clock: Callable[[], float] = time.monotonic) -> Iterator[StartupLine]:
        """Attaches a handler to the engine's logger for the duration of the block."""
        from eval.cli_progress import logging_to

        with logging_to(logging.getLogger("asymcache_core.engine"), cls(policy, clock), logging.INFO) as handler:
            yield handler


@app.command()
@clean_errors
@engine_options(exclude={"kv_memory_fraction"}, defaults={"num_kv_blocks": 2048, "max_step_log": 10_000})
def serve(
    ctx: typer.Context,
    model_tag: str = typer.Argument(
        None, metavar="MODEL", show_default=False,
        help="The model, as `vllm serve MODEL` takes it (the same as --model)."),
    config: str = typer.Option(
        None, "--config", is_eager=True, callback=read_config_file, metavar="FILE",
        help="Options from a YAML file (vLLM's --config: names as on the command line, which wins over it)."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: str = typer.Option(
        None, envvar=["ASYMCACHE_API_KEY", "VLLM_API_KEY"], show_envvar=True,
        help="Require this bearer token (or from the environment: a key on the command line shows in the "
        "process list)."),
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    max_request_body_bytes: int = typer.Option(8 << 20, help="Request bodies beyond this are a 413."),
    max_queue_len: int = typer.Option(256, help="Completions waiting beyond the running batch before new ones get a 429 (one of n choices counts n)."),
    shutdown_timeout: float = typer.Option(30.0, help="On SIGTERM, seconds in-flight requests may finish before they are aborted."),
    replicas: int = typer.Option(1, help="Engine replicas behind the one endpoint; above 1 on a local Ray cluster "
                                 "(the ray extra), each job kept on the replica that holds its KV."),
    served_model_name: list[str] = typer.Option(
        None, metavar="NAME", help="The model name clients send and /v1/models lists (default: --model); several, as vLLM's "
        "aliases (--served-model-name a b): each is listed and accepted, responses report the first."),
    generation_config: str = typer.Option(
        "auto", metavar="auto|vllm|FOLDER",
        help="Where requests' sampling defaults come from (vLLM's flag): auto, the model's "
        "generation_config.json; vllm, vLLM's defaults (temperature 1), the model's file ignored; or a folder "
        "holding a generation_config.json."),
    override_generation_config: str = typer.Option(
        None, help='Sampling defaults of requests that leave them out, as a JSON object over the generation '
        'config\'s (vLLM\'s flag; e.g. \'{"temperature": 0}\' for greedy replies). Keys: '
        'temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, '
        'max_new_tokens. Without either, vLLM\'s defaults (temperature 1).'),
    chat_template: str = typer.Option(None, help="A chat template, as a Jinja file or its text, instead of the "
                                      "model's."),
    default_chat_template_kwargs: str = typer.Option(
        None, help='Template variables every chat gets unless it sets its own, as a JSON object '
        '(e.g. \'{"enable_thinking": false}\').'),
    trust_request_chat_template: bool = typer.Option(
        False, "--trust-request-chat-template", help="Serve chats that send a chat_template of their own."),
    tool_call_parser: str = typer.Option(
        "hermes", help="How tool calls are written and parsed: hermes (tagged; Qwen, and models without a tools "
        "template) or llama3_json (Llama 3.1+, with its own template)."),
    reasoning_parser: str = typer.Option(
        None, help="Split reasoning models' thinking off chat replies into reasoning_content: deepseek_r1 or "
        "qwen3 (vLLM's names)."),
    responses_store_size: int = typer.Option(
        4096, help="Responses API responses kept for previous_response_id and GET /v1/responses/{id} (least "
        "recently used dropped first; 0: none)."),
    enable_auto_tool_choice: bool = typer.Option(
        True, "--enable-auto-tool-choice", help="vLLM's flag, accepted: tool calls are parsed under "
        "tool_choice auto whether it is given or not."),
    uvicorn_log_level: str = typer.Option(
        "info", help="uvicorn's log level (vLLM's flag): critical, error, warning, info, debug or trace."),
    disable_uvicorn_access_log: bool = typer.Option(
        False, "--disable-uvicorn-access-log", help="No access-log line per HTTP request (vLLM's flag)."),
    enable_prefix_caching: bool = typer.Option(
        True, "--enable-prefix-caching/--no-enable-prefix-caching",
        help="vLLM's flag, accepted: the KV cache is always reused across requests (what the cache policies "
        "manage); turning it off is an error."),
    enable_chunked_prefill: bool = typer.Option(
        True, "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="vLLM's flag, accepted: prompts are always computed in chunks of the step budget "
        "(--admit-full-prompt reserves a prompt's blocks whole); turning it off is an error."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="vLLM's flag, accepted: no model code is ever loaded from a model's files."),
    disable_log_requests: bool = typer.Option(
        False, "--disable-log-requests", help="vLLM's older flag, accepted: requests are not logged (the default; "
        "--enable-log-requests logs them)."),
    enable_log_requests: bool = typer.Option(
        False, "--enable-log-requests/--no-enable-log-requests",
        help="vLLM's flag: log each received completion request at INFO (its id and sampling parameters; its "
        "body at DEBUG), on the logger agent_runtime.server.requests_log."),
    max_log_len: int = typer.Option(
        None, metavar="N", help="Most characters of a request's body its --enable-log-requests DEBUG line prints "
        "(vLLM's flag; default: all)."),
    allowed_origins: str = typer.Option(
        None, metavar="JSON", help='CORS: origins allowed cross-origin access, as a JSON list (vLLM\'s flag; e.g. '
        '\'["*"]\'; default: none).'),
    allowed_methods: str = typer.Option(
        None, metavar="JSON", help='CORS: methods allowed, as a JSON list (vLLM\'s flag; default \'["*"]\').'),
    allowed_headers: str = typer.Option(
        None, metavar="JSON", help='CORS: headers allowed, as a JSON list (vLLM\'s flag; default \'["*"]\').'),
    allow_credentials: bool = typer.Option(
        False, "--allow-credentials/--no-allow-credentials", help="CORS: allow credentials (vLLM's flag)."),
    root_path: str = typer.Option(
        None, metavar="PATH", help="The app's root_path behind a path-based routing proxy (vLLM's flag; e.g. /api): "
        "routes answer under it as well as without it."),
    disable_fastapi_docs: bool = typer.Option(
        False, "--disable-fastapi-docs/--no-disable-fastapi-docs",
        help="No /openapi.json, /docs or /redoc (vLLM's flag)."),
    ssl_keyfile: str = typer.Option(None, metavar="FILE", help="TLS key file, passed to uvicorn (vLLM's flag)."),
    ssl_certfile: str = typer.Option(None, metavar="FILE", help="TLS certificate file, passed to uvicorn (vLLM's flag)."),
    ssl_ca_certs: str = typer.Option(
        None, metavar="FILE", help="CA certificates that clients' certificates are checked against, passed to "
        "uvicorn (vLLM's flag; needs --ssl-keyfile and --ssl-certfile)."),
    ssl_cert_reqs: int = typer.Option(
        0, metavar="0|1|2", help="Whether clients must show a certificate, as Python's ssl module's CERT_NONE (0), "
        "CERT_OPTIONAL (1) or CERT_REQUIRED (2), passed to uvicorn (vLLM's flag; 1 and 2 need TLS)."),
    max_logprobs: int = typer.Option(
        20, help="Most log probabilities a request may ask for (logprobs, top_logprobs, prompt_logprobs); more is "
        "a 400 (vLLM's flag and default; at most 20 here)."),
    enable_force_include_usage: bool = typer.Option(
        False, "--enable-force-include-usage/--no-enable-force-include-usage",
        help="Every streamed completion reports usage, on each chunk and in a final chunk, as if it sent "
        "stream_options include_usage and continuous_usage_stats (vLLM's flag)."),
    response_role: str = typer.Option(
        "assistant", help="The chat reply's role after a generation prompt (vLLM's flag); with "
        "add_generation_prompt false, the role of the message it continues."),
    kv_cache_dtype: str = typer.Option(
        "auto", help="vLLM's flag, accepted as auto only: the KV cache is kept in the model's dtype (--dtype)."),
    enable_prompt_tokens_details: bool = typer.Option(
        True, "--enable-prompt-tokens-details/--no-enable-prompt-tokens-details",
        help="vLLM's flag, accepted: usage always reports prompt_tokens_details (cached_tokens); turning it off "
        "is an error."),
    disable_log_stats: bool = typer.Option(
        False, "--disable-log-stats", help="vLLM's flag, accepted: the engine logs no periodic stats "
        "(they are on /metrics)."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /metrics).

    MODEL is taken as vllm serve takes it, and vLLM's launch flags that describe what this
    server always does are accepted, so a vLLM launch line runs as it is.
    """
    from agent_runtime.commands import run_serve

    if not enable_prefix_caching:
        raise ValueError("enable_prefix_caching: cannot be turned off: the KV cache policies manage the reused "
                         "cache (--policy vllm-apc is vLLM's own prefix caching)")
    _check_frontend_flags(kv_cache_dtype=kv_cache_dtype, enable_prompt_tokens_details=enable_prompt_tokens_details,
                          enable_log_requests=enable_log_requests, disable_log_requests=disable_log_requests)
    frontend = _frontend_kwargs(allowed_origins=allowed_origins, allowed_methods=allowed_methods,
                                allowed_headers=allowed_headers, allow_credentials=allow_credentials,
                                root_path=root_path, disable_fastapi_docs=disable_fastapi_docs,
                                max_logprobs=max_logprobs, enable_force_include_usage=enable_force_include_usage,
                                enable_log_requests=enable_log_requests, max_log_len=max_log_len,
                                response_role=response_role)
    if not enable_chunked_prefill:
        raise ValueError("enable_chunked_prefill: cannot be turned off: prompts are computed in chunks of "
                         "--max-num-batched-tokens (--admit-full-prompt reserves a prompt's blocks whole, as "
                         "vLLM does without chunking)")
    if model_tag is not None:
        # NOTE: a --config file's model gives way to MODEL, as the file's options give way to flags
        on_command_line = getattr(ctx.get_parameter_source("model"), "name", None) == "COMMANDLINE"
        if on_command_line and engine_args["model"] != model_tag:
            raise ValueError(f"model: given twice, as MODEL ({model_tag!r}) and --model ({engine_args['model']!r})")
        engine_args["model"] = model_tag
    memory_sized_pool(ctx, engine_args)
    template_kwargs = json_object("default_chat_template_kwargs", default_chat_template_kwargs)
    from agent_runtime.server.generation_defaults import (
        check_generation_config,
        check_generation_config_source,
    )

    generation = check_generation_config(override_generation_config) or None
    # NOTE: a folder's file is read now: a bad one is one line before the model loads
    generation_source = check_generation_config_source(generation_config)
    from eval.cli_progress import showing_model_loads

    with StartupLine.listening(policy), showing_model_loads():
        run_serve(host=host, port=port, api_key=api_key, policy=policy, max_request_body_bytes=max_request_body_bytes,
                  max_queue_len=max_queue_len, shutdown_timeout=shutdown_timeout, replicas=replicas,
                  served_model_name=(served_model_name[0] if len(served_model_name) == 1 else tuple(served_model_name))
                  if served_model_name else None,
                  override_generation_config=generation, generation_config=generation_source,
                  chat_template=chat_template,
                  default_chat_template_kwargs=template_kwargs,
                  trust_request_chat_template=trust_request_chat_template, tool_call_parser=tool_call_parser,
                  reasoning_parser=reasoning_parser, responses_store_size=responses_store_size,
                  log_level=uvicorn_log_level, access_log=not disable_uvicorn_access_log,
                  ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, ssl_ca_certs=ssl_ca_certs,
                  ssl_cert_reqs=ssl_cert_reqs, **frontend, **engine_args)


def _check_frontend_flags(*, kv_cache_dtype: str, enable_prompt_tokens_details: bool, enable_log_requests: bool,
                          disable_log_requests: bool) -> None:
    """vLLM's flags accepted for the one value this server serves; any other is one line."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype: only 'auto' is served (the KV cache is kept in the model's dtype, "
                         f"--dtype), got {kv_cache_dtype!r}")
    if not enable_prompt_tokens_details:
        raise ValueError("enable_prompt_tokens_details: cannot be turned off: usage always reports "
                         "prompt_tokens_details (cached_tokens, what the cache policies are measured by)")
    if enable_log_requests and disable_log_requests:
        raise ValueError("enable_log_requests: given with --disable-log-requests; give one")


def _frontend_kwargs(**given: Any) -> dict[str, Any]:
    """vLLM's frontend flags as :class:`~agent_runtime.server.frontend.FrontendOptions`' keyword
    arguments (the CORS lists read as vLLM reads them, JSON; those not given left out),
    checked now: a bad one is one line before the model loads."""
    from agent_runtime.server.frontend import FrontendOptions, json_list

    kwargs = dict(given)
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        kwargs[name] = json_list(name, kwargs[name])
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    FrontendOptions(**kwargs)
    return kwargs


@app.command()
@clean_errors
@engine_options()
def chat(
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Interactive chat with the local model (/exit to quit)."""
    from agent_runtime.commands import run_chat
    from eval.cli_progress import showing_model_loads

    with showing_model_loads():
        run_chat(policy=policy, **engine_args)


@agent_app.command("run")
@clean_errors
@engine_options()
def agent_run(
    task: str = typer.Argument(..., help="What the agent should do."),
    workdir: Path = typer.Option(
        Path("."), help="The agent's working directory: the file tools stay inside it; bash runs there, sandboxed "
        "only where bubblewrap is installed (otherwise its own session, rlimits and a scrubbed environment)."
    ),
    max_turns: int = typer.Option(6, min=1),
    policy: str = typer.Option("asymcache+continuum", help="Serving preset (vllm-apc, asymcache, continuum, ...)."),
    tool_choice: str = typer.Option(
        "required", help="Per-turn tool choice, comma-separated: auto, none, required or a tool name (that "
        "call is forced, constrained decoding); later turns are auto. Small models need the tools named."
    ),
    parallel_tool_calls: bool = typer.Option(
        False, "--parallel-tool-calls/--no-parallel-tool-calls",
        help="Let a reply make several tool calls, all run (OpenAI's parallel_tool_calls); off: one call a turn.",
    ),
    *,
    engine_args: dict[str, Any],
) -> None:
    """A real tool loop (bash, read/list/write files) on the local model."""
    from agent_runtime.commands import run_agent

    if not workdir.is_dir():
        raise ValueError(f"workdir: {str(workdir)!r} is not a directory")
    choices = [c.strip() for c in tool_choice.split(",") if c.strip()]
    from eval.cli_progress import showing_model_loads

    with showing_model_loads():
        run_agent(
            task=task, workdir=workdir, max_turns=max_turns, policy=policy, tool_choice=choices,
            parallel_tool_calls=parallel_tool_calls, **engine_args
        )
