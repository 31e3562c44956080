"""Tests of the workloads package: schema, generators, arrivals, token streams (the importers:
``test_importers.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads import (
    ClosedLoopDispatcher,
    Job,
    Trace,
    TraceError,
    Turn,
    apply_arrivals,
    burst,
    closed_loop,
    generate,
    job_token_stream,
    load_trace,
    poisson,
)

# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def swe500() -> Trace:
    return generate("swe", num_jobs=500, seed=7)


@pytest.fixture(scope="module")
def toolloop500() -> Trace:
    return generate("toolloop", num_jobs=500, seed=7)


@pytest.fixture(scope="module")
def chat500() -> Trace:
    return generate("chat", num_jobs=500, seed=7)


# ------------------------------------------------------------------------ package hygiene


def test_package_imports_nothing_from_upper_or_lower_layers() -> None:
    code = (
        "import sys, workloads, workloads.importers;"
        "bad=[m for m in sys.modules if m.split('.')[0] in "
        "('eval','agent_runtime','asymcache_core','kernels','torch')];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------------ generators


@pytest.mark.parametrize("name", ["swe", "toolloop", "chat"])
def test_generators_deterministic(name: str) -> None:
    a = generate(name, num_jobs=40, seed=3)
    b = generate(name, num_jobs=40, seed=3)
    c = generate(name, num_jobs=40, seed=4)
    assert a == b
    assert a.model_dump() == b.model_dump()
    assert [j.turns for j in a.jobs] != [j.turns for j in c.jobs]
    # Per-job streams: more jobs never change the earlier ones.
    longer = generate(name, num_jobs=60, seed=3)
    assert longer.jobs[:40] == a.jobs


def test_swe_statistics(swe500: Trace) -> None:
    s = swe500.stats()
    assert s.jobs == 500
    assert 9.5 <= s.mean_turns <= 12.5
    assert s.max_turns <= 50
    assert s.p95_turns > 1.6 * s.mean_turns  # heavy tail
    assert s.shared_prefix_groups == 1
    assert 1500 <= swe500.jobs[0].shared_prefix_tokens <= 2000
    for job in swe500.jobs:
        assert job.kind == "swe"
        assert 300 <= job.turns[0].input_tokens <= 800  # task prompt
        assert job.turns[-1].tool is None
        for turn in job.turns[1:]:
            assert 50 <= turn.input_tokens <= 4000  # tool outputs, unscaled
        for turn in job.turns:
            assert 50 <= turn.output_tokens <= 300
        assert all(t.tool is not None for t in job.turns[:-1])
    assert set(s.tools) == {"bash", "read_file", "edit_file", "run_tests", "search"}
    durations: dict[str, list[float]] = {}
    for job in swe500.jobs:
        for t in job.turns[:-1]:
            durations.setdefault(t.tool or "", []).append(t.tool_duration_s)
    assert np.median(durations["run_tests"]) > 2.0  # seconds
    assert np.median(durations["read_file"]) < 0.1  # tens of ms
    assert np.median(durations["run_tests"]) > 50 * np.median(durations["read_file"])


def test_toolloop_statistics(toolloop500: Trace) -> None:
    s = toolloop500.stats()
    assert 5.5 <= s.mean_turns <= 7.1  # Continuum BFCL: 6.3
    assert s.max_turns <= 30
    assert s.shared_prefix_groups > 1
    for job in toolloop500.jobs:
        for turn in job.turns[:-1]:
            assert turn.tool is not None
            assert 0.01 <= turn.tool_duration_s <= 0.3
        for turn in job.turns[1:]:
            assert turn.input_tokens <= 400
    assert s.mean_input_tokens < 150


def test_chat_statistics(chat500: Trace) -> None:
    s = chat500.stats()
    assert 3.0 <= s.mean_turns <= 4.2
    assert s.tool_calls == 0
    assert 7.0 <= s.mean_think_time_s <= 13.0  # exponential, mean 10
    for job in chat500.jobs:
        assert job.turns[-1].think_time_s == 0.0
        for turn in job.turns:
            assert 20 <= turn.input_tokens <= 300
            assert 50 <= turn.output_tokens <= 400
            assert turn.tool is None
    fast = generate("chat", num_jobs=200, seed=7, think_time_mean_s=1.0)
    assert fast.stats().mean_think_time_s < 1.5


def test_token_and_time_scale() -> None:
    small = generate("swe", num_jobs=100, seed=1, token_scale=0.05, time_scale=0.1)
    full = generate("swe", num_jobs=100, seed=1)
    assert [j.num_turns for j in small.jobs] == [j.num_turns for j in full.jobs]
    s_small, s_full = small.stats(), full.stats()
    assert s_small.mean_input_tokens < 0.1 * s_full.mean_input_tokens
    for job in small.jobs:
        assert job.shared_prefix_tokens == 90
        for turn in job.turns:
            assert turn.input_tokens >= 4 and turn.output_tokens >= 2
    assert s_small.mean_tool_duration_s == pytest.approx(0.1 * s_full.mean_tool_duration_s)


def test_generate_errors() -> None:
    with pytest.raises(ValueError, match="nosuch"):
        generate("nosuch", 5, 0)
    with pytest.raises(ValueError, match="'swe'.*bogus"):
        generate("swe", 5, 0, bogus=1)
    with pytest.raises(ValueError, match="token_scale"):
        generate("chat", 5, 0, token_scale=0)
    # List values (JSON / CLI) become tuples.
    t = generate("swe", 5, 0, task_tokens=[10, 20])
    assert all(10 <= j.turns[0].input_tokens <= 20 for j in t.jobs)


# ------------------------------------------------------------------------ schema and JSONL


def test_jsonl_round_trip(tmp_path: Path, toolloop500: Trace) -> None:
    trace = poisson(toolloop500.head(50), rate=2.0, seed=1)
    path = tmp_path / "sub" / "t.jsonl"
    trace.save_jsonl(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 51 and "trace" in json.loads(lines[0])
    back = Trace.load_jsonl(path)
    assert back == trace
    assert load_trace(f"trace:{path}") == trace
    assert len(load_trace(f"trace:{path}", num_jobs=5)) == 5


def test_jsonl_without_header_and_with_text(tmp_path: Path) -> None:
    job = Job(
        job_id="a",
        turns=[Turn(input_tokens=3, input_text="hi", input_token_ids=[5, 6, 7], output_tokens=2)],
    )
    path = tmp_path / "plain.jsonl"
    path.write_text("\n" + job.model_dump_json() + "\n\n")
    back = Trace.load_jsonl(path)
    assert back.name == "plain" and back.jobs == [job]


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "invalid JSON"),
        ('{"job_id": "x", "turns": []}', "invalid job"),
        ('{"job_id": "x", "turns": [{"input_tokens": -1, "output_tokens": 1}]}', "invalid job"),
        (
            '{"job_id": "x", "turns": [{"input_tokens": 1, "output_tokens": 1, "tool": "a"}]}',
            "last turn",
        ),
        ("[1, 2]", "expected a JSON object"),
        # counts that are no integers were coerced ("20", 1.5 cut, true as 1); an infinite arrival taken
        ('{"job_id": "x", "turns": [{"input_tokens": "20", "output_tokens": 1}]}', "invalid job"),
        ('{"job_id": "x", "turns": [{"input_tokens": 1.5, "output_tokens": 1}]}', "invalid job"),
        ('{"job_id": "x", "turns": [{"input_tokens": 1, "output_tokens": true}]}', "invalid job"),
        ('{"job_id": "x", "arrival_s": 1e400, "turns": [{"input_tokens": 1, "output_tokens": 1}]}', "invalid job"),
    ],
)
def test_malformed_trace_names_line(tmp_path: Path, bad: str, needle: str) -> None:
    good = generate("chat", 2, 0)
    path = tmp_path / "bad.jsonl"
    good.save_jsonl(path)
    with path.open("a") as f:
        f.write(bad + "\n")
    with pytest.raises(TraceError, match=needle) as exc:
        Trace.load_jsonl(path)
    assert f"{path}:4" in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_trace_errors_on_missing_and_duplicates(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        Trace.load_jsonl(tmp_path / "missing.jsonl")
    job = generate("chat", 1, 0).jobs[0].model_dump_json()
    path = tmp_path / "dup.jsonl"
    path.write_text(job + "\n" + job + "\n")
    with pytest.raises(TraceError, match="duplicate job_id"):
        Trace.load_jsonl(path)


def test_job_helpers() -> None:
    job = Job(
        job_id="j",
        shared_prefix_id="p",
        shared_prefix_tokens=10,
        system_tokens=5,
        turns=[
            Turn(input_tokens=3, output_tokens=4, tool="bash", tool_duration_s=1.5),
            Turn(input_tokens=6, output_tokens=7, think_time_s=2.0),
            Turn(input_tokens=8, output_tokens=9, think_time_s=99.0),
        ],
    )
    assert job.first_prompt_tokens == 18
    assert job.context_tokens_before(0) == 18
    assert job.context_tokens_before(2) == 18 + 4 + 6 + 7 + 8
    assert job.total_tokens == 15 + 3 + 4 + 6 + 7 + 8 + 9
    assert [job.pause_after(i) for i in range(3)] == [1.5, 2.0, 0.0]
    with pytest.raises(ValueError):
        Turn(input_tokens=2, input_token_ids=[1], output_tokens=1)
    with pytest.raises(ValueError):
        Job(job_id="x", shared_prefix_tokens=3, turns=[Turn(input_tokens=1, output_tokens=1)])


# ------------------------------------------------------------------------ token streams


def test_token_stream_shares_prefix_exactly(swe500: Trace, toolloop500: Trace) -> None:
    vocab = 1000
    a, b = swe500.jobs[0], swe500.jobs[1]
    sa = job_token_stream(a, vocab, seed=0)
    sb = job_token_stream(b, vocab, seed=0)
    p = a.shared_prefix_tokens
    assert sa[0][:p] == sb[0][:p]
    assert sa[0][p:] != sb[0][p:]
    assert [len(x) for x in sa] == [a.first_prompt_tokens] + [t.input_tokens for t in a.turns[1:]]
    assert all(16 <= t < vocab for part in sa for t in part)
    assert job_token_stream(a, vocab, seed=0) == sa  # deterministic
    assert job_token_stream(a, vocab, seed=1)[0][:p] != sa[0][:p]
    # Different shared_prefix_id -> different prefix.
    by_set: dict[str, Job] = {}
    for job in toolloop500.jobs:
        by_set.setdefault(job.shared_prefix_id or "", job)
    (j1, j2) = list(by_set.values())[:2]
    s1, s2 = job_token_stream(j1, vocab), job_token_stream(j2, vocab)
    n = min(j1.shared_prefix_tokens, j2.shared_prefix_tokens)
    assert s1[0][:n] != s2[0][:n]


def test_token_stream_range_and_explicit_ids() -> None:
    job = Job(
        job_id="x",
        turns=[
            Turn(input_tokens=50, output_tokens=1, tool="t"),
            Turn(input_tokens=3, input_token_ids=[1, 2, 3], output_tokens=1),
        ],
    )
    s = job_token_stream(job, 100, reserved=40, high=60)
    assert all(40 <= t < 60 for t in s[0])
    assert s[1] == [1, 2, 3]
    with pytest.raises(ValueError):
        job_token_stream(job, 100, reserved=60, high=60)
    with pytest.raises(ValueError):
        job_token_stream(job, 100, high=200)


@settings(max_examples=30, deadline=None)
@given(
    common=st.lists(st.integers(0, 50), min_size=0, max_size=4),
    tail_a=st.lists(st.integers(51, 99), min_size=1, max_size=3),
    tail_b=st.lists(st.integers(100, 150), min_size=1, max_size=3),
    block=st.sampled_from([4, 16]),
)
def test_token_stream_block_hashes(
    common: list[int], tail_a: list[int], tail_b: list[int], block: int
) -> None:
    def mk(jid: str, hashes: list[int]) -> Job:
        return Job(
            job_id=jid,
            turns=[Turn(input_tokens=len(hashes) * block, output_tokens=1)],
            block_hash_ids=hashes,
            block_hash_size=block,
        )

    a = job_token_stream(mk("a", common + tail_a), 5000)[0]
    b = job_token_stream(mk("b", common + tail_b), 5000)[0]
    shared = len(common) * block
    assert a[:shared] == b[:shared]
    assert a[shared : shared + block] != b[shared : shared + block]


# ------------------------------------------------------------------------ arrivals


def test_poisson_arrivals(chat500: Trace) -> None:
    t = poisson(chat500, rate=4.0, seed=11)
    times = np.array([j.arrival_s for j in t.jobs])
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.15)
    assert t.arrival.kind == "poisson" and t.arrival.rate == 4.0
    assert poisson(chat500, 4.0, seed=11) == t
    assert poisson(chat500, 4.0, seed=12) != t
    assert all(j.arrival_s == 0 for j in chat500.jobs)  # input untouched
    assert t.closed_loop_concurrency is None
    with pytest.raises(ValueError):
        poisson(chat500, 0.0)


def test_burst_arrivals() -> None:
    t = burst(generate("toolloop", 10, 0), burst_size=4, interval_s=30.0, start_s=5.0)
    assert [j.arrival_s for j in t.jobs] == [5.0] * 4 + [35.0] * 4 + [65.0] * 2
    assert t.arrival.burst_size == 4
    assert apply_arrivals(generate("toolloop", 10, 0), "burst:4x30") == burst(
        generate("toolloop", 10, 0), 4, 30.0
    )


def test_closed_loop_dispatcher(tmp_path: Path) -> None:
    t = closed_loop(generate("swe", 7, 0), concurrency=3)
    assert t.closed_loop_concurrency == 3
    assert all(j.arrival_s == 0 for j in t.jobs)
    path = tmp_path / "cl.jsonl"
    t.save_jsonl(path)
    assert Trace.load_jsonl(path).closed_loop_concurrency == 3

    d = ClosedLoopDispatcher.from_trace(t)
    first = d.start()
    assert [j.job_id for j in first] == [j.job_id for j in t.jobs[:3]]
    assert d.in_flight == 3 and d.remaining == 4
    started = [j.job_id for j in first]
    now = 0.0
    in_flight = list(first)
    while in_flight:
        now += 1.0
        done = in_flight.pop(0)
        nxt = d.on_job_done(done.job_id, now)
        if nxt is not None:
            assert nxt.arrival_s == now
            started.append(nxt.job_id)
            in_flight.append(nxt)
        assert d.in_flight <= 3
    assert started == [j.job_id for j in t.jobs]
    assert d.finished
    with pytest.raises(KeyError):
        d.on_job_done(t.jobs[0].job_id, now)
    with pytest.raises(ValueError, match="not closed-loop"):
        ClosedLoopDispatcher.from_trace(generate("swe", 2, 0))
    assert apply_arrivals(generate("swe", 7, 0), "closed:3") == t


def test_apply_arrivals_errors() -> None:
    t = generate("chat", 3, 0)
    for spec in ["poisson:", "poisson:-1", "burst:3", "closed:0", "weird", "zero:1"]:
        with pytest.raises(ValueError):
            apply_arrivals(t, spec)
    assert apply_arrivals(t, "trace") is t
