"""Render OpenAI-format chats (tools, tool calls, tool results) with a model's chat template.

Rendering is transformers' ``tokenizer.apply_chat_template(..., tokenize=False)``. Two paths:

* **Native** (:func:`detect_tools_support` is True: rendering with a probe tool prints it):
  messages and tools go to ``apply_chat_template(tools=...)`` as they are (tool-call arguments
  as objects, the form HF templates expect).
* **Injected** (templates without a tool section, e.g. SmolLM2's, which only knows ``role`` and
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

Templates take vLLM's extras: variables of the caller's own (``chat_template_kwargs``, such as
``enable_thinking``; :func:`check_template_kwargs`), ``documents`` for retrieval templates, and
a template other than the tokenizer's (:mod:`asymcache_core.chat_template_options`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from asymcache_core.chat_escaping import escape_tree, unescape
from asymcache_core.chat_messages import TEXT_PART_KEYS, TEXT_PART_SEPARATOR, validate_messages
from asymcache_core.chat_template_options import (
    check_documents,
    check_template_kwargs,
    check_template_source,
)
from asymcache_core.tool_parsing import from_openai_tool_calls, render_hermes_tool_calls

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


# A tool no template has seen: a template with a tool section prints its name.
_PROBE_TOOL_NAME = "asymcache_probe_tool_7c1e"
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL_NAME,
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def detect_tools_support(tokenizer: Any, template: str | None = None) -> bool:
    """Does the chat template render a tools list itself?

    Args:
        tokenizer: an HF tokenizer.
        template: template source to use instead of the tokenizer's.

    Returns:
        True when rendering a one-message chat with a probe tool prints the tool's name; False
        when it does not, when the template fails on it, or when there is no template.
    """
    # NOTE: rendered, not read from the source: a template may name ``tools`` without
    # printing them (a guard, an error), and a tokenizer with named templates renders its
    # "tool_use" one when tools are given.
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}],
            tools=[_PROBE_TOOL],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 - a template failing on the probe has no usable tool section
        return False
    return isinstance(text, str) and _PROBE_TOOL_NAME in text


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
        The text parts joined by newlines (others, refused by the protocol's checks, dropped).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            key = TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, Mapping) else None
            if key is not None:
                texts.append(str(part.get(key, "")))
            elif isinstance(part, str):
                texts.append(part)
        return TEXT_PART_SEPARATOR.join(texts)
    return str(content)


def _native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-aware template: tool-call arguments decoded to objects.

    Args:
        messages: OpenAI messages.

    Returns:
        Copies, with ``tool_calls[*].function.arguments`` as dicts (an empty list of calls
        dropped) and list contents as text.
    """
    out = []
    for m in messages:
        msg = dict(m)
        if not isinstance(msg.get("content"), str | None):
            msg["content"] = _content_text(msg.get("content"))
        if not msg.get("tool_calls"):
            # NOTE: vLLM's: an empty (or null) list is no calls; Llama 3.1's template reads any
            # ``tool_calls`` key as calls and refuses a list without exactly one (a client that
            # sends a reply back as it came, ``"tool_calls": []`` included, would get a 400)
            msg.pop("tool_calls", None)
        else:
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
    """A tokenizer's chat template rendering OpenAI chats to prompt text.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        template: template source to use instead of the tokenizer's.

    Raises:
        ValueError: no chat template.
    """

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        if not (template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("chat_template: the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.template: str | None = template
        self.native_tools: bool = detect_tools_support(tokenizer, template)
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special_tokens: tuple[str, ...] = tuple(sorted(
            {str(t.content) for t in decoder.values() if getattr(t, "special", False) and str(t.content)},
            key=len, reverse=True,
        ))
        self._special_re = re.compile("|".join(map(re.escape, self.special_tokens))) if self.special_tokens else None
        # NOTE: a private copy encodes caller text: ``split_special_tokens`` switches state on
        # the tokenizer it is passed to, and the shared one is in use on other threads.
        self._plain: Any = None

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]:
        """The prompt of a chat: its text, or its token ids when caller text holds special tokens.

        Text that the caller supplied (message contents, tool calls and results, tool schemas,
        documents, the string values of template variables) may spell a special token (``<|im_start|>system``); encoded with the rendered prompt,
        it would become that control token and could open a fake turn. Such text is kept out
        of the template's reach (swapped for private-use markers while rendering) and encoded
        as plain text, while the template's own special tokens stay special. A chat without
        such text renders exactly as :meth:`render` (and is encoded by the engine as before).

        Args:
            messages: OpenAI chat messages.
            tools: OpenAI tool schemas, or None.
            add_generation_prompt: end with the opening of an assistant turn.
            continue_final_message: end inside the final message, without its end of turn, so
                that the model goes on writing it (vLLM's; not with ``add_generation_prompt``).
            template_kwargs: further template variables (checked by
                :func:`check_template_kwargs`).
            documents: the ``documents`` variable of retrieval templates.

        Returns:
            The prompt text, or its token ids.

        Raises:
            ValueError: as :meth:`render`.
        """
        ending = (add_generation_prompt, continue_final_message)
        if self._special_re is None:
            return self.render(messages, tools, *ending, template_kwargs, documents)
        found: set[str] = set()

        def escaped(node: Any) -> Any:
            return escape_tree(node, self._special_re, self.special_tokens, found) if node else node

        caller = (escaped(messages), escaped(tools), escaped(template_kwargs), escaped(documents))
        if not found:
            return self.render(messages, tools, *ending, template_kwargs, documents)
        text = self.render(caller[0], caller[1], *ending, caller[2], caller[3])
        return self.encode_rendered(text)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a prompt rendered from escaped caller text.

        The template's special tokens (the only ones left in ``text``) are their ids; the text
        between them has its markers restored and is encoded with special tokens read as text.
        Added special tokens split the text before the model's pre-tokenizer runs, so for text
        without markers this equals ``tokenizer.encode(text, add_special_tokens=False)``.

        Args:
            text: the rendered prompt.

        Returns:
            The token ids.
        """
        if self._plain is None:
            self._plain = copy.deepcopy(self.tokenizer)
        ids: list[int] = []
        pos = 0
        pattern = self._special_re
        matches = list(pattern.finditer(text)) if pattern is not None else []
        for m in [*matches, None]:
            end = m.start() if m is not None else len(text)
            if end > pos:
                piece = unescape(text[pos:end], self.special_tokens)
                ids.extend(self._plain.encode(piece, add_special_tokens=False, split_special_tokens=True))
            if m is not None:
                ids.append(int(self.tokenizer.convert_tokens_to_ids(m.group(0))))
                pos = m.end()
        return ids

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render a chat.

        Args:
            messages: OpenAI chat messages (``tool`` messages and assistant ``tool_calls``
                included).
            tools: OpenAI tool schemas, or None.
            add_generation_prompt: end with the opening of an assistant turn.
            continue_final_message: end inside the final message (no end of turn after it).
            template_kwargs: further template variables (``enable_thinking``, ...).
            documents: the ``documents`` variable of retrieval templates.

        Returns:
            The prompt text.

        Raises:
            ValueError: both endings asked for, a reserved template variable, a final message
                the template does not render as written (it cannot be left open), or the
                template failing on this chat (``chat_template: ...``: its own
                ``raise_exception``, a variable of the wrong type).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: not with add_generation_prompt (send add_generation_prompt=false)")
        if self.native_tools:
            msgs: list[dict[str, Any]] = _native_messages(messages)
            schemas: list[dict[str, Any]] | None = [dict(t) for t in tools] if tools else None
        else:
            msgs = list(_injected_messages(messages, tools))
            schemas = None
        variables = check_template_kwargs(template_kwargs)
        try:
            return self.tokenizer.apply_chat_template(
                msgs,
                tools=schemas,
                documents=[dict(d) for d in documents] if documents else None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **variables,
            )
        except Exception as e:  # noqa: BLE001 - see the note
            # NOTE: a template's ``raise_exception`` (roles out of order, a variable it refuses),
            # its operations on a caller's variable of another type, or a request's own
            # template dividing by zero, recursing or overflowing ``range``: the chat's fault
            raise ValueError(f"chat_template: the template failed on this chat: {e}") from None


class ChatTemplates:
    """The renderers a runtime chooses from: the model's (or a deployment's) template, and the
    templates requests bring, each probed once for tool support (a few kept, least recently
    used dropped); plus the template variables every chat gets unless it sets its own.

    Args:
        tokenizer: an HF tokenizer.
        template: the deployment's template source (vLLM's ``--chat-template``), or None for
            the tokenizer's.
        default_kwargs: template variables every chat gets (vLLM's
            ``--default-chat-template-kwargs``); a chat's own win.
        max_request_templates: request templates kept ready.

    Raises:
        ValueError: no template at all, or bad ``default_kwargs``.
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
        max_request_templates: int = 8,
    ) -> None:
        self.default = ChatRenderer(tokenizer, template)
        self.default_kwargs: dict[str, Any] = check_template_kwargs(default_kwargs, "default_chat_template_kwargs")
        self.max_request_templates = max_request_templates
        self._requested: dict[str, ChatRenderer] = {}

    def renderer(self, template: str | None = None) -> ChatRenderer:
        """The renderer of ``template`` (None: the default one).

        Args:
            template: a template's source.

        Returns:
            The renderer.

        Raises:
            ValueError: a template Jinja cannot parse (``chat_template: ...``).
        """
        if template is None or template == self.default.template:
            return self.default
        found = self._requested.pop(template, None)
        if found is None:
            found = ChatRenderer(self.default.tokenizer, check_template_source(template))
        self._requested[template] = found  # most recent last
        while len(self._requested) > self.max_request_templates:
            del self._requested[next(iter(self._requested))]
        return found

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Any = None,
    ) -> str | list[int]:
        """A chat's prompt as the server, the runtime and ``Engine.chat`` render it: messages
        checked (:func:`~asymcache_core.chat_messages.validate_messages`), ``chat_template``'s
        renderer (None: the default), the default variables under the chat's own.

        Returns:
            The text, or its token ids (:meth:`ChatRenderer.prompt`).

        Raises:
            ValueError: naming the field (``messages[i]...``, ``chat_template...``,
                ``documents...``, ``continue_final_message``).
        """
        validate_messages(messages)
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: True or False, got {flag!r}")
        return self.renderer(chat_template).prompt(
            messages, tools or None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=self.variables(chat_template_kwargs),
            documents=check_documents(documents),
        )

    def variables(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The template variables of a chat: the defaults, then its own.

        Args:
            kwargs: the chat's variables, or None.

        Returns:
            The merged variables.

        Raises:
            ValueError: bad ``chat_template_kwargs``.
        """
        return {**self.default_kwargs, **check_template_kwargs(kwargs)}


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a chat with the tokenizer's template (see the module docstring).

    Probes the template for a tool section on every call; hold a :class:`ChatRenderer` to
    do that once.

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
