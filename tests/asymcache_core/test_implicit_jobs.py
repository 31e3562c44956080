"""Jobs for requests that name none: which conversation a turn continues (the table alone), and
the engine giving its requests those jobs (simulated engine: no weights)."""

from __future__ import annotations

import pytest

from asymcache_core import Engine
from asymcache_core.implicit_jobs import JOB_PREFIX, REPLY_TOKENS, ImplicitJobs
from asymcache_core.kv_cache_manager import _ROOT_HASH, chain_hash
from asymcache_core.sampling_params import SamplingParams

BS = 4


def _hashes(ids: list[int], bs: int = BS) -> list[int]:
    out, parent = [], _ROOT_HASH
    for i in range(len(ids) // bs):
        parent = chain_hash(parent, tuple(ids[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


def _finish(table: ImplicitJobs, job: str, prompt: list[int], reply: list[int]) -> None:
    table.on_finished(job, prompt + reply, len(prompt), _hashes(prompt + reply))


def _assign(table: ImplicitJobs, prompt: list[int]) -> str:
    return table.assign(prompt, _hashes(prompt))


SYSTEM = list(range(100, 130))  # a long shared system prompt


def test_a_turn_joins_the_conversation_it_continues():
    table = ImplicitJobs(BS)
    p1 = SYSTEM + [1, 2, 3]
    a = _assign(table, p1)
    assert a.startswith(JOB_PREFIX) and table.started == 1
    reply = list(range(200, 240))
    _finish(table, a, p1, reply)
    # the reply token for token, then the tool's output
    p2 = p1 + reply + [7, 7, 7, 7, 7]
    assert _assign(table, p2) == a and table.matched == 1
    # its keys went with the match: a second continuation of that turn (a fork) is a new job
    assert _assign(table, p1 + reply + [8]) != a
    table.check_integrity()


def test_a_reply_rendered_otherwise_past_its_start_still_continues_the_conversation():
    table = ImplicitJobs(BS)
    p1 = SYSTEM + [1, 2, 3]
    a = _assign(table, p1)
    reply = list(range(200, 240))
    _finish(table, a, p1, reply)
    # the template writes the reply's end another way (a tool call's JSON re-rendered)
    rendered = reply[:REPLY_TOKENS] + [9, 9, 9]
    assert _assign(table, p1 + rendered + [7, 7]) == a
    # but not when the reply's start differs: that is another conversation
    b = _assign(table, p1 + [5])
    _finish(table, b, p1 + [5], reply)
    assert _assign(table, p1 + [5] + [0] + reply[1:]) != b


def test_repeats_retries_and_lookalikes_start_jobs_of_their_own():
    table = ImplicitJobs(BS)
    p1 = SYSTEM + [1, 2, 3]
    a = _assign(table, p1)
    _finish(table, a, p1, list(range(200, 220)))
    # the same prompt again (a retry, another sample): it holds no reply
    assert _assign(table, p1) != a
    # nor when the reply was too short to fill a block of its own
    prompt = SYSTEM + [6, 6, 6]  # 33 tokens: 8 full blocks and one token
    short = _assign(table, prompt)
    _finish(table, short, prompt, [1])
    assert _assign(table, prompt) != short and _assign(table, prompt + [1, 9]) == short
    # another task that differs from the first only in its last tokens (inside the prompt's
    # last partial block), then longer
    assert _assign(table, SYSTEM + [1, 2, 4] + list(range(200, 220))) != a
    # the first conversation's next turn is still its own
    assert _assign(table, p1 + list(range(200, 220)) + [5]) == a


def test_identical_conversations_keep_apart_oldest_first():
    table = ImplicitJobs(BS)
    p1, reply = SYSTEM + [1], list(range(200, 216))
    a, b = _assign(table, p1), _assign(table, p1)
    assert a != b
    _finish(table, a, p1, reply)
    _finish(table, b, p1, reply)
    nxt = p1 + reply + [3]
    assert [_assign(table, nxt), _assign(table, nxt)] == [a, b]
    assert _assign(table, nxt) not in (a, b)  # both continued: a third is new


def test_the_table_is_bounded():
    table = ImplicitJobs(BS, max_conversations=2)
    jobs = []
    for task in range(3):
        p = SYSTEM + [task]
        jobs.append(_assign(table, p))
        _finish(table, jobs[-1], p, list(range(200, 216)))
    assert len(table) == 2
    table.check_integrity()
    assert _assign(table, SYSTEM + [0] + list(range(200, 216)) + [1]) != jobs[0]  # the oldest went
    assert _assign(table, SYSTEM + [2] + list(range(200, 216)) + [1]) == jobs[2]
    with pytest.raises(ValueError, match="^implicit jobs"):
        ImplicitJobs(0)


def test_kept_choices_of_one_turn_each_continue_the_job():
    # vLLM's n > 1: every choice of a turn keeps its keys (keep=True), sharing the prompt's
    table = ImplicitJobs(BS)
    prompt = SYSTEM + [1, 2, 3]
    job = _assign(table, prompt)
    replies = [list(range(200, 212)), list(range(300, 312)), list(range(300, 308)) + [9, 9, 9, 9]]
    for i, reply in enumerate(replies):
        table.on_finished(job, prompt + reply, len(prompt), _hashes(prompt + reply), keep=i > 0)
    table.check_integrity()
    for reply in replies:
        probe = ImplicitJobs(BS)
        probe._by_hash = {h: list(keys) for h, keys in table._by_hash.items()}
        probe._by_job = table._by_job.copy()
        assert _assign(probe, prompt + reply + [7, 7, 7, 7]) == job
        probe.check_integrity()
    # a continuation takes every choice's keys; a plain finish replaces them
    assert _assign(table, prompt + replies[1] + [7, 7, 7, 7]) == job and len(table) == 0
    _finish(table, job, prompt, replies[0])
    _finish(table, job, prompt, replies[1])
    assert _assign(table, prompt + replies[0] + [7, 7, 7, 7]) != job
    table.check_integrity()


def _turn(engine: Engine, prompt: list[int], **kw) -> tuple[str | None, list[int]]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), **kw)
    job = engine.requests[rid].job_id
    reply: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                reply = list(out.token_ids)
    return job, reply


@pytest.mark.parametrize(("policy", "overrides", "asked", "on"), [
    ("asymcache", {}, True, True),  # the agent runtime asks
    ("asymcache", {}, False, False),  # a bare engine: nothing would end the jobs
    ("vllm-apc", {}, True, False),  # vLLM's baseline knows no jobs
    ("asymcache", {"implicit_jobs": False}, True, False),
    ("vllm-apc", {"implicit_jobs": True}, False, True),
])
def test_the_engine_gives_a_conversations_turns_one_job(policy, overrides, asked, on):
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=64, block_size=BS, eviction_policy=policy,
                              **overrides)
    assert (engine.use_implicit_jobs() if asked else engine.implicit_jobs is not None) is on
    prompt = SYSTEM + [1, 2, 3]
    jobs = []
    for _ in range(3):
        job, reply = _turn(engine, prompt)
        jobs.append(job)
        prompt = prompt + reply + [7, 7, 7]
    if on:
        assert jobs[0] is not None and jobs[0].startswith(JOB_PREFIX) and len(set(jobs)) == 1
        assert len(engine.job_stats.jobs[jobs[0]].new_tokens) == 3  # three turns of one job
    else:
        assert jobs == [None] * 3
    # a job the client names is its own, and a request that says it is the last step gets none
    assert _turn(engine, prompt, job_id="mine")[0] == "mine"
    assert _turn(engine, prompt + [1], is_last_step=True)[0] is None
    engine.check_integrity()


def test_an_ended_job_leaves_the_gate_and_a_later_turn_rejoins_it_as_new():
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=64, block_size=BS, eviction_policy="asymcache")
    assert engine.use_implicit_jobs()
    prompt = SYSTEM + [1]
    job, reply = _turn(engine, prompt)
    assert job is not None and engine.job_admission is not None and job in engine.job_admission.jobs
    engine.end_job(job)
    assert job not in engine.job_admission.jobs and engine.job_admission.final_tokens[-1] >= len(prompt)
    again, _ = _turn(engine, prompt + reply + [5])
    assert again == job and job in engine.job_admission.jobs
    engine.check_integrity()


def test_implicit_jobs_are_lossless_under_pressure(smollm, short_unbounded):
    # the multi-session script (3-token answers) without job ids on the tight pool (12 blocks
    # for ~30): the engine gives each session's turns one job, and the greedy tokens are the
    # unbounded pool's
    from tests.asymcache_core.test_holes_and_policies import (
        SESSIONS,
        TURNS,
        run_script,
        short_turns,
    )
    from tests.conftest import StepClock, make_engine

    engine = make_engine(smollm, clock=StepClock(), num_kv_blocks=12, eviction_policy="asymcache")
    assert engine.use_implicit_jobs()
    assert run_script(engine, anonymous=True, params=short_turns) == short_unbounded
    assert engine.implicit_jobs.started == SESSIONS and engine.implicit_jobs.matched == SESSIONS * (TURNS - 1)
    stats = engine.stats()
    assert stats.evictions_total > 0 and stats.engine_hole_tokens_total > 0
    engine.check_integrity()


def test_the_callers_continued_job_is_taken_where_no_key_matched():
    table = ImplicitJobs(BS)
    p1 = SYSTEM + [1, 2, 3]
    a = _assign(table, p1)
    _finish(table, a, p1, list(range(200, 220)))
    # the reply rendered otherwise from its start (its thinking dropped)
    p2 = p1[:-1] + [9] + list(range(210, 220)) + [5]
    assert table.assign(p2, _hashes(p2)) != a
    assert table.assign(p2, _hashes(p2), continues=a) == a
    # taken once: a second continuation of the turn (a fork) is new, as is an unknown job
    assert table.assign(p2, _hashes(p2), continues=a) != a
    assert table.assign(p2, _hashes(p2), continues="implicit-999").startswith(JOB_PREFIX)
    # a key that matches wins over the caller's job
    b = _assign(table, SYSTEM + [4])
    _finish(table, b, SYSTEM + [4], list(range(300, 320)))
    c = _assign(table, SYSTEM + [5])
    _finish(table, c, SYSTEM + [5], list(range(400, 420)))
    nxt = SYSTEM + [4] + list(range(300, 320)) + [1]
    assert table.assign(nxt, _hashes(nxt), continues=c) == b
    table.check_integrity()
