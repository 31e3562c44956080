"""Piecewise graphs for mixed steps: the size ladder, padding that stores nothing, the same
tokens as the plain forward (pieces run eagerly on the CPU); on a GPU, captured pieces give
the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from asymcache_core.config import EngineConfig
from asymcache_core.model_runner import pack_step
from asymcache_core.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from asymcache_core.sampling_params import SamplingParams
from tests.conftest import make_engine


def test_piecewise_sizes_cover_every_step() -> None:
    sizes = piecewise_sizes(1024)
    assert sizes[0] == 16 and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    for tokens in range(1, 1025):
        size = next(s for s in sizes if s >= tokens)
        assert size <= max(16, 2 * tokens - 2)  # less than twice the step's work
        if tokens > 256:
            assert size - tokens < 128  # a quarter of the step at most
    assert piecewise_sizes(100) == [16, 32, 64, 100]
    assert piecewise_sizes(0) == []


def test_mixed_graph_max_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(mixed_graph_max_tokens=-1)
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(mixed_graph_max_tokens=True)  # type: ignore[arg-type]
    assert EngineConfig(mixed_graph_max_tokens=0).mixed_graph_max_tokens == 0


def _attach_eager_pieces(engine, sizes: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Gives ``engine`` eager piecewise runs of ``sizes``; returns the token count of every
    step that ran through them."""
    runner = engine.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.backend, sizes, runner.device, capture=False)
    used: list[int] = []
    original = pieces.run

    def run(input_ids, *args):  # type: ignore[no-untyped-def]
        logits = original(input_ids, *args)
        if logits is not None:
            used.append(len(input_ids))
        return logits

    pieces.run = run  # type: ignore[method-assign]
    runner.mixed_graphs = pieces
    return used


def test_pieces_give_the_forward_tokens(smollm, chat_prompts) -> None:
    """Prefill chunks, cache hits and decodes through padded pieces pick the plain forward's
    greedy tokens; steps larger than the largest size fall back to the forward."""
    shared = chat_prompts[2][:40]
    prompts = [*chat_prompts, shared + chat_prompts[0][-20:]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = make_engine(smollm, max_num_batched_tokens=48)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = make_engine(smollm, max_num_batched_tokens=48)
    used = _attach_eager_pieces(engine, [16, 32])
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert any(t > 1 for t in used) and max(used) <= 32  # mixed steps went through the pieces
    assert any(s.num_tokens > 32 for s in engine.step_log)  # larger ones did not
    engine.check_integrity()


def test_padding_rows_store_nothing(smollm) -> None:
    """A 5-token step padded to 16 rows writes exactly its own 5 KV slots."""
    engine = make_engine(smollm)
    _attach_eager_pieces(engine, [16])
    runner = engine.runner
    engine.scheduler.add(engine.requests.setdefault("r", _request(list(range(200, 205)))))
    plan = engine.scheduler.schedule()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    inputs = pack_step(plan, runner.block_size)
    runner.execute(plan)
    changed: set[int] = set()
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        flat = k0.shape[0] * k0.shape[1]
        diff = (k0.reshape(flat, -1) != k1.reshape(flat, -1)).any(-1) | (v0.reshape(flat, -1) != v1.reshape(flat, -1)).any(-1)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    assert changed == set(inputs.slots) and len(inputs.slots) == 5


def _request(tokens: list[int]):  # type: ignore[no-untyped-def]
    from asymcache_core.request import Request

    return Request("r", tokens, SamplingParams(max_tokens=2), arrival_time=0.0)


@pytest.mark.gpu
def test_captured_pieces_match_eager_engine() -> None:
    """fp32 on the GPU: mixed steps replayed as piecewise graphs pick the eager engine's greedy
    tokens (chunked prefills next to decodes), and the engine really replays them."""
    from asymcache_core import Engine

    prompts = [[(10 + i + j) % 500 for j in range(n)] for i, n in enumerate((5, 40, 77, 130, 260, 600))]
    outputs = []
    for mixed in (0, 256):
        engine = Engine(
            model="dummy:tiny", device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=8,
            max_model_len=1024, max_num_batched_tokens=96, mixed_graph_max_tokens=mixed,
        )
        assert (engine.runner.mixed_graphs is None) == (mixed == 0)
        used: list[int] = []
        if mixed:
            pieces = engine.runner.mixed_graphs
            original = pieces.run

            def counting(input_ids, *args, original=original, used=used):  # type: ignore[no-untyped-def]
                logits = original(input_ids, *args)
                if logits is not None:
                    used.append(len(input_ids))
                return logits

            pieces.run = counting
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
        if mixed:
            assert len(used) >= 5 and max(used) > 1
        engine.check_integrity()
    assert outputs[0] == outputs[1]
