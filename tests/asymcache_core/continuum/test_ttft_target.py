"""The AIMD control of program order's slack under a TTFT target."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.continuum.ttft_target import TTFTTarget


def _feed(target: TTFTTarget, waits: list[float]) -> None:
    for wait in waits:
        target.record(wait)
        target.check_integrity()


def test_starts_at_half_the_target() -> None:
    assert TTFTTarget(10.0).slack_s == 5.0
    assert TTFTTarget(10.0, slack_s=30.0).slack_s == 10.0  # never past the target
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^target_s:"):
            TTFTTarget(bad)


def test_the_slack_grows_to_the_target_while_waits_stay_within_it() -> None:
    target = TTFTTarget(10.0, period=4)
    _feed(target, [1.0] * 4)
    assert target.slack_s == pytest.approx(6.0)  # + a tenth of the target per period
    _feed(target, [1.0] * 3)
    assert target.slack_s == pytest.approx(6.0)  # checks come once a period
    _feed(target, [1.0] * 100)
    assert target.slack_s == 10.0


def test_the_slack_halves_on_late_waits_but_not_again_for_the_same_ones() -> None:
    target = TTFTTarget(10.0, period=4, window=8, max_late=0.01)
    _feed(target, [1.0, 1.0, 1.0, 12.0])  # one of four past the target
    assert target.slack_s == pytest.approx(2.5)
    # the late wait is still in the window, but no new one came: nothing moves
    _feed(target, [1.0] * 4)
    assert target.slack_s == pytest.approx(2.5)
    # once it leaves the window the slack grows again
    _feed(target, [1.0] * 4)
    assert target.slack_s == pytest.approx(3.5)
    _feed(target, [11.0] + [1.0] * 3)
    assert target.slack_s == pytest.approx(1.75)


def test_a_target_arrival_order_cannot_meet_drives_it_to_arrival_order() -> None:
    target = TTFTTarget(2.0, period=8)
    _feed(target, [5.0] * 400)
    assert target.slack_s < 1e-6
    _feed(target, [0.5] * 256)  # once waits are back within it, program order returns
    assert target.slack_s > 0.0


@settings(max_examples=60, deadline=None)
@given(
    seconds=st.floats(0.01, 100.0),
    waits=st.lists(st.floats(-5.0, 500.0), max_size=300),
    period=st.integers(1, 40),
    window=st.integers(1, 64),
)
def test_the_slack_stays_in_range(seconds: float, waits: list[float], period: int, window: int) -> None:
    target = TTFTTarget(seconds, period=period, window=window)
    _feed(target, waits)
    assert len(target.waits) == min(len(waits), window)
