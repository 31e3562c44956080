"""Caller text that spells a special token, kept out of a chat template's reach: swapped for
private-use markers while the template renders, and restored after
(:meth:`ChatRenderer.prompt <asymcache_core.chat_template.ChatRenderer.prompt>`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: Private-use characters that stand for special-token text while a template renders.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def _marker(index: int) -> str:
    return f"{_MARK_OPEN}{index}{_MARK_CLOSE}"


def escape_tree(node: Any, pattern: re.Pattern[str], specials: Sequence[str], found: set[str]) -> Any:
    """A copy of ``node`` whose strings have special-token text (and marker characters)
    replaced by markers; ``found`` collects what was replaced."""
    if isinstance(node, str):
        if _MARK_OPEN in node:
            found.add(_MARK_OPEN)
            node = node.replace(_MARK_OPEN, _marker(len(specials)))
        if pattern.search(node) is None:
            return node
        index = {tok: i for i, tok in enumerate(specials)}

        def swap(m: re.Match[str]) -> str:
            found.add(m.group(0))
            return _marker(index[m.group(0)])

        return pattern.sub(swap, node)
    if isinstance(node, Mapping):
        return {k: escape_tree(v, pattern, specials, found) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [escape_tree(v, pattern, specials, found) for v in node]
    return node


def unescape(text: str, specials: Sequence[str]) -> str:
    """The caller's text back from markers (raw, or JSON-escaped by a ``tojson`` filter)."""
    if _MARK_OPEN not in text and "\\ue000" not in text:
        return text
    originals = [*specials, _MARK_OPEN]

    def restore(m: re.Match[str]) -> str:
        return originals[int(m.group(1))]

    text = re.sub(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}", restore, text)
    return re.sub(r"\\ue000(\d+)\\ue001", lambda m: json.dumps(restore(m))[1:-1], text)


__all__ = ["escape_tree", "unescape"]
