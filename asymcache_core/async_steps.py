"""Async scheduling's half of the engine loop: launch step N+1, then collect step N.

:class:`AsyncSteps` is mixed into :class:`~asymcache_core.engine.Engine`, whose ``_step`` calls
:meth:`AsyncSteps._launch` when ``async_scheduling`` is on; its methods use the engine's
runner, clock, step log and output path (``_execute``, ``_complete``, ``_log_step``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from asymcache_core.errors import EngineDeadError
from asymcache_core.request import RequestOutput
from asymcache_core.scheduler import SchedulerOutput
from asymcache_core.step_faults import StepResult, drop_stopped

if TYPE_CHECKING:
    from asymcache_core.launched_steps import LaunchedStep

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """A step launched on the device and not collected yet (async scheduling).

    Attributes:
        launched: the runner's handle.
        plan: the step's plan.
        start: when its planning began (engine clock).
        schedule_s: host seconds from then to the end of its launch.
        launch_time: when its launch began (engine clock).
        chained: the step before it was still in flight when it was launched.
    """

    launched: LaunchedStep
    plan: SchedulerOutput
    start: float
    schedule_s: float
    launch_time: float
    chained: bool


class AsyncSteps:
    """Launch and collect of async scheduling (a mixin of the engine).

    Invariant: at most one step is in flight (``_in_flight``), and steps are collected in the
    order they were launched: a step's pending inputs (:attr:`Request.num_pending`) are always
    sampled by the one step in flight when it is launched.
    """

    def _launch(self, plan: SchedulerOutput, start: float) -> list[RequestOutput]:
        """Async scheduling: launches ``plan`` (step N+1) while step N runs on the device, then
        collects step N. Returns step N's outputs.

        NOTE: N+1 is planned before N's tokens are back: each request N samples has one
        pending token, which N+1 reads on the device; a request N ends has been planned into
        N+1 too, and its token there is dropped (vLLM's async scheduling does the same).
        """
        outputs: list[RequestOutput] = []
        previous = self._in_flight
        launched: LaunchedStep | None = None
        launch_time = self.clock()
        try:
            launched = self.runner.launch(plan, previous.launched if previous is not None else None)  # type: ignore[attr-defined]
        except EngineDeadError as exc:
            self.dead = exc
            raise
        except Exception as exc:  # noqa: BLE001 - run again below, isolating the culprit
            logger.warning("launching a step failed (%s: %s); running it synchronously", type(exc).__name__, exc)
        flight = (
            InFlight(launched, plan, start, self.clock() - start, launch_time, previous is not None)
            if launched is not None
            else None
        )
        if previous is not None:
            done, collected = self._finish_in_flight()
            outputs += done
            if not collected and flight is not None:
                # NOTE: the step before it ran again synchronously: the tokens this one read
                # on the device are not trustworthy, so it runs again too
                flight = None
        if flight is not None and flight.launched.awaiting_masks:
            # NOTE: its rows' masks follow the tokens of the step just collected; its forward
            # pass runs on the device meanwhile
            try:
                flight = flight._replace(launched=self.runner.sample_masked(flight.launched))  # type: ignore[attr-defined]
            except EngineDeadError as exc:
                self.dead = exc
                raise
            except Exception as exc:  # noqa: BLE001 - run again below, isolating the culprit
                logger.warning("sampling a launched step failed (%s: %s); running it synchronously", type(exc).__name__, exc)
                flight = None
        if flight is not None:
            self._in_flight = flight
            return outputs
        # the launch failed (or read failed tokens): its inputs are all known now
        self.device_timeline.reset()
        result = self._execute_again(plan)
        if not result.ran.scheduled and not result.faults:
            return outputs
        end = self.clock()
        self._log_step(plan, start, end, 0.0)
        return outputs + self._complete(result, end)

    def _finish_in_flight(self) -> tuple[list[RequestOutput], bool]:
        """Collects the step in flight and returns its outputs, and whether its launch ran
        (``False``: collecting it raised, and it ran again synchronously)."""
        flight = self._in_flight
        assert flight is not None
        self._in_flight = None
        collected = True
        try:
            result = StepResult(flight.plan, self.runner.collect(flight.launched), [])  # type: ignore[attr-defined]
        except EngineDeadError as exc:
            self.dead = exc
            raise
        except Exception as exc:  # noqa: BLE001 - run again, isolating the culprit
            logger.warning("a launched step failed (%s: %s); running it synchronously", type(exc).__name__, exc)
            collected = False
            result = self._execute_again(flight.plan)
        end = self.clock()
        span = None
        if collected:
            launched = flight.launched
            try:
                span = self.device_timeline.place(launched.started, launched.ready, flight.launch_time, flight.chained)
            except RuntimeError as exc:  # an event not complete: log it on host times
                logger.warning("step timeline: %s", exc)
                self.device_timeline.reset()
        else:
            self.device_timeline.reset()
        if span is None:
            # NOTE: no device events (off CUDA): it ran from its launch or from the end of the
            # step before, the later, to when its tokens came back
            span = (max(flight.start + flight.schedule_s, self._last_end), end)
        self._log_step(flight.plan, *span, flight.schedule_s)
        return self._complete(result, end), collected

    def _execute_again(self, plan: SchedulerOutput) -> StepResult:
        """Runs a launched step's plan synchronously (its launch or collection failed), without
        the requests that stopped running since it was planned: the blocks those were to write
        stop being cache hits, and the requests that read them are preempted
        (:func:`~asymcache_core.step_faults.drop_stopped`). Every request of ``plan`` that
        does not run (stopped, failed, or preempted for reading a failed one's blocks) drops
        its pending token, as :meth:`Scheduler.update_from_output` does for those that ran."""
        keep, readers = drop_stopped(plan, self.kv, self.pool, self.scheduler, self.block_size)
        preempted = [*plan.preempted, *readers]
        result = (
            self._execute(SchedulerOutput(keep, preempted, plan.budget, sum(item.num_tokens for item in keep)))
            if keep
            else StepResult(SchedulerOutput([], preempted, plan.budget, 0), {}, [])
        )
        ran = {id(item.request) for item in result.ran.scheduled}
        for item in plan.scheduled:
            if item.sample and id(item.request) not in ran:
                if item.request.skip_samples:
                    item.request.skip_samples -= 1  # the sample a jump-forward was to drop
                elif item.request.num_pending:
                    item.request.num_pending -= 1
        return result
