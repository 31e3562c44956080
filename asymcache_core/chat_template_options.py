"""vLLM's chat-template options, checked: a caller's template variables
(``chat_template_kwargs``), retrieval ``documents``, and a template given as a file or as text
(``--chat-template``, a request's ``chat_template``). :mod:`asymcache_core.chat_template` renders
with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

#: ``apply_chat_template``'s own parameters and the variables it sets: never template variables
#: of the caller's (``chat_template_kwargs`` naming one is an error, not an override).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """Variables a caller passes to the chat template (vLLM's ``chat_template_kwargs``).

    Args:
        kwargs: an object of variable names to JSON values, or None.
        field: the name errors give it.

    Returns:
        A copy (empty for None).

    Raises:
        ValueError: not an object, a key that is not a Python identifier (a template could not
            name it), or one of :data:`RESERVED_TEMPLATE_KWARGS` (naming ``field.key``).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{field}: must be an object of template variables")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{field}: variable names must be identifiers, got {key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{field}.{key}: not a template variable ({key!r} is the renderer's own argument)")
    return dict(kwargs)


def check_documents(documents: Any) -> list[dict[str, Any]] | None:
    """A chat's ``documents`` for retrieval templates (vLLM's field): a list of objects.

    Args:
        documents: the value, or None.

    Returns:
        Copies of the documents, or None.

    Raises:
        ValueError: not a list of objects (naming ``documents[i]``).
    """
    if documents is None:
        return None
    if not isinstance(documents, Sequence) or isinstance(documents, str):
        raise ValueError("documents: must be a list of objects")
    for i, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            raise ValueError(f"documents[{i}]: must be an object")
    return [dict(doc) for doc in documents]


def load_chat_template(value: str | Path | None) -> str | None:
    """A chat template given as a file or as its text (vLLM's ``--chat-template`` rule).

    Args:
        value: a path to a Jinja file, the template itself (text with ``{``, ``}`` or a line
            break), or None.

    Returns:
        The template source, or None.

    Raises:
        ValueError: a path that cannot be read, an empty template, or one Jinja cannot parse.
    """
    if value is None:
        return None
    text = str(value)
    if not any(c in text for c in "{}\n") or _is_file(text):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {str(value)!r} ({e.__class__.__name__}); "
                             "give a Jinja file or the template's text") from None
    return check_template_source(text)


def _is_file(text: str) -> bool:
    """Whether ``text`` names a file (a template's text may be no valid path at all)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def check_template_source(text: Any) -> str:
    """A chat template's source, checked to parse.

    Args:
        text: the Jinja source.

    Returns:
        The source.

    Raises:
        ValueError: not a string, empty, or not parsed by Jinja (naming ``chat_template``).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("chat_template: must be a non-empty Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a Jinja template: {e.message} (line {e.lineno})") from None
    return text


__all__ = [
    "RESERVED_TEMPLATE_KWARGS", "check_documents", "check_template_kwargs", "check_template_source",
    "load_chat_template",
]
