"""The system prompt of an Anthropic Messages request (:mod:`agent_runtime.server.anthropic_messages`):
the top-level ``system`` (a string or text blocks) and the ``system`` messages Anthropic's API
takes anywhere in ``messages`` (the SDK's ``SystemMessageParam``), as vLLM reads them.

Claude Code opens its system prompt with an ``x-anthropic-billing-header: ...; cch=<hash>;``
text block whose hash changes on every request; as the first text of the prompt it would make
every request's prefix new, so no turn could reuse the cached KV of the one before. Such a
block is billing metadata, not an instruction, and is left out (:func:`system_text`), as vLLM
leaves it out.

A ``system`` message after the first message stays where it is when the chat template renders
it there; a template that takes a system message only first (Qwen3's ``raise_exception``) gets
its text appended to the leading system prompt (:func:`merge_inline_system`), vLLM's fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asymcache_core.chat_messages import TEXT_PART_SEPARATOR
from asymcache_core.chat_template import ChatRenderer

#: How Claude Code's per-request billing block starts (its text, not an HTTP header).
BILLING_HEADER_PREFIX = "x-anthropic-billing-header"

#: A chat with a system message after a user message: a template that refuses it raises.
_INLINE_SYSTEM_PROBE = (
    {"role": "system", "content": "a"}, {"role": "user", "content": "b"},
    {"role": "system", "content": "c"}, {"role": "user", "content": "d"},
)


def block_texts(content: Any, where: str) -> list[str]:
    """The texts of a system prompt or a ``tool_result``'s content: a string (one text) or a
    list of ``text`` blocks; empty ones are left out (Anthropic refuses them; vLLM skips them).

    Args:
        content: the value.
        where: its field, for errors.

    Raises:
        ValueError: a value of another type, or a block that is not text (naming it).
    """
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise ValueError(f"{where}: must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if block.get("type") != "text":
            raise ValueError(f"{where}[{j}].type: not served by this server: {block.get('type')!r}")
        text = block.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}].text: must be a string")
        if text:
            texts.append(text)
    return texts


def system_text(content: Any, where: str) -> str:
    """A system prompt's text: its text blocks joined by newlines, Claude Code's billing block
    left out (see the module's docstring).

    Args:
        content: a string or a list of text blocks.
        where: its field, for errors (``system``, ``messages[i].content``).

    Raises:
        ValueError: as :func:`block_texts`.
    """
    return TEXT_PART_SEPARATOR.join(t for t in block_texts(content, where) if not t.startswith(BILLING_HEADER_PREFIX))


def has_inline_system(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a system message comes after the first message of a chat."""
    return any(m.get("role") == "system" for m in messages[1:])


def accepts_inline_system(renderer: ChatRenderer | None) -> bool:
    """Whether a chat template renders a system message after a user message (a template
    that takes a system message only first raises on it).

    Args:
        renderer: the runtime's renderer (None: no template, nothing to merge for).
    """
    if renderer is None:
        return True
    try:
        renderer.render(_INLINE_SYSTEM_PROBE, add_generation_prompt=False)
    except ValueError:
        return False
    return True


def merge_inline_system(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A chat whose system messages are all one leading system prompt: the texts of those after
    the first message are appended to it (a new one first where the chat has none), in order.

    Args:
        messages: chat messages (system ones with string content).

    Returns:
        The merged chat.
    """
    lead = [dict(messages[0])] if messages and messages[0].get("role") == "system" else []
    rest = [dict(m) for m in messages[len(lead):] if m.get("role") != "system"]
    moved = [m["content"] for m in messages[len(lead):] if m.get("role") == "system"]
    if not moved:
        return [*lead, *rest]
    texts = ([lead[0]["content"]] if lead and lead[0]["content"] else []) + moved
    return [{"role": "system", "content": TEXT_PART_SEPARATOR.join(texts)}, *rest]


__all__ = ["BILLING_HEADER_PREFIX", "accepts_inline_system", "block_texts", "has_inline_system",
           "merge_inline_system", "system_text"]
