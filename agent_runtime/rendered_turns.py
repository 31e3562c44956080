"""Which earlier turn a chat continues, found by its rendered messages.

The engine gives a request that names no job the job of the conversation its prompt continues
(:class:`~asymcache_core.implicit_jobs.ImplicitJobs`): the new prompt holds the previous prompt,
then the previous reply's start as it was generated. A reasoning model's template breaks the
second half: DeepSeek-R1's drops the ``<think>`` block of every earlier reply, Qwen3's does when
the client does not send ``reasoning_content`` back (the OpenAI SDK does not), so the new prompt
shows the reply without the tokens the model began it with, and every turn started a job of its
own.

The chat says which turn it continues without looking at tokens: the messages before its last
assistant message are the chat that turn was rendered from. Rendered again (same tools, same
template and variables, with the generation prompt), they give that turn's prompt, which this
table maps to the job the engine gave it. The engine takes that job only where no key of its own
matched and the job still has keys; a turn's entry is taken by its first continuation, so a
fork becomes a job of its own. Nothing here changes a token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from asymcache_core.implicit_jobs import DEFAULT_MAX_CONVERSATIONS


def previous_turn_chat(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]] | None:
    """The chat whose reply is ``messages``' last assistant message: the messages before it.

    Args:
        messages: OpenAI messages.

    Returns:
        The messages before the last assistant message, or None where there is none (or
        nothing before it).
    """
    for i in range(len(messages) - 1, 0, -1):
        if messages[i].get("role") == "assistant":
            return messages[:i]
    return None


class RenderedTurns:
    """The jobs the engine gave chat turns, keyed by each turn's rendered prompt (text, or
    token ids where the template's output was encoded as text), least recently used first out.

    Invariant: at most ``max_turns`` prompts are kept. Only the prompts' hashes are stored.

    Args:
        max_turns: prompts kept at most.
    """

    def __init__(self, max_turns: int = DEFAULT_MAX_CONVERSATIONS) -> None:
        if max_turns < 1:
            raise ValueError(f"rendered turns: max_turns must be >= 1, got {max_turns!r}")
        self.max_turns = max_turns
        self._jobs: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    @staticmethod
    def _key(prompt: str | Sequence[int], salt: str | None) -> int:
        # NOTE: a ``cache_salt`` is a namespace: a turn is found only by turns of the same one
        return hash((salt, prompt if isinstance(prompt, str) else tuple(prompt)))

    def remember(self, prompt: str | Sequence[int], job: str, salt: str | None = None) -> None:
        """A turn rendered to ``prompt`` (under ``cache_salt`` ``salt``) runs in ``job``."""
        key = self._key(prompt, salt)
        self._jobs[key] = job
        self._jobs.move_to_end(key)
        while len(self._jobs) > self.max_turns:
            self._jobs.popitem(last=False)

    def take(self, prompt: str | Sequence[int], salt: str | None = None) -> str | None:
        """The job of the turn rendered to ``prompt`` under ``salt``, once (None: none is known).

        NOTE: once, as the engine's keys go with a match: a second continuation of the same
        turn (a fork) is a job of its own, not the job of the first one's later turns.
        """
        return self._jobs.pop(self._key(prompt, salt), None)


__all__ = ["RenderedTurns", "previous_turn_chat"]
