"""Sampling parameters of one request, validated to what the sampler can take."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from asymcache_core.logprobs import MAX_LOGPROBS

#: Smallest non-zero temperature: below it ``logits / temperature`` leaves float32's range.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
#: Seeds are taken modulo 2**64 by ``torch.Generator.manual_seed``; the API accepts int64.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
#: ``allowed_token_ids`` entries at most (a vocabulary's worth).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_LOGIT_BIAS_ENTRIES = 1024
#: vLLM's bound on a ``cache_salt``.
MAX_CACHE_SALT_CHARS = 1024
#: ``repetition_penalty`` at most: float32's largest finite value (vLLM bounds it below only).
MAX_REPETITION_PENALTY = 3.4028234663852886e38
#: Choices of one prompt at most (``n``): a bound on what one call may queue, far above
#: what group sampling (best-of, RL rollouts) asks for.
MAX_CHOICES = 1024
#: ``max_tokens`` beyond any context a model could hold (the engine checks the real limit).
MAX_TOKENS_LIMIT = 1 << 24


@runtime_checkable
class LogitsProcessor(Protocol):
    """Rewrites one request's next-token logits (e.g. a grammar mask for tool calls).

    Called once per sampled token with the tokens generated so far (prompt excluded) and the
    ``[vocab]`` float32 logits row; returns the row to sample from (may modify it in place).
    Stateful processors must be able to see the same prefix again after a preemption: they are
    handed the full list of generated ids each time, so they can resynchronise.

    A processor that only masks tokens should also say which it keeps with
    ``keep_words(output_token_ids, vocab) -> packed int32 mask | None``
    (:mod:`asymcache_core.token_masks`): its row is then masked and sampled where the logits
    are, and with async scheduling its mask is built while the step runs. Without it the row is
    copied to the host and its step waited for before the next is planned.

    A masking processor may also say which tokens it alone allows next, one after another, with
    ``forced_tokens(output_token_ids, limit) -> list[int]`` (taking them as generated): when it
    is a request's only processor, the engine appends them at once (jump-forward,
    ``EngineConfig.jump_forward``).
    """

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor: ...


def processors_pass(processors: tuple[LogitsProcessor, ...], output_token_ids: list[int]) -> bool:
    """Whether every processor leaves the next token's logits untouched, as those that can tell
    say with a ``passes(output_token_ids) -> bool`` method (a thinking budget before its limit);
    a processor without one is taken to rewrite them."""
    return all(getattr(p, "passes", None) is not None and p.passes(output_token_ids) for p in processors)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _items(name: str, value: Any) -> tuple[Any, ...]:
    """A list field's items (``None``: none, as vLLM takes it), or a ``ValueError`` naming it."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(f"{name}: must be a list, got {value!r}")
    return tuple(value)


def _real(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past a float's range
        v = math.inf
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise ValueError(f"{name}: must be in {left}{lo}, {hi}], got {value!r}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's output.

    Every value is checked here against what :class:`~asymcache_core.sampler.Sampler` can
    take, so that a bad request is rejected when it is added and never fails a step.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 means greedy; otherwise in ``[0.01, 100]``.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top one's (0: off).
        seed: per-request seed for reproducible random sampling (int64).
        stop_token_ids: extra ids that end the request (kept in the output).
        stop: strings that end the request (cut from the text).
        ignore_eos: keep generating past the model's end-of-sequence token.
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI's, in [-2, 2]).
        frequency_penalty: subtracted per occurrence from the logit of generated tokens
            (OpenAI's, in [-2, 2]).
        repetition_penalty: divides positive and multiplies negative logits of tokens in the
            prompt or the output (vLLM's / HF's: any value > 0, as in vLLM; 1 is off).
        logit_bias: token id -> bias added to its logit (OpenAI's, each in [-100, 100]).
        logits_processors: per-request logits rewriters (constrained decoding).
        logprobs: report each sampled token's log probability and this many most likely
            alternatives (0..20; ``None``: none). Taken from the model's raw logits (see
            :mod:`asymcache_core.logprobs`).
        prompt_logprobs: report each prompt token's log probability given the tokens before
            it, and this many most likely alternatives (vLLM's; 0..20; ``None``: none). The
            engine computes the logits of every prompt position for it, so such a request
            takes no prefix-cache hit until they are all computed.
        min_tokens: tokens to generate before EOS, ``stop_token_ids`` or a stop string may
            end the request (vLLM's; the engine masks those ids until then; 0: off).
        include_stop_str_in_output: keep the stop string that ended the request at the end
            of its text (vLLM's; default: cut).
        allowed_token_ids: sample only among these ids (vLLM's; the others' logits are
            masked; ``None``: all).
        bad_words: words never to generate (vLLM's; each word's token sequence, with and
            without a leading space, has its last token banned where the output ends with the
            rest; at most 16 words of at most 1,024 characters).
        skip_special_tokens: leave special tokens out of the text (vLLM's default); False
            keeps them (the token that ended the request stays out unless
            ``include_stop_str_in_output``).
        truncate_prompt_tokens: keep only the prompt's last this many tokens (vLLM's; -1: the
            last ``max_model_len - 1``, room for one generated token; ``None``: the whole prompt).
        cache_salt: the request's prefix-cache namespace (vLLM's): its blocks hash from this
            salt, so they are found only by requests with the same salt (tenants that must not
            learn whether another's prompt was cached). 1 to 1,024 characters; ``None``: the
            shared namespace.
        n: output sequences to sample from the prompt (vLLM's; 1 to 1,024).
            :meth:`Engine.generate <asymcache_core.engine.Engine.generate>` and
            :meth:`Engine.chat <asymcache_core.engine.Engine.chat>` run each as its own
            request (:func:`choice_params`) and report them together; a request queued with
            :meth:`Engine.add_request <asymcache_core.engine.Engine.add_request>` is one
            sequence (n=1).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = field(default=None, compare=False)
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()
    cache_salt: str | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n: must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens: must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}")
        temperature = _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature: must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature!r}"
            )
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", _real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        object.__setattr__(self, "min_p", _real("min_p", self.min_p, 0.0, 1.0))
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be an integer >= -1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed: must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _real(name, getattr(self, name), -2.0, 2.0))
        # NOTE: vLLM requires > 0 only; the bound is float32's largest value so that the sampler's
        # float32 penalty stays finite (an infinite one would turn a zero logit into NaN)
        object.__setattr__(self, "repetition_penalty",
                           _real("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        stop_ids = _items("stop_token_ids", self.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids: must be up to {MAX_STOP_TOKEN_IDS} non-negative integers")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else _items("stop", self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        processors = _items("logits_processors", self.logits_processors)
        if any(not callable(p) for p in processors):
            raise ValueError("logits_processors: each must be callable as (output_token_ids, logits) -> logits")
        object.__setattr__(self, "logits_processors", processors)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output: must be a boolean, got {self.include_stop_str_in_output!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else _items("bad_words", self.bad_words)
        if len(words) > MAX_STOP_STRINGS or any(
            not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_CHARS for w in words
        ):
            raise ValueError(
                f"bad_words: at most {MAX_STOP_STRINGS} non-blank strings of at most {MAX_STOP_CHARS} characters"
            )
        object.__setattr__(self, "bad_words", words)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: must be a boolean, got {self.skip_special_tokens!r}")
        if self.allowed_token_ids is not None:
            allowed = (
                tuple(self.allowed_token_ids)
                if isinstance(self.allowed_token_ids, Iterable) and not isinstance(self.allowed_token_ids, str | bytes)
                else ()
            )
            if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in allowed):
                raise ValueError(
                    f"allowed_token_ids: must be 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative token ids, or None"
                )
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
        ):
            raise ValueError(
                f"truncate_prompt_tokens: must be a positive integer, -1 or None, got {self.truncate_prompt_tokens!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs: must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"
            )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(f"cache_salt: must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_params(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The parameters of each of a prompt's ``n`` choices, each one sequence (``n=1``).

    NOTE: with a seed, choice ``i`` samples with ``seed + i`` (vLLM's rule; int64 wraps
    around), so the choices differ yet the set is reproducible; without one each choice
    draws its own stream.

    Args:
        params: the prompt's parameters.
        n: its number of choices (``None``: ``params.n``).

    Returns:
        One per choice, in order.
    """
    n = params.n if n is None else n
    one = params if params.n == 1 else replace(params, n=1)
    if n == 1 or params.seed is None:
        return [one] * n
    span = SEED_MAX + 1
    return [replace(one, seed=(params.seed + i + span) % (2 * span) - span) for i in range(n)]


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (keys may be strings of ints, as JSON sends them), checked."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError("logit_bias: must map token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            token = key
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias: keys must be non-negative token ids, got {key!r}")
        out[token] = _real(f"logit_bias[{key}]", value, -100.0, 100.0)
    return out or None
