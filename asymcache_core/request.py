"""Requests and their outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asymcache_core.detokenizer import DetokenizerState
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.sampling_params import SamplingParams

HOLE = -1
"""Block-table entry of a logical block that is neither cached nor allocated yet."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class RequestMetrics:
    """Timings (seconds on the engine clock) and token counters of one request.

    Attributes:
        arrival_time: when ``add_request`` took it.
        first_scheduled_time: first step that ran any of its tokens.
        first_token_time: when its first output token was sampled.
        finish_time: when it finished.
        cached_tokens: prompt tokens served from the cache at first admission (not inflated by
            re-admission after a preemption).
        cache_creation_tokens: prompt tokens this request computed and wrote to the prefix cache
            before its first output token: the tokens of its prompt's full blocks that it
            registered (vLLM's ``PrefillStats.num_cache_creation_tokens``); never more than the
            prompt's full blocks less ``cached_tokens``.
        hole_tokens: tokens recomputed inside holes (missing blocks before a later cache hit).
        suffix_recomputed_tokens: prompt tokens computed after a missing block in prefix-only
            mode although a later block of theirs was cached (what hole reuse would have saved).
        preempted_tokens: tokens computed again because of a preemption.
        reload_tokens: tokens copied back from the host KV tier instead of being computed
            (part of ``cached_tokens`` at first admission; counted at every admission).
        computed_tokens: every token the model ran for this request.
        num_preemptions: times it was preempted.
    """

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    hole_tokens: int = 0
    suffix_recomputed_tokens: int = 0
    preempted_tokens: int = 0
    reload_tokens: int = 0
    computed_tokens: int = 0
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time between output tokens after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class Request:
    """One generation request as the scheduler and cache manager see it.

    The request's context is ``prompt + output`` tokens. ``num_computed_tokens`` is the
    *frontier*: every position below it is computed or held as a cache hit. Positions beyond
    the frontier may already be cache hits too (``block_ids[i] != HOLE`` at a block boundary
    past the frontier): the scheduler skips them and computes only the holes between them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        job_id: str | None = None,
        priority: float = 0.0,
        is_last_step: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.job_id = job_id
        #: the engine gave its job (:class:`~asymcache_core.implicit_jobs.ImplicitJobs`): the
        #: request named none
        self.implicit_job = False
        self.priority = priority
        self.is_last_step = is_last_step
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        #: the lowest index of ``block_ids`` changed in place since the model runner last copied
        #: the table (:class:`~asymcache_core.block_tables.BlockTableRows`); ``len(block_ids)``
        #: or more: none. A new list needs no mark.
        self.table_dirty_from = 0
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.admitted_once = False
        self.had_pin = False  # its job held a Continuum pin when it arrived
        self.max_computed_ever = 0
        # End of its last cache hit at admission: positions below it that run refill holes.
        self.hit_end = 0
        #: ticket of the host-tier copies its blocks wait for (``None``: nothing in flight)
        self.kv_ticket: int | None = None
        #: tokens sampled by steps still in flight (async scheduling), not appended yet: the
        #: scheduler plans past ``num_tokens`` by this many positions, whose input ids the
        #: model runner takes on the device from the step that samples them
        self.num_pending = 0
        #: samples of the step in flight to drop: a jump-forward appended the token at the
        #: position it samples (async scheduling; :mod:`asymcache_core.jump_forward`)
        self.skip_samples = 0
        #: tokens proposed to follow the context (speculative decoding,
        #: :mod:`asymcache_core.speculative`): the next step computes them after its last token
        #: and keeps those its rows would have sampled
        self.draft_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        #: why the request failed alone (sampling or detokenizing raised); None otherwise
        self.error: str | None = None
        self.text = ""
        self.detok = DetokenizerState()
        #: one entry per output token when ``params.logprobs`` is set, else None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        #: one entry per prompt token when ``params.prompt_logprobs`` is set, else None: the
        #: first token's is None (nothing precedes it), token ``i``'s comes from the logits of
        #: position ``i - 1`` and is appended once that position is computed. A list while
        #: some are missing, a tuple once complete (every later output shares it).
        self.prompt_logprobs: list[TokenLogprob | None] | tuple[TokenLogprob | None, ...] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = (None,) if len(self.prompt_token_ids) == 1 else [None]

    @property
    def prompt_logits_from(self) -> int | None:
        """The first position whose logits the prompt's log probabilities still need (``None``:
        none asked for, or all computed). No cache hit may cover it or what follows."""
        if not isinstance(self.prompt_logprobs, list):
            return None
        return len(self.prompt_logprobs) - 1

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Records the prompt log probabilities computed from the logits of positions
        ``start, start + 1, ...`` (entry ``k`` is prompt token ``start + k + 1``'s).

        NOTE: a position is computed again after a preemption, and async scheduling plans a
        step before the previous one's entries arrive: only the part that continues the list
        is kept (the values are the same: the cache is lossless), and a part past its end is
        dropped (it cannot happen: no cache hit covers an uncomputed position).
        """
        frontier = self.prompt_logits_from
        if frontier is None or not start <= frontier < start + len(entries):
            return
        assert isinstance(self.prompt_logprobs, list)
        self.prompt_logprobs.extend(entries[frontier - start :])
        if len(self.prompt_logprobs) >= len(self.prompt_token_ids):
            self.prompt_logprobs = tuple(self.prompt_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Its context once the tokens of the steps in flight arrive (``num_tokens`` without
        async scheduling), and its drafts (speculative decoding)."""
        return len(self.all_token_ids) + self.num_pending + len(self.draft_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def draw_index(self) -> int:
        """The index of the output token its row samples in the step being run (what keys a
        random draw).

        NOTE: with async scheduling a planned step counts its own token in ``num_pending`` (and
        the step in flight before it, one more): the token drawn comes after those still pending.
        """
        return len(self.output_token_ids) + max(self.num_pending - 1, 0)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (streaming: ``new_token_ids`` are this step's).

    Attributes:
        request_id: the id ``add_request`` returned.
        new_token_ids: tokens sampled in this step.
        token_ids: every generated token so far.
        text: detokenised ``token_ids`` (stop strings removed); empty without a tokenizer.
        finished: whether the request ended in this step.
        finish_reason: ``stop``, ``length`` or ``abort`` once finished.
        metrics: the request's metrics (shared, updated in place).
        num_prompt_tokens: prompt length.
        error: set when this request alone failed (finished as ``abort``; others go on).
        logprobs: one :class:`~asymcache_core.logprobs.TokenLogprob` per token of
            ``token_ids`` when the request asked for them (``SamplingParams.logprobs``); the
            last ``len(new_token_ids)`` are this step's. None otherwise.
        prompt_logprobs: one entry per prompt token (the first None) once all are computed,
            when the request asked for them (``SamplingParams.prompt_logprobs``); None
            otherwise.
        stop_reason: what stopped it, as vLLM reports it: the stop string or the
            ``stop_token_ids`` id that ended it; None for an EOS, a length limit, or while
            running.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    num_prompt_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: int | str | None = None
