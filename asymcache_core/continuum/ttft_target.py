"""A stated time-to-first-token target, kept by bounding how far program order moves a turn.

Program order (Continuum's, and the default's eta-weighted one) serves old jobs' turns first:
it shortens jobs, and the youngest jobs' turns pay for it in waiting, so its time-to-first-token
tail is several times arrival order's. :class:`TTFTTarget` bounds it by the target the user
states (``EngineConfig.ttft_slo_ms``): a request ranks no earlier than its arrival less a slack,
so a later request passes it only if it arrived within the slack after it. The slack learns
from the waits seen (arrival to first admission), additive increase and multiplicative
decrease: every :attr:`TTFTTarget.period` first admissions, the recent
:attr:`TTFTTarget.window` waits are checked; if more than :attr:`TTFTTarget.max_late` of them
exceeded the target and some of those came since the last check, the slack halves; if no more
than that did, it grows by a tenth of the target, up to the target.

Where arrival order keeps the waits within the target, the slack settles at the largest value
that still does, and program order keeps what it buys within it; where arrival order cannot,
the slack falls to zero: arrival order.

NOTE: job admission (:class:`~asymcache_core.job_admission.JobAdmission`) makes turns wait too,
and the target does not open it. A gate scaled up while waits ran past the target (AIMD on the
multiple of the pool it admits against, tried 2026-12-04) paid job time and missed the target
anyway: simulated H200, tool loop, seed 23, 400 jobs, 48 in flight, 1,200 blocks, a 2 s target,
mean JCT 7.87 s against 6.71 with no target and 8.19 for ``vllm-apc``, TTFT p99 4.95 s against
6.55 and 1.13: the scale swung between 1 and 2.4 as late waits left the window, and each swing
let a burst of late turns through.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TTFTTarget:
    """AIMD control of the order's slack under a time-to-first-token target.

    Invariants (:meth:`check_integrity`): ``0 <= slack_s <= target_s``; ``waits`` holds at most
    ``window`` samples.

    Attributes:
        target_s: the time-to-first-token target, seconds (> 0).
        slack_s: how far program order may move a request ahead of its arrival (starts at half
            the target).
        window: recent waits a check looks at.
        period: first admissions between two checks.
        max_late: the fraction of recent waits allowed past the target (0.01: a p99 target).
    """

    target_s: float
    slack_s: float = -1.0
    window: int = 256
    period: int = 32
    max_late: float = 0.01
    # NOTE: its own window, not the controller's T_queue samples: those age out after 60 s
    # when the pin rule reads their mean, so what a check saw would depend on tool calls.
    waits: deque[float] = field(default_factory=deque, repr=False)
    _since: int = field(default=0, repr=False)
    _late_since: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.target_s, int | float) and math.isfinite(self.target_s) and self.target_s > 0):
            raise ValueError(f"target_s: must be a positive number of seconds, got {self.target_s!r}")
        if self.slack_s < 0:
            self.slack_s = self.target_s / 2
        self.slack_s = min(self.slack_s, self.target_s)

    def record(self, wait_s: float) -> None:
        """A request was admitted for the first time after waiting ``wait_s`` seconds.

        Args:
            wait_s: its arrival -> first admission (negatives count as 0).
        """
        wait = max(0.0, float(wait_s))
        self.waits.append(wait)
        while len(self.waits) > self.window:
            self.waits.popleft()
        self._since += 1
        self._late_since += wait > self.target_s
        if self._since < self.period:
            return
        late = sum(1 for w in self.waits if w > self.target_s)
        if late <= self.max_late * len(self.waits):
            self.slack_s = min(self.target_s, self.slack_s + self.target_s / 10)
        elif self._late_since:
            # NOTE: only on new late waits: the window still holds the ones that made the last
            # check halve, and halving again for them would collapse the slack.
            self.slack_s /= 2
        self._since = self._late_since = 0

    def check_integrity(self) -> None:
        """Asserts the invariants of the class docstring."""
        assert 0.0 <= self.slack_s <= self.target_s, f"slack {self.slack_s} outside [0, {self.target_s}]"
        assert len(self.waits) <= self.window, "waits past their window"
