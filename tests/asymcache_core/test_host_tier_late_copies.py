"""Host-tier reloads that land steps after they were issued, as on a GPU's copy stream.

On the CPU the host tier's copies run when they are issued; on CUDA a reload lands later, and
only a request whose ticket is complete may read its blocks. Here the runner's copy manager is
replaced, on one engine, by one that lands a reload two tickets after it was issued (or when
waited on) and says so through ``is_complete``, the CUDA path's contract; the forward pass does
not wait for reloads, as on CUDA. A request admitted while another one's reload of the blocks
it hits is in flight must wait for that reload: its greedy tokens equal an unbounded pool's.
"""

from __future__ import annotations

from typing import Any

from asymcache_core import SamplingParams
from asymcache_core.host_tier import KVTransfers
from asymcache_core.request import Request
from tests.conftest import make_engine

SHARED = list(range(300, 364))  # four blocks of 16 tokens
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _user(session: int) -> list[int]:
    return [1000 + 97 * session + i for i in range(20)]


def _land_copies_late(engine: Any) -> dict[int, list[tuple[int, int]]]:
    """Makes ``engine``'s host copies land like a GPU copy stream's; returns the reloads not
    landed yet, by ticket."""
    cache = engine.runner.host_cache
    copy_now = cache._copy_cpu
    pending: dict[int, list[tuple[int, int]]] = {}

    def land(ticket: int) -> None:
        reloads = pending.pop(ticket, None)
        if reloads:
            copy_now(KVTransfers(ticket, [], reloads, None, None))

    def issue(transfers: KVTransfers) -> None:
        for ticket in sorted(t for t in pending if t <= transfers.ticket - 2):
            land(ticket)
        if transfers.offloads:
            copy_now(transfers._replace(reloads=[]))
        if transfers.reloads:
            pending[transfers.ticket] = list(transfers.reloads)

    def wait_all() -> None:
        for ticket in sorted(pending):
            land(ticket)

    cache.issue = issue
    cache.is_complete = lambda ticket: ticket not in pending
    cache.wait = land
    cache.wait_all = wait_all
    return pending


def test_a_request_hitting_blocks_still_being_reloaded_waits_for_them(smollm) -> None:
    first, second, other = SHARED + _user(1), SHARED + _user(2), list(range(9000, 9030))
    reference = make_engine(smollm, batch_invariant=True, num_kv_blocks=512)
    expected = {rid: reference.generate([prompt], PARAMS)[0].token_ids for rid, prompt in (("R", first), ("B", second))}

    engine = make_engine(smollm, batch_invariant=True, num_kv_blocks=14, eviction_policy="vllm-apc",
                         num_host_kv_blocks=40)
    pending = _land_copies_late(engine)
    # the shared prefix goes to the host: later prompts fill the 14-block pool
    engine.generate([SHARED + _user(0)], PARAMS)
    for k in range(3):
        engine.generate([list(range(5000 + 200 * k, 5180 + 200 * k))], PARAMS)
    hashes = engine.kv.ensure_hashes(Request("probe", first, PARAMS, 0.0))[:4]
    assert all(engine.pool.lookup(h) is None and engine.host_tier.lookup(h) is not None for h in hashes)

    outputs: dict[str, list[int]] = {}

    def step() -> None:
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})

    engine.add_request(other, SamplingParams(max_tokens=30, ignore_eos=True), request_id="C")
    step()  # a long decode keeps every later step busy
    engine.add_request(first, PARAMS, request_id="R")
    step()  # R's reload of the shared prefix is planned and issued, not landed
    ticket = engine.requests["R"].kv_ticket
    assert ticket is not None and ticket in pending
    reloading = {block for _, block in pending[ticket]}
    assert reloading and all(engine.kv.loading.get(b) == ticket for b in reloading)
    engine.add_request(second, PARAMS, request_id="B")
    step()  # B hits the blocks R is reloading: it waits for the same copies
    assert ticket in pending and engine.requests["B"].kv_ticket == ticket
    while engine.has_unfinished():
        step()
    engine.check_integrity()
    assert {rid: outputs[rid] for rid in expected} == expected
