"""The engine under random operations (hypothesis state machine), every eviction policy.

Requests are added (jobs with shared prefixes, some poisoned so the forward pass raises on
them), stepped, aborted, pinned, unpinned, expired and evicted on a pool of a few blocks, with
the simulated runner, with and without a host KV tier (whose copies fail while the device is
down), and with the real model runner of a tiny dummy model under async scheduling (each step
launched while the one before is in flight). After every rule the block pool, the host tier, the KV-cache manager, the pins and job
admission are checked; at the end everything runs out and the pool must hold nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asymcache_core import Engine, SamplingParams
from asymcache_core.eviction import registered_policies
from asymcache_core.request import HOLE, RequestOutput
from asymcache_core.scheduler import SchedulerOutput
from asymcache_core.sim_runner import VirtualClock

POISON = 13
JOBS = ["j0", "j1", "j2"]
#: the tokens a masked request may take (``allowed_token_ids``; the tiny model's vocabulary is 512)
ALLOWED = tuple(range(100, 512, 3))


class FaultyRunner:
    """The simulated runner, raising when a poisoned request is in the step or while ``down``."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.down = False

    def _check(self, plan: SchedulerOutput) -> None:
        if self.down or any(POISON in item.request.prompt_token_ids for item in plan.scheduled):
            raise RuntimeError("injected fault")

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self._check(plan)
        return self.runner.execute(plan)

    def launch(self, plan: SchedulerOutput, previous):  # type: ignore[no-untyped-def]
        self._check(plan)
        return self.runner.launch(plan, previous)

    def transfer_kv(self, transfers) -> None:
        if self.down:
            raise RuntimeError("injected copy fault")
        self.runner.transfer_kv(transfers)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def make_machine(policy: str, host_tier: bool, async_model: bool = False) -> type[RuleBasedStateMachine]:
    class EngineMachine(RuleBasedStateMachine):
        @initialize(
            blocks=st.integers(min_value=5, max_value=16),
            host=st.integers(min_value=2, max_value=24) if host_tier else st.just(0),
            copy_s=st.sampled_from([1e-6, 0.05, 2.0]),
        )
        def build(self, blocks: int, host: int, copy_s: float) -> None:
            if async_model:
                self.engine = Engine(
                    model="dummy:tiny", num_kv_blocks=blocks, eviction_policy=policy, num_host_kv_blocks=host,
                    async_scheduling=True, clock=VirtualClock(),
                )
            else:
                self.engine = Engine.simulated(
                    model="dummy:tiny", num_kv_blocks=blocks, eviction_policy=policy, num_host_kv_blocks=host
                )
            if self.engine.host_tier is not None:
                # NOTE: copies from instant to slower than several steps: reloading requests wait
                # across steps, and blocks are reused while copies are in flight.
                tier = self.engine.host_tier
                tier.reload_seconds = lambda n: n * copy_s  # type: ignore[method-assign]
                tier.offload_seconds = lambda n: n * copy_s  # type: ignore[method-assign]
            self.runner = FaultyRunner(self.engine.runner)
            self.engine.runner = self.runner
            self.live: dict[str, tuple[bool, int]] = {}  # id -> (poisoned, max_tokens)
            self.aborted: set[str] = set()
            self.done: dict[str, RequestOutput] = {}
            self.masked: set[str] = set()

        # -- rules ---------------------------------------------------------------------------
        @rule(
            job=st.sampled_from([None, *JOBS]),
            shared=st.integers(min_value=0, max_value=40),
            own=st.integers(min_value=1, max_value=20),
            max_tokens=st.integers(min_value=1, max_value=8),
            last=st.sampled_from([False, False, False, True]),
            poisoned=st.sampled_from([False, False, False, False, True]),
            copies=st.integers(min_value=1, max_value=3),
            logprobs=st.sampled_from([None, None, 0, 3]),
            masked=st.sampled_from([False, False, True]),
        )
        def add(
            self, job: str | None, shared: int, own: int, max_tokens: int, last: bool, poisoned: bool, copies: int,
            logprobs: int | None, masked: bool,
        ) -> None:
            for copy in range(copies):
                # NOTE: a job's prompts share a prefix, so turns (and copies) hit each other's blocks.
                base = 20 + 7 * (JOBS.index(job) if job else 3)
                prompt = [base + i % 50 for i in range(shared)] + [300 + (len(self.done) + copy + i) % 150 for i in range(own)]
                if poisoned and copy == 0:
                    prompt[-1] = POISON
                # NOTE: the simulator computes no logits: log probabilities on the real model only
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs if async_model else None)
                if masked and async_model:
                    # NOTE: a processor that only masks: its rows sample in the async pipeline,
                    # their masks built once the step before is collected
                    params = dataclasses.replace(params, allowed_token_ids=ALLOWED)
                try:
                    rid = self.engine.add_request(prompt, params, job_id=job, is_last_step=last)
                except ValueError as exc:
                    assert str(exc).startswith(("num_kv_blocks", "prompt")), exc
                    return
                self.live[rid] = (POISON in prompt, max_tokens)
                if params.allowed_token_ids is not None:
                    self.masked.add(rid)

        @rule(times=st.integers(min_value=1, max_value=4), down=st.sampled_from([False, False, False, True]))
        def step(self, times: int, down: bool) -> None:
            self.runner.down = down
            try:
                for _ in range(times):
                    for out in self.engine.step():
                        self.observe(out)
                    if self.engine.stalled:
                        self.engine.idle_until(self.engine.clock() + 1.0)
            finally:
                self.runner.down = False

        @precondition(lambda self: bool(self.live))
        @rule(pick=st.integers(min_value=0, max_value=1_000))
        def abort(self, pick: int) -> None:
            rid = sorted(self.live)[pick % len(self.live)]
            assert self.engine.abort(rid)
            self.aborted.add(rid)
            for out in self.engine.step():
                self.observe(out)

        @rule(pick=st.integers(min_value=0, max_value=1_000), ttl=st.sampled_from([0.5, 5.0, 1e6]))
        def pin(self, pick: int, ttl: float) -> None:
            # NOTE: mostly a job with a finished turn to pin (others pin nothing).
            remembered = sorted(self.engine.pins.last_blocks) or JOBS
            job = remembered[pick % len(remembered)] if pick % 4 else JOBS[pick % len(JOBS)]
            pinned = self.engine.pin_job(job, ttl)
            assert pinned == 0 or self.engine.pins.is_pinned(job)

        @rule(pick=st.integers(min_value=0, max_value=1_000))
        def unpin(self, pick: int) -> None:
            pinned = sorted(self.engine.pins.pins) or JOBS
            job = pinned[pick % len(pinned)]
            had = self.engine.pins.is_pinned(job)
            assert self.engine.unpin_job(job) == had and not self.engine.pins.is_pinned(job)

        @rule(dt=st.sampled_from([0.1, 1.0, 10.0]))
        def expire(self, dt: float) -> None:
            self.engine.idle_until(self.engine.clock() + dt)

        @rule(pick=st.integers(min_value=0, max_value=1_000), everything=st.booleans())
        def evict(self, pick: int, everything: bool) -> None:
            pool = self.engine.pool
            if everything:
                self.engine.reset_prefix_cache()
                return
            candidates = [b.block_id for b in pool.blocks if pool.is_candidate(b.block_id)]
            if candidates:
                pool.evict_block(candidates[pick % len(candidates)])

        # -- checks --------------------------------------------------------------------------
        def observe(self, out: RequestOutput) -> None:
            assert out.request_id in self.live, f"output for unknown or finished {out.request_id}"
            if not out.finished:
                return
            poisoned, max_tokens = self.live.pop(out.request_id)
            self.done[out.request_id] = out
            if out.error is not None:
                assert out.finish_reason == "abort" and "injected fault" in out.error
                assert poisoned or self.runner.down, "a clean request failed while the device was up"
            elif out.request_id not in self.aborted:
                assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
                assert not poisoned, "a poisoned request ran"
            if out.request_id in self.masked:
                # the mask held for every token, whatever preemption, faults and aborts did
                assert set(out.token_ids) <= set(ALLOWED)
            if out.logprobs is not None:
                # one entry per token, whatever preemption, faults and async steps did to it
                assert [e.token_id for e in out.logprobs] == out.token_ids

        @invariant()
        def pool_and_cache_manager_hold(self) -> None:
            engine = self.engine
            engine.check_integrity()
            bs = engine.block_size
            assert set(engine.requests) == set(self.live)
            for request in engine.scheduler.running:
                frontier = -(-request.num_computed_tokens // bs)
                assert all(b != HOLE for b in request.block_ids[:frontier]), "a hole below the frontier"
                assert request.num_committed_blocks <= len(request.block_hashes)
                for idx in range(request.num_committed_blocks):
                    block = engine.pool.blocks[request.block_ids[idx]]
                    assert block.block_hash in (None, request.block_hashes[idx]), "a block caches other tokens"
            for request in engine.scheduler.waiting:
                assert not engine.kv.held_blocks(request), "a waiting request holds blocks"
            assert 0 <= engine.pool.num_in_use <= engine.num_blocks

        def teardown(self) -> None:
            engine = getattr(self, "engine", None)
            if engine is None:
                return
            for _ in range(5_000):
                if not engine.has_unfinished():
                    break
                for out in engine.step():
                    self.observe(out)
                if engine.stalled:
                    engine.idle_until(engine.clock() + 1.0)
            assert not engine.has_unfinished() and not self.live
            for job in JOBS:
                engine.unpin_job(job)
            engine.idle_until(engine.clock() + 1e7)
            engine.step()  # releases prefetched blocks whose copies have landed
            engine.check_integrity()
            assert all(b.ref_cnt == 0 and b.pin_cnt == 0 for b in engine.pool.blocks)
            assert engine.stats().pinned_blocks == 0 and not engine.requests
            engine.reset_prefix_cache()
            assert engine.pool.num_in_use == 0 and len(engine.pool.free_uncached) == engine.num_blocks

    return EngineMachine


@pytest.mark.parametrize("host_tier", [False, True], ids=["device", "host-tier"])
@pytest.mark.parametrize("policy", registered_policies())
def test_engine_state_machine(policy: str, host_tier: bool) -> None:
    run_state_machine_as_test(
        make_machine(policy, host_tier),
        settings=settings(
            max_examples=60, stateful_step_count=50, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_engine_state_machine_with_async_scheduling() -> None:
    # the real runner (tiny dummy model, CPU) launching each step before the last is collected,
    # with a host tier: requests end, abort and fail while a step is in flight
    run_state_machine_as_test(
        make_machine("asymcache", host_tier=True, async_model=True),
        settings=settings(
            max_examples=60, stateful_step_count=50, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
