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
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
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
        shown_z: the normal quantile of :meth:`eta_shown`'s one-sided bound (1.645: 95%).
    """

    window: int = 512
    min_jobs: int = 8
    default: float = 0.5
    shown_z: float = 1.645
    _jobs: deque[int] = field(default_factory=deque, repr=False)
    # NOTE: eta is read for every waiting request of every step (adaptive admission order)
    # and changes only when a job finishes: cached until then.
    _eta: float | None = field(default=None, repr=False)
    _eta_shown: float | None = field(default=None, repr=False)

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
        self._eta_shown = None

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
            measured = self._measured()
            self._eta = self.default if measured is None else measured
        return self._eta

    def eta_shown(self, in_flight: Iterable[int] = ()) -> float:
        """The memoryfulness the jobs show with confidence, for the admission order: eta of the
        length distribution estimated with the jobs still running as censored lengths
        (Kaplan-Meier), then the lower bound of its one-sided confidence interval (Fisher's z,
        one sample per finished job, at :attr:`shown_z`); 0 before :attr:`min_jobs` jobs
        finished or with a degenerate sample.

        NOTE: the order reads this, not :meth:`eta`. Ranking a job's turns by its start costs
        wherever lengths are near memoryless (it puts the longest contexts first), and
        :meth:`eta` runs high while a run is young: the jobs that finished first are the short
        ones, a sample truncated from above, which looks memoryful. Simulated H200, chat on 450
        blocks, 48 agents (its lengths' eta 0.08): :meth:`eta` read 0.35-0.53 through most of
        the run, and mean JCT was 1.5%, 3.5% and 6.8% above arrival order at a fixed eta of
        0.05, 0.1 and 0.2. A running job of ``j`` turns is known to last at least ``j``: counted
        so, the short jobs no longer stand for all. Where lengths are memoryful the estimate
        holds (BFCL, mean JCT 18.1 s at eta 0, 15.9 s at 0.4, 15.6 s at 0.55). Seeds 1-6 and
        23 of chat at 450 and 900 blocks, mean JCT against ``vllm-apc``: +8.2% and +5.5% with
        :meth:`eta`, +1.7% and +2.9% with the censored estimate, +1.1% and +1.3% with its bound;
        BFCL (4 seeds) -15.3%, -14.1%, -11.8% (BENCHMARKS.md, "The default on chat, tool loops
        and BFCL").

        The value is recomputed when a job finishes (``in_flight`` is read then).

        Args:
            in_flight: the turns started so far by each job still running.

        Returns:
            A lower bound of eta in [0, 1].
        """
        if self._eta_shown is None:
            self._eta_shown = self._lower_bound(sorted(in_flight))
        return self._eta_shown

    def _lower_bound(self, in_flight: list[int]) -> float:
        jobs = len(self._jobs)
        if jobs < max(self.min_jobs, 4):
            return 0.0
        measured = _eta_of(_censored_lengths(list(self._jobs), in_flight))
        if measured is None:
            return 0.0
        r = min(measured, 0.9999)  # identical lengths: eta 1, whose z is infinite
        return max(0.0, math.tanh(math.atanh(r) - self.shown_z / math.sqrt(jobs - 3)))

    def _measured(self) -> float | None:
        """eta from the window's jobs (``None``: fewer than :attr:`min_jobs`, or no variance)."""
        if len(self._jobs) < self.min_jobs:
            return None
        return _eta_of(Counter(self._jobs))


def _censored_lengths(finished: list[int], in_flight: list[int]) -> dict[int, float]:
    """The distribution of job lengths (turns) by Kaplan-Meier: ``finished`` lengths are
    observed, a running job that started ``j`` turns lasts at least ``j`` (censored: it is at
    risk of ending at turns ``1 .. j - 1`` only). Mass left past the longest length seen gets a
    geometric tail at the mean hazard seen.

    Args:
        finished: lengths of finished jobs (>= 1).
        in_flight: turns started by running jobs, sorted.

    Returns:
        length -> probability.
    """
    ended = Counter(finished)
    longest = max(max(finished), in_flight[-1] if in_flight else 0)
    at_risk_finished = len(finished)
    survival, exposure, dist = 1.0, 0.0, {}
    running = len(in_flight)
    i = 0
    for k in range(1, longest + 1):
        # running jobs with j <= k are not at risk at k (their turn k is not known to be the last or not)
        while i < len(in_flight) and in_flight[i] <= k:
            i += 1
            running -= 1
        at_risk = at_risk_finished + running
        exposure += at_risk
        d = ended.get(k, 0)
        if at_risk > 0 and d:
            hazard = d / at_risk
            dist[k] = survival * hazard
            survival *= 1.0 - hazard
        at_risk_finished -= d
    if survival > 1e-9:
        # NOTE: past the longest length seen nothing is known; the tail is given a memoryless
        # (geometric) shape at the mean hazard seen, so that what is not shown reads as no
        # memory. A point mass there would read the opposite: early in a run most jobs are
        # still running, and piling them on one length looks like fixed-length jobs.
        hazard = len(finished) / max(1.0, exposure)
        k = longest
        while survival > 1e-6 and k < 64 * longest:
            k += 1
            dist[k] = survival * hazard
            survival *= 1.0 - hazard
    return dist


def _eta_of(lengths: Mapping[int, float]) -> float | None:
    """eta = -Corr(k, N - k) over the points k = 1..N of jobs of length N, each length weighted
    (closed-form sums); ``None`` without variance."""
    n = sx = sy = sxx = syy = sxy = 0.0
    for big_n, weight in lengths.items():
        s1 = big_n * (big_n + 1) / 2  # sum k
        s2 = big_n * (big_n + 1) * (2 * big_n + 1) / 6  # sum k^2
        n += weight * big_n
        sx += weight * s1
        sy += weight * (big_n * big_n - s1)  # sum (N - k)
        sxx += weight * s2
        syy += weight * (big_n * big_n * big_n - 2 * big_n * s1 + s2)  # sum (N - k)^2
        sxy += weight * (big_n * s1 - s2)  # sum k (N - k)
    if n <= 0:
        return None
    vx = sxx / n - (sx / n) ** 2
    vy = syy / n - (sy / n) ** 2
    if vx <= 1e-12 or vy <= 1e-12:
        return None
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
