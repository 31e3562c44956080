"""A cap on a reasoning model's thinking (vLLM's ``thinking_token_budget``, Anthropic's
``thinking.budget_tokens``).

Reasoning models can spend the whole ``max_tokens`` inside ``<think>``: the reply then has no
content, no tool call, nothing an agent loop can use. :class:`ThinkingBudget` is a logits
processor that counts the tokens a reply spends inside its thinking block (as the runtime's
reasoning parser reads the reply: :func:`~agent_runtime.reasoning.stream_split`) and, once they
reach the budget without the block being closed, forces the closing text (``\\n</think>\\n\\n``,
token by token); after it the model writes its answer as usual. A block the model closes itself
is left alone (``qwen3``: or ends with a tool call), and a reply with no block (``qwen3`` with
the template's thinking off) is never touched. Greedy decoding stays deterministic: the forced tokens depend only on the tokens
before them. Until the budget runs out the processor says it passes (``passes``), so the
sampler keeps a greedy row's argmax on the device, as for a request without a budget: its
tokens are those of the same request without one, and no row of logits is copied to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from agent_runtime.reasoning import THINK_CLOSE, TOOL_OPEN, stream_split
from asymcache_core.token_masks import keep_only

#: What a reply that ran out of budget is made to write: the block's end, as models write it.
FORCED_CLOSE = f"\n{THINK_CLOSE}\n\n"
#: The same where a grammar takes the reply over after the block (a JSON reply, a forced tool
#: call): the blank line is the grammar's to allow, or not.
FORCED_CLOSE_BEFORE_GRAMMAR = f"\n{THINK_CLOSE}"


def check_thinking_budget(budget: object, field: str = "thinking_token_budget") -> int:
    """``budget`` as a token count (an integer >= 0).

    Raises:
        ValueError: naming ``field``.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{field}: must be an integer >= 0, got {budget!r}")
    return budget


class AnthropicThinking(NamedTuple):
    """What Anthropic's ``thinking`` settings ask of a chat.

    Attributes:
        budget: the thinking-token budget (None: none).
        template_kwargs: the template's ``enable_thinking`` (None: the template's default).
    """

    budget: int | None
    template_kwargs: dict[str, Any] | None


def anthropic_thinking(thinking: Mapping[str, Any] | None, max_tokens: int, reasoning_parser: str | None,
                       forced_tool: bool = False) -> AnthropicThinking:
    """What Anthropic's ``thinking`` settings ask for.

    ``disabled`` turns the template's ``enable_thinking`` off (Qwen3 and its kind think by
    default, and an Anthropic client cannot send ``chat_template_kwargs``), ``enabled`` and
    ``adaptive`` turn it on; without the field the template decides. Without a reasoning parser
    nothing can be returned as thinking: the reply is all text (what vLLM does) and a budget
    is not applied.

    Args:
        thinking: the request's ``thinking`` (``enabled`` with ``budget_tokens``, ``adaptive``:
            the model decides, ``disabled``), or None.
        max_tokens: the request's ``max_tokens`` (the budget must be below it, Anthropic's rule).
        reasoning_parser: the runtime's reasoning parser.
        forced_tool: ``tool_choice`` is ``any`` or ``tool`` (Anthropic refuses thinking then).

    Returns:
        The budget and the template variable.

    Raises:
        ValueError: a malformed setting, a budget not below ``max_tokens``, or thinking with a
            forced tool (naming the ``thinking`` field).
    """
    kind = None if thinking is None else thinking.get("type")
    if kind is None:
        return AnthropicThinking(None, None)
    if kind == "disabled":
        return AnthropicThinking(None, {"enable_thinking": False})
    if kind not in ("enabled", "adaptive"):
        raise ValueError(f"thinking.type: one of enabled, adaptive, disabled; got {kind!r}")
    if forced_tool:
        raise ValueError("thinking: not with tool_choice any or tool (Anthropic's rule); use auto or none")
    budget = None
    if kind == "enabled":
        assert thinking is not None
        budget = check_thinking_budget(thinking.get("budget_tokens"), "thinking.budget_tokens")
        if budget >= max_tokens:
            raise ValueError(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got {budget}")
    return AnthropicThinking(budget if reasoning_parser is not None else None, {"enable_thinking": True})


class ThinkingBudget:
    """Closes a reply's thinking block once it holds ``budget`` tokens (a logits processor).

    State is rebuilt from the generated ids whenever they are not the ones seen last (a
    preempted request sees its prefix again), so one instance serves one request.

    Args:
        budget: thinking tokens allowed.
        parser: the reply's reasoning parser (``deepseek_r1`` and ``qwen3``: the block may be
            opened in the prompt or by the reply).
        decode: one token id to its text (the block's tags are plain text to every tokenizer).
        forced: the token ids that close the block (``FORCED_CLOSE`` encoded).
    """

    def __init__(self, budget: int, parser: str, decode: Callable[[int], str], forced: Sequence[int]) -> None:
        if not forced:
            raise ValueError("thinking budget: the closing text encodes to no tokens")
        self.budget = check_thinking_budget(budget)
        self.parser = parser
        self._decode = decode
        self.forced = tuple(forced)
        self._reset()

    def _reset(self) -> None:
        self._seen: list[int] = []
        self._text = ""
        self._opened = False  # the block is open and past its opening tag
        self._thinking = 0  # tokens generated while the block was open
        self._closed = False  # the block was closed (or there is none)
        self._forcing_from: int | None = None  # output index where the forced text began

    def _advance(self, output: list[int]) -> None:
        seen = self._seen
        # NOTE: the ids only grow; a shorter or different list is another pass over the request
        if len(output) < len(seen) or (seen and output[len(seen) - 1] != seen[-1]):
            self._reset()
            seen = self._seen
        for token in output[len(seen):]:
            if not self._closed:
                piece = self._decode(token)
                self._text += piece
                if self._opened:
                    # NOTE: only the text the new piece can complete a closing tag in: a scan
                    # of the whole thinking per token would be quadratic
                    window = self._text[-(len(piece) + len(TOOL_OPEN)):]
                    # NOTE: a qwen3 reply's tool call ends its thinking too (vLLM's qwen3_config)
                    self._closed = THINK_CLOSE in window or (self.parser == "qwen3" and TOOL_OPEN in window)
                else:
                    _, content_start = stream_split(self._text, self.parser)
                    self._closed = content_start is not None
                    self._opened = not self._closed and len(self._text.lstrip()) >= len(THINK_CLOSE)
                self._thinking += not self._closed
            seen.append(token)

    def _forced_token(self, output_token_ids: list[int]) -> int | None:
        """The token the next step must take (None: any)."""
        self._advance(output_token_ids)
        n = len(output_token_ids)
        if self._forcing_from is None:
            if self._closed or self._thinking < self.budget:
                return None
            self._forcing_from = n
        # NOTE: the whole closing text, though the block counts as closed from its tag on
        k = n - self._forcing_from
        return self.forced[k] if k < len(self.forced) else None

    def passes(self, output_token_ids: list[int]) -> bool:
        """Whether the next token's logits are left as they are (the sampler then keeps a
        greedy row's argmax on the device)."""
        return self._forced_token(output_token_ids) is None

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray | None:
        """The tokens kept for the next step, packed (:mod:`asymcache_core.token_masks`): the
        forced one alone while the block must close, else ``None`` (every token).

        NOTE: a processor that says so only masks: its row is masked and sampled where the
        logits are, and keeps async scheduling's overlap (a processor without it makes its
        step wait for the one before). Combined with other masks, the forced token is kept
        only where they keep it too (a grammar waits for the block's end:
        :mod:`agent_runtime.reasoning_gate`).
        """
        token = self._forced_token(output_token_ids)
        return None if token is None else keep_only((token,), vocab)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Masks every token but the next forced one while the block must close."""
        token = self._forced_token(output_token_ids)
        if token is None:
            return logits
        masked = torch.full_like(logits, float("-inf"))
        masked[token] = logits[token] if torch.isfinite(logits[token]) else 0.0
        return masked


def thinking_budget_processor(budget: int, parser: str, tokenizer: object,
                              grammar_follows: bool = False) -> ThinkingBudget:
    """A :class:`ThinkingBudget` for ``tokenizer`` (an HF tokenizer: ``encode``/``decode``);
    ``grammar_follows``: a grammar constrains the reply from the block's end on
    (:mod:`agent_runtime.reasoning_gate`), so the forced text ends at the tag."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
    decode = tokenizer.decode  # type: ignore[attr-defined]
    forced = encode(FORCED_CLOSE_BEFORE_GRAMMAR if grammar_follows else FORCED_CLOSE, add_special_tokens=False)
    return ThinkingBudget(budget, parser, lambda t: decode([t], skip_special_tokens=False), forced)


__all__ = [
    "FORCED_CLOSE", "FORCED_CLOSE_BEFORE_GRAMMAR", "AnthropicThinking", "ThinkingBudget", "anthropic_thinking", "check_thinking_budget",
    "thinking_budget_processor",
]
