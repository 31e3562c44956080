"""Where launched steps ran on the device, on the engine's clock (async scheduling's step log).

Under async scheduling the host plans and launches step N+1 while the device runs step N, and
collects N only after that launch. Host times then misplace work: N's tokens come back after
N+1's launch, so N's span on the host holds N+1's planning and enqueueing (a decode step before
an eagerly launched prompt looked 2.4x its length on the H200), and N+1's looks short. The
step log feeds the latency feedback and ``asymcache calibrate``, so each launched step carries
two device events instead (recorded when its launch begins and after its last kernel), and
this module places the steps on the engine's clock from them:

- a step launched while the one before was still in flight starts where that one ended plus
  the time the device sat idle between them (the events' elapsed time, 0 when it never
  waited), so a run of launched steps is one gap-free chain of device time;
- a step launched with nothing in flight (the device idle) starts at its launch on the host
  clock: the chain is anchored again there.

Off CUDA (no events) nothing is placed and the engine keeps host times.
"""

from __future__ import annotations

from typing import Protocol


class TimedEvent(Protocol):
    """A device event recorded with timing (``torch.cuda.Event(enable_timing=True)``)."""

    def elapsed_time(self, end_event: TimedEvent) -> float: ...


class DeviceTimeline:
    """Places launched steps on the engine clock from their device events.

    Invariant: :attr:`last` is ``(engine time the last placed step ended, its end event)``,
    or ``None`` when the chain is broken (no step placed yet, or the last one had no events).
    """

    def __init__(self) -> None:
        self.last: tuple[float, TimedEvent] | None = None

    def place(
        self, started: TimedEvent | None, ended: TimedEvent | None, launch_time: float, chained: bool
    ) -> tuple[float, float] | None:
        """The engine-clock ``(start, end)`` of a collected step, in launch order.

        Args:
            started: its event recorded when its launch began (``None``: no events).
            ended: its event recorded after its last kernel.
            launch_time: engine time its launch began (host clock).
            chained: the step before it was still in flight when it was launched.

        Returns:
            Its span, or ``None`` without events (the chain breaks).
        """
        if started is None or ended is None:
            self.last = None
            return None
        if chained and self.last is not None:
            before_end, before_event = self.last
            start = before_end + max(before_event.elapsed_time(started), 0.0) / 1e3
        else:
            # NOTE: nothing was in flight, so the device ran its first event when it was recorded
            start = launch_time
        end = start + max(started.elapsed_time(ended), 0.0) / 1e3
        self.last = (end, ended)
        return start, end

    def reset(self) -> None:
        """Breaks the chain (a step ran outside it, synchronously)."""
        self.last = None
