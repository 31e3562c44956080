"""Constrained replies that wait for a reasoning model's thinking to end (vLLM's reasoning gate).

vLLM 0.32 applies a request's grammar (a JSON ``response_format``, a forced tool call,
``structured_outputs``) only once the reply's reasoning has ended
(``StructuredOutputManager._get_constraint_bounds``: ``reasoning_ended`` is latched by the
reasoning parser's end token): a thinking model thinks freely, then writes the constrained reply.
The grammar sees the tokens after ``</think>``, and with ``qwen3`` a ``<tool_call>`` that ends the
thinking is itself the grammar's first token (an implicit end: the call is content).
:class:`ReasoningGate` does the same around a
:class:`~agent_runtime.grammar_processor.GrammarLogitsProcessor`: until the reply's thinking has
ended, as the runtime's reasoning parser reads it (:func:`~agent_runtime.reasoning.stream_split`),
it masks nothing, forces nothing and says it passes (a greedy row keeps its argmax on the
device); from there the grammar is handed the reply's tokens from the content's first.

NOTE: vLLM finds the end by token id (``</think>`` and ``<tool_call>`` are single tokens of the
models that use them); here it is found in the decoded text, so a tokenizer that spells a tag
in several tokens gates the same way. The grammar starts at the first token that begins at or
after the content's start: with such a tokenizer, text that shares the closing tag's last token
(``>\\n\\n``) is content the grammar does not see, and a tool call whose ``<`` shares a token with
the text before it is not one the grammar can read (it then allows only EOS).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agent_runtime.reasoning import REASONING_ENDS


class ReasoningGate:
    """A grammar processor that starts at the end of the reply's thinking.

    Implements :class:`asymcache_core.sampling_params.LogitsProcessor` (``keep_words``,
    ``forced_tokens``, ``passes``). Stateful, one per request; like the grammar it wraps, it
    rebuilds its state when the ids it is handed are not the ones it saw last (a preempted
    request's output recomputed).

    Args:
        grammar: the processor of the request's constraint (its ``keep_words``,
            ``forced_tokens`` and ``__call__`` see only the content's tokens).
        parser: the reply's reasoning parser (``deepseek_r1``, ``qwen3`` with thinking on).
        decode: one token id to its text, special tokens kept.
    """

    def __init__(self, grammar: Any, parser: str, decode: Callable[[int], str]) -> None:
        if parser not in REASONING_ENDS:
            raise ValueError(f"reasoning_parser: one of {', '.join(REASONING_ENDS)}; got {parser!r}")
        self.grammar = grammar
        self._ends = REASONING_ENDS[parser]
        # NOTE: a tag completed by a new token starts at most this many characters before it
        self._overlap = max(len(tag) for tag, _ in self._ends) - 1
        self._decode = decode
        self._reset()

    def _reset(self) -> None:
        self._seen: list[int] = []
        self._text = ""
        self._offsets: list[int] = []  # where each token's text begins, while thinking
        #: index of the reply's first token the grammar reads (None: still thinking)
        self.grammar_start: int | None = None

    @property
    def failed(self) -> bool:
        """The grammar saw a token outside it."""
        return bool(self.grammar.failed)

    @property
    def is_terminated(self) -> bool:
        """The grammar was completed and EOS accepted (or it failed)."""
        return bool(self.grammar.is_terminated)

    def _content_start(self, scanned: int) -> int | None:
        """Where the content starts, if a tag that ends the thinking is in the text (only the
        text from ``scanned`` on can hold one not seen before)."""
        begin = max(0, scanned - self._overlap)
        found = [(at, implicit, tag) for tag, implicit in self._ends if (at := self._text.find(tag, begin)) >= 0]
        if not found:
            return None
        at, implicit, tag = min(found)
        return at if implicit else at + len(tag)

    def _advance(self, output_token_ids: list[int]) -> None:
        seen = self._seen
        # NOTE: the ids only grow; a shorter or different list is another pass over the request
        if len(output_token_ids) < len(seen) or (seen and output_token_ids[len(seen) - 1] != seen[-1]):
            self._reset()
            seen = self._seen
        for token in output_token_ids[len(seen):]:
            if self.grammar_start is None:
                scanned = len(self._text)
                self._offsets.append(scanned)
                self._text += self._decode(int(token))
                start = self._content_start(scanned)
                if start is not None:
                    self.grammar_start = bisect_left(self._offsets, start)
                    self._text, self._offsets = "", []
            seen.append(int(token))

    def _content(self, output_token_ids: list[int]) -> list[int] | None:
        """The reply's tokens from the content's first (None: still thinking)."""
        self._advance(output_token_ids)
        return None if self.grammar_start is None else list(output_token_ids[self.grammar_start:])

    def passes(self, output_token_ids: list[int]) -> bool:
        """Whether the next token's logits are left as they are: while the reply thinks."""
        return self._content(output_token_ids) is None

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray | None:
        """The grammar's packed mask of the next token (:mod:`asymcache_core.token_masks`), or
        None (every token) while the reply thinks."""
        content = self._content(output_token_ids)
        return None if content is None else self.grammar.keep_words(content, vocab)

    def forced_tokens(self, output_token_ids: list[int], limit: int) -> list[int]:
        """The tokens the grammar alone allows next (jump-forward; none while the reply
        thinks): see :meth:`GrammarLogitsProcessor.forced_tokens
        <agent_runtime.grammar_processor.GrammarLogitsProcessor.forced_tokens>`."""
        content = self._content(output_token_ids)
        return [] if content is None else list(self.grammar.forced_tokens(content, limit))

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` masked to the grammar once the thinking ended (as they are before)."""
        content = self._content(output_token_ids)
        return logits if content is None else self.grammar(content, logits)


def gated_processor(grammar: Any, parser: str | None, tokenizer: Any) -> Any:
    """``grammar`` behind a :class:`ReasoningGate` for the reply's reasoning parser (as it is
    without one: the reply has no thinking, and is constrained from its first token).

    Args:
        grammar: the request's grammar processor.
        parser: the reply's reasoning parser (None: none).
        tokenizer: an HF tokenizer (``decode``).

    Returns:
        The processor to give the request.
    """
    if parser is None:
        return grammar
    decode = tokenizer.decode
    return ReasoningGate(grammar, parser, lambda token: decode([token], skip_special_tokens=False))


__all__ = ["ReasoningGate", "gated_processor"]
