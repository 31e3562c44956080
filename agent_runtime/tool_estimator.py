"""Continuum's tool-pause estimators and its KV time-to-live (TTL) choice.

While an agent's tool runs, Continuum keeps (pins) the job's KV for a TTL tau, chosen as

    tau* = argmax_tau  P(duration <= tau) * (T_queue * eta + C_reload(L)) - tau

over candidate taus including 0 (no pin). The first term is the expected saving: if the tool
returns before the pin expires, the job skips the reload (prefill of its context L, cost
``C_reload(L)`` seconds) and, weighted by the job's memoryfulness eta, the queueing delay
``T_queue`` a re-admitted job would wait. The ``- tau`` term charges the pin for the memory it
holds (in seconds of pin, the paper's unit).

Pieces, all driven by times passed in as arguments (no wall clock inside, so a virtual clock
can drive them):

* :class:`ToolDurationEstimator`: per tool name, a bounded window of observed durations
  (measured by the runtime from the end of an LLM call to the arrival of the job's next one);
  empirical CDF and quantiles; cold start 2 s when a tool has no samples.
* :class:`MemoryfulnessEstimator`: eta = -Corr(turns done, turns remaining) over finished jobs,
  clipped to [0, 1]. For jobs of similar length the turns done predict the turns remaining
  (eta near 1: a job that is pinned now is likely to come back, and its queueing delay counts);
  for memoryless (geometric) lengths the correlation is near 0.
* :class:`QueueDelayTracker`: recent mean queueing delay (time between a request's arrival and
  its first scheduling).
* :func:`choose_ttl` / :meth:`ToolDurationEstimator.choose_ttl`: the argmax above, or the
  public preview code's rule (pin 2 s when the tool's mean duration is <= 2 s).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

#: Continuum's cold-start duration guess for a tool never seen before (seconds).
COLD_START_S = 2.0
#: Fixed TTL grid (seconds) added to the empirical quantiles.
DEFAULT_TTL_GRID: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
#: Quantiles of a tool's durations used as TTL candidates.
DEFAULT_QUANTILES: tuple[float, ...] = tuple(q / 20 for q in range(1, 21))

TTLPolicy = Literal["continuum", "preview"]


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Empirical quantile (inverse CDF, no interpolation: always a sample value).

    Sample values are where the empirical CDF jumps, so they are the TTL candidates that
    matter; an interpolated value would sit on a flat part of the CDF and never win.

    Args:
        sorted_xs: samples in increasing order (non-empty).
        q: quantile in [0, 1].

    Returns:
        The smallest sample x with F(x) >= q.
    """
    n = len(sorted_xs)
    k = max(0, min(n - 1, math.ceil(q * n) - 1))
    return sorted_xs[k]


@dataclass
class ToolDurationEstimator:
    """Online per-tool duration distribution.

    Attributes:
        window: samples kept per tool (most recent).
        cold_start_s: assumed duration of a tool with no samples.
    """

    window: int = 256
    cold_start_s: float = COLD_START_S
    _samples: dict[str, deque[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window}")
        if self.cold_start_s < 0:
            raise ValueError(f"cold_start_s: must be >= 0, got {self.cold_start_s}")

    def record(self, tool: str, duration_s: float) -> None:
        """Add one observed duration.

        Args:
            tool: tool name.
            duration_s: observed pause in seconds (negative values are clipped to 0; NaN and
                infinities are ignored).
        """
        if not math.isfinite(duration_s):
            return
        q = self._samples.get(tool)
        if q is None:
            q = self._samples[tool] = deque(maxlen=self.window)
        q.append(max(0.0, float(duration_s)))

    def samples(self, tool: str) -> list[float]:
        """The kept samples of a tool, oldest first.

        Args:
            tool: tool name.

        Returns:
            A copy of the window.
        """
        return list(self._samples.get(tool, ()))

    def count(self, tool: str) -> int:
        """Number of kept samples.

        Args:
            tool: tool name.

        Returns:
            The count.
        """
        return len(self._samples.get(tool, ()))

    @property
    def tools(self) -> list[str]:
        """Tools with at least one sample."""
        return list(self._samples)

    def mean(self, tool: str) -> float:
        """Mean duration (cold start value when unseen).

        Args:
            tool: tool name.

        Returns:
            Seconds.
        """
        xs = self._samples.get(tool)
        if not xs:
            return self.cold_start_s
        return sum(xs) / len(xs)

    def cdf(self, tool: str, tau: float) -> float:
        """Empirical P(duration <= tau).

        Unseen tools use a point mass at the cold-start duration.

        Args:
            tool: tool name.
            tau: seconds.

        Returns:
            Probability in [0, 1].
        """
        xs = self._samples.get(tool)
        if not xs:
            return 1.0 if tau >= self.cold_start_s else 0.0
        return sum(1 for x in xs if x <= tau) / len(xs)

    def quantile(self, tool: str, q: float) -> float:
        """Empirical quantile of a tool's durations (cold start value when unseen).

        Args:
            tool: tool name.
            q: in [0, 1].

        Returns:
            Seconds.
        """
        xs = self._samples.get(tool)
        if not xs:
            return self.cold_start_s
        return _quantile(sorted(xs), q)

    def candidates(
        self,
        tool: str,
        grid: Iterable[float] = DEFAULT_TTL_GRID,
        quantiles: Iterable[float] = DEFAULT_QUANTILES,
    ) -> list[float]:
        """TTL candidates: 0, the tool's empirical quantiles, and a fixed grid.

        Args:
            tool: tool name.
            grid: fixed candidates (seconds).
            quantiles: quantile levels of the tool's durations.

        Returns:
            Sorted distinct candidates (seconds), starting with 0.
        """
        xs = self._samples.get(tool)
        if xs:
            sx = sorted(xs)
            emp = [_quantile(sx, q) for q in quantiles]
        else:
            emp = [self.cold_start_s]
        return sorted({0.0, *(float(g) for g in grid), *emp})

    def choose_ttl(
        self,
        tool: str,
        context_tokens: int,
        reload_cost_fn: Callable[[int], float],
        queue_delay_s: float,
        eta: float,
        candidates: Iterable[float] | None = None,
        policy: TTLPolicy = "continuum",
    ) -> float:
        """TTL to pin a job's KV for while ``tool`` runs.

        Args:
            tool: name of the tool the job called.
            context_tokens: the job's context length L (tokens a reload would prefill).
            reload_cost_fn: C_reload(L) in seconds (e.g. from the latency model).
            queue_delay_s: recent mean queueing delay T_queue (seconds).
            eta: the job's memoryfulness in [0, 1].
            candidates: TTLs to consider (default: :meth:`candidates`); 0 is always added.
            policy: ``"continuum"`` (the argmax) or ``"preview"`` (2 s if the mean <= 2 s,
                else 0).

        Returns:
            The TTL in seconds (0: do not pin).
        """
        return self.explain_ttl(
            tool, context_tokens, reload_cost_fn, queue_delay_s, eta, candidates, policy
        ).ttl_s

    def explain_ttl(
        self,
        tool: str,
        context_tokens: int,
        reload_cost_fn: Callable[[int], float],
        queue_delay_s: float,
        eta: float,
        candidates: Iterable[float] | None = None,
        policy: TTLPolicy = "continuum",
    ) -> TTLDecision:
        """Same as :meth:`choose_ttl`, with the numbers behind the choice.

        Args:
            tool: tool name.
            context_tokens: context length L.
            reload_cost_fn: C_reload(L) in seconds.
            queue_delay_s: T_queue in seconds.
            eta: memoryfulness in [0, 1].
            candidates: TTLs to consider (0 always added).
            policy: ``"continuum"`` or ``"preview"``.

        Returns:
            The decision.
        """
        benefit = pin_benefit_s(context_tokens, reload_cost_fn, queue_delay_s, eta)
        if policy == "preview":
            ttl = COLD_START_S if self.mean(tool) <= COLD_START_S else 0.0
            p = self.cdf(tool, ttl) if ttl > 0 else 0.0
            return TTLDecision(ttl, p, benefit, p * benefit - ttl)
        cands = self.candidates(tool) if candidates is None else list(candidates)
        return choose_ttl(lambda tau: self.cdf(tool, tau), benefit, cands)


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

    @property
    def num_jobs(self) -> int:
        """Finished jobs in the window."""
        return len(self._jobs)

    def eta(self) -> float:
        """Current memoryfulness estimate.

        Returns:
            eta in [0, 1], or ``default`` with too few jobs or a degenerate sample.
        """
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
