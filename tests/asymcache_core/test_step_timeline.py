"""The step log of launched steps under async scheduling: placed on the device's timeline from
each step's events (:class:`DeviceTimeline`), not on the host's, where a step's span would hold
the next one's launch."""

from __future__ import annotations

from typing import Any

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.step_timeline import DeviceTimeline
from tests.asymcache_core.test_step_faults import run_all
from tests.conftest import StepClock


class FakeEvent:
    """A timing event that fires at ``t`` seconds of a synthetic device clock. With ``waited``,
    it counts as complete only once waited for (:meth:`synchronize`), as a step's end event on
    a device still running it: timing it before raises, as CUDA does."""

    def __init__(self, t: float, waited: bool = False, clock: StepClock | None = None) -> None:
        self.t = t
        self.complete = not waited
        self.clock = clock

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if not (self.complete and end_event.complete):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end_event.t - self.t) * 1e3

    def synchronize(self) -> None:
        self.complete = True
        if self.clock is not None:  # the host waited for the device
            self.clock.now = max(self.clock.now, self.t)


def test_a_chain_of_launched_steps_is_placed_back_to_back_with_the_device_idle_between():
    timeline = DeviceTimeline()
    # anchored at its launch (nothing in flight); 4 ms on the device
    assert timeline.place(FakeEvent(10.0), FakeEvent(10.004), launch_time=5.0, chained=False) == (5.0, pytest.approx(5.004))
    # launched while the first ran: its start event fired when the first ended
    start, end = timeline.place(FakeEvent(10.004), FakeEvent(10.010), launch_time=5.001, chained=True)
    assert (start, end) == (pytest.approx(5.004), pytest.approx(5.010))
    # the device waited 2 ms for its launch
    start, end = timeline.place(FakeEvent(10.012), FakeEvent(10.015), launch_time=5.0115, chained=True)
    assert (start, end) == (pytest.approx(5.012), pytest.approx(5.015))
    # nothing in flight at its launch: anchored again at the host's launch time
    assert timeline.place(FakeEvent(20.0), FakeEvent(20.001), launch_time=9.0, chained=False) == (9.0, pytest.approx(9.001))


def test_a_step_without_events_breaks_the_chain():
    timeline = DeviceTimeline()
    timeline.place(FakeEvent(1.0), FakeEvent(1.002), launch_time=1.0, chained=False)
    assert timeline.place(None, None, launch_time=1.001, chained=True) is None
    assert timeline.last is None
    # chained, but with nothing to chain to: anchored at its launch
    assert timeline.place(FakeEvent(1.004), FakeEvent(1.005), launch_time=1.003, chained=True) == (1.003, pytest.approx(1.004))
    timeline.reset()
    assert timeline.last is None


class SyntheticDevice:
    """Wraps an engine's ``runner.launch``: each launched step gets the events of a synthetic
    device (on the engine's :class:`StepClock`, which waiting for an end event moves on) that
    runs steps in launch order, one at a time, each for 2 ms plus 0.2 ms a token,
    starting one at its launch when it is idle."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.launch = engine.runner.launch
        self.free_at = 0.0
        #: per launch: (launch time, another step in flight, device start, device end)
        self.launches: list[tuple[float, bool, float, float]] = []
        self.plans: list[Any] = []
        engine.runner.launch = self  # type: ignore[method-assign]

    def __call__(self, plan: Any, previous: Any) -> Any:
        launched = self.launch(plan, previous)
        now = self.engine.clock.now  # type: ignore[attr-defined]  # the engine's launch time
        start = max(now, self.free_at)
        end = start + 2e-3 + 2e-4 * plan.num_tokens
        self.free_at = end
        self.launches.append((now, previous is not None, start, end))
        self.plans.append(plan)
        return launched._replace(started=FakeEvent(start), ready=FakeEvent(end, waited=True, clock=self.engine.clock))


def test_the_engine_logs_launched_steps_where_the_device_ran_them():
    # the engine clock ticks 1 ms a reading: some launches find the device busy, some idle;
    # 48-token steps split the prompts, so some steps sample nothing
    engine = Engine(
        model="dummy:tiny", num_kv_blocks=512, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=48,
        async_scheduling=True, clock=StepClock(1e-3),
    )
    device = SyntheticDevice(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request([(7 * i + j) % 400 + 5 for j in range(100 + 30 * i)], params)
    done = run_all(engine)
    assert all(len(out.token_ids) == 12 for out in done.values())
    log = list(engine.step_log)
    assert len(log) == len(device.launches) >= 12
    # what the log should say: a step launched behind another starts where that one ended
    # plus the device's idle time between them; one launched on an idle device at its launch
    expected_end = device_end = 0.0
    busy = idle = 0
    for step, (launch_time, chained, start, end) in zip(log, device.launches, strict=True):
        if chained:
            gap = start - device_end
            busy += gap == 0
            idle += gap > 0
            expected_start = expected_end + gap
        else:
            expected_start = launch_time
        expected_end = expected_start + (end - start)
        device_end = end
        assert (step.start, step.start + step.duration_s) == (
            pytest.approx(expected_start, abs=1e-9), pytest.approx(expected_end, abs=1e-9)
        )
    assert busy and idle
    assert any(not any(item.sample for item in plan.scheduled) for plan in device.plans)


@pytest.mark.gpu
def test_launched_steps_on_the_gpu_are_laid_end_to_end_within_the_wall_time(caplog: pytest.LogCaptureFixture) -> None:
    """On the GPU (async by default), the step log of a run whose prompts arrive while others
    decode, some in chunks: each launched step carries its device events (none is timed on the
    host: no warning), the steps never overlap, and together
    with the device's idle time between them they fit in the run's wall time."""
    import logging
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # 64-token steps split the prompts: some steps sample nothing
    engine = Engine(
        model="dummy:tiny", device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8, max_model_len=2048,
        max_num_batched_tokens=64,
    )
    assert engine.async_scheduling
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    t0 = engine.clock()
    wall0 = time.monotonic()
    for i in range(6):
        engine.add_request(list(range(10 + i, 10 + i + 30 * (i + 1))), params)
        for _ in range(3):
            engine.step()
    with caplog.at_level(logging.WARNING, logger="asymcache_core.async_steps"):
        run_all(engine)
    assert not [r for r in caplog.records if "step timeline" in r.getMessage()]
    wall = time.monotonic() - wall0
    log = list(engine.step_log)
    assert len(log) > 16
    assert all(step.duration_s > 0 for step in log)
    for before, after in zip(log, log[1:], strict=False):
        assert after.start >= before.start + before.duration_s - 1e-6
    assert log[0].start >= t0 - 1e-6
    assert log[-1].start + log[-1].duration_s - log[0].start <= wall + 1e-3
