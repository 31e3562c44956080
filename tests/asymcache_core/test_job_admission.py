"""Job-level admission: the gate's ranking and bookkeeping (the engine under it: test_engine_job_admission)."""

from __future__ import annotations

import pytest

from asymcache_core.job_admission import JobAdmission, gate_capacity_blocks
from asymcache_core.request import Request
from asymcache_core.sampling_params import SamplingParams


def _req(job: str | None, tokens: int, *, last: bool = False, rid: str | None = None) -> Request:
    return Request(rid or f"{job}-{tokens}", [1] * tokens, SamplingParams(max_tokens=1), 0.0, job_id=job, is_last_step=last)


def _admit(gate: JobAdmission, request: Request, now: float = 0.0) -> bool:
    if gate.admits(request, now):
        gate.on_admitted(request, now)
        return True
    return False


def test_new_jobs_start_only_while_every_older_job_fits() -> None:
    gate = JobAdmission(capacity_tokens=1000)
    assert _admit(gate, _req("a", 400))
    assert _admit(gate, _req("b", 500))
    assert not _admit(gate, _req("c", 200))  # 400 + 500 + 200 > 1000
    assert _admit(gate, _req(None, 900))  # requests without a job are never held back
    assert gate.num_held_back == 1 and gate.num_jobs == 2


def test_the_oldest_job_always_runs_even_past_capacity() -> None:
    gate = JobAdmission(capacity_tokens=100)
    r = _req("a", 90)
    assert _admit(gate, r)
    gate.on_released(r, 1.0)
    assert _admit(gate, _req("a", 300, rid="a2"), 2.0)  # grew past the pool: still first


def test_a_younger_job_that_no_longer_fits_waits_between_turns_and_resumes() -> None:
    gate = JobAdmission(capacity_tokens=1000)
    a1, b1 = _req("a", 300), _req("b", 300)
    assert _admit(gate, a1) and _admit(gate, b1)
    gate.on_released(a1, 1.0)
    gate.on_released(b1, 1.0)
    assert _admit(gate, _req("a", 800, rid="a2"), 1.5)  # a grew: 800 + b's 300 > 1000
    assert not gate.admits(_req("b", 350, rid="b2"), 1.6)  # b waits between its turns
    gate.on_released(_req("a", 850, last=True, rid="a2"), 2.0)  # a's last step ends a
    assert gate.num_jobs == 1
    assert _admit(gate, _req("b", 350, rid="b2"), 2.1)
    gate.check_integrity()


def test_preemption_keeps_the_rank_and_last_step_ends_the_job() -> None:
    gate = JobAdmission(capacity_tokens=1000)
    r = _req("a", 100, last=True)
    _admit(gate, r)
    gate.on_released(r, 0.5, preempted=True)
    assert gate.num_jobs == 1 and gate.jobs["a"].in_flight == 0
    _admit(gate, r, 0.6)
    gate.on_released(r, 1.0)
    assert gate.num_jobs == 0
    gate.check_integrity()


def test_idle_jobs_leave_the_ranking_after_a_learned_timeout() -> None:
    gate = JobAdmission(capacity_tokens=1000, min_idle_timeout_s=5.0)
    a1 = _req("a", 900)
    _admit(gate, a1, 0.0)
    gate.on_released(a1, 1.0)
    a2 = _req("a", 950, rid="a2")
    # a 20 s gap is longer than the 5 s floor: a left the ranking, and its return teaches the
    # gap, so the timeout becomes 3 x 20 s.
    assert _admit(gate, a2, 21.0) and gate.num_expired == 1
    gate.on_released(a2, 22.0)
    assert gate.idle_timeout_s == pytest.approx(60.0)
    assert not gate.admits(_req("b", 100), 50.0)
    assert gate.admits(_req("b", 100, rid="b2"), 83.0)  # a idle for 61 s: dropped
    assert gate.num_expired == 2 and "a" not in gate.jobs
    gate.check_integrity()


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="capacity_tokens"):
        JobAdmission(capacity_tokens=0)
    with pytest.raises(ValueError, match="min_idle_timeout_s"):
        JobAdmission(capacity_tokens=10, min_idle_timeout_s=0.0)


def test_nothing_is_held_back_while_the_engine_is_idle() -> None:
    gate = JobAdmission(capacity_tokens=100)
    _admit(gate, _req("a", 90))
    assert not gate.admits(_req("b", 50), 0.0)
    assert gate.admits(_req("b", 50), 0.0, engine_idle=True)


def _finish_job(gate: JobAdmission, job: str, tokens: int, now: float) -> None:
    request = _req(job, tokens, last=True)
    gate.on_admitted(request, now)  # a one-turn job, admitted whatever the gate would say now
    gate.on_released(request, now)


def test_idle_jobs_with_contexts_one_step_rebuilds_reserve_nothing() -> None:
    # a job between turns whose context is within min_held_tokens keeps its rank (it still goes
    # first when it returns) but does not hold the younger jobs back, once jobs are seen to
    # stay that short
    gate = JobAdmission(capacity_tokens=1000, min_held_tokens=500)
    _finish_job(gate, "done", 300, 0.0)
    assert gate.jobs_stay_short() and list(gate.final_tokens) == [300]
    a1, b1 = _req("a", 400), _req("b", 550)
    assert _admit(gate, a1) and _admit(gate, b1)
    gate.on_released(a1, 1.0)
    gate.on_released(b1, 1.0)
    # a (400, idle) reserves nothing; b (550, idle) reserves its context
    assert _admit(gate, _req("c", 400), 1.1)  # 0 + 550 + 400 fits
    assert not gate.admits(_req("d", 100), 1.2)  # 550 + 400 (c in flight) + 100 > 1000
    assert _admit(gate, _req("a", 450, rid="a2"), 1.3)  # the oldest returns first
    gate.check_integrity()
    # in flight again, a's 450 counts: c's next turn no longer fits beside a and b
    gate.on_released(_req("c", 400), 1.4)
    assert not gate.admits(_req("c", 350, rid="c2"), 1.5)  # 450 + 550 + 400 > 1000
    gate.check_integrity()


def test_short_idle_jobs_reserve_their_context_while_jobs_grow_long() -> None:
    # jobs start short and grow (coding agents): a short idle context is a job's first turns,
    # and letting younger jobs in past it would stop them later, once grown
    gate = JobAdmission(capacity_tokens=1000, min_held_tokens=500)
    a1 = _req("a", 400)
    assert _admit(gate, a1)
    gate.on_released(a1, 1.0)
    assert not gate.jobs_stay_short()  # no job finished yet: every idle job reserves
    assert not gate.admits(_req("b", 700), 1.1)  # 400 + 700 > 1000
    for i, tokens in enumerate((900, 300, 2000)):  # median 900 > 500: jobs grow long
        _finish_job(gate, f"done{i}", tokens, 2.0 + i)
    assert not gate.jobs_stay_short()
    assert not gate.admits(_req("b", 700), 5.1)
    for i in range(2):  # two more short ones: median 300
        _finish_job(gate, f"short{i}", 200 + i, 6.0 + i)
    assert gate.jobs_stay_short()
    assert _admit(gate, _req("b", 700), 8.1)  # a's idle 400 is one step: not reserved now
    gate.check_integrity()


def test_final_contexts_are_a_bounded_window_of_finished_jobs() -> None:
    gate = JobAdmission(capacity_tokens=10_000, min_held_tokens=500, final_history=3)
    for i, tokens in enumerate((5000, 5000, 5000, 100, 100)):
        _finish_job(gate, f"j{i}", tokens, float(i))
    assert list(gate.final_tokens) == [5000, 100, 100]  # the oldest two left the window
    assert gate.jobs_stay_short()
    unfinished = _req("k", 50)
    assert _admit(gate, unfinished, 9.0)
    gate.on_released(unfinished, 9.5)  # a turn that is not the last step: nothing recorded
    assert len(gate.final_tokens) == 3
    gate.check_integrity()
    with pytest.raises(ValueError, match="final_history"):
        JobAdmission(capacity_tokens=1000, final_history=0)


def test_min_held_tokens_zero_reserves_every_ranked_context() -> None:
    gate = JobAdmission(capacity_tokens=1000)
    a1 = _req("a", 400)
    assert _admit(gate, a1)
    gate.on_released(a1, 1.0)
    assert not gate.admits(_req("b", 700), 1.1)  # a's idle 400 is reserved
    with pytest.raises(ValueError, match="min_held_tokens"):
        JobAdmission(capacity_tokens=1000, min_held_tokens=-1)


def _with_prefix(request: Request, hashes: list[int]) -> Request:
    request.block_hashes = list(hashes)
    return request


def _admit_sharing(gate: JobAdmission, job: str, tokens: int, shared: list[int], cached: int) -> bool:
    """Admits the first request of ``job``: its blocks hashed ``shared`` and then its own."""
    own = 10_000 + 100 * len(gate.jobs)  # block hashes no other job holds
    request = _with_prefix(_req(job, tokens), [*shared, *range(own, own + tokens // 100 - len(shared))])
    if not gate.admits(request, 0.0):
        return False
    gate.on_admitted(request, 0.0, cached_prefix_tokens=cached)
    return True


def test_a_shared_prefix_is_keyed_and_counted_once_in_the_unique_sum() -> None:
    gate = JobAdmission(capacity_tokens=10_000, block_size=100)
    shared = list(range(1, 9))  # an 800-token prompt
    assert _admit_sharing(gate, "a", 1000, shared, cached=0)  # the first: nothing cached
    assert _admit_sharing(gate, "b", 1000, shared, cached=800)
    assert gate.jobs["b"].shared_tokens == 800 and gate.jobs["b"].shared_key == 8
    assert gate.jobs["a"].shared_key is None
    # per job: 1000 + 1000; unique: a's 1000 (the prompt inside), b's 200 and the prompt once
    assert gate._tokens_before("c") == 2000 and gate._unique_before("c") == 2000
    assert _admit_sharing(gate, "c", 1000, shared, cached=800)
    assert gate._tokens_before("d") == 3000 and gate._unique_before("d") == 2200
    assert gate._key_owner == {8: "b"} and gate._prefix_from_older == {"c"}
    gate.check_integrity()


def test_jobs_sharing_a_prompt_pass_while_their_unique_tokens_fit_half_the_pool() -> None:
    # jobs of 1,000 tokens, 800 of them one shared prompt: ten fill the per-job count of a
    # 10,000-token pool; the pool holds far less (a's 1,000, the prompt, 200 a job), so more
    # pass while that is within half of it
    gate = JobAdmission(capacity_tokens=10_000, min_held_tokens=1000, block_size=100, final_history=2)
    shared = list(range(1, 9))
    for i in range(10):
        assert _admit_sharing(gate, f"j{i}", 1000, shared, cached=800 if i else 0)
    assert gate._tokens_before("k") == 10_000 and gate._unique_before("k") == 3600
    assert not _admit_sharing(gate, "j10", 1000, shared, cached=800)  # no job has finished yet
    _finish_job(gate, "done0", 300, 0.0)
    assert not _admit_sharing(gate, "j10", 1000, shared, cached=800)  # one of final_history (2)
    _finish_job(gate, "done1", 300, 0.0)
    assert _admit_sharing(gate, "j10", 1000, shared, cached=800)  # 2 x (3600 + 200) <= 10,000
    # a job with another 2,000-token prompt needs 2 x (3800 + 2000) > 10,000: held
    assert not _admit_sharing(gate, "other", 2000, [901, 902], cached=0)
    assert gate.num_held_back == 3
    gate.check_integrity()


def test_where_the_unique_tokens_pass_half_the_pool_the_per_job_count_holds() -> None:
    # the same jobs on a 5,000-token pool: the sixth fits neither count (the pool binds, and
    # the prompt counted per job is the room the running jobs take as they grow)
    gate = JobAdmission(capacity_tokens=5000, min_held_tokens=1000, block_size=100, final_history=1)
    _finish_job(gate, "done", 300, 0.0)
    shared = list(range(1, 9))
    for i in range(5):
        assert _admit_sharing(gate, f"j{i}", 1000, shared, cached=800 if i else 0)
    assert gate._unique_before("k") == 2600  # 2 x (2600 + 200) > 5000
    assert not _admit_sharing(gate, "j5", 1000, shared, cached=800)
    gate.check_integrity()


def test_bad_block_size_names_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        JobAdmission(capacity_tokens=10, block_size=0)
    with pytest.raises(ValueError, match="tier_tokens"):
        JobAdmission(capacity_tokens=10, tier_tokens=-1)
    with pytest.raises(ValueError, match="min_pauses"):
        JobAdmission(capacity_tokens=10, min_pauses=0)
    with pytest.raises(ValueError, match="pause_window"):
        JobAdmission(capacity_tokens=10, min_pauses=8, pause_window=4)


def _turns_with_pauses(gate: JobAdmission, job: str, tokens: int, turn_s: float, pause_s: float, n: int) -> float:
    """``n`` turns of ``job`` at ``tokens`` tokens, each ``turn_s`` from its first step to its
    release and followed by a ``pause_s`` tool pause; returns the time after the last pause."""
    now = 0.0
    for i in range(n):
        request = Request(f"{job}-{i}", [1] * tokens, SamplingParams(max_tokens=1), now, job_id=job)
        gate.on_admitted(request, now + 0.5)  # waits 0.5 s at the gate: not a pause
        request.admitted_once = True
        request.metrics.first_scheduled_time = now + 0.5
        now += 0.5 + turn_s
        gate.on_released(request, now)
        now += pause_s
    return now


def test_a_tier_adds_to_the_gate_as_far_as_jobs_pause() -> None:
    # 1,000 device tokens, a tier worth up to 3,000 more
    gate = JobAdmission(capacity_tokens=1000, tier_tokens=3000, min_pauses=4)
    assert gate.capacity_tokens == 1000 and gate.pause_share() is None  # nothing seen yet
    # three turns of 3 s, a pause of 1 s between two: two pauses are too few to count
    _turns_with_pauses(gate, "a", 100, turn_s=3.0, pause_s=1.0, n=3)
    assert gate.pause_share() is None and gate.capacity_tokens == 1000
    # five more turns, four more pauses: 6 s of pauses in 30 s (the wait at the gate before
    # each turn is neither); the device holds what is in flight, so the gate admits
    # 1,000 / (1 - 1/5)
    _turns_with_pauses(gate, "b", 100, turn_s=3.0, pause_s=1.0, n=5)
    assert gate.pause_share() == pytest.approx(6 / 30)
    assert gate.capacity_tokens == 1250
    gate.check_integrity()


def test_pauses_are_weighted_by_the_context_held_and_the_tier_bounds_the_gate() -> None:
    gate = JobAdmission(capacity_tokens=1000, tier_tokens=500, min_pauses=2, pause_window=4)
    # long pauses of a small job, short ones of a large job: the large job's time dominates
    _turns_with_pauses(gate, "small", 10, turn_s=1.0, pause_s=9.0, n=3)
    _turns_with_pauses(gate, "large", 1000, turn_s=9.0, pause_s=1.0, n=3)
    share = gate.pause_share()
    assert share is not None and share < 0.2  # the window holds the large job's last turns
    # jobs that mostly pause would take the whole tier, and no more
    _turns_with_pauses(gate, "idle", 1000, turn_s=0.1, pause_s=50.0, n=6)
    assert gate.capacity_tokens == 1500
    gate.check_integrity()


def _sharing_gate(final_tokens: int, **kwargs) -> tuple[JobAdmission, int]:
    """A gate with a 30,000-token tier share that has learned a pause share, seen one job
    finish at ``final_tokens``, and ranks three jobs of 1,000 tokens sharing an 800-token
    prompt; returns it and its learned (unscaled) capacity."""
    gate = JobAdmission(capacity_tokens=10_000, block_size=100, min_pauses=4, min_held_tokens=2000, **kwargs)
    _turns_with_pauses(gate, "x", 100, turn_s=3.0, pause_s=1.0, n=5)
    _finish_job(gate, "f", final_tokens, 30.0)
    share = gate.pause_share()
    assert (share is not None) == bool(gate.tier_tokens)  # pauses are learned only with a tier
    learned = 10_000 + min(gate.tier_tokens, int(10_000 * share / (1 - share))) if share is not None else 10_000
    shared = list(range(1, 9))
    for job in "abc":
        assert _admit_sharing(gate, job, 1000, shared, cached=0 if job == "a" else 800)
    return gate, learned


def test_where_jobs_stay_short_the_learned_capacity_is_scaled_by_the_overcount() -> None:
    # the gate sums a shared prefix once a job, the device holds it once: where jobs stay
    # short (and x's idle 100 tokens reserve nothing), per job 3,000, the prompt once 2,200
    gate, learned = _sharing_gate(500, tier_tokens=30_000)
    assert gate.jobs_stay_short() and gate.overcount() == pytest.approx(3000 / 2200)
    assert gate.capacity_tokens == int(learned * 3000 / 2200)
    gate.check_integrity()
    # where jobs grow long the overcount is the room they grow into: not scaled
    grown, learned = _sharing_gate(5000, tier_tokens=30_000)
    assert not grown.jobs_stay_short() and grown.overcount() > 1.0
    assert grown.capacity_tokens == learned
    # without a tier the gate is the device pool
    no_tier, _ = _sharing_gate(500)
    assert no_tier.overcount() > 1.0 and no_tier.capacity_tokens == 10_000


def test_a_stated_ttft_target_counts_the_whole_tier_share_from_the_start() -> None:
    gate = JobAdmission(capacity_tokens=1000, tier_tokens=3000, min_pauses=4, tier_for_ttft=True)
    assert gate.capacity_tokens == 4000
    # pauses that would give the gate a third of the tier's share change nothing
    _turns_with_pauses(gate, "a", 100, turn_s=3.0, pause_s=1.0, n=8)
    assert gate.pause_share() == pytest.approx(7 / 31)
    assert gate.capacity_tokens == 4000
    assert JobAdmission(capacity_tokens=1000, tier_for_ttft=True).capacity_tokens == 1000  # no tier
    gate.check_integrity()


def test_without_a_tier_the_gate_is_the_device_pool_whatever_jobs_pause() -> None:
    gate = JobAdmission(capacity_tokens=1000, min_pauses=1)
    _turns_with_pauses(gate, "a", 100, turn_s=1.0, pause_s=10.0, n=5)
    assert gate.capacity_tokens == 1000
    gate.check_integrity()


def test_gate_capacity_counts_half_of_what_a_host_tier_holds_beyond_the_device():
    assert gate_capacity_blocks(19_934) == 19_934  # no tier
    assert gate_capacity_blocks(19_934, 0) == 19_934
    assert gate_capacity_blocks(100, 60) == 100  # a tier smaller than the device adds nothing
    assert gate_capacity_blocks(100, 100) == 100
    assert gate_capacity_blocks(19_934, 32_768) == 19_934 + (32_768 - 19_934) // 2
    assert gate_capacity_blocks(10, 41) == 25


@pytest.mark.parametrize(("device", "host", "field"), [(0, 10, "device_blocks"), (10, -1, "host_blocks")])
def test_gate_capacity_rejects_bad_sizes(device, host, field):
    with pytest.raises(ValueError, match=field):
        gate_capacity_blocks(device, host)
