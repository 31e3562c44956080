"""Jump-forward decoding: the tokens a request's constraint forces, appended without sampling.

After a request samples a token, :func:`forced_tokens` asks its one logits processor which
tokens it keeps alone next, one after the other (a grammar's fixed text: parts of a forced
tool call), through the processor's ``forced_tokens(output_token_ids, limit)``. The scheduler
appends them at once (:meth:`~asymcache_core.scheduler.Scheduler.update_from_output`), and the
next step computes them together, as it computes the rest of a prompt, instead of one decode
step each (``EngineConfig.jump_forward``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from asymcache_core.request import Request
from asymcache_core.token_masks import keep_only

#: Most tokens one jump appends (a long forced text is computed over a few steps, each a chunk
#: the step budget takes like a prompt's).
MAX_JUMP_FORWARD = 64


def forced_tokens(request: Request, max_model_len: int | None) -> list[int]:
    """The tokens that follow ``request``'s last one whatever the logits are, at most up to
    its ``max_tokens`` and ``max_model_len``.

    NOTE: exact: with one token kept, every sampling setting picks it (greedy or not; a seeded
    row draws by its position, so later draws do not move). None where that may not hold or
    cannot be reported: a row with log probabilities (the forced tokens would need theirs) or
    another processor (its mask could differ), or more than one step in flight. A stop string
    is looked for token by token along the run (``engine_outputs.detokenize_step``): the
    request ends on the same token as without the jump. With async scheduling the one step in flight
    samples the position the first forced token takes; the scheduler drops that token.

    Args:
        request: a request that just appended a sampled token and runs on.
        max_model_len: the context limit (``None``: none).

    Returns:
        The forced tokens, in order (often none).
    """
    params = request.params
    if request.num_pending > 1 or params.logprobs is not None or len(params.logits_processors) != 1:
        return []
    ask = getattr(params.logits_processors[0], "forced_tokens", None)
    if ask is None:
        return []
    limit = min(MAX_JUMP_FORWARD, params.max_tokens - len(request.output_token_ids))
    if max_model_len is not None:
        limit = min(limit, max_model_len - request.num_tokens)
    return list(ask(request.output_token_ids, limit))[:limit] if limit > 0 else []


class PositionForcing(ABC):
    """A logits processor that keeps one fixed token alone at the output positions a rule
    names (:meth:`forced_at`) and leaves the others free; it answers ``forced_tokens``, so
    jump-forward appends each run of fixed tokens at once.

    The three methods are what a constraint gives the engine: ``__call__`` masks a row's
    logits, ``keep_words`` the same mask for the batched sampler, ``forced_tokens`` the run
    that follows. Benchmarks and tests build forced runs on it (a tool call's fixed text
    between its free values); a grammar gives its own (``GrammarLogitsProcessor``).
    """

    @abstractmethod
    def forced_at(self, position: int) -> int | None:
        """The token output position ``position`` must be, or ``None`` where it is free."""

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        token = self.forced_at(len(output_token_ids))
        if token is not None:
            kept = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = kept
        return logits

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray | None:
        token = self.forced_at(len(output_token_ids))
        return None if token is None else keep_only([token], vocab)

    def forced_tokens(self, output_token_ids: list[int], limit: int) -> list[int]:
        forced: list[int] = []
        position = len(output_token_ids)
        while len(forced) < limit and (token := self.forced_at(position)) is not None:
            forced.append(token)
            position += 1
        return forced


__all__ = ["MAX_JUMP_FORWARD", "PositionForcing", "forced_tokens"]
