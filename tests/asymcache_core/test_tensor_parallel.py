"""Tensor parallelism over gloo on this CPU: the shard plan, the collectives, and SmolLM2 split
over two worker processes giving the greedy tokens of one, under a tight pool with holes and
with the host tier; a rank that dies fails the engine loudly and the server answers 503."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core import Engine, EngineDeadError, SamplingParams
from asymcache_core.models import ModelConfig
from asymcache_core.parallel import TensorParallelGroup, plan_tensor_shards, shard_parameter
from tests.asymcache_core.test_holes_and_policies import TURN, run_script, short_turns
from tests.conftest import StepClock, make_engine

MODEL = "smollm2-135m"


def _config(heads: int, kv: int, inter: int = 48, vocab: int = 101, hidden: int = 32) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=4,
    )


# -- the shard plan ----------------------------------------------------------------------------
def test_smollm2_splits_its_three_kv_heads_unevenly_over_two_ranks() -> None:
    cfg = _config(heads=9, kv=3, inter=1536, vocab=49152)
    a, b = plan_tensor_shards(cfg, 2)
    assert (a.kv_heads, b.kv_heads) == ((0, 2), (2, 3))
    assert (a.q_heads, b.q_heads) == ((0, 6), (6, 9))  # whole GQA groups of 3
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab) == ((0, 24576), (24576, 49152))


def test_more_ranks_than_kv_heads_replicate_each_kv_head() -> None:
    shards = plan_tensor_shards(_config(heads=8, kv=2), 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_llama_70b_splits_evenly_and_its_shards_fit_an_h200(size: int) -> None:
    from asymcache_core.loaders import resolve_hf_config

    cfg = ModelConfig.from_hf(resolve_hf_config("dummy:llama-3.1-70b")[0])
    assert cfg.num_params == pytest.approx(70.6e9, rel=0.01)
    shards = plan_tensor_shards(cfg, size)
    assert {s.num_kv_heads for s in shards} == {8 // size} and {s.num_q_heads for s in shards} == {64 // size}
    # bf16 weights per rank: ~141 GB / size, under an H200's 141 GB from two ranks up
    assert cfg.num_params * 2 / size < 141e9 * (0.55 if size == 2 else 0.3)


@pytest.mark.parametrize(("heads", "kv", "size"), [(9, 3, 4), (8, 2, 3), (4, 2, 8), (8, 8, 0)])
def test_a_split_that_cuts_a_kv_group_is_refused(heads: int, kv: int, size: int) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_tensor_shards(_config(heads=heads, kv=kv), size)


@settings(max_examples=40, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 3, 4]), group=st.sampled_from([1, 2, 3]), size=st.integers(1, 4),
    vocab=st.integers(7, 40), inter=st.integers(4, 20),
)
def test_the_shards_put_together_are_the_whole_model(kv: int, group: int, size: int, vocab: int, inter: int) -> None:
    cfg = _config(heads=kv * group, kv=kv, inter=inter, vocab=vocab, hidden=8)
    try:
        shards = plan_tensor_shards(cfg, size)
    except ValueError:
        return  # an indivisible split (tested above)
    from asymcache_core.models import build_model

    full = build_model(cfg, 16)
    for name, param in full.named_parameters():
        torch.nn.init.normal_(param)
        parts = [shard_parameter(name, param.detach(), cfg, s) for s in shards]
        d = cfg.head_dim
        if name.endswith("qkv_proj.weight"):
            # each rank's rows: its q heads, then its k heads, then its v heads
            q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
            for s, part in zip(shards, parts, strict=True):
                (q0, q1), (k0, k1) = s.q_heads, s.kv_heads
                expected = torch.cat((
                    param[q0 * d : q1 * d],
                    param[q_size + k0 * d : q_size + k1 * d],
                    param[q_size + kv_size + k0 * d : q_size + kv_size + k1 * d],
                ))
                assert torch.equal(part, expected)
            assert torch.equal(torch.cat([p[: s.num_q_heads * d] for s, p in zip(shards, parts, strict=True)]),
                               param[:q_size])  # every query head once, in order
        elif name.endswith("o_proj.weight"):
            assert torch.equal(torch.cat(parts, dim=1), param)
        elif name.endswith("gate_up_proj.weight"):
            gates = torch.cat([p[: p.shape[0] // 2] for p in parts])
            ups = torch.cat([p[p.shape[0] // 2 :] for p in parts])
            assert torch.equal(torch.cat((gates, ups)), param)
        elif name.endswith("down_proj.weight"):
            assert torch.equal(torch.cat(parts, dim=1), param)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(torch.cat(parts), param)
        else:
            assert all(p is param or torch.equal(p, param) for p in parts)


@pytest.mark.parametrize("size", [2, 4])
def test_dummy_shards_hold_the_slices_of_the_whole_dummy_model(size: int) -> None:
    # dummy weights are drawn tensor by tensor as the whole model's are, then sliced: every split
    # of a dummy model is the unsplit one (no collective runs while loading)
    from asymcache_core.loaders import load_model

    cpu = torch.device("cpu")
    whole = load_model("dummy:tiny", cpu, torch.float32, seed=3)
    params = dict(whole.model.named_parameters())
    for shard in plan_tensor_shards(whole.config, size):
        part = load_model("dummy:tiny", cpu, torch.float32, seed=3, tensor_parallel=TensorParallelGroup(shard, None))
        for name, param in part.model.named_parameters():
            assert torch.equal(param, shard_parameter(name, params[name], whole.config, shard)), name


# -- the collectives, two gloo ranks ------------------------------------------------------------
def _collectives(rank: int, port: int, deterministic: bool, queue: object = None) -> tuple[torch.Tensor, ...]:
    """Rank ``rank`` of the collectives test (rank 1 runs in a spawned process)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    weight, partials, logits = torch.randn(11, 5), [torch.randn(3, 5), torch.randn(3, 5)], torch.randn(2, 11)
    ids = torch.tensor([0, 5, 6, 10, 3])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, timedelta(seconds=60))
    shard = plan_tensor_shards(_config(heads=6, kv=3, vocab=11), 2)[rank]
    group = TensorParallelGroup(shard, pg, deterministic=deterministic)
    v0, v1 = shard.vocab
    out = (
        group.all_reduce(partials[rank].clone()), partials[0] + partials[1],
        group.embed(ids, weight[v0:v1]), weight[ids],
        group.gather_vocab(logits[:, v0:v1]), logits,
    )
    if queue is not None:
        queue.put([t.tolist() for t in out])  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_collectives_sum_embed_and_gather_the_uneven_vocab(deterministic: bool) -> None:
    import multiprocessing

    import torch.distributed as dist

    assert [s.vocab for s in plan_tensor_shards(_config(heads=6, kv=3, vocab=11), 2)] == [(0, 6), (6, 11)]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    peer = ctx.Process(target=_collectives, args=(1, store.port, deterministic, queue))
    peer.start()
    try:
        ours = _collectives(0, store.port, deterministic)
        theirs = [torch.tensor(t) for t in queue.get(timeout=60)]
    finally:
        peer.join(timeout=60)
    for summed, expected_sum, embedded, expected_rows, gathered, expected_logits in (ours, theirs):
        assert torch.equal(summed, expected_sum)
        assert torch.equal(embedded, expected_rows)  # one non-zero term per row: exact
        assert torch.equal(gathered, expected_logits)


# -- SmolLM2 over two worker processes -------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_engine() -> Engine:
    # NOTE: one engine for the module (each starts a worker interpreter that loads its shard):
    # a 10-block pool with holes and a 12-block host tier, so that the short script (3-token
    # answers) both rebuilds holes and reloads blocks from the host (measured on one rank: 48
    # hole tokens, 10 reloads; with 16 host blocks every host hit is reloaded, no hole left)
    engine = Engine(
        MODEL, clock=StepClock(), num_kv_blocks=10, eviction_policy="asymcache", num_host_kv_blocks=12,
        tensor_parallel_size=2,
    )
    yield engine
    engine.close()


def test_tp2_gives_the_greedy_tokens_of_one_rank_under_a_tight_pool_with_holes_and_a_host_tier(
    tp_engine, short_unbounded
) -> None:
    # the multi-session script of test_holes_and_policies: constant eviction, holes in the
    # middle of histories rebuilt by MSA and blocks reloaded from the host, on both ranks'
    # shares of every block
    assert run_script(tp_engine, params=short_turns) == short_unbounded
    stats = tp_engine.stats()
    assert stats.evictions_total > 0
    assert stats.engine_hole_tokens_total > 0
    assert stats.host_reloaded_blocks_total > 0
    tp_engine.check_integrity()
    assert tp_engine.runner.kv_cache.shape[-2] == 2  # rank 0 holds 2 of the 3 KV heads


def test_tp2_prompt_logprobs_match_one_rank(tp_engine, smollm) -> None:
    # NOTE: the prompt rows go through the vocabulary-parallel head on both ranks (the same
    # slices, so the ranks' gathers pair up)
    prompt = list(range(300, 340))
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    (ours,) = tp_engine.generate([prompt], params)
    (one,) = make_engine(smollm).generate([prompt], params)
    assert ours.token_ids == one.token_ids and len(ours.prompt_logprobs) == len(prompt)
    for a, b in zip(ours.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    tp_engine.check_integrity()


def test_a_dead_rank_fails_the_engine_loudly_and_the_server_answers_503(tp_engine) -> None:
    from fastapi.testclient import TestClient

    from agent_runtime.runtime import AgentRuntime
    from agent_runtime.server import create_app

    runtime = AgentRuntime(tp_engine, policy="asymcache")
    with TestClient(create_app(runtime, MODEL)) as client:
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        victim = tp_engine.tp_workers.processes[0]
        victim.kill()
        victim.wait(timeout=30)
        failed = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello again", "max_tokens": 3})
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "engine_unavailable"
        assert "rank 1 died" in failed.json()["error"]["message"]
        later = client.post("/v1/completions", json={"model": MODEL, "prompt": "Anyone?", "max_tokens": 3})
        assert later.status_code == 503
        assert client.get("/health").status_code == 503
    # the engine itself: every later step fails the same way
    tp_engine.add_request(list(range(300, 340)), TURN)
    for _ in range(2):
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            tp_engine.step()


def test_bad_tensor_parallel_sizes_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Engine(MODEL, num_kv_blocks=16, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks cannot split 3 KV heads"):
        Engine(MODEL, num_kv_blocks=16, tensor_parallel_size=4)


@pytest.mark.gpu
def test_gpu_nccl_group_runs_the_collectives_on_device_tensors() -> None:
    # one GPU: a one-rank NCCL group (two ranks need two GPUs) through the engine's own
    # constructor, so the NCCL options and the backend's collectives are exercised on CUDA
    import torch.distributed as dist

    from asymcache_core.tensor_parallel import new_process_group

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pg = new_process_group(store, 0, 1, device)
    cfg = _config(heads=6, kv=3, vocab=11)
    for deterministic in (False, True):
        group = TensorParallelGroup(plan_tensor_shards(cfg, 1)[0], pg, deterministic=deterministic)
        x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
        assert torch.equal(group.all_reduce(x.clone()), x)
        weight = torch.randn(11, 8, device=device)
        ids = torch.tensor([0, 10, 3], device=device)
        assert torch.equal(group.embed(ids, weight), weight[ids])
        logits = torch.randn(3, 11, device=device)
        assert torch.equal(group.gather_vocab(logits), logits)
    torch.cuda.synchronize()
