"""The replicas' routing decisions as pure functions (no Ray): keys, affinity, balance, moves."""

from __future__ import annotations

import json

import pytest

from agent_runtime.server.job_router import (
    PREFIX_CHARS,
    AffinityTable,
    ReplicaLoad,
    RoutingPolicy,
    affinity_digest,
    needs_home,
    rank_for_new,
    response_digest,
    route,
    routing_key,
)
from agent_runtime.server.response_store import chain_digest, new_response_id

POLICY = RoutingPolicy()


def _conversation(task: str, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": task}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"step {i}"}, {"role": "tool", "content": f"out {i}"}]
    return messages


def test_key_is_the_job_id_else_the_conversation_prefix():
    assert routing_key({"job_id": "j-1", "messages": _conversation("a", 0)}) == "job:j-1"
    assert routing_key(json.dumps({"job_id": "j-1"}).encode()) == "job:j-1"
    # the turns of one conversation share a key; another task has another
    first = routing_key({"messages": _conversation("fix the bug", 0)})
    later = routing_key({"messages": _conversation("fix the bug", 3)})
    other = routing_key({"messages": _conversation("write the docs", 3)})
    assert first is not None and first.startswith("prefix:")
    assert first == later != other
    # text prompts: the head decides; token prompts too
    head = "x" * PREFIX_CHARS
    assert routing_key({"prompt": head + "turn 1"}) == routing_key({"prompt": head + "turn 2"})
    assert routing_key({"prompt": "short a"}) != routing_key({"prompt": "short b"})
    assert routing_key({"prompt": [1, 2, 3]}) == routing_key({"prompt": [1, 2, 3]}) != routing_key({"prompt": [1, 2]})
    # the Responses API: the instructions and the first input items, as a chat's first messages
    items = _conversation("fix the bug", 3)[1:]
    turn1 = routing_key({"instructions": "You are an agent.", "input": items[:1]})
    turn3 = routing_key({"instructions": "You are an agent.", "input": [*items, {"type": "function_call_output",
                                                                                "call_id": "c", "output": "x"}]})
    assert turn1 == turn3 != routing_key({"instructions": "Another agent.", "input": items})
    assert routing_key({"input": "fix the bug"}) != routing_key({"input": "write the docs"})
    # a job named the vLLM ways (vllm_xargs, session_id) is the job a replica reads
    assert routing_key({"vllm_xargs": {"job_id": "j-2"}, "messages": _conversation("a", 0)}) == "job:j-2"
    assert routing_key({"vllm_xargs": {"job_id": 7}}) == "job:7"
    assert routing_key({"session_id": "s-1", "messages": _conversation("a", 0)}) == "job:s-1"
    assert routing_key({"job_id": "j-1", "vllm_xargs": {"job_id": "j-2"}, "session_id": "s"}) == "job:j-1"
    # a conversation without a system message keeps its key once replies join it (its first user
    # turn decides), and Anthropic's top-level system prompt counts
    user = {"role": "user", "content": "fix the bug"}
    turns = [[user], [user, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]]
    assert routing_key({"messages": turns[0]}) == routing_key({"messages": turns[1]})
    assert routing_key({"system": "A", "messages": turns[0]}) == routing_key({"system": "A", "messages": turns[1]})
    assert routing_key({"system": "A", "messages": turns[0]}) != routing_key({"system": "B", "messages": turns[0]})
    # a body nested past the JSON decoder's depth is no key, not an error
    assert routing_key(b"[" * 100_000 + b"]" * 100_000) is None
    # nothing to key on
    for body in (b"not json", b"[1, 2]", {"model": "m"}, {"job_id": "", "messages": []}, {"prompt": ""}, {"input": []}):
        assert routing_key(body) is None, body


def test_new_jobs_go_to_the_shortest_queue_then_the_most_free_kv_then_the_fewest_jobs():
    loads = [ReplicaLoad("a", 3, 100), ReplicaLoad("b", 1, 10), ReplicaLoad("c", 1, 50)]
    assert rank_for_new(loads) == ["c", "b", "a"]
    table = AffinityTable()
    table.assign("job:1", "x")
    idle = [ReplicaLoad("x", 0, 64), ReplicaLoad("y", 0, 64)]
    assert rank_for_new(idle, table) == ["y", "x"]  # a tie: the replica with fewer jobs
    decision = route("job:new", idle, table, POLICY)
    assert decision.reason == "new" and decision.order == ("y", "x")
    assert route(None, idle, table, POLICY).reason == "new"
    assert route("job:1", [], table, POLICY).reason == "no_replica"


def test_a_job_stays_on_its_replica_until_that_replica_is_overloaded_or_gone():
    table = AffinityTable()
    table.assign("job:1", "a")
    # busier than the other, but not overloaded: it stays (its KV is there)
    loads = [ReplicaLoad("a", 6, 0), ReplicaLoad("b", 1, 500)]
    decision = route("job:1", loads, table, POLICY)
    assert decision.reason == "affinity" and decision.order == ("a", "b")
    # overloaded: queue beyond 2 x 1 + 4
    loads = [ReplicaLoad("a", 7, 0), ReplicaLoad("b", 1, 500)]
    decision = route("job:1", loads, table, POLICY)
    assert decision.reason == "overloaded" and decision.order == ("b", "a")
    # the threshold is the policy's
    assert route("job:1", loads, table, RoutingPolicy(overload_factor=3.0)).reason == "affinity"
    # its replica died (or was replaced): routed as new
    decision = route("job:1", [ReplicaLoad("b", 5), ReplicaLoad("c", 0)], table, POLICY)
    assert decision.reason == "replica_gone" and decision.order == ("c", "b")
    # the least loaded replica is never "overloaded" against itself
    assert route("job:1", [ReplicaLoad("a", 50)], table, POLICY).order == ("a",)


def test_route_does_not_write_the_table():
    table = AffinityTable()
    route("job:1", [ReplicaLoad("a")], table, POLICY)
    assert len(table) == 0


def test_the_affinity_table_is_bounded_lru():
    table = AffinityTable(max_jobs=3)
    for i in range(3):
        table.assign(f"k{i}", "a" if i < 2 else "b")
    assert table.get("k0") == "a"  # k0 is now the most recent
    table.assign("k3", "b")
    assert len(table) == 3 and table.get("k1") is None and table.get("k0") == "a"
    assert (table.jobs_on("a"), table.jobs_on("b")) == (1, 2)
    table.assign("k0", "b")  # a job that moved
    assert (table.jobs_on("a"), table.jobs_on("b")) == (0, 3)
    for i in range(1000):
        table.assign(f"many{i}", "c")
    assert len(table) == 3 and table.jobs_on("c") == 3 and table.jobs_on("b") == 0
    table.forget_replicas(["a"])
    # the gone replica's keys stay (their next request is a "replica_gone" move), uncounted
    assert len(table) == 3 and table.jobs_on("c") == 0 and table.get("many999") == "c"
    assert route("many999", [ReplicaLoad("a")], table, POLICY).reason == "replica_gone"
    table.assign("many999", "a")
    assert (len(table), table.jobs_on("a"), table.jobs_on("c")) == (3, 1, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"overload_factor": 0.5}, "overload_factor"), ({"overload_margin": -1}, "overload_margin"),
     ({"max_jobs": 0}, "max_jobs")],
)
def test_bad_policies_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        RoutingPolicy(**kwargs)


def test_a_stored_responses_chain_keeps_its_first_requests_home():
    """Response ids carry the affinity digest of the key their chain began with, so the turns
    that continue them (and reads of them) find the same entry of the table, whichever key
    began the chain."""
    for first_key in (routing_key({"instructions": "You are an agent.", "input": "fix the bug"}),
                      routing_key({"job_id": "j-7", "input": "fix the bug"})):
        assert first_key is not None
        resp = new_response_id(chain_digest(first_key))
        assert resp.startswith("resp_") and response_digest(resp) == affinity_digest(first_key)
        later = routing_key({"previous_response_id": resp, "input": [{"type": "function_call_output"}]})
        assert later is not None and affinity_digest(later) == affinity_digest(first_key)
        # continuations and reads need that home; a job key in the body keys the continuation
        # as before, but its home is still the stored response's
        assert needs_home("POST", "/v1/responses", json.dumps({"previous_response_id": resp}).encode()) == later
        assert needs_home("GET", f"/v1/responses/{resp}", None) == later
        assert needs_home("DELETE", f"/v1/responses/{resp}", None) == later
        assert routing_key({"job_id": "j-7", "previous_response_id": resp}) == "job:j-7"
    # nothing else needs a home: fresh requests, other paths, ids not of this server
    assert needs_home("POST", "/v1/responses", {"input": "hi"}) is None
    assert needs_home("POST", "/v1/chat/completions", {"previous_response_id": resp}) is None
    assert needs_home("GET", "/v1/responses/resp_1", None) is None
    assert needs_home("POST", "/v1/responses", b"not json") is None
    assert response_digest("resp_" + "g" * 48) is None and response_digest(7) is None
    assert chain_digest(None) != chain_digest(None)  # no key: a chain of its own


def test_a_request_that_needs_its_home_stays_there_however_loaded():
    table = AffinityTable()
    table.assign("d", "a")
    loads = [ReplicaLoad("a", 40, 0), ReplicaLoad("b", 0, 100)]
    assert route("d", loads, table, POLICY).reason == "overloaded"
    decision = route("d", loads, table, POLICY, home_only=True)
    assert decision.reason == "affinity" and decision.order[0] == "a"
    # a home that is gone is gone: the request goes where a new job would (and finds nothing)
    assert route("d", loads[1:], table, POLICY, home_only=True).reason == "replica_gone"
