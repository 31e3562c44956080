"""The client-latency benchmark's metric computation on synthetic timestamps (no server, no model)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "client_latency_metrics.py"
_SPEC = importlib.util.spec_from_file_location("client_latency_metrics", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
# NOTE: dataclasses look their module up in sys.modules while the class is built.
sys.modules[_SPEC.name] = bench
_SPEC.loader.exec_module(bench)


def test_summarize_interpolates_percentiles() -> None:
    s = bench.summarize([float(x) for x in range(1, 102)])  # 1..101
    assert s["n"] == 101 and s["mean"] == pytest.approx(51.0)
    assert s["p50"] == pytest.approx(51.0) and s["p90"] == pytest.approx(91.0) and s["p99"] == pytest.approx(100.0)
    assert bench.summarize([0.0, 1.0])["p90"] == pytest.approx(0.9)
    empty = bench.summarize([])
    assert empty["n"] == 0 and math.isnan(empty["p99"])


def test_compare_separates_engine_time_from_what_the_server_adds() -> None:
    # engine: arrives 10 ms after the send, first token 100 ms later, then one token every 50 ms;
    # the client receives each token 5 ms after it was sampled (the last one 25 ms after)
    engine = {"a": bench.EngineRecord(1.010, 1.110, [1.110, 1.160, 1.210], received=1.002, submitted=1.006),
              "b": bench.EngineRecord(2.020, 2.220, [2.220, 2.270])}
    clients = [bench.ClientRecord("a", 1.000, [1.115, 1.165, 1.235], 200, written=1.001),
               # one chunk carried two tokens: counted, but not paired token by token
               bench.ClientRecord("b", 2.000, [2.230], 200),
               bench.ClientRecord("lost", 3.000, [3.5], 200),      # no engine record
               bench.ClientRecord("a", 4.000, [], 429)]            # rejected: left out
    r = bench.compare(clients, engine)
    assert (r["requests"], r["paired_requests"], r["unmatched"]) == (2, 1, 1)
    assert r["client_ttft"]["n"] == 2 and r["client_ttft"]["mean"] == pytest.approx((0.115 + 0.230) / 2)
    assert r["engine_ttft"]["mean"] == pytest.approx((0.100 + 0.200) / 2)
    assert r["before_engine"]["mean"] == pytest.approx(0.015)
    assert r["first_delivery"]["mean"] == pytest.approx(0.0075)
    # the server's own stamps split the way in (only where it stamped them)
    assert r["to_app"]["n"] == 1 and r["to_app"]["mean"] == pytest.approx(0.002)
    # a: TTFT 0.114 from the written request, engine 0.100; b (not written-stamped): 0.230 - 0.200
    assert r["server_ttft"]["mean"] == pytest.approx((0.014 + 0.030) / 2)
    assert r["client_write"]["mean"] == pytest.approx(0.001) and r["written_to_app"]["mean"] == pytest.approx(0.001)
    assert r["app_to_submit"]["mean"] == pytest.approx(0.004) and r["submit_to_arrival"]["mean"] == pytest.approx(0.004)
    assert r["client_itl"]["n"] == 2
    assert r["client_itl"]["mean"] == pytest.approx((0.050 + 0.070) / 2)
    assert r["engine_itl"]["n"] == 3 and r["engine_itl"]["mean"] == pytest.approx(0.050)
    assert r["token_delivery"]["n"] == 3
    assert r["token_delivery"]["mean"] == pytest.approx((0.005 + 0.005 + 0.025) / 3)
    share = bench.server_share(r)
    assert share["itl_mean_share"] == pytest.approx((0.060 - 0.050) / 0.060)
    assert share["delivery_share"] == pytest.approx((0.035 / 3) / 0.060)
    assert share["step_s"] == pytest.approx(0.050)
    assert share["server_ttft_p99"] == pytest.approx(0.014 + 0.99 * 0.016)
    rows = bench.markdown_rows(16, r)
    assert len(rows) == 15 and rows[0].startswith("| 16 | TTFT, client | 172.5 |")


def test_step_summary_reports_durations_and_the_gaps_between_steps() -> None:
    steps = [[0.0, 0.100, 64, 4], [0.102, 0.100, 4, 4], [0.206, 0.050, 4, 4], [5.0, 0.1, 1, 1]]
    s = bench.step_summary(steps)
    assert s["steps"] == 4 and s["duration"]["mean"] == pytest.approx(0.0875)
    # 2 ms and 4 ms between steps; the 4.7 s pause (idle) is not overhead
    assert s["gap"]["n"] == 2 and s["gap"]["mean"] == pytest.approx(0.003)
