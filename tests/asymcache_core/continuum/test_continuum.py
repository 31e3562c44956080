"""Continuum with a virtual clock: the controller over both pin backends (the engine's and the
vLLM plugin's), and on the real SmolLM2: policies, TTL pins, expiry, pressure, the pin cap,
is_last_step, and program-level FCFS admission order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent_runtime.presets import preset_names, resolve_preset
from asymcache_core import SamplingParams
from asymcache_core.block_pool import BlockPool
from asymcache_core.continuum.backends import PinBackend, PinManager
from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.continuum.ttl import apply_ttl_rule, pin_benefit_s
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.integrations.vllm.pins import PinSet
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel
from tests.conftest import make_engine

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


class FakeClock:
    """A virtual clock the test advances by hand."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def _prompt(seed: int, n: int) -> list[int]:
    """Distinct token-id prompts (no shared prefix between seeds)."""
    return [1000 + (seed * 997 + i * 31) % 40000 for i in range(n)]


def _run(engine, prompt: list[int], job: str, params: SamplingParams = ONE, **kw) -> list[str]:
    """Add one request and step until it finishes; returns the ids finishing, in order."""
    rid = engine.add_request(prompt, params, job_id=job, **kw)
    done = []
    while engine.has_unfinished():
        done += [o.request_id for o in engine.step() if o.finished]
    assert rid in done
    return done


def _continuum_engine(smollm, clock: FakeClock, profile: str | None = None, **kw):
    if profile is not None:
        kw["latency_profile"] = profile
    return make_engine(smollm, clock=clock, **resolve_preset("continuum").engine_overrides, **kw)


# -- policies ----------------------------------------------------------------------------------


def test_policy_table():
    assert {"vllm-apc", "lru", "pensieve", "asymcache", "continuum", "asymcache+continuum"} <= set(preset_names())
    for name in ("vllm-apc", "lru", "pensieve", "asymcache"):
        spec = resolve_preset(name)
        assert spec.engine_overrides == {"eviction_policy": name, "priority": "fcfs"} and not spec.pinning
    c = resolve_preset("continuum")
    assert c.engine_overrides == {"eviction_policy": "vllm-apc", "priority": "program"} and c.pinning
    ac = resolve_preset("asymcache+continuum")
    # waiting requests in program order as far as jobs are memoryful (adaptive_program_key)
    assert ac.engine_overrides == {"eviction_policy": "asymcache", "priority": "adaptive"} and ac.pinning
    c.engine_overrides["priority"] = "fcfs"  # a fresh dict each time: the table is not touched
    assert resolve_preset("continuum").engine_overrides["priority"] == "program"
    with pytest.raises(ValueError, match="^policy: unknown policy 'nope'"):
        resolve_preset("nope")


# -- the controller over both backends -----------------------------------------------------------

#: Reloading a context costs seconds here, so short tool pauses are worth a pin.
SLOW_RELOAD = LatencyModel(floor_s=0.04, per_token_s=0.0045, per_attn_s=1.15e-6, knee_tokens=8, source="test")
BLOCK_HASHES = [7000 + i for i in range(6)]


def _engine_backend(clock: FakeClock) -> tuple[PinManager, list[int]]:
    """An engine pin manager over a pool whose six cached blocks are free (a finished turn)."""
    pool = BlockPool(16, create_policy("vllm-apc", PolicyContext(16)), clock)
    ids = pool.allocate(len(BLOCK_HASHES), "job")
    for pos, (bid, h) in enumerate(zip(ids, BLOCK_HASHES, strict=True)):
        assert pool.cache_block(bid, h, pos)
    pool.free(ids)
    return PinManager(pool, max_pinned_fraction=1.0), ids


def _remember(backend: PinBackend, ids: list[int]) -> None:
    """What each engine tells its backend when the job's request finishes."""
    if isinstance(backend, PinManager):
        backend.remember("job", list(zip(ids, BLOCK_HASHES, strict=True)))
    else:
        assert isinstance(backend, PinSet)
        backend.remember("job", ids)


def _drive(backend: PinBackend, ids: list[int], clock: FakeClock) -> tuple[ContinuumController, list]:
    """One job of three turns (grep, then an explicit TTL, then its last step), with a queue
    delay and a learned pause, through the controller; returns it and what it saw."""
    ctl = ContinuumController(backend, SLOW_RELOAD, JobStats(), clock)
    seen: list = []
    ctl.durations.record("grep", 0.4)
    clock.t = 10.0
    ctl.on_request_arrival("job")
    ctl.on_request_scheduled(10.0, 10.5)
    _remember(backend, ids)
    clock.t = 11.0
    first = ctl.on_tool_call("job", ["grep"], 2000, ended_at=10.9)
    seen += [first, backend.num_pinned_blocks, backend.is_pinned("job"), ctl.job_stats.state("job").expected_gap]
    clock.t = 11.2
    seen.append(ctl.on_request_arrival("job"))
    seen += [backend.unpin("job"), backend.num_pinned_blocks]
    _remember(backend, ids)
    seen.append(ctl.on_tool_call("job", ["grep"], 2100, ttl_s=3.0))
    clock.t = 12.0
    seen += [ctl.on_request_arrival("job"), backend.expire(clock.t + 3.0)]
    ctl.on_job_finished("job")
    seen += [backend.is_pinned("job"), ctl.memoryfulness.num_jobs, ctl.job_stats.state("job").finished]
    return ctl, seen


def test_both_backends_get_the_same_decisions() -> None:
    engine_pins, ids = _engine_backend(FakeClock())
    vllm_pins = PinSet(capacity_blocks=16)
    assert isinstance(engine_pins, PinBackend) and isinstance(vllm_pins, PinBackend)
    ctl_e, seen_e = _drive(engine_pins, ids, FakeClock())
    ctl_v, seen_v = _drive(vllm_pins, ids, FakeClock())
    assert seen_e == seen_v
    assert ctl_e.decisions == ctl_v.decisions
    first, explicit = ctl_e.decisions
    # the grep samples (0.4 s, then the learned 0.3 s) are far below the reload they save
    assert first.ttl_s == pytest.approx(0.4) and first.blocks_pinned == 6 and first.p_return == 1.0
    assert first.benefit_s == pytest.approx(0.5 * 0.5 + ctl_e.reload_cost(2000))
    assert seen_e[1:4] == [6, True, pytest.approx(0.4)]
    assert seen_e[4] == pytest.approx(0.3)
    assert ctl_e.durations.samples("grep") == pytest.approx([0.4, 0.3, 0.8])
    assert explicit.ttl_s == 3.0 and explicit.blocks_pinned == 6
    assert seen_e[-5] == pytest.approx(0.8)  # the pause after the explicit-TTL turn
    assert seen_e[-4] == ["job"]  # expired at its TTL
    assert seen_e[-3:] == [False, 1, True]


def test_reload_cost_is_one_prefill_of_the_context() -> None:
    ctl = ContinuumController(PinSet(0), SLOW_RELOAD, JobStats(), FakeClock())
    for n in (1, 17, 2000):
        # n(n+1)/2 query-key pairs: each position attends to itself and every earlier one
        assert ctl.reload_cost(n) == pytest.approx(SLOW_RELOAD.step_latency(n, n * (n + 1) / 2))
    assert ctl.reload_cost(2000) > SLOW_RELOAD.step_latency(2000, 2000 * 2000 / 2)
    assert ctl.reload_cost(-5) == SLOW_RELOAD.step_latency(0, 0)


def test_decision_follows_the_rule_and_the_overrides() -> None:
    clock = FakeClock(5.0)
    pins = PinSet(capacity_blocks=8)
    ctl = ContinuumController(pins, SLOW_RELOAD, JobStats(), clock, pinning=False)
    pins.remember("j", [1, 2])
    d = ctl.on_tool_call("j", [], 100)
    benefit = pin_benefit_s(100, ctl.reload_cost, 0.0, ctl.memoryfulness.eta())
    want = apply_ttl_rule("continuum", ctl.durations, "unknown", benefit)
    # not pinning: the rule's benefit is reported, the TTL and P(return) are 0, and no pin
    assert d == replace(d, tool="unknown", ttl_s=0.0, blocks_pinned=0, p_return=0.0, benefit_s=want.benefit_s)
    assert not pins.is_pinned("j") and ctl.job_stats.state("j").expected_gap == 2.0
    pins.remember("j", [1, 2])
    d = ctl.on_tool_call("j", ["t"], 100, pinning=True, ttl_rule="preview")
    assert d.ttl_s == 2.0 and d.blocks_pinned == 2 and pins.is_pinned("j")
    assert ctl.configure(pinning=True) is ctl and ctl.pinning and ctl.ttl_rule == "continuum"
    explicit = ctl.on_tool_call("j", ["t"], 100, ttl_s=-1.0)
    assert explicit.ttl_s == 0.0 and explicit.blocks_pinned == 0 and explicit.p_return == 0.0
    # a client's TTL is capped: a pin may not hold its blocks from everyone for years
    from asymcache_core.continuum.controller import MAX_CLIENT_TTL_S

    pins.remember("j", [1, 2])
    forever = ctl.on_tool_call("j", ["t"], 100, ttl_s=1e12)
    assert forever.ttl_s == MAX_CLIENT_TTL_S and forever.blocks_pinned == 2


# -- pins --------------------------------------------------------------------------------------


def test_tool_call_pins_then_next_request_unpins_and_hits(smollm):
    clock = FakeClock(10.0)
    engine = _continuum_engine(smollm, clock)
    ctl = engine.continuum
    for _ in range(4):
        ctl.durations.record("grep", 0.2)
    first = _prompt(1, 100)
    _run(engine, first, "a")
    finished_at = clock()
    decision = ctl.on_tool_call("a", ["grep"], 101, ended_at=finished_at)
    # C_reload(101) on the CPU latency model is well above the 0.2 s pin it buys.
    assert ctl.reload_cost(101) > 0.2
    assert decision.ttl_s == pytest.approx(0.2)
    assert decision.blocks_pinned == 100 // 16 == engine.pins.num_pinned_blocks
    assert engine.job_stats.state("a").expected_gap == pytest.approx(0.2)  # the pause hint
    engine.check_integrity()

    clock.advance(0.15)
    out_tokens = engine.pins.last_blocks["a"]
    assert len(out_tokens) == 6
    rid = engine.add_request(first + [42] + _prompt(2, 20), ONE, job_id="a")
    assert ctl.on_request_arrival("a") == pytest.approx(0.15)
    assert ctl.durations.samples("grep")[-1] == pytest.approx(0.15)
    assert engine.pins.is_pinned("a")  # still pinned while it waits in the queue
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert not engine.pins.is_pinned("a") and engine.pins.num_pinned_blocks == 0
    assert outs[0].request_id == rid and outs[0].metrics.cached_tokens == 96
    engine.check_integrity()


def test_abandoned_job_loses_pin_at_expiry(smollm, expensive_reload_profile):
    clock = FakeClock()
    engine = _continuum_engine(smollm, clock, expensive_reload_profile)
    ctl = engine.continuum
    ctl.durations.record("test", 0.3)
    _run(engine, _prompt(3, 100), "gone")
    decision = ctl.on_tool_call("gone", ["test"], 101)
    assert decision.ttl_s == pytest.approx(0.3) and decision.blocks_pinned > 0
    clock.advance(0.2)
    engine.step()  # before the TTL: still pinned
    assert engine.pins.is_pinned("gone")
    clock.advance(0.2)
    engine.step()  # the job never came back: the pin expires
    assert not engine.pins.is_pinned("gone") and engine.pins.num_expired == 1
    assert engine.pins.num_pinned_blocks == 0
    # its blocks are ordinary evictable cache now, still hit while nobody needed them
    assert engine.pool.num_free_blocks == engine.num_blocks
    assert ctl.paused_jobs() == ["gone"]
    engine.check_integrity()


def test_memory_pressure_releases_latest_expiring_pin_first(smollm):
    clock = FakeClock()
    engine = _continuum_engine(smollm, clock, num_kv_blocks=20)
    engine.pins.max_pinned_fraction = 1.0  # only pressure, not the cap, may release here
    _run(engine, _prompt(4, 100), "a")
    _run(engine, _prompt(5, 100), "b")
    assert engine.pin_job("a", 5.0) == 6
    assert engine.pin_job("b", 10.0) == 6
    assert engine.pool.num_free_blocks == 8
    # 150 prompt tokens + 1 need 10 blocks: one pin must go, the latest-expiring (b)
    _run(engine, _prompt(6, 150), "c")
    assert engine.pins.is_pinned("a") and not engine.pins.is_pinned("b")
    assert engine.pins.num_released_pressure == 1
    engine.check_integrity()


def test_pin_cap_never_lets_pins_starve_admissions(smollm):
    clock = FakeClock()
    engine = _continuum_engine(smollm, clock, num_kv_blocks=40)
    engine.pins.max_pinned_fraction = 0.25  # at most 10 idle pinned blocks
    _run(engine, _prompt(7, 100), "a")
    _run(engine, _prompt(8, 100), "b")
    assert engine.pin_job("a", 5.0) == 6
    assert engine.pin_job("b", 10.0) == 0  # 12 > 10: the latest-expiring pin is refused
    assert engine.pins.is_pinned("a") and engine.pins.num_pinned_blocks == 6
    engine.check_integrity()


def test_last_step_releases_everything(smollm):
    clock = FakeClock()
    engine = _continuum_engine(smollm, clock)
    ctl = engine.continuum
    ctl.durations.record("t", 0.1)
    _run(engine, _prompt(9, 100), "j")
    ctl.on_request_arrival("j")
    assert ctl.on_tool_call("j", ["t"], 101).blocks_pinned > 0
    ctl.on_job_finished("j")
    assert engine.pins.num_pinned_blocks == 0 and not engine.pins.is_pinned("j")
    assert engine.job_stats.reuse_probability("j", clock()) == 0.0
    assert ctl.memoryfulness.num_jobs == 1 and ctl.paused_jobs() == []
    # an is_last_step request also drops what it leaves behind
    _run(engine, _prompt(10, 40), "k", is_last_step=True)
    assert engine.pin_job("k", 5.0) == 0
    engine.check_integrity()


def test_no_pin_when_benefit_is_below_the_ttl(smollm):
    clock = FakeClock()
    engine = _continuum_engine(smollm, clock)
    ctl = engine.continuum
    _run(engine, _prompt(11, 40), "s")
    # cold start: the tool is assumed to take 2 s; reloading 41 tokens costs far less
    decision = ctl.on_tool_call("s", ["new_tool"], 41)
    assert decision.ttl_s == 0.0 and decision.blocks_pinned == 0
    assert decision.expected_duration_s == 2.0
    assert engine.pins.num_pinned_blocks == 0
    preview = engine.continuum.configure(ttl_rule="preview")
    assert preview.on_tool_call("s", ["new_tool"], 41).ttl_s == 2.0  # the preview code's rule
    assert engine.pins.is_pinned("s")
    engine.check_integrity()


# -- program-level FCFS ------------------------------------------------------------------------


def _admission_order(smollm, priority: str, eta: float | None = None, **overrides) -> list[str]:
    clock = FakeClock()
    engine = make_engine(smollm, clock=clock, priority=priority, max_num_seqs=1, **overrides)
    if eta is not None:  # the memoryfulness the adaptive order reads, as if jobs had shown it
        engine.continuum.memoryfulness.eta_shown = lambda *_: eta
    _run(engine, _prompt(20, 24), "old")  # t=0: job "old" starts
    clock.advance(1.0)
    _run(engine, _prompt(21, 24), "pinned")  # t=1: job "pinned" starts, then calls a tool
    assert engine.pin_job("pinned", 100.0) > 0
    ids = {}
    for t, job, seed in ((5.0, "new", 22), (6.0, "old", 23), (7.0, "pinned", 24)):
        clock.t = t
        ids[engine.add_request(_prompt(seed, 24), ONE, job_id=job)] = job
    order = []
    while engine.has_unfinished():
        order += [ids[o.request_id] for o in engine.step() if o.finished]
    engine.check_integrity()
    return order


def test_program_fcfs_admission_order(smollm):
    # pinned jobs first, then by the job's first arrival (not the request's)
    assert _admission_order(smollm, "program") == ["pinned", "old", "new"]
    assert _admission_order(smollm, "fcfs") == ["new", "old", "pinned"]


def test_adaptive_admission_order_follows_the_jobs_memoryfulness(smollm):
    # before any job finished no memory is shown: arrival order, pinned jobs first
    assert _admission_order(smollm, "adaptive") == ["pinned", "new", "old"]
    # with eta 0.5 shown the old job's request (job start 0, arrival 6) ranks at 3, before the
    # new job's (5): the same order as program order
    assert _admission_order(smollm, "adaptive", eta=0.5) == ["pinned", "old", "new"]


def test_a_stated_ttft_target_bounds_the_adaptive_order(smollm):
    # with eta 0.5 shown, a 2 s target starts at a 1 s slack: no request ranks earlier than 1 s before its arrival,
    # so the old job's request (arrival 6, program rank 3) ranks at 5 and no longer passes the
    # new job's (5), which arrived first, and the pinned job's (arrival 7) ranks at 6 instead
    # of before everything
    assert _admission_order(smollm, "adaptive", eta=0.5, ttft_slo_ms=2000.0) == ["new", "old", "pinned"]
    # an 8 s target (4 s slack) leaves room for the old job's lead (rank 3) and lets the pinned
    # one pass the new job's request, which arrived 2 s before it
    assert _admission_order(smollm, "adaptive", eta=0.5, ttft_slo_ms=8000.0) == ["old", "pinned", "new"]
    assert make_engine(smollm, priority="adaptive", ttft_slo_ms=8000.0).stats().order_slack_seconds == 4.0
    assert make_engine(smollm, priority="adaptive").stats().order_slack_seconds == float("inf")  # no target
    # the other orders take no bound: fcfs is arrival order, program Continuum's own
    for priority in ("fcfs", "program"):
        engine = make_engine(smollm, priority=priority, ttft_slo_ms=8000.0)
        assert engine.continuum.ttft_target is None and engine.stats().order_slack_seconds == float("inf")


def test_order_slack_bounds_how_far_a_request_moves_ahead_of_its_arrival():
    from asymcache_core.continuum.ttft_target import TTFTTarget
    from asymcache_core.request import Request

    ctl = ContinuumController(PinSet(0), SLOW_RELOAD, JobStats(), FakeClock())
    first = Request("old-1", [1, 2], ONE, 0.0, job_id="old")
    old = Request("old-2", [1, 2], ONE, 10.0, job_id="old")
    new = Request("new-1", [1, 2], ONE, 8.0, job_id="new")
    for request in (first, new, old):
        ctl.on_request_added(request)
    ctl.memoryfulness.eta_shown = lambda *_: 1.0  # pure program order: the old job ranks at its start
    assert ctl.adaptive_program_key(old)[1] == 0.0 and ctl.adaptive_program_key(old) < ctl.adaptive_program_key(new)
    ctl.ttft_target = TTFTTarget(6.0)  # starts at half the target: the old job's turn may pass
    assert ctl.adaptive_program_key(old)[1] == pytest.approx(7.0)  # what arrived up to 3 s before it
    assert ctl.adaptive_program_key(old) < ctl.adaptive_program_key(new)
    ctl.ttft_target.slack_s = 1.5  # but not a request that waited longer than the slack
    assert ctl.adaptive_program_key(old)[1] == pytest.approx(8.5)
    assert ctl.adaptive_program_key(new) < ctl.adaptive_program_key(old)
    assert ctl.adaptive_program_key(new)[1] == 8.0  # a job's first request ranks at its arrival
    pinned = Request("p-2", [1, 2], ONE, 10.0, job_id="p")
    pinned.had_pin = True  # a pinned job's turn goes ahead by the slack, not before everything
    assert ctl.adaptive_program_key(pinned) == (0, 8.5, 10.0)
    assert ctl.adaptive_program_key(new) < ctl.adaptive_program_key(pinned)  # new waited 2 s > 1.5
    ctl.ttft_target.slack_s = 0.0  # arrival order
    assert ctl.adaptive_program_key(old)[1] == 10.0
    assert ctl.program_key(old)[1] == 0.0  # Continuum's own order is never bounded
    # first admissions feed the slack and T_queue their waits; a re-admission (after a
    # preemption) does not
    clock = ctl.clock
    clock.t = 12.0
    ctl.on_admit(new)
    assert list(ctl.ttft_target.waits) == [4.0]
    assert ctl.queue.mean(12.0) == 4.0  # and T_queue, the pin benefit's queueing delay
    new.admitted_once = True
    ctl.on_admit(new)
    assert list(ctl.ttft_target.waits) == [4.0] and len(ctl.queue._samples) == 1


def test_adaptive_program_key_moves_from_program_to_arrival_order():
    from asymcache_core.request import Request

    clock = FakeClock()
    ctl = ContinuumController(PinSet(0), SLOW_RELOAD, JobStats(), clock)
    old = Request("old-2", [1, 2], ONE, 6.0, job_id="old")
    new = Request("new-1", [1, 2], ONE, 5.0, job_id="new")
    first = Request("old-1", [1, 2], ONE, 0.0, job_id="old")
    for request in (first, new, old):
        ctl.on_request_added(request)
    assert ctl.adaptive_program_key(new) < ctl.adaptive_program_key(old)  # nothing shown yet: arrival order
    for _ in range(10):  # jobs of equal length: turns done predict turns left exactly
        ctl.memoryfulness.record_job(5)
    assert ctl.memoryfulness.eta() == pytest.approx(1.0)
    assert ctl.memoryfulness.eta_shown() > 0.99
    assert ctl.adaptive_program_key(old) < ctl.adaptive_program_key(new)  # program order
    assert ctl.adaptive_program_key(old)[1] == pytest.approx(ctl.program_key(old)[1], abs=0.06)
    ctl.memoryfulness.eta_shown = lambda *_: 0.0  # memoryless lengths
    assert ctl.adaptive_program_key(new) < ctl.adaptive_program_key(old)  # arrival order
    assert ctl.adaptive_program_key(old)[1] == 6.0
