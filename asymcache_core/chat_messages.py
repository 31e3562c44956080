"""OpenAI chat messages checked for what the chat layer renders (:mod:`asymcache_core.chat_template`):
the server, the agent runtime and :meth:`Engine.chat <asymcache_core.engine.Engine.chat>` take
messages through one check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asymcache_core.tool_parsing import from_openai_tool_calls

#: The content-part types that are text, with the key of their text: OpenAI's ``text`` (and an
#: assistant's ``refusal``), and the Responses API's ``input_text`` / ``output_text``, which
#: clients converting between the two APIs send in chat messages too (vLLM reads them all).
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}

#: What joins a message's text parts (or an Anthropic message's text blocks) into the one string
#: a chat template renders: a newline, vLLM's join, so parts such as a reminder and the request
#: after it do not run together ("...</system-reminder>Fix the bug").
TEXT_PART_SEPARATOR = "\n"

#: The roles a chat message may have.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

#: A message's fields that hold text when present (OpenAI's and vLLM's).
_STRING_FIELDS = ("name", "tool_call_id", "reasoning_content", "reasoning", "refusal")


def validate_messages(messages: Any) -> None:
    """Check the shape of an OpenAI ``messages`` list.

    Args:
        messages: the value to check.

    Raises:
        ValueError: naming ``messages`` or ``messages[i].<field>``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {sorted(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None and role != "assistant":
            # NOTE: only an assistant turn may be empty (its tool calls say what it did); a
            # template would print another role's null as the text "None"
            raise ValueError(f"messages[{i}].content: a {role} message needs content (a string or a list of parts)")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"messages[{i}].content: must be a string, a list of parts, or null")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            _check_content_part(part, f"messages[{i}].content[{j}]")
        for key in _STRING_FIELDS:
            if m.get(key) is not None and not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}].{key}: must be a string")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
            if not isinstance(tool_calls, list):
                raise ValueError(f"messages[{i}].tool_calls: must be a list")
            for j, call in enumerate(tool_calls):
                if isinstance(call, Mapping) and call.get("id") is not None and not isinstance(call["id"], str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].id: must be a string")
            try:
                from_openai_tool_calls(tool_calls)
            except ValueError as e:
                raise ValueError(f"messages[{i}].{e}") from None


def _check_content_part(part: Any, where: str) -> None:
    """A content part must be text: an image or audio part would be dropped from the prompt
    unseen (the models served take text only), so it is refused instead.

    Raises:
        ValueError: naming ``where`` or its ``type`` / ``text``.
    """
    if isinstance(part, str):
        return  # NOTE: a bare string part, as some clients send: its text
    if not isinstance(part, Mapping):
        raise ValueError(f"{where}: must be a content part object")
    kind = part.get("type")
    key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise ValueError(f"{where}.type: {kind!r} parts are not served: the model takes text only "
                         f"(types {', '.join(TEXT_PART_KEYS)})")
    if not isinstance(part.get(key), str):
        raise ValueError(f"{where}.{key}: must be a string")


__all__ = ["ROLES", "TEXT_PART_KEYS", "validate_messages"]
