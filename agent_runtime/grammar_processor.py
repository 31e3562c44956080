"""The logits processor of a compiled xgrammar grammar (tool calls, JSON replies).

:class:`GrammarLogitsProcessor` implements :class:`asymcache_core.sampling_params.LogitsProcessor`
for one request, and says which tokens it keeps (``keep_words``), so the sampler masks its row
where the logits are (:mod:`asymcache_core.token_masks`), and which tokens the grammar alone
allows next (``forced_tokens``: the engine appends those at once, jump-forward decoding). The
grammars come from :class:`agent_runtime.grammar_cache.GrammarCache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from asymcache_core.token_masks import apply_keep, clear_tokens, keep_only, single_token, words_for

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarLogitsProcessor:
    """Masks one request's logits to a compiled grammar; then allows only EOS.

    Implements :class:`asymcache_core.sampling_params.LogitsProcessor`. Stateful: create one per
    request. It feeds the matcher the output tokens it has not seen; if the list shrank or
    changed (a preemption that dropped and recomputed the output), it resets the matcher and
    replays the list. A token the grammar rejects (another processor changed the choice, or the
    engine ignored the mask) leaves only EOS allowed, so the request ends instead of producing
    text the grammar cannot describe.

    Args:
        compiled: the compiled grammar.
        vocab_size: length of the logit rows (tokens past the grammar's vocabulary are masked).
        stop_token_ids: EOS ids (default: those xgrammar found in the tokenizer).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        from agent_runtime.constrained import load_xgrammar

        xgr = load_xgrammar("tool_choice")
        self._compiled = compiled
        info = compiled.tokenizer_info
        self._grammar_vocab: int = info.vocab_size
        self.vocab_size: int = vocab_size if vocab_size is not None else info.vocab_size
        stops = list(stop_token_ids) if stop_token_ids is not None else list(info.stop_token_ids)
        if not stops:
            raise ValueError("stop_token_ids: none known for this tokenizer; pass them")
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self._bitmask = xgr.allocate_token_bitmask(1, self._grammar_vocab)
        self._seen: list[int] = []
        self._failed = False
        # NOTE: the bitmask holds the matcher's next-token mask while this is True (filled for
        # the same state by forced_tokens, then read by keep_words: one fill a step)
        self._bitmask_current = False

    @property
    def failed(self) -> bool:
        """A token outside the grammar was seen."""
        return self._failed

    @property
    def is_terminated(self) -> bool:
        """The grammar was completed and EOS accepted (or it failed)."""
        return self._failed or self._matcher.is_terminated()

    def _reset(self) -> None:
        self._matcher.reset()
        self._seen = []
        self._failed = False
        self._bitmask_current = False

    def _accept(self, token_id: int) -> None:
        self._seen.append(token_id)
        self._bitmask_current = False
        if self._failed:
            return
        if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
            self._failed = True

    def _sync(self, output_token_ids: Sequence[int]) -> None:
        n = len(self._seen)
        # Cheap divergence check: a shorter list, or a different last common token. Outputs
        # only ever grow or are recomputed from scratch, so this catches every real case
        # without comparing whole lists on each step.
        if len(output_token_ids) < n or (n and output_token_ids[n - 1] != self._seen[-1]):
            self._reset()
            n = 0
        for tok in output_token_ids[n:]:
            self._accept(int(tok))

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        """The tokens the grammar allows next, packed as a row of ``vocab`` logits
        (:mod:`asymcache_core.token_masks`: the sampler masks the row where it is)."""
        self._sync(output_token_ids)
        if self.is_terminated:
            return keep_only(self.stop_token_ids, vocab)
        grammar = self._next_mask()
        words = np.zeros(words_for(vocab), dtype=np.int32)
        n = min(self._grammar_vocab, vocab)
        words[: words_for(n)] = grammar[: words_for(n)]
        # NOTE: tokens past the grammar's vocabulary stay masked, as __call__ masks them
        return clear_tokens(words, range(n, words_for(n) * 32))

    def _next_mask(self) -> np.ndarray:
        """The grammar's packed mask of the tokens allowed next (over its own vocabulary)."""
        if not self._bitmask_current:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._bitmask_current = True
        return self._bitmask[0].numpy()

    def forced_tokens(self, output_token_ids: list[int], limit: int) -> list[int]:
        """The tokens the grammar allows alone next, one after another (its fixed text: a
        forced call's name, an object's keys), at most ``limit``; they end at a choice, at a
        stop token or where the grammar is complete. They are taken as the request's next
        output tokens (the engine appends them: jump-forward decoding,
        :mod:`asymcache_core.jump_forward`).

        Args:
            output_token_ids: all tokens generated so far for this request.
            limit: the most tokens to return.

        Returns:
            The forced tokens, in order (often none).
        """
        self._sync(output_token_ids)
        forced: list[int] = []
        while len(forced) < limit and not self.is_terminated:
            token = single_token(self._next_mask())
            if token is None or token in self.stop_token_ids or token >= self.vocab_size:
                break
            self._accept(token)
            forced.append(token)
        return forced

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` (a ``[vocab]`` row) to the tokens the grammar allows next (only the
        stop tokens once it is complete or failed).

        Args:
            output_token_ids: all tokens generated so far for this request.
            logits: next-token logits, modified in place.

        Returns:
            ``logits``.
        """
        words = self.keep_words(output_token_ids, logits.shape[-1])
        apply_keep(logits.view(1, -1), [0], words[None, :])
        return logits
