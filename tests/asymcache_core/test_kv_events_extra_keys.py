"""KV events carry a block's extra hash keys (vLLM's ``BlockStored.extra_keys``): a router that
rebuilds block identities from ``token_ids`` tells a ``cache_salt`` chain from an unsalted one
of the same tokens, on both tiers (the device pool's stores and the host tier's copies)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.kv_cache_manager import _ROOT_HASH, chain_hash, salted_root
from asymcache_core.kv_events import END_SEQ

# NOTE: the kv-events extra (make install has it); machines without it skip this module.
msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

BLOCK = 4
#: vLLM's array layout of a ``BlockStored`` (tag first, then its fields in declaration order)
STORED_FIELDS = (
    "tag",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def _replay_all(ctx: zmq.Context, replay_endpoint: str) -> list[list[Any]]:
    """Every event the engine published, in order, read as a late subscriber reads them: a replay
    from sequence number 0, each payload decoded with plain msgpack."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    events: list[list[Any]] = []
    try:
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            _, seq_bytes, payload = dealer.recv_multipart()
            if int.from_bytes(seq_bytes, "big", signed=True) == END_SEQ:
                return events
            _ts, batch_events, _rank = msgpack.unpackb(payload)
            events.extend(batch_events)
    finally:
        dealer.close(linger=0)


def _run(engine: Engine, prompt: list[int], job: str, cache_salt: str | None) -> None:
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=2, cache_salt=cache_salt), job_id=job
    )
    for _ in range(1000):
        if any(o.request_id == rid and o.finished for o in engine.step()):
            return
    raise AssertionError("request did not finish")


def _stored(events: list[list[Any]], medium: str) -> list[dict[str, Any]]:
    """The ``BlockStored`` events of one medium as field name -> value (the layout checked)."""
    stored = []
    for event in events:
        if event[0] == "BlockStored":
            assert len(event) == len(STORED_FIELDS), f"BlockStored layout: {event!r}"
            fields = dict(zip(STORED_FIELDS, event, strict=True))
            if fields["medium"] == medium:
                stored.append(fields)
    return stored


def _blocks(stored: list[dict[str, Any]]) -> dict[int, tuple[tuple[int, ...], Any]]:
    """Block hash -> (its tokens, its extra keys), checking that each hash is what a router
    recomputes from the parent, the tokens and the extra keys alone."""
    blocks = {}
    for event in stored:
        hashes, extra_keys = event["block_hashes"], event["extra_keys"]
        # one entry per block
        assert isinstance(extra_keys, list) and len(extra_keys) == len(hashes)
        assert (
            event["lora_id"] is None and event["lora_name"] is None and event["block_size"] == BLOCK
        )
        parent = event["parent_block_hash"]
        for i, (block_hash, keys) in enumerate(zip(hashes, extra_keys, strict=True)):
            tokens = tuple(event["token_ids"][i * BLOCK : (i + 1) * BLOCK])
            if parent is None:  # a chain's first block: the salt, if any, is its only extra key
                root = _ROOT_HASH if keys is None else salted_root(keys[0])
            else:
                assert keys is None  # vLLM puts the salt on the first block only
                root = parent
            assert chain_hash(root, tokens) == block_hash
            blocks[block_hash] = (tokens, None if keys is None else tuple(keys))
            parent = block_hash
    return blocks


def test_salted_and_unsalted_chains_of_the_same_tokens_are_told_apart(ctx):
    engine = Engine.simulated(
        model="dummy:tiny",
        num_kv_blocks=16,
        block_size=BLOCK,
        kv_events_config=json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://127.0.0.1:0",
            }
        ),
    )
    prompt = list(range(100, 113))  # 3 full blocks and one token
    try:
        _run(engine, prompt, "plain", None)
        _run(engine, prompt, "tenant-a", "tenant-a")
        events = _replay_all(ctx, engine.kv_events.publisher.replay_endpoint)
    finally:
        engine.close()
    blocks = _blocks(_stored(events, "GPU"))
    by_tokens: dict[tuple[int, ...], set[Any]] = {}
    for tokens, keys in blocks.values():
        by_tokens.setdefault(tokens, set()).add(keys)
    first = tuple(prompt[:BLOCK])
    assert by_tokens[first] == {None, ("tenant-a",)}  # the same tokens, two identities
    salted = [h for h, (tokens, keys) in blocks.items() if keys == ("tenant-a",)]
    assert len(salted) == 1 and salted[0] == chain_hash(salted_root("tenant-a"), first)


def test_the_host_tier_stores_carry_the_salt_too(ctx):
    # a device pool too small for both chains: the salted one is evicted to the host tier
    engine = Engine.simulated(
        model="dummy:tiny",
        num_kv_blocks=6,
        block_size=BLOCK,
        num_host_kv_blocks=20,
        kv_events_config=json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://127.0.0.1:0",
            }
        ),
    )
    prompt = list(range(200, 213))
    try:
        _run(engine, prompt, "tenant-b", "tenant-b")
        _run(engine, list(range(300, 313)), "other", None)
        _run(engine, list(range(400, 413)), "third", None)
        engine.step()  # issues the host copies of what the last turn evicted
        events = _replay_all(ctx, engine.kv_events.publisher.replay_endpoint)
        host_cached = set(engine.host_tier.pool.cached)
    finally:
        engine.close()
    host_blocks = _blocks(_stored(events, "CPU"))
    salted_first = chain_hash(salted_root("tenant-b"), tuple(prompt[:BLOCK]))
    assert salted_first in host_cached
    assert host_blocks[salted_first] == (tuple(prompt[:BLOCK]), ("tenant-b",))
