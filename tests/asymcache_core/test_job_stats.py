"""JobStats: a job id that comes back after its last step is a live job again."""

from __future__ import annotations

from asymcache_core.job_stats import JobStats


def test_a_job_id_used_again_after_its_last_step_is_live() -> None:
    stats = JobStats(prior_reuse=0.3)
    stats.on_arrival("chat", 0.0, 64)
    stats.on_finish("chat", 1.0, last_step=True, context_tokens=80)
    assert stats.reuse_probability("chat", 2.0) == 0.0
    # the same id comes back (vLLM's session_id is a conversation's stable id)
    stats.on_arrival("chat", 50.0, 32)
    assert not stats.state("chat").finished
    assert stats.reuse_probability("chat", 50.0) == 1.0  # running: its blocks are wanted
    assert stats.demand_since("chat") == 50.0
    stats.on_finish("chat", 51.0, last_step=False)
    # paused, not done: neither 0 (the old last step) nor certain
    p = stats.reuse_probability("chat", 51.5)
    assert 0.0 < p < 1.0
    # the idle time after the last step is no pause of the job: no gap was learned from it
    assert stats.state("chat").gaps == []


def test_gaps_between_live_turns_are_still_learned() -> None:
    stats = JobStats()
    stats.on_arrival("j", 0.0, 10)
    stats.on_finish("j", 1.0, last_step=False)
    stats.on_arrival("j", 3.0, 10)
    assert stats.state("j").gaps == [2.0]
    stats.on_finish("j", 4.0, last_step=True)
    stats.on_arrival("j", 100.0, 10)
    stats.on_finish("j", 101.0, last_step=False)
    stats.on_arrival("j", 102.5, 10)
    assert stats.state("j").gaps == [2.0, 1.5]
