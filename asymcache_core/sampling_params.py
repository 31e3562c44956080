"""Sampling parameters of one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    """Rewrites one request's next-token logits (e.g. a grammar mask for tool calls).

    Called once per sampled token with the tokens generated so far (prompt excluded) and the
    ``[vocab]`` float32 logits row; returns the row to sample from (may modify it in place).
    Stateful processors must be able to see the same prefix again after a preemption: they are
    handed the full list of generated ids each time, so they can resynchronise.
    """

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's output.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        seed: per-request seed for reproducible random sampling.
        stop_token_ids: extra ids that end the request (kept in the output).
        stop: strings that end the request (cut from the text).
        ignore_eos: keep generating past the model's end-of-sequence token.
        logits_processors: per-request logits rewriters (constrained decoding).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be >= -1, got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
