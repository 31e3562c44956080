"""Continuum's TTL rule: how long to keep (pin) a job's KV while its tool runs.

While an agent's tool runs, Continuum pins the job's KV for a TTL tau, chosen as

    tau* = argmax_tau  P(duration <= tau) * (T_queue * eta + C_reload(L)) - tau

over candidate taus including 0 (no pin). The first term is the expected saving: if the tool
returns before the pin expires, the job skips the reload (prefill of its context L, cost
``C_reload(L)`` seconds) and, weighted by the job's memoryfulness eta, the queueing delay
``T_queue`` a re-admitted job would wait. The ``- tau`` term charges the pin for the memory it
holds (in seconds of pin, the paper's unit).

Pieces, all driven by times passed in as arguments (no wall clock inside, so a virtual clock
can drive them):

* :data:`TTLRule`: ``continuum`` (the argmax above) or ``preview`` (the public preview code's
  rule: pin :data:`PREVIEW_TTL_S` when the tool's mean duration is at most that long);
  :func:`apply_ttl_rule` applies one to a tool's durations.
* :func:`pin_benefit_s`: T_queue * eta + C_reload(L); :func:`choose_ttl`: the argmax.
* :class:`MemoryfulnessEstimator`: eta = -Corr(turns done, turns remaining) over finished jobs,
  clipped to [0, 1]. For jobs of similar length the turns done predict the turns remaining
  (eta near 1: a job that is pinned now is likely to come back, and its queueing delay counts);
  for memoryless (geometric) lengths the correlation is near 0.
* :class:`QueueDelayTracker`: recent mean queueing delay (time between a request's arrival and
  its first scheduling).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from asymcache_core.continuum.estimator import ToolDurationEstimator

#: How a TTL is chosen: ``continuum`` (the tau* argmax) or ``preview`` (2 s if the mean <= 2 s).
TTLRule = Literal["continuum", "preview"]
#: The preview rule's TTL, and the mean duration up to which it pins (seconds).
PREVIEW_TTL_S = 2.0


class TTLDecision(NamedTuple):
    """A TTL choice and why.

    Attributes:
        ttl_s: chosen TTL (0: no pin).
        p_return: P(duration <= ttl_s).
        benefit_s: T_queue * eta + C_reload(L).
        objective: p_return * benefit_s - ttl_s.
    """

    ttl_s: float
    p_return: float
    benefit_s: float
    objective: float


def pin_benefit_s(
    context_tokens: int,
    reload_cost_fn: Callable[[int], float],
    queue_delay_s: float,
    eta: float,
) -> float:
    """Seconds saved when a pinned job returns in time: T_queue * eta + C_reload(L).

    Args:
        context_tokens: context length L.
        reload_cost_fn: C_reload(L) in seconds.
        queue_delay_s: T_queue in seconds (negative clipped to 0).
        eta: memoryfulness (clipped to [0, 1]).

    Returns:
        Seconds (>= 0).
    """
    eta_c = min(1.0, max(0.0, eta))
    reload = max(0.0, float(reload_cost_fn(max(0, context_tokens))))
    return max(0.0, queue_delay_s) * eta_c + reload


def choose_ttl(
    cdf: Callable[[float], float], benefit_s: float, candidates: Iterable[float]
) -> TTLDecision:
    """tau* = argmax_tau cdf(tau) * benefit_s - tau over the candidates and 0.

    Ties go to the smaller TTL (pins cost memory others could use).

    Args:
        cdf: P(duration <= tau).
        benefit_s: T_queue * eta + C_reload(L).
        candidates: TTLs in seconds (negatives and non-finite ones ignored).

    Returns:
        The decision; ``ttl_s == 0`` when no candidate beats not pinning.
    """
    best = TTLDecision(0.0, 0.0, benefit_s, 0.0)
    for tau in sorted({float(c) for c in candidates if math.isfinite(c) and c > 0}):
        p = cdf(tau)
        obj = p * benefit_s - tau
        if obj > best.objective + 1e-12:
            best = TTLDecision(tau, p, benefit_s, obj)
    return best


def apply_ttl_rule(
    rule: TTLRule,
    durations: ToolDurationEstimator,
    tool: str,
    benefit_s: float,
    candidates: Iterable[float] | None = None,
) -> TTLDecision:
    """The TTL ``rule`` gives a job whose ``tool`` is about to run.

    Args:
        rule: ``"continuum"`` (the argmax over ``candidates``) or ``"preview"``
            (:data:`PREVIEW_TTL_S` if the tool's mean duration is at most that, else 0).
        durations: the per-tool duration estimator (its CDF is P(duration <= tau)).
        tool: name of the tool the job called.
        benefit_s: T_queue * eta + C_reload(L) (:func:`pin_benefit_s`).
        candidates: TTLs to consider with the ``continuum`` rule (default: the estimator's
            :meth:`~ToolDurationEstimator.candidates`); 0 is always one of them.

    Returns:
        The decision (``ttl_s == 0``: do not pin).
    """
    if rule == "preview":
        ttl = PREVIEW_TTL_S if durations.mean(tool) <= PREVIEW_TTL_S else 0.0
        p = durations.cdf(tool, ttl) if ttl > 0 else 0.0
        return TTLDecision(ttl, p, benefit_s, p * benefit_s - ttl)
    cands = durations.candidates(tool) if candidates is None else list(candidates)
    return choose_ttl(lambda tau: durations.cdf(tool, tau), benefit_s, cands)


@dataclass
class MemoryfulnessEstimator:
    """eta = -Corr(turns done, turns remaining) over finished jobs.

    A finished job of N turns contributes the points (k, N - k) for k = 1..N (after each turn
    k: k done, N - k remaining). Pearson correlation over the pooled points of the last
    ``window`` jobs; the result is negated and clipped to [0, 1].

    Attributes:
        window: finished jobs kept.
        min_jobs: below this many jobs (or with no variance), ``eta()`` returns ``default``.
        default: eta before enough data (0.5: halfway between memoryless and fully
            memoryful).
    """

    window: int = 512
    min_jobs: int = 8
    default: float = 0.5
    _jobs: deque[int] = field(default_factory=deque, repr=False)
    # NOTE: eta is read for every waiting request of every step (adaptive admission order)
    # and changes only when a job finishes: cached until then.
    _eta: float | None = field(default=None, repr=False)

    def record_job(self, num_turns: int) -> None:
        """Add a finished job.

        Args:
            num_turns: its number of LLM calls (>= 1; smaller values are ignored).
        """
        if num_turns < 1:
            return
        self._jobs.append(int(num_turns))
        while len(self._jobs) > self.window:
            self._jobs.popleft()
        self._eta = None

    @property
    def num_jobs(self) -> int:
        """Finished jobs in the window."""
        return len(self._jobs)

    def eta(self) -> float:
        """Current memoryfulness estimate.

        Returns:
            eta in [0, 1], or ``default`` with too few jobs or a degenerate sample.
        """
        if self._eta is None:
            self._eta = self._estimate()
        return self._eta

    def _estimate(self) -> float:
        if len(self._jobs) < self.min_jobs:
            return self.default
        # Closed-form sums over the points (k, r = N - k), k = 1..N, of every job.
        n = sx = sy = sxx = syy = sxy = 0.0
        for big_n in self._jobs:
            s1 = big_n * (big_n + 1) / 2  # sum k
            s2 = big_n * (big_n + 1) * (2 * big_n + 1) / 6  # sum k^2
            n += big_n
            sx += s1
            sy += big_n * big_n - s1  # sum (N - k)
            sxx += s2
            syy += big_n * big_n * big_n - 2 * big_n * s1 + s2  # sum (N - k)^2
            sxy += big_n * s1 - s2  # sum k (N - k)
        vx = sxx / n - (sx / n) ** 2
        vy = syy / n - (sy / n) ** 2
        if vx <= 1e-12 or vy <= 1e-12:
            return self.default
        corr = (sxy / n - (sx / n) * (sy / n)) / math.sqrt(vx * vy)
        return min(1.0, max(0.0, -corr))


@dataclass
class QueueDelayTracker:
    """Recent mean queueing delay T_queue.

    Keeps the last ``window`` samples and, if ``horizon_s`` is set, drops samples older than
    that relative to the ``now_s`` passed in.

    Attributes:
        window: samples kept.
        horizon_s: age limit of samples (None: no limit).
    """

    window: int = 256
    horizon_s: float | None = 60.0
    _samples: deque[tuple[float, float]] = field(default_factory=deque, repr=False)

    def record(self, delay_s: float, now_s: float) -> None:
        """Add one observed queueing delay.

        Args:
            delay_s: seconds between a request's arrival and its first scheduling.
            now_s: time of the observation (any clock, as long as it is the same one).
        """
        if not math.isfinite(delay_s):
            return
        self._samples.append((float(now_s), max(0.0, float(delay_s))))
        while len(self._samples) > self.window:
            self._samples.popleft()

    def mean(self, now_s: float) -> float:
        """Mean of the recent samples.

        Args:
            now_s: current time on the clock used by :meth:`record`.

        Returns:
            Seconds (0 when no recent samples).
        """
        if self.horizon_s is not None:
            cutoff = now_s - self.horizon_s
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
        if not self._samples:
            return 0.0
        return sum(d for _, d in self._samples) / len(self._samples)
