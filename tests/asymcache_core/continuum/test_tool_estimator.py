"""Continuum's estimators and TTL rule, driven by a virtual clock."""

from __future__ import annotations

import random

import pytest

from asymcache_core.continuum.estimator import COLD_START_S, ToolDurationEstimator
from asymcache_core.continuum.ttl import (
    MemoryfulnessEstimator,
    QueueDelayTracker,
    TTLDecision,
    TTLRule,
    apply_ttl_rule,
    choose_ttl,
    pin_benefit_s,
)


def reload_cost(tokens: int) -> float:
    """Prefill cost model: 1 ms per token."""
    return tokens * 1e-3


def explain(
    est: ToolDurationEstimator,
    tool: str,
    tokens: int,
    queue_delay_s: float,
    eta: float,
    candidates: list[float] | None = None,
    rule: TTLRule = "continuum",
) -> TTLDecision:
    """The TTL ``rule`` gives a job of ``tokens`` context whose ``tool`` is about to run."""
    benefit = pin_benefit_s(tokens, reload_cost, queue_delay_s, eta)
    return apply_ttl_rule(rule, est, tool, benefit, candidates)


def test_cold_start() -> None:
    est = ToolDurationEstimator()
    assert est.mean("new") == COLD_START_S == 2.0
    assert est.cdf("new", 1.99) == 0.0 and est.cdf("new", 2.0) == 1.0
    assert 2.0 in est.candidates("new")
    # Big benefit (10 s reload): pin exactly the cold-start 2 s.
    assert explain(est, "new", 10_000, 0.0, 0.5).ttl_s == 2.0
    # Benefit below 2 s: pinning 2 s costs more than it can save.
    assert explain(est, "new", 1_000, 0.0, 0.5).ttl_s == 0.0
    # The preview rule pins 2 s for an unseen tool whatever the benefit.
    assert explain(est, "new", 1_000, 0.0, 0.5, rule="preview").ttl_s == 2.0


def test_fast_tool_with_big_reload_gets_about_one_second() -> None:
    rng = random.Random(0)
    est = ToolDurationEstimator()
    for _ in range(200):
        est.record("pytest", rng.uniform(0.3, 1.0))
    tau = explain(est, "pytest", 20_000, queue_delay_s=1.0, eta=0.8).ttl_s
    # All returns happen by the max sample (< 1 s): tau* is that max, nothing longer.
    assert tau == pytest.approx(max(est.samples("pytest")))
    assert 0.95 <= tau <= 1.0
    d = explain(est, "pytest", 20_000, 1.0, 0.8)
    assert d.p_return == 1.0 and d.benefit_s == pytest.approx(20.8)
    assert d.objective == pytest.approx(20.8 - tau)


def test_slow_tool_gets_no_pin() -> None:
    est = ToolDurationEstimator()
    for i in range(50):
        est.record("build", 60.0 + i)
    assert explain(est, "build", 20_000, queue_delay_s=2.0, eta=1.0).ttl_s == 0.0
    assert explain(est, "build", 20_000, 2.0, 1.0, rule="preview").ttl_s == 0.0


def test_bimodal_tool_pins_for_fast_mode_only_when_worth_it() -> None:
    est = ToolDurationEstimator()
    for _ in range(70):
        est.record("grep", 0.5)
    for _ in range(30):
        est.record("grep", 40.0)
    # 0.7 * 10 - 0.5 > 0 and beats 1.0 * 10 - 40.
    assert explain(est, "grep", 10_000, 0.0, 0.0).ttl_s == 0.5
    # With a huge benefit, waiting for the slow mode too pays off.
    assert explain(est, "grep", 1_000_000, 0.0, 0.0).ttl_s == 40.0
    # Small benefit: 0.7 * 0.5 - 0.5 < 0.
    assert explain(est, "grep", 500, 0.0, 0.0).ttl_s == 0.0


def test_explicit_candidates_and_ties() -> None:
    est = ToolDurationEstimator()
    est.record("t", 1.0)
    assert explain(est, "t", 5_000, 0, 0, candidates=[0.5, 3.0]).ttl_s == 3.0
    # Objective 0 at tau = benefit: not better than not pinning -> 0 (tie goes to smaller).
    d = choose_ttl(lambda tau: 1.0, benefit_s=1.0, candidates=[1.0])
    assert d.ttl_s == 0.0
    assert choose_ttl(lambda tau: 1.0, 5.0, [float("nan"), -1.0, float("inf")]).ttl_s == 0.0


def test_window_and_quantiles() -> None:
    est = ToolDurationEstimator(window=10)
    for i in range(100):
        est.record("t", float(i))
    assert est.samples("t") == [float(i) for i in range(90, 100)]
    assert est.cdf("t", 94.0) == 0.5
    assert est.quantile("t", 0.5) == 94.0 and est.quantile("t", 1.0) == 99.0
    est.record("t", float("nan"))
    est.record("t", -3.0)
    assert est.count("t") == 10 and est.samples("t")[-1] == 0.0
    with pytest.raises(ValueError, match="window"):
        ToolDurationEstimator(window=0)


def test_preview_rule_uses_mean() -> None:
    est = ToolDurationEstimator()
    for d in (1.0, 2.5):  # mean 1.75 <= 2
        est.record("a", d)
    for d in (1.0, 4.0):  # mean 2.5 > 2
        est.record("b", d)
    assert explain(est, "a", 1, 0, 0, rule="preview").ttl_s == 2.0
    assert explain(est, "b", 1, 0, 0, rule="preview").ttl_s == 0.0


def test_pin_benefit_clips() -> None:
    assert pin_benefit_s(1000, reload_cost, 4.0, 0.5) == pytest.approx(3.0)
    assert pin_benefit_s(1000, reload_cost, 4.0, 7.0) == pytest.approx(5.0)
    assert pin_benefit_s(-5, reload_cost, -1.0, -1.0) == 0.0


def test_cdf_and_quantiles_match_the_window_through_evictions() -> None:
    """The sorted copy the CDF bisects follows the window as samples come and go (repeats
    included), tool by tool."""
    rng = random.Random(5)
    est = ToolDurationEstimator(window=7)
    for _ in range(200):
        tool = rng.choice(("a", "b"))
        est.record(tool, rng.choice((0.5, 1.0, 1.0, 2.5, rng.random() * 4)))
        for name in ("a", "b"):
            xs = est.samples(name)
            for tau in (0.0, 0.5, 1.0, 2.0, 2.5, 3.9):
                assert est.cdf(name, tau) == (sum(x <= tau for x in xs) / len(xs) if xs else float(tau >= 2.0))
            if xs:
                assert est.quantile(name, 0.5) == sorted(xs)[max(0, -(-len(xs) // 2) - 1)]


def test_memoryfulness() -> None:
    est = MemoryfulnessEstimator(min_jobs=5, default=0.3)
    assert est.eta() == 0.3
    for _ in range(10):
        est.record_job(10)  # identical lengths: done fully determines remaining
    assert est.eta() == pytest.approx(1.0)

    # Geometric (memoryless) lengths: done says little about remaining.
    rng = random.Random(1)
    geo = MemoryfulnessEstimator(window=5000)
    for _ in range(3000):
        n = 1
        while rng.random() < 0.9:
            n += 1
        geo.record_job(n)
    assert geo.eta() < 0.15

    # Lengths tightly clustered around 10: strongly memoryful.
    near = MemoryfulnessEstimator()
    for _ in range(200):
        near.record_job(rng.randint(9, 11))
    assert 0.9 < near.eta() <= 1.0

    # Too few jobs or degenerate data -> default.
    ones = MemoryfulnessEstimator(min_jobs=2, default=0.4)
    for _ in range(5):
        ones.record_job(1)
    assert ones.eta() == 0.4
    ones.record_job(0)
    assert ones.num_jobs == 5


def test_memoryfulness_shown_is_a_lower_bound_that_tightens_with_jobs() -> None:
    rng = random.Random(3)
    est = MemoryfulnessEstimator(min_jobs=8, default=0.5)
    assert est.eta() == 0.5 and est.eta_shown() == 0.0  # nothing shown before any job
    for _ in range(7):
        est.record_job(10)
    assert est.eta_shown() == 0.0  # fewer than min_jobs
    est.record_job(10)
    assert est.eta() == pytest.approx(1.0) and est.eta_shown() > 0.95  # identical lengths
    # clustered lengths: the bound is below the estimate and rises towards it with more jobs
    bounds = []
    near = MemoryfulnessEstimator(window=5000)
    for jobs in (10, 40, 400):
        while near.num_jobs < jobs:
            near.record_job(rng.choice((2, 3, 4, 5, 6)))
        bounds.append(near.eta_shown())
        assert 0.0 <= near.eta_shown() < near.eta()
    assert bounds[0] < bounds[1] < bounds[2] and near.eta() - bounds[2] < 0.1
    # geometric (memoryless) lengths: nothing shown, whatever the point estimate's noise
    for jobs in (12, 100):
        geo = MemoryfulnessEstimator(window=5000)
        for _ in range(jobs):
            n = 1
            while rng.random() < 0.7:
                n += 1
            geo.record_job(n)
        assert geo.eta_shown() < 0.05, (jobs, geo.eta(), geo.eta_shown())
    # the bound is recomputed when a job finishes
    before = near.eta_shown()
    for _ in range(50):
        near.record_job(1)
    assert near.eta_shown() != before


def test_memoryfulness_shown_counts_running_jobs_as_censored_lengths() -> None:
    """Early in a closed-loop run only the short jobs have finished: their lengths alone look
    memoryful; the running jobs, known to last at least the turns they started, say otherwise."""
    rng = random.Random(4)
    lengths = []
    for _ in range(48):  # geometric (memoryless) lengths, mean 4
        n = 1
        while rng.random() < 0.75:
            n += 1
        lengths.append(n)
    est = MemoryfulnessEstimator(window=5000)
    turn = 3
    for n in lengths:
        if n <= turn:
            est.record_job(n)
    running = [turn + 1 for n in lengths if n > turn]  # each started its fourth turn
    assert est.num_jobs >= 8 and running
    assert est.eta() > 0.3  # lengths 1-3 only: a sample truncated from above
    assert est.eta_shown() > 0.0  # without the running jobs the bound is fooled too
    est.record_job(turn)  # (invalidates the cached bound; one more short job)
    assert est.eta_shown(running) == 0.0
    # fixed-length jobs stay memoryful however many are still running
    fixed = MemoryfulnessEstimator()
    for _ in range(20):
        fixed.record_job(6)
    assert fixed.eta_shown([3] * 40 + [6] * 8) > 0.95


def test_memoryfulness_matches_brute_force() -> None:
    rng = random.Random(2)
    lengths = [rng.randint(1, 30) for _ in range(40)]
    est = MemoryfulnessEstimator(min_jobs=1)
    for n in lengths:
        est.record_job(n)
    xs = [k for n in lengths for k in range(1, n + 1)]
    ys = [n - k for n in lengths for k in range(1, n + 1)]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx = sum((x - mx) ** 2 for x in xs)
    vy = sum((y - my) ** 2 for y in ys)
    corr = cov / (vx * vy) ** 0.5
    assert est.eta() == pytest.approx(min(1.0, max(0.0, -corr)))


def test_queue_delay_tracker_virtual_clock() -> None:
    q = QueueDelayTracker(window=3, horizon_s=10.0)
    assert q.mean(now_s=0.0) == 0.0
    q.record(1.0, now_s=0.0)
    q.record(3.0, now_s=5.0)
    assert q.mean(now_s=5.0) == 2.0
    assert q.mean(now_s=12.0) == 3.0  # the sample at t=0 is older than 10 s
    for d in (4.0, 5.0, 6.0):
        q.record(d, now_s=13.0)
    assert q.mean(now_s=13.0) == 5.0  # window keeps the last 3
    assert q.mean(now_s=100.0) == 0.0
