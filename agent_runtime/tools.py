"""Tools an agent can call: schemas and a registry that never raises.

A :class:`Tool` wraps a Python callable (sync or async) together with a pydantic model of its
arguments; the model gives the JSON schema that the LLM sees (OpenAI ``tools`` format) and
validates the arguments the LLM produced. :class:`ToolRegistry` runs calls and turns every
failure (unknown tool, bad JSON, validation error, exception, timeout) into an error
:class:`ToolResult`, because a failed tool call is a normal event of an agent loop: the model
reads the error and tries again. Sync tools run in a daemon thread of their own per call, so
one that hangs past its timeout cannot starve the others.

The SWE-style built-ins (``bash``, ``read_file``, ``list_files``, ``write_file``) are in
:mod:`agent_runtime.builtin_tools`; their names are importable from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import pydantic

from agent_runtime.tool_schema import validate_tool_schema


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one tool call, as fed back to the model.

    Attributes:
        content: text for the ``tool`` message (output, or the error explained).
        is_error: the call failed (unknown tool, bad arguments, exception, timeout, or a
            tool-reported failure such as a non-zero exit code).
        duration_s: wall time of the call in seconds.
    """

    content: str
    is_error: bool = False
    duration_s: float = 0.0


# --------------------------------------------------------------------------------------------
# Tool
# --------------------------------------------------------------------------------------------


def _doc_summary_and_args(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its summary and ``Args:`` descriptions.

    Args:
        doc: the docstring (may be None).

    Returns:
        (summary paragraph, {argument name: description}).
    """
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    m = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, flags=re.MULTILINE)
    if m:
        current: str | None = None
        for line in m.group(1).splitlines():
            am = re.match(r"^\s{2,8}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if am:
                current = am.group(1)
                args[current] = am.group(2).strip()
            elif current is not None and line.strip():
                args[current] += " " + line.strip()
    return summary, args


def _model_from_function(fn: Callable[..., Any], model_name: str) -> type[pydantic.BaseModel]:
    """Build a pydantic model of ``fn``'s parameters from its signature and type hints.

    Args:
        fn: the function.
        model_name: class name of the model.

    Returns:
        A model class whose fields are the parameters (unannotated ones are ``Any``).

    Raises:
        ValueError: for ``*args``/``**kwargs`` or positional-only parameters, which a JSON
            object cannot address.
    """
    sig = inspect.signature(fn)
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # e.g. a hint naming a class local to another function
        raise ValueError(
            f"{getattr(fn, '__name__', fn)}: cannot resolve type hints ({e}); pass args_model"
        ) from e
    _, arg_docs = _doc_summary_and_args(fn.__doc__)
    fields: dict[str, Any] = {}
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"{pname}: *args, **kwargs and positional-only are not supported")
        ann = hints.get(pname, Any)
        default = ... if p.default is p.empty else p.default
        fields[pname] = (ann, pydantic.Field(default, description=arg_docs.get(pname)))
    # Extra keys the model invents are an error the model should hear about.
    return pydantic.create_model(
        model_name, __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )


def _strip_titles(node: Any) -> Any:
    """Drop pydantic's auto-generated ``title`` keys: they only cost prompt tokens.

    Args:
        node: a JSON-schema node.

    Returns:
        A copy of the node without ``title`` keys (property names called ``title`` kept).
    """
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "title" and isinstance(v, str):
                continue
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                out[k] = {pk: _strip_titles(pv) for pk, pv in v.items()}
            else:
                out[k] = _strip_titles(v)
        return out
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


@dataclass(frozen=True)
class Tool:
    """A callable the model may invoke, with its argument model.

    Attributes:
        name: function name the model uses.
        description: what the tool does (shown to the model).
        fn: the implementation, sync or async, called with the validated arguments as keyword
            arguments. It may return a str, a :class:`ToolResult` (to flag an error itself),
            a pydantic model, or anything JSON-serialisable.
        args_model: pydantic model of the arguments; its JSON schema is the ``parameters``.
        timeout_s: per-call time limit (None: the registry's default).
    """

    name: str
    description: str
    fn: Callable[..., Any]
    args_model: type[pydantic.BaseModel]
    timeout_s: float | None = None

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        name: str | None = None,
        description: str | None = None,
        args_model: type[pydantic.BaseModel] | None = None,
        timeout_s: float | None = None,
    ) -> Tool:
        """Make a tool from a function.

        Args:
            fn: sync or async function; its type hints give the schema unless ``args_model``
                is given. Google-style ``Args:`` docstring lines become field descriptions.
            name: tool name (default: ``fn.__name__``).
            description: tool description (default: the docstring's first paragraph).
            args_model: explicit argument model (its fields must be ``fn``'s keyword args).
            timeout_s: per-call time limit.

        Returns:
            The tool; its schema is validated.

        Raises:
            ValueError: invalid name or schema (message names the field).
        """
        tool_name = name or getattr(fn, "__name__", "")
        summary, _ = _doc_summary_and_args(getattr(fn, "__doc__", None))
        model = args_model or _model_from_function(fn, f"{tool_name or 'tool'}_args")
        tool = cls(
            name=tool_name,
            description=description if description is not None else summary,
            fn=fn,
            args_model=model,
            timeout_s=timeout_s,
        )
        validate_tool_schema(tool.openai_schema())
        return tool

    def parameters_schema(self) -> dict[str, Any]:
        """JSON schema of the arguments (an ``object`` schema, titles stripped).

        Returns:
            The schema dict.
        """
        schema = _strip_titles(self.args_model.model_json_schema())
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        return schema

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI chat-completions tool entry.

        Returns:
            ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        """
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters_schema(),
            },
        }


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def _to_text(value: Any) -> str:
    """Render a tool's return value as the text the model reads.

    Args:
        value: what the tool returned.

    Returns:
        The text: strings as is, pydantic models and other values as JSON.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _format_validation_error(err: pydantic.ValidationError) -> str:
    """Compact, model-readable description of a validation error.

    Args:
        err: the pydantic error.

    Returns:
        One line per problem: ``field: message``.
    """
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ())) or "(arguments)"
        lines.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(lines)


@dataclass
class ToolRegistry:
    """Named tools plus a ``call`` that never raises.

    Attributes:
        default_timeout_s: time limit for tools without their own ``timeout_s``.
        max_output_chars: tool outputs longer than this are cut (head and tail kept).
        clock: monotonic clock for ``duration_s`` (injectable for tests).
    """

    default_timeout_s: float = 60.0
    max_output_chars: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _tools: dict[str, Tool] = field(default_factory=dict, repr=False)

    def register(self, tool: Tool | Callable[..., Any], *, replace: bool = False) -> Tool:
        """Add a tool (a :class:`Tool`, or a function turned into one).

        Args:
            tool: the tool or function.
            replace: allow replacing a tool of the same name.

        Returns:
            The registered tool.

        Raises:
            ValueError: invalid schema, or a duplicate name without ``replace``.
        """
        t = tool if isinstance(tool, Tool) else Tool.from_function(tool)
        validate_tool_schema(t.openai_schema())
        if t.name in self._tools and not replace:
            raise ValueError(f"function.name: tool {t.name!r} is already registered")
        self._tools[t.name] = t
        return t

    def register_all(self, tools: Iterable[Tool | Callable[..., Any]]) -> None:
        """Register several tools.

        Args:
            tools: tools or functions.
        """
        for t in tools:
            self.register(t)

    def get(self, name: str) -> Tool | None:
        """Look a tool up.

        Args:
            name: tool name.

        Returns:
            The tool, or None.
        """
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self._tools)

    def openai_schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI ``tools`` list.

        Args:
            names: restrict to these tools (default: all).

        Returns:
            One schema per tool.
        """
        chosen = list(self._tools) if names is None else list(names)
        return [self._tools[n].openai_schema() for n in chosen if n in self._tools]

    def _truncate(self, text: str) -> str:
        limit = self.max_output_chars
        if len(text) <= limit:
            return text
        return truncate_middle(text, limit)

    async def call(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult:
        """Run one tool call; every failure becomes an error result.

        Args:
            name: tool name from the model's call.
            arguments: arguments as a dict or as the JSON text the model wrote.

        Returns:
            The result; ``is_error`` set for an unknown tool, arguments that are not a JSON
            object, arguments failing validation, an exception, a timeout, or a tool-reported
            error.
        """
        start = self.clock()

        def done(content: str, is_error: bool) -> ToolResult:
            return ToolResult(self._truncate(content), is_error, max(0.0, self.clock() - start))

        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return done(f"Error: unknown tool {name!r} (available: {known})", True)
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return done(f"Error: arguments are not valid JSON: {e}", True)
        if not isinstance(arguments, Mapping):
            return done("Error: arguments must be a JSON object", True)
        try:
            model = tool.args_model.model_validate(dict(arguments))
        except pydantic.ValidationError as e:
            return done(f"Error: invalid arguments for {name}: {_format_validation_error(e)}", True)
        # Pass field values (not a dump) so nested models arrive as model instances.
        kwargs = {k: getattr(model, k) for k in type(model).model_fields}
        timeout = tool.timeout_s if tool.timeout_s is not None else self.default_timeout_s
        try:
            # An object with an ``async def __call__`` is async too.
            if inspect.iscoroutinefunction(tool.fn) or inspect.iscoroutinefunction(
                type(tool.fn).__call__
            ):
                coro: Awaitable[Any] = tool.fn(**kwargs)
            else:
                coro = _in_own_thread(tool.fn, kwargs, name)
            value = await asyncio.wait_for(coro, timeout=timeout)
        except TimeoutError:
            return done(f"Error: tool {name} timed out after {timeout:g} s", True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failing tool is data for the model
            return done(f"Error: {name} raised {type(e).__name__}: {e}", True)
        if isinstance(value, ToolResult):
            return done(value.content, value.is_error)
        return done(_to_text(value), False)


async def _in_own_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """Runs a sync tool in a daemon thread of its own, so the event loop (and other jobs) go on.

    NOTE: not the loop's default executor: a thread cannot be killed, so a tool that hangs past
    its timeout is abandoned, and a few of those would fill the executor's handful of workers
    and stall every later ``to_thread`` (the other tools, ``bash`` included). An abandoned
    thread ends when its tool returns; its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return  # timed out or cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting call
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name=f"asymcache-tool-{name}", daemon=True).start()
    return await future


def truncate_middle(text: str, limit: int) -> str:
    """Cut ``text`` to about ``limit`` characters, keeping its head and tail.

    The tail is kept because errors and exit summaries usually come last.

    Args:
        text: the text.
        limit: maximum characters kept (>= 0).

    Returns:
        The text, or head + a marker saying how much was elided + tail.
    """
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    elided = len(text) - head - tail
    return f"{text[:head]}\n... [{elided} characters elided] ...\n{text[len(text) - tail :]}"


# --------------------------------------------------------------------------------------------
# Built-in SWE tools
# --------------------------------------------------------------------------------------------


#: names that moved out of this module (importable from here as before), and their modules
_MOVED_NAMES = {
    **dict.fromkeys(("PathEscapeError", "resolve_in_workdir", "BuiltinToolConfig", "bash_sandbox", "bash_env",
                     "bash_argv", "make_builtin_tools", "builtin_registry"), "builtin_tools"),
    **dict.fromkeys(("kill_call", "BashRun", "run_bash"), "bash_process"),
}


def __getattr__(name: str) -> Any:
    # NOTE: lazily, as builtin_tools imports this module
    if name in _MOVED_NAMES:
        import importlib

        return getattr(importlib.import_module(f"agent_runtime.{_MOVED_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
