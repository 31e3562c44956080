"""CUDA-graph decode: which steps qualify, what a replay is fed, how the latency model prices
graph steps; on a GPU, graph replays give the eager engine's tokens."""

from __future__ import annotations

import pytest

from asymcache_core.cuda_graphs import graph_batch_sizes
from asymcache_core.latency_model import LatencyModel
from asymcache_core.model_runner import pack_step
from asymcache_core.profiler import ProfilePoint, fit
from asymcache_core.request import Request
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.scheduler import ScheduledRequest, SchedulerOutput
from asymcache_core.sim_runner import SimulatedRunner, VirtualClock


def _request(rid: str, tokens: list[int], blocks: list[int]) -> Request:
    request = Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0)
    request.block_ids = blocks
    return request


def _plan(*items: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(list(items), [], 64, sum(i.num_tokens for i in items))


def test_graph_batch_sizes_cover_every_batch() -> None:
    sizes = graph_batch_sizes(64)
    assert sizes[0] == 1 and sizes[-1] == 64 and sizes == sorted(set(sizes))
    for batch in range(1, 65):
        fit_size = next(s for s in sizes if s >= batch)
        assert fit_size - batch < 8  # padding never wastes more than one step of the ladder
    assert graph_batch_sizes(3) == [1, 2, 3]


def test_a_decode_step_packs_last_tokens() -> None:
    # what a graph replay is fed (DecodeBatch is these fields of the packed step)
    a = _request("a", list(range(100, 140)), [7, 3, 9])  # last token at 39: logical block 2 -> 9
    b = _request("b", [5, 6, 7], [4])
    batch = pack_step(_plan(ScheduledRequest(a, [(39, 40)], True), ScheduledRequest(b, [(2, 3)], True)), 16)
    assert batch.decode_only
    assert batch.input_ids == [139, 7]
    assert batch.positions == [39, 2]
    assert batch.slots == [9 * 16 + 7, 4 * 16 + 2]
    assert batch.block_tables == [[7, 3, 9], [4]]
    assert batch.logits_rows == [0, 1] and batch.sample_index == [0, 1]


@pytest.mark.parametrize(
    "item",
    [
        ScheduledRequest(_request("p", list(range(40)), [1, 2, 3]), [(16, 40)], True),  # prefill chunk
        ScheduledRequest(_request("h", list(range(40)), [1, 2, 3]), [(0, 16), (39, 40)], True),  # hole
        ScheduledRequest(_request("c", list(range(40)), [1, 2, 3]), [(30, 31)], False),  # not last
    ],
)
def test_steps_with_other_work_are_not_decode_batches(item: ScheduledRequest) -> None:
    d = _request("d", [1, 2, 3], [0])
    assert not pack_step(_plan(ScheduledRequest(d, [(2, 3)], True), item), 16).decode_only


def test_latency_model_prices_decode_only_steps_at_their_floor() -> None:
    model = LatencyModel(floor_s=0.02, per_token_s=1e-4, per_attn_s=1e-9, knee_tokens=64, decode_floor_s=0.005)
    assert model.step_latency(8, 8000, decode_only=True) == pytest.approx(0.005 + 8e-6)
    assert model.step_latency(8, 8000) == pytest.approx(0.02 + 8e-6)
    legacy = LatencyModel(floor_s=0.02, per_token_s=1e-4, per_attn_s=1e-9, knee_tokens=64)
    assert legacy.step_latency(8, 8000, decode_only=True) == legacy.step_latency(8, 8000)


def test_fit_separates_the_graph_floor() -> None:
    truth = LatencyModel(floor_s=0.03, per_token_s=3e-5, per_attn_s=1e-9, knee_tokens=512, decode_floor_s=0.008)
    points = []
    for ctx in (0, 2048):
        for tokens in (1, 64, 256, 512, 1024, 2048):
            pairs = tokens * ctx + tokens * (tokens + 1) / 2
            points.append(ProfilePoint("chunk", tokens, ctx, 1, pairs, truth.step_latency(tokens, pairs)))
    for batch in (1, 8, 32):
        pairs = batch * 4097.0
        points.append(ProfilePoint("graph", batch, 4096, batch, pairs, truth.step_latency(batch, pairs, True)))
    model = fit(points, device="cuda")
    assert model.knee_tokens == 512
    assert model.floor_s == pytest.approx(0.03, rel=1e-3)
    assert model.decode_floor_s == pytest.approx(0.008, rel=1e-3)
    assert model.fit_error is not None and model.fit_error < 1e-3
    # without graph points the model has no separate decode floor
    assert fit([p for p in points if p.kind == "chunk"]).decode_floor_s is None


def test_simulator_charges_decode_steps_the_graph_floor() -> None:
    model = LatencyModel(floor_s=0.02, per_token_s=0.0, per_attn_s=0.0, knee_tokens=64, decode_floor_s=0.005)
    runner = SimulatedRunner(model, VirtualClock(), vocab_size=1000)
    d = _request("d", [1, 2, 3], [0])
    p = _request("p", list(range(40)), [1, 2, 3])
    assert runner.step_cost(_plan(ScheduledRequest(d, [(2, 3)], True))) == pytest.approx(0.005)
    mixed = _plan(ScheduledRequest(d, [(2, 3)], True), ScheduledRequest(p, [(16, 40)], True))
    assert runner.step_cost(mixed) == pytest.approx(0.02)


def test_decode_keys_count_what_decodes_read_in_any_step() -> None:
    """``K``: a decode reads its position plus one keys, in a decode-only step and beside a
    prefill alike; a chunk, a hole refill and a token that does not sample read none of it."""
    d = _request("d", list(range(40)), [1, 2, 3])
    e = _request("e", [1, 2, 3], [0])
    p = _request("p", list(range(40)), [1, 2, 3])
    assert _plan(ScheduledRequest(d, [(39, 40)], True), ScheduledRequest(e, [(2, 3)], True)).decode_kv_tokens == 43
    mixed = _plan(ScheduledRequest(d, [(39, 40)], True), ScheduledRequest(p, [(16, 40)], True))
    assert mixed.decode_kv_tokens == 40
    others = _plan(ScheduledRequest(p, [(0, 16), (39, 40)], True), ScheduledRequest(d, [(30, 31)], False))
    assert others.decode_kv_tokens == 0


def test_simulator_charges_decodes_their_keys() -> None:
    model = LatencyModel(floor_s=0.02, per_token_s=0.0, per_attn_s=0.0, knee_tokens=64, decode_floor_s=0.005,
                         per_decode_kv_s=1e-6)
    runner = SimulatedRunner(model, VirtualClock(), vocab_size=1000)
    d = _request("d", list(range(1000)), list(range(63)))
    p = _request("p", list(range(40)), [1, 2, 3])
    assert runner.step_cost(_plan(ScheduledRequest(d, [(999, 1000)], True))) == pytest.approx(0.005 + 1e-3)
    mixed = _plan(ScheduledRequest(d, [(999, 1000)], True), ScheduledRequest(p, [(16, 40)], True))
    assert runner.step_cost(mixed) == pytest.approx(0.02 + 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "max_model_len"), [("float32", 1024), ("float32", 2048), ("bfloat16", 2048)])
def test_graph_decode_matches_eager_engine(dtype: str, max_model_len: int) -> None:
    """On the GPU: graph replays and eager steps pick the same greedy tokens, and the engine
    really replays graphs for its decode steps; also with a ``max_model_len`` (the model's) far beyond the
    contexts, where each replay sets a smaller KV chunk than the capture's (fp32, the library
    kernels), and in bf16, the batch-invariant default, whose KV split is fixed."""
    from asymcache_core import Engine

    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 130, 260))]
    outputs = []
    for eager in (True, False):
        engine = Engine(
            model="dummy:tiny", device="cuda", dtype=dtype, num_kv_blocks=256, max_num_seqs=8,
            max_model_len=max_model_len, enforce_eager=eager,
        )
        assert (engine.runner.decode_graphs is None) == eager
        assert engine.runner.backend.batch_invariant == (dtype == "bfloat16")
        replays = 0
        if not eager:
            graphs = engine.runner.decode_graphs
            original = graphs.run

            def counting(batch, fill=None, original=original):  # type: ignore[no-untyped-def]
                nonlocal replays
                replays += 1
                return original(batch, fill)

            graphs.run = counting
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
        if not eager:
            assert replays >= 20
        engine.check_integrity()
    assert outputs[0] == outputs[1]
