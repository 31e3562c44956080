"""The fused elementwise kernels of a decoder layer (:mod:`kernels.fused`) against their torch twins
(:mod:`kernels.reference`).

- CPU (default suite): the Triton kernels under the interpreter: rotary + KV store (padding
  slots untouched), residual add + RMSNorm (the residual stream bit-equal to the unfused add),
  SiLU-mul; each row's result independent of the other rows; a whole model step with the
  fused backend against the unfused one.
- GPU (``-m gpu``): the compiled kernels, the same comparisons in bf16 and fp32.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from asymcache_core.loaders import resolve_hf_config
from asymcache_core.models.config import ModelConfig
from asymcache_core.models.llama import LlamaForCausalLM, RotaryEmbedding
from kernels.dispatch import AttentionBackend, select_attention_backend
from kernels.metadata import build_msa_metadata
from kernels.reference import (
    add_rms_norm_torch,
    rope_store_torch,
    rotate_torch,
    silu_mul_torch,
    store_kv_torch,
)

# the packaged tiny Llama config (2 layers, 4 q / 2 KV heads, head_dim 16)
_TINY = resolve_hf_config("dummy:tiny")[0]


def _rope_case(num_tokens: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_hf({**_TINY, "hidden_size": hq * head_dim, "num_attention_heads": hq,
                               "num_key_value_heads": hkv, "max_position_embeddings": 4096})
    rotary = RotaryEmbedding(cfg, 4096)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    cos, sin = rotary.tables(positions, dtype)
    qkv = torch.randn((num_tokens, (hq + 2 * hkv) * head_dim), generator=gen).to(dtype)
    num_blocks, page = 8, 16
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows store nothing
    cache_shape = (num_blocks, page, hkv, head_dim)
    caches = [torch.full(cache_shape, 7.0, dtype=dtype) for _ in range(4)]
    to = lambda t: t.to(device)  # noqa: E731
    return to(qkv), to(cos), to(sin), [to(c) for c in caches], to(slots)


def _check_rope_store(module: ModuleType, dtype: torch.dtype, device: str) -> None:
    for case, (hq, hkv, head_dim) in enumerate([(4, 2, 64), (8, 1, 128), (6, 3, 32), (5, 5, 80)]):
        qkv, cos, sin, (k_ref, v_ref, k_out, v_out), slots = _rope_case(23, hq, hkv, head_dim, dtype, device, case)
        q_ref = rope_store_torch(qkv, cos, sin, k_ref, v_ref, slots, hq, hkv, store_kv_torch)
        q = module.rope_store_triton(qkv, cos, sin, k_out, v_out, slots, hq, hkv)
        assert q.shape == (23, hq, head_dim) and q.dtype == dtype
        # float64 truth: the kernels round once, the twin after each bf16 op
        truth = rotate_torch(qkv.double()[:, : (hq + hkv) * head_dim].reshape(23, hq + hkv, head_dim),
                             cos.double(), sin.double())
        # bf16: within one unit in the last place of the truth (Triton's interpreter truncates
        # where the GPU rounds to nearest)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert float(((q.double() - truth[:, :hq]).abs() / (1 + truth[:, :hq].abs())).max()) < tol
        assert float(((q.double() - q_ref.double()).abs() / (1 + q_ref.double().abs())).max()) < 4 * tol
        # the same slots written, the others untouched; values copied exactly
        untouched = k_out == 7.0
        assert torch.equal(untouched, k_ref == 7.0) and torch.equal(v_out == 7.0, v_ref == 7.0)
        assert torch.equal(v_out, v_ref)
        assert float(((k_out.double() - k_ref.double()).abs() / (1 + k_ref.double().abs())).max()) < 4 * tol
        written = int((~(v_out == 7.0)).any(-1).any(-1).sum())
        assert written == int((slots >= 0).sum())


def _rms_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    exact = x.double()
    return exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()


def _check_add_rms_norm(module: ModuleType, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    for width in (64, 576, 4096):
        x = torch.randn((37, width), generator=gen).to(dtype).to(device)
        residual = torch.randn((37, width), generator=gen).to(dtype).to(device)
        weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(device)
        ref_total = add_rms_norm_torch(x, residual, weight, 1e-5)[1]
        out, total = module.add_rms_norm_triton(x, residual, weight, 1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(total, ref_total), "the residual stream must keep the unfused add's bits"
        else:  # the interpreter truncates to bf16 where the GPU rounds to nearest
            assert float(((total.double() - ref_total.double()).abs() / (1 + ref_total.double().abs())).max()) < tol
        # within one unit in the last place of the float64 norm of the kernel's own sum
        assert bool(((out.double() - _rms_exact(total, weight)).abs() <= tol * _rms_exact(total, weight).abs() + 1e-6).all())
        alone, same = module.add_rms_norm_triton(x, None, weight, 1e-5)
        assert same is x or torch.equal(same, x)
        assert bool(((alone.double() - _rms_exact(x, weight)).abs() <= tol * _rms_exact(x, weight).abs() + 1e-6).all())
        # a row's bits do not depend on the other rows
        for start, rows in ((0, 1), (5, 3), (11, 26)):
            part, _ = module.add_rms_norm_triton(x[start : start + rows], residual[start : start + rows], weight, 1e-5)
            assert torch.equal(part, out[start : start + rows])


def _check_silu_mul(module: ModuleType, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    for inter in (96, 1536, 3000):
        gate_up = (3 * torch.randn((19, 2 * inter), generator=gen)).to(dtype).to(device)
        out = module.silu_mul_triton(gate_up)
        truth = silu_mul_torch(gate_up.double())
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert out.shape == (19, inter)
        assert float(((out.double() - truth).abs() / (1 + truth.abs())).max()) < tol
        assert torch.equal(module.silu_mul_triton(gate_up[4:9]), out[4:9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_interpreter(interp_fused: ModuleType, dtype: torch.dtype) -> None:
    _check_rope_store(interp_fused, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_interpreter(interp_fused: ModuleType, dtype: torch.dtype) -> None:
    _check_add_rms_norm(interp_fused, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_interpreter(interp_fused: ModuleType, dtype: torch.dtype) -> None:
    _check_silu_mul(interp_fused, dtype, "cpu")


def _model_step(backend: AttentionBackend) -> torch.Tensor:
    """Logits of one packed step (two sequences: a prefill chunk and a 1-token decode) of a
    seeded tiny model, with the caches pre-filled by an earlier step of the second sequence."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(_TINY)
    model = LlamaForCausalLM(cfg, 512).eval()
    vocab = cfg.vocab_size
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    page = 16
    shape = (16, page, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # step 1: sequence 1 prefills 20 tokens into blocks 3, 4
        ids = torch.randint(0, vocab, (20,), generator=gen)
        meta = build_msa_metadata([[3, 4]], [(0, 0, 20, 0)], [3 * page + i if i < page else 4 * page + i - page
                                                               for i in range(20)], page)
        model(ids, torch.arange(20), caches, meta, backend, torch.tensor([19]))
        # step 2: sequence 0 prefills 9 tokens (block 7); sequence 1 decodes its 21st token
        ids = torch.randint(0, vocab, (10,), generator=gen)
        positions = torch.tensor(list(range(9)) + [20])
        slots = [7 * page + i for i in range(9)] + [4 * page + 4]
        meta = build_msa_metadata([[7], [3, 4]], [(0, 0, 9, 0), (1, 9, 1, 20)], slots, page)
        return model(ids, positions, caches, meta, backend, torch.tensor([8, 9]))


def test_model_step_with_fused_kernels_matches_unfused(interp_fused: ModuleType) -> None:
    unfused = select_attention_backend("cpu", "torch")
    assert unfused.rope_store is None and unfused.dense.add_rms_norm is None
    fused = dataclasses.replace(
        unfused,
        rope_store=interp_fused.rope_store_triton,
        dense=dataclasses.replace(
            unfused.dense, add_rms_norm=interp_fused.add_rms_norm_triton, silu_mul=interp_fused.silu_mul_triton
        ),
    )
    ref = _model_step(unfused)
    out = _model_step(fused)
    assert ref.shape == (2, _TINY["vocab_size"])
    assert float((out - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_triton_backend_carries_the_fused_ops_unless_ablated(interp_fused: ModuleType, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        backend = select_attention_backend("cpu", "triton")
    except ImportError:
        pytest.skip("triton is not installed")
    assert backend.rope_store is not None
    assert backend.dense.add_rms_norm is not None and backend.dense.silu_mul is not None
    plain = select_attention_backend("cpu", "triton", fused=False)
    assert plain.rope_store is None and plain.dense.add_rms_norm is None and plain.dense.silu_mul is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernels_gpu(compiled_fused: ModuleType, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_rope_store(compiled_fused, dtype, "cuda")
    _check_add_rms_norm(compiled_fused, dtype, "cuda")
    _check_silu_mul(compiled_fused, dtype, "cuda")
