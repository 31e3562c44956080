"""Parallel sampling (``n > 1``) as one turn of a job: the choices of a request, together.

vLLM 0.32 fans a request with ``n`` choices out into ``n`` child requests before they reach the
scheduler (``LLMEngine.add_request`` / ``AsyncLLM.add_request``): the i-th child's id is
``f"{i}_{parent}"`` (``vllm/v1/engine/parallel_sampling.py``: ``ParentRequest.get_child_info``),
and each carries a shallow copy of the parent's sampling params, so the same ``extra_args``: the
same job hints. Nothing else links them in the engine core (``vllm.v1.request.Request`` has no
parent field), so the scheduler groups them by that id.

For a job, the choices are one turn: the client gets them together and continues from one of
them. :class:`ParallelTurns` keeps a turn open from its first choice's arrival to its last
choice's finish; the scheduler counts the turn's arrival at the first choice and its end (the
job's statistics, the tool pause, one pin over every choice's cached blocks) at the last. A
request that is not a child is a turn of one choice, ended at its own finish, as before.

NOTE: a child that reaches the engine after all its siblings finished (possible only when the
others ran their whole turn in one step before it was read off the engine's input queue) opens a
turn of its own, as every child did before this grouping.

Plain Python: nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asymcache_core.integrations.vllm.pins import JobHints


def parent_request_id(request_id: str) -> str | None:
    """The id of the request that vLLM fanned ``request_id`` out from, if it is a child's.

    Args:
        request_id: the engine core's request id.

    Returns:
        ``parent`` for an id ``f"{i}_{parent}"`` (``ParentRequest.get_child_info``), else
        ``None``. NOTE: a plain request whose own id looks so (a client's id ``"0_x"`` becomes
        ``"0_x-<8 random chars>"``) is a child of a parent with a random suffix no other request
        shares: a turn of one choice, as any plain request is.
    """
    index, sep, parent = request_id.partition("_")
    if not sep or not parent or not (index.isascii() and index.isdigit()):
        return None
    return parent


@dataclass
class ChoiceTurn:
    """One turn of a job whose choices are in flight or just ended.

    Attributes:
        hints: the hints of its first choice (every choice's, implicit job included).
        live: choices added and not finished.
        finished: the choices finished so far, in finish order (vLLM's ``Request`` objects).
        blocks: each cached block a finished choice held, with the hash it had then.
        context_tokens: the longest finished choice's tokens (prompt + output).
        failed: a choice was aborted or failed (the client got no turn to continue).
    """

    hints: JobHints
    live: int = 0
    finished: list[Any] = field(default_factory=list)
    blocks: dict[int, tuple[Any, Hashable]] = field(default_factory=dict)
    context_tokens: int = 0
    failed: bool = False

    def cached_block_ids(self) -> list[int]:
        """The ids of the turn's blocks that still hold the content they had when their choice
        finished.

        NOTE: a choice's blocks are free from its own finish on; one evicted before the turn's
        last choice finished may hold other content now, which a pin must not protect.

        Returns:
            Block ids, in the order the choices gave them.
        """
        return [
            block_id
            for block_id, (block, block_hash) in self.blocks.items()
            if block.block_hash is not None and block.block_hash == block_hash
        ]


class ParallelTurns:
    """The open turns of jobs, by the request id their choices were fanned out from."""

    def __init__(self) -> None:
        self._open: dict[str, ChoiceTurn] = {}

    def in_flight(self) -> int:
        """Open turns (bounded by the requests in flight)."""
        return len(self._open)

    def sibling_hints(self, request_id: str) -> JobHints | None:
        """The hints of the open turn ``request_id`` is another choice of.

        Args:
            request_id: a new request's id.

        Returns:
            Its first choice's hints, or ``None`` (not a child, or its turn's first choice).
        """
        parent = parent_request_id(request_id)
        turn = None if parent is None else self._open.get(parent)
        return None if turn is None else turn.hints

    def join(self, request_id: str, hints: JobHints) -> bool:
        """A choice of a job arrived.

        Args:
            request_id: its id.
            hints: its hints (a job's).

        Returns:
            Whether it opens the turn (its arrival is the job's; a sibling's is not).
        """
        parent = parent_request_id(request_id)
        if parent is None:
            return True
        turn = self._open.get(parent)
        opens = turn is None
        if turn is None:
            turn = self._open[parent] = ChoiceTurn(hints)
        turn.live += 1
        return opens

    def finish(self, request: Any, blocks: Iterable[Any], failed: bool) -> ChoiceTurn | None:
        """A choice of a job finished.

        Args:
            request: vLLM's request.
            blocks: the cached blocks it held (``block_hash`` set).
            failed: it was aborted or failed.

        Returns:
            The turn when this was its last choice (a request that is not a child: its own
            turn), else ``None``.
        """
        parent = parent_request_id(request.request_id)
        turn = None if parent is None else self._open.get(parent)
        if turn is None:
            # NOTE: not a child, or a child that joined no turn (its add_request was not seen)
            turn = ChoiceTurn(JobHints(), live=1)
        for block in blocks:
            turn.blocks.setdefault(block.block_id, (block, block.block_hash))
        turn.finished.append(request)
        turn.context_tokens = max(turn.context_tokens, int(request.num_tokens))
        turn.failed = turn.failed or failed
        turn.live -= 1
        if turn.live > 0:
            return None
        if parent is not None:
            self._open.pop(parent, None)
        return turn


__all__ = ["ChoiceTurn", "ParallelTurns", "parent_request_id"]
