"""Per-job state is dropped when a job ends or idles, and bounded in between."""

from __future__ import annotations

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.continuum.estimator import MAX_TOOLS, ToolDurationEstimator
from asymcache_core.engine_jobs import JOB_SWEEP_INTERVAL_S

ONE = SamplingParams(max_tokens=2, ignore_eos=True)


def _engine(**kw) -> Engine:
    return Engine.simulated(model="dummy:tiny", num_kv_blocks=64, priority="program", **kw)


def _run_jobs(engine: Engine, n: int, pin_every: int = 3) -> None:
    for j in range(n):
        job = f"job-{j}"
        engine.add_request(list(range(10, 40)), ONE, job_id=job, is_last_step=(j % 2 == 0))
        while engine.has_unfinished():
            engine.step()
        if j % pin_every == 0:
            engine.pin_job(job, ttl_s=5.0)
            engine.continuum.on_tool_call(job, ["sleep"], 32)
        engine.continuum.on_request_arrival(job)


def test_two_thousand_jobs_leave_nothing_behind_once_idle():
    engine = _engine()
    _run_jobs(engine, 2000)
    busy = engine.tracked_jobs()
    assert busy["job_stats"] == 2000  # within the idle horizon everything is still known
    engine.idle_until(engine.clock() + engine.job_idle_s + JOB_SWEEP_INTERVAL_S + 1)
    assert engine.tracked_jobs() == {k: 0 for k in busy}
    engine.check_integrity()
    assert engine.pool.num_in_use == 0 or all(b.ref_cnt == 0 for b in engine.pool.blocks)


def test_the_tables_stay_under_the_cap_without_idling():
    engine = _engine()
    engine.max_tracked_jobs = 300
    _run_jobs(engine, 2000)
    sizes = engine.tracked_jobs()
    assert max(sizes.values()) <= 300, sizes
    assert sizes["job_stats"] >= 200  # recent jobs are kept
    # the most recent job is still known: its state was not the one dropped
    assert "job-1999" in engine.job_stats.jobs
    engine.check_integrity()


def test_a_job_in_flight_or_pinned_keeps_its_state():
    engine = _engine()
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=500, ignore_eos=True), job_id="long")
    engine.add_request(list(range(50, 80)), ONE, job_id="pinned")
    for _ in range(5):
        engine.step()
    assert engine.pin_job("pinned", ttl_s=1e9) > 0
    engine.job_idle_s = 0.0
    engine._next_job_sweep = 0.0
    engine.step()
    assert {"long", "pinned"} <= set(engine.job_stats.jobs)
    assert "pinned" in engine.pins.last_blocks


def test_tool_names_are_bounded():
    est = ToolDurationEstimator()
    for i in range(MAX_TOOLS + 500):
        est.record(f"tool-{i}", 1.0)
    assert len(est._samples) == MAX_TOOLS and est.samples(f"tool-{MAX_TOOLS + 499}") == [1.0]


def test_the_step_log_keeps_a_window_when_bounded() -> None:
    from asymcache_core import Engine, EngineConfig, SamplingParams

    with pytest.raises(ValueError, match="max_step_log"):
        EngineConfig(max_step_log=0)
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=64, max_step_log=3))
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=8, ignore_eos=True))
    starts = []
    while engine.has_unfinished():
        engine.step()
        starts.append(engine.step_log[-1].start)
    assert len(starts) > 3 and len(engine.step_log) == 3
    assert [s.start for s in engine.step_log] == starts[-3:]  # the most recent steps, in order
