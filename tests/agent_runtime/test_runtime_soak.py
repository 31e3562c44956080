"""A 1,000-job soak of the runtime over the simulated engine: per-job state stays flat, and at the
end no block, pin or per-job entry is left.

Jobs of 1-4 turns run 32 at a time on a pool that cannot hold them all (evictions, pins, job
admission); between turns a job pauses for a tool (the virtual clock moves), some jobs are
abandoned without their last step, and some requests are aborted mid-stream.
"""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc

from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from asymcache_core import Engine, SamplingParams
from asymcache_core.engine_jobs import JOB_SWEEP_INTERVAL_S

JOBS = 1_000
CONCURRENCY = 32
IDLE_S = 20.0
SYSTEM = list(range(10, 74))  # a shared 64-token system prompt (four blocks)


def _sizes(runtime: AgentRuntime, engine: Engine) -> dict[str, int]:
    return {**engine.tracked_jobs(), "runtime_job_tokens": len(runtime._processor._job_tokens),
            "engine_requests": len(engine.requests)}


def test_a_thousand_simulated_jobs_leave_flat_state_and_nothing_behind(expensive_reload_profile):
    preset = resolve_preset("asymcache+continuum")
    # NOTE: a profile where rebuilding a context is costly, so tool pauses are pinned.
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=96, latency_profile=expensive_reload_profile,
                              **preset.engine_overrides)
    engine.job_idle_s = IDLE_S
    rng = random.Random(0)
    plans = [(rng.randint(1, 4), rng.random() < 0.1, rng.random() < 0.05) for _ in range(JOBS)]
    samples: list[dict[str, int]] = []
    outcomes = {"finished": 0, "aborted": 0, "abandoned": 0}
    memory: list[int] = []

    async def job(index: int, runtime: AgentRuntime, gate: asyncio.Semaphore) -> None:
        turns, abandon, abort = plans[index]
        job_id = f"soak-{index}"
        history = [*SYSTEM, *(300 + (index * 13 + i) % 150 for i in range(20))]
        async with gate:
            for turn in range(turns):
                last = turn == turns - 1 and not abandon
                params = SamplingParams(max_tokens=4 if not abort else 64, ignore_eos=True)
                stream = await runtime.submit(history, params, job_id=job_id, is_last_step=last,
                                              pause_tool=None if last else "sim_tool")
                if abort and turn == turns - 1:
                    async for _ in stream:
                        stream.abort()
                        break
                    await stream.result()
                    outcomes["aborted"] += 1
                    break
                final = await stream.result()
                history = [*history, *final.output.token_ids, *(400 + turn * 7 + i for i in range(8))]
                if not last:
                    # NOTE: Continuum's own pins depend on how the jobs interleave with the engine
                    # thread; every 10th job also pins through the API, so that pins always exist.
                    if index % 10 == 0:
                        await runtime.call(lambda e, j=job_id: e.pin_job(j, 0.5))
                    # the tool's pause: engine time moves on while the job is away
                    await runtime.call(lambda e: e.idle_until(e.clock() + 0.2))
            else:
                outcomes["abandoned" if abandon else "finished"] += 1
            if index % 100 == 99:
                samples.append(await runtime.call(lambda e: _sizes(runtime, e)))
                gc.collect()
                # NOTE: traced from the middle of the soak on (tracing every allocation of all
                # of it tripled the test's time): what the second half allocates and still holds
                if index + 1 == JOBS // 2:
                    tracemalloc.start()
                if tracemalloc.is_tracing():
                    memory.append(tracemalloc.get_traced_memory()[0])

    async def main() -> tuple[dict[str, int], tuple[int, int, int, bool]]:
        runtime = AgentRuntime(engine, policy="asymcache+continuum")
        gate = asyncio.Semaphore(CONCURRENCY)
        try:
            await asyncio.gather(*(job(i, runtime, gate) for i in range(JOBS)))

            def settle(e: Engine) -> tuple[int, int, int, bool]:
                e.idle_until(e.clock() + IDLE_S + JOB_SWEEP_INTERVAL_S + 3600)
                # NOTE: the engine thread drops the runtime's state of forgotten jobs after its
                # next step; dropped here too, so the sizes below do not race that step.
                runtime._processor.drop_forgotten(e.job_stats.jobs)
                e.check_integrity()
                return (sum(b.ref_cnt for b in e.pool.blocks), sum(b.pin_cnt for b in e.pool.blocks),
                        e.stats().pinned_blocks, e.has_unfinished())

            state = await runtime.call(settle)
            return await runtime.call(lambda e: _sizes(runtime, e)), state
        finally:
            await runtime.close()

    try:
        final_sizes, (refs, pin_refs, pinned, unfinished) = asyncio.run(main())
    finally:
        tracemalloc.stop()
    assert sum(outcomes.values()) == JOBS and min(outcomes.values()) > 0, outcomes
    assert refs == 0 and pin_refs == 0 and pinned == 0 and not unfinished
    assert final_sizes == {k: 0 for k in final_sizes}, final_sizes
    # flat: the tables hold about the jobs of the idle horizon, not every job seen so far
    assert len(samples) == JOBS // 100
    for name in samples[0]:
        later = [s[name] for s in samples[2:]]
        assert max(later) <= max(3 * CONCURRENCY, 2 * samples[1][name] + CONCURRENCY), (name, samples)
    stats = engine.stats()
    assert stats.evictions_total > 0 and stats.pins_total > 0  # the pool was under pressure
    # memory: what the second half of the soak allocated and still holds at its end (every job
    # of it gone; the tables' entries of its idle horizon) stays below what the first few jobs took
    assert len(memory) == len(samples) // 2 + 1 and memory[-1] - memory[0] < 4 << 20, memory
