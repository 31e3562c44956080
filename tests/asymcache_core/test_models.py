"""Model family parity with transformers on small random checkpoints (HF folders, safetensors)."""

from __future__ import annotations

import json

import pytest
import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

BASE = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES = {
    "llama": ("LlamaForCausalLM", {"rope_theta": 10000.0, "tie_word_embeddings": False}),
    "llama3-rope": (
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralForCausalLM", {"rope_theta": 1000000.0, "sliding_window": None}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    # q/k norms, and a head_dim (24) that is not hidden / heads (16): o_proj reads 4 * 24
    "qwen3-tied": (
        "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": 24},
    ),
}


def _hf_checkpoint(tmp_path, family: str):
    import transformers

    arch, extra = FAMILIES[family]
    cfg_dict = {**BASE, **extra, "architectures": [arch]}
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    cfg.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so that errors would show
        for name, p in model.named_parameters():
            # q/k norms near one, as trained ones are: unit-RMS heads give the attention
            # scores of order one, so that a missing or misplaced norm would show
            p.normal_(1.0, 0.3) if name.endswith(("q_norm.weight", "k_norm.weight")) else p.normal_(0, 0.08)
    folder = tmp_path / family
    model.save_pretrained(folder, safe_serialization=True)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == [arch]
    return model, folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf, folder = _hf_checkpoint(tmp_path, family)
    loaded = load_model(str(folder), torch.device("cpu"), torch.float32, seed=0)
    assert loaded.config.architecture == FAMILIES[family][0]
    # positions beyond the llama3 original context exercise the scaled frequencies
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0]
    engine = Engine(model=str(folder), loaded=loaded, num_kv_blocks=32)
    captured: list[torch.Tensor] = []
    original = engine.runner.sampler.sample

    def spy(logits, *args, **kwargs):
        captured.append(logits.clone())
        return original(logits, *args, **kwargs)

    engine.runner.sampler.sample = spy  # type: ignore[method-assign]
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert torch.allclose(captured[0][0], expected[-1], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 150:].tolist()
    assert out.token_ids == greedy


def test_dummy_configs_ship_and_build():
    from asymcache_core.loaders import resolve_hf_config, shipped_dummy_configs
    from asymcache_core.models import ModelConfig

    names = shipped_dummy_configs()
    for name in ("llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "smollm2-135m", "tiny", "tiny-qwen3"):
        assert name in names
    cfg = ModelConfig.from_hf(resolve_hf_config("dummy:llama-3.1-8b")[0])
    assert 7.9e9 < cfg.num_params < 8.1e9
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    qwen = ModelConfig.from_hf(resolve_hf_config("dummy:qwen2.5-7b")[0])
    assert qwen.attention_bias and 7.0e9 < qwen.num_params < 7.8e9
    qwen3 = ModelConfig.from_hf(resolve_hf_config("dummy:qwen3-8b")[0])
    # Qwen3-8B has 8.19B parameters (untied head, q/k norms, no q/k/v bias)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 128
    assert qwen3.num_params == pytest.approx(8.19e9, rel=0.005)
