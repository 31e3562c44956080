"""Render OpenAI-format chats (tools, tool calls, tool results) with a model's chat template.

The template is the tokenizer's own (``tokenizer.chat_template``), compiled in a sandboxed jinja2
environment set up the way transformers sets it up (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` filter, ``raise_exception`` and ``strftime_now`` globals, the
tokenizer's special tokens as variables), so the output equals
``tokenizer.apply_chat_template(..., tokenize=False)`` for plain chats.

Two paths:

* **Native** (:func:`detect_tools_support` is True: the template reads a ``tools`` variable):
  messages and tools go to the template as they are (tool-call arguments as objects, the form
  HF templates expect).
* **Injected** (templates without tools, e.g. SmolLM2's, which only knows ``role`` and
  ``content``): a Hermes-style tools section (the JSON schemas inside ``<tools>`` and the
  instruction to answer with ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) is
  appended to the system message (or becomes the system message when there is none; the
  template's default system prompt is then not rendered). Assistant ``tool_calls`` become
  ``<tool_call>`` text after the content, rendered exactly as the constrained grammar of
  :mod:`agent_runtime.constrained` makes the model write them, so the next turn's prompt
  repeats the generated tokens and its KV stays reusable. ``tool`` messages become a ``user``
  turn holding ``<tool_response>...</tool_response>`` blocks (consecutive tool results share
  one user turn, as Qwen's template does), because a template that does not know the ``tool``
  role would print it as an unknown role the model never saw in training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agent_runtime.tool_parsing import from_openai_tool_calls, render_hermes_tool_calls

_TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_INSTRUCTION = (
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template the way transformers does.

    Args:
        template: jinja source.

    Returns:
        The compiled template.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = _make_env()
    return env.from_string(template)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def detect_tools_support(template: str | None) -> bool:
    """Does the chat template render a tools list itself?

    Args:
        template: jinja source (None: no template).

    Returns:
        True when the template reads a ``tools`` variable (HF convention for tool-aware
        templates); False otherwise or when it does not parse.
    """
    if not template:
        return False
    try:
        ast = _make_env().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-style tools section injected into the system message.

    Args:
        tools: OpenAI tool schemas (``{"type": "function", "function": {...}}``).

    Returns:
        The section text.
    """
    lines = [json.dumps(dict(t), ensure_ascii=False) for t in tools]
    return _TOOLS_PREAMBLE + "\n" + "\n".join(lines) + "\n" + _TOOLS_INSTRUCTION


def _content_text(content: Any) -> str:
    """OpenAI content (string, None, or a list of parts) as plain text.

    Args:
        content: message content.

    Returns:
        The text parts joined (non-text parts dropped).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    return str(content)


def _native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-aware template: tool-call arguments decoded to objects.

    Args:
        messages: OpenAI messages.

    Returns:
        Copies, with ``tool_calls[*].function.arguments`` as dicts and list contents as text.
    """
    out = []
    for m in messages:
        msg = dict(m)
        if not isinstance(msg.get("content"), str | None):
            msg["content"] = _content_text(msg.get("content"))
        if msg.get("tool_calls"):
            calls = from_openai_tool_calls(msg["tool_calls"])
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        out.append(msg)
    return out


def _injected_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """Messages reduced to ``role``/``content`` strings for a template without tool support.

    Args:
        messages: OpenAI messages (system/developer/user/assistant/tool).
        tools: tool schemas to announce in the system message (None or empty: none).

    Returns:
        The reduced messages.
    """
    out: list[dict[str, str]] = []
    pending_tool: list[str] = []

    def flush_tool_results() -> None:
        if pending_tool:
            out.append({"role": "user", "content": "\n".join(pending_tool)})
            pending_tool.clear()

    for m in messages:
        role = str(m.get("role", "user"))
        text = _content_text(m.get("content"))
        if role == "tool":
            pending_tool.append(f"<tool_response>\n{text}\n</tool_response>")
            continue
        flush_tool_results()
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            calls_text = render_hermes_tool_calls(from_openai_tool_calls(m["tool_calls"]))
            text = f"{text}\n{calls_text}" if text else calls_text
        out.append({"role": role, "content": text})
    flush_tool_results()
    if tools:
        section = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            base = out[0]["content"]
            out[0] = {"role": "system", "content": f"{base}\n\n{section}" if base else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


class ChatRenderer:
    """A tokenizer's chat template, compiled once, rendering OpenAI chats to prompt text.

    Args:
        tokenizer: an HF tokenizer (anything with ``chat_template`` and, optionally,
            ``special_tokens_map``).
        template: override of the template source.

    Raises:
        ValueError: no chat template.
    """

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        source = template if template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(source, Mapping):  # some tokenizers carry named templates
            source = source.get("default") or next(iter(source.values()), None)
        if not source:
            raise ValueError("chat_template: the tokenizer has no chat template")
        self.template_source: str = source
        self.native_tools: bool = detect_tools_support(source)
        self._template = compile_template(source)
        special = getattr(tokenizer, "special_tokens_map", None) or {}
        # Templates reference e.g. bos_token/eos_token; pass the plain strings.
        self._special: dict[str, Any] = {
            k: v for k, v in dict(special).items() if isinstance(v, str)
        }

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render a chat.

        Args:
            messages: OpenAI chat messages (``tool`` messages and assistant ``tool_calls``
                included).
            tools: OpenAI tool schemas, or None.
            add_generation_prompt: end with the opening of an assistant turn.

        Returns:
            The prompt text.
        """
        if self.native_tools:
            msgs: list[dict[str, Any]] = _native_messages(messages)
            extra: dict[str, Any] = {"tools": list(tools) if tools else None}
        else:
            msgs = list(_injected_messages(messages, tools))
            extra = {}
        return self._template.render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            **self._special,
            **extra,
        )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a chat with the tokenizer's template (see the module docstring).

    Compiles the template on every call (a millisecond); hold a :class:`ChatRenderer` to
    avoid that.

    Args:
        tokenizer: HF tokenizer with a chat template.
        messages: OpenAI chat messages.
        tools: OpenAI tool schemas, or None.
        add_generation_prompt: end with the opening of an assistant turn.

    Returns:
        The prompt text.

    Raises:
        ValueError: the tokenizer has no chat template, or an assistant ``tool_calls`` entry
            is malformed.
    """
    return ChatRenderer(tokenizer).render(messages, tools, add_generation_prompt)
