"""KV events in vLLM's wire format: a router-side consumer subscribes over ZMQ, rebuilds each
tier's set of cached block hashes from the events alone, and finds the engine's pools; replay of
missed batches; bad configs."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.config import cli_flags
from asymcache_core.kv_cache_manager import _ROOT_HASH, chain_hash
from asymcache_core.kv_events import END_SEQ, KVEventsConfig
from tests.conftest import make_engine

# NOTE: the kv-events extra (make install has it); machines without it skip this module.
msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

BLOCK = 4


class RouterIndex:
    """What a KV-aware router keeps of one engine: per medium, the block hashes it caches.

    It reads the events only (never the engine), checks each as a strict consumer would (a
    removal of a hash it does not hold, a stored chain whose tokens do not hash to the stored
    hashes, or a gap in the sequence numbers is an error) and fills gaps through the replay
    socket.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None, topic: bytes = b"") -> None:
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.cached: dict[str, set[int]] = {}
        self.next_seq = 0
        self.batches = 0
        self.events: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.first_event: str | None = None

    def close(self) -> None:
        self.sub.close(linger=0)

    # -- transport -------------------------------------------------------------------------------
    def drain(self, quiet_s: float = 0.3) -> None:
        """Reads the live stream until it is quiet, replaying whatever was missed."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue  # replayed already
            if seq > self.next_seq:
                self.replay(self.next_seq)
            if seq == self.next_seq:
                self.apply(seq, payload)
            assert seq < self.next_seq, f"batches {self.next_seq}..{seq - 1} are lost"

    def replay(self, start: int) -> list[int]:
        """Asks the replay socket for every batch from ``start``; returns the sequence numbers."""
        assert self.replay_endpoint is not None, "a gap without a replay socket"
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        try:
            while True:
                assert dealer.poll(5000), "no answer from the replay socket"
                empty, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    assert payload == b""
                    return got
                got.append(seq)
                if seq == self.next_seq:
                    self.apply(seq, payload)
        finally:
            dealer.close(linger=0)

    # -- the index ---------------------------------------------------------------------------------
    def apply(self, seq: int, payload: bytes) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 600 and dp_rank == 0
        for event in events:
            tag = event[0]
            self.events[tag] += 1
            if self.first_event is None:
                self.first_event = tag
            if tag == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium, lora_name, keys = event
                assert block_size == BLOCK and lora_id is None and lora_name is None
                assert len(tokens) == block_size * len(hashes) and keys == [None] * len(hashes)
                for i, block_hash in enumerate(hashes):
                    # the chain: each block's hash is its parent's and its own tokens'
                    chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
                    assert chain_hash(_ROOT_HASH if parent is None else parent, chunk) == block_hash
                    parent = block_hash
                held = self.cached.setdefault(medium, set())
                assert held.isdisjoint(hashes), f"{medium}: stored twice"
                held.update(hashes)
            elif tag == "BlockRemoved":
                _, hashes, medium = event
                held = self.cached.setdefault(medium, set())
                assert set(hashes) <= held, f"{medium}: removal of a block never stored"
                held.difference_update(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.cached.clear()
        self.next_seq = seq + 1
        self.batches += 1


def _config(**overrides) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                       "replay_endpoint": "tcp://127.0.0.1:0", **overrides})


def _local(endpoint: str) -> str:
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def _run(engine: Engine, prompt: list[int], job: str, max_tokens: int = 3) -> list[int]:
    """Runs one turn to the end; returns its output tokens."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), job_id=job)
    out: list[int] = []
    for _ in range(10_000):
        for o in engine.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
                if o.finished:
                    return out
        if engine.stalled:
            engine.idle_until(engine.clock() + 0.5)
    raise AssertionError("turn did not finish")


def _agent_load(engine: Engine, jobs: int = 3, turns: int = 4) -> None:
    """Multi-turn jobs whose contexts grow (the previous turn, its output, a tool result), taken
    in turns so that the pools evict each other's blocks."""
    contexts = {f"job{j}": [100 * (j + 1) + i for i in range(10)] for j in range(jobs)}
    for turn in range(turns):
        for job, context in contexts.items():
            output = _run(engine, context, job)
            context.extend(output + [7 * turn + k for k in range(5)])


def _pools(engine: Engine) -> dict[str, set[int]]:
    pools = {"GPU": set(engine.pool.cached)}
    if engine.host_tier is not None:
        pools["CPU"] = set(engine.host_tier.pool.cached)
    return pools


def _nonempty(index: RouterIndex) -> dict[str, set[int]]:
    return {medium: held for medium, held in index.cached.items() if held or medium == "GPU"}


def test_a_consumer_rebuilds_both_tiers_from_the_events(ctx):
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=12, block_size=BLOCK, num_host_kv_blocks=20,
                              kv_events_config=_config())
    publisher = engine.kv_events.publisher
    index = RouterIndex(ctx, _local(publisher.endpoint), publisher.replay_endpoint)
    try:
        time.sleep(0.2)  # the subscription reaches the publisher (what it misses is replayed)
        _agent_load(engine)
        index.drain()
        assert engine.pool.num_evictions > 0 and engine.host_tier.pool.num_evictions > 0
        assert index.events["BlockRemoved"] > 0
        assert index.first_event == "AllBlocksCleared"  # a router drops what an earlier run left
        assert index.cached == _pools(engine)
        assert index.batches == engine.kv_events.batches  # one batch per step with events, at most

        # a reset evicts every unheld device block: removals, and copies to the host tier (a
        # second reset before any step must not lose the tokens those copies are stored with)
        engine.reset_prefix_cache()
        assert engine.reset_prefix_cache().device_blocks == 0
        index.drain()
        assert index.cached["GPU"] == set(engine.pool.cached) == set()
        engine.step()  # issues the host copies of what the reset evicted
        _run(engine, list(range(400, 431)), "late")  # more stores on a pool that starts empty
        index.drain()
        assert index.cached == _pools(engine)
        assert engine.kv_events.unknown_tokens == 0
        engine.check_integrity()
    finally:
        index.close()
        engine.close()


def test_a_late_subscriber_catches_up_through_replay(ctx):
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=12, block_size=BLOCK, num_host_kv_blocks=20,
                              kv_events_config=_config(topic="kv@replica-0"))
    publisher = engine.kv_events.publisher
    try:
        _agent_load(engine, jobs=2, turns=3)  # nobody listens
        late = RouterIndex(ctx, _local(publisher.endpoint), publisher.replay_endpoint, topic=b"kv@replica-0")
        try:
            time.sleep(0.2)
            seqs = late.replay(0)
            assert seqs == list(range(engine.kv_events.batches))
            assert late.cached == _pools(engine)
            _run(engine, list(range(450, 477)), "after")  # then the live stream goes on from there
            late.drain()
            assert late.cached == _pools(engine) and late.next_seq == engine.kv_events.batches
            assert late.replay(late.next_seq + 5) == []  # past the end: just the end marker
        finally:
            late.close()
    finally:
        engine.close()


def test_replay_keeps_the_last_buffer_steps_batches(ctx):
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=12, block_size=BLOCK,
                              kv_events_config=_config(buffer_steps=3))
    publisher = engine.kv_events.publisher
    try:
        _agent_load(engine, jobs=2, turns=2)
        total = engine.kv_events.batches
        assert total > 3
        late = RouterIndex(ctx, _local(publisher.endpoint), publisher.replay_endpoint)
        try:
            late.next_seq = total - 3  # so that the kept batches apply
            late.cached = {"GPU": set()}
            assert late.replay(0) == [total - 3, total - 2, total - 1]
        finally:
            late.close()
    finally:
        engine.close()


def test_a_real_model_publishes_what_its_pools_hold(ctx, smollm):
    # the real SmolLM2 on the CPU: a pool tight enough to evict, a host tier, greedy turns
    engine = make_engine(smollm, num_kv_blocks=10, block_size=BLOCK, num_host_kv_blocks=12,
                         kv_events_config=_config())
    publisher = engine.kv_events.publisher
    index = RouterIndex(ctx, _local(publisher.endpoint), publisher.replay_endpoint)
    try:
        time.sleep(0.2)
        _agent_load(engine, jobs=2, turns=3)
        index.drain()
        assert engine.pool.num_evictions > 0 and engine.stats().host_offloaded_blocks_total > 0
        assert index.cached == _pools(engine)
    finally:
        index.close()
        engine.close()


def test_blocks_a_failed_step_wrote_are_removed(ctx):
    # a request whose forward pass fails: the blocks it was writing were announced when its
    # step was planned, and are withdrawn when the step fails
    poison = 77
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=16, block_size=BLOCK, kv_events_config=_config())
    execute = engine.runner.execute

    def faulty(plan):
        if any(poison in item.request.all_token_ids for item in plan.scheduled):
            raise RuntimeError("injected forward-pass fault")
        return execute(plan)

    engine.runner.execute = faulty
    publisher = engine.kv_events.publisher
    index = RouterIndex(ctx, _local(publisher.endpoint), publisher.replay_endpoint)
    try:
        time.sleep(0.2)
        good = engine.add_request(list(range(20)), SamplingParams(max_tokens=2))
        bad = engine.add_request(list(range(100, 120)) + [poison], SamplingParams(max_tokens=2))
        finished: dict[str, str | None] = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o.error for o in engine.step() if o.finished})
        assert finished[good] is None and finished[bad] is not None
        index.drain()
        assert index.events["BlockRemoved"] > 0
        assert index.cached == _pools(engine) and len(engine.pool.cached) == 5  # the good prompt's
    finally:
        index.close()
        engine.close()


def test_the_null_publisher_and_disabled_events():
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=12, block_size=BLOCK,
                              kv_events_config=json.dumps({"enable_kv_cache_events": True, "publisher": "null"}))
    _agent_load(engine, jobs=1, turns=2)
    assert engine.kv_events.batches == engine.kv_events.publisher.published > 0
    engine.close()
    engine.close()  # idempotent
    off = Engine.simulated(model="dummy:tiny", num_kv_blocks=12, kv_events_config='{"endpoint": "tcp://*:5557"}')
    assert off.kv_events is None and Engine.simulated(model="dummy:tiny", num_kv_blocks=12).kv_events is None


def test_the_cli_flag_and_the_defaults():
    assert cli_flags()["kv_events_config"].name == "--kv-events-config"
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.topic, config.buffer_steps) == (
        "zmq", "tcp://*:5557", None, "", 10_000)


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be a bool"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost"}', "endpoint must be a ZMQ address"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": 5558}', "replay_endpoint must be a ZMQ address"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "hwm": true}', "hwm must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "topic": 3}', "topic must be a string"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'"),
])
def test_bad_configs_name_the_field(text, match):
    with pytest.raises(ValueError, match=f"^kv_events_config: .*{match}"):
        EngineConfig(model="dummy:tiny", kv_events_config=text)


def test_a_busy_endpoint_fails_the_engine_start():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"^kv_events_config: cannot open 'tcp://\\*:{port}'"):
            Engine.simulated(model="dummy:tiny", num_kv_blocks=12, kv_events_config=json.dumps(
                {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))


def test_the_config_takes_a_dict_of_vllms_fields_as_its_json():
    """The README's ``EngineConfig(kv_events_config=...)``, as vLLM's ``KVEventsConfig(...)``."""
    fields = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "topic": "kv"}
    assert EngineConfig(kv_events_config=fields).kv_events_config == json.dumps(fields)
    with pytest.raises(ValueError, match="^kv_events_config: unknown key 'endpont'"):
        EngineConfig(kv_events_config={"endpont": "tcp://*:5557"})
    with pytest.raises(ValueError, match="^kv_events_config: the dict is not JSON"):
        EngineConfig(kv_events_config={"topic": object()})
