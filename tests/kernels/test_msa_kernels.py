"""MSA kernels against the float64 oracle :func:`kernels.reference.msa_naive`.

- CPU (default suite): the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``),
  on small shapes in float32; the torch fast path :func:`msa_torch`; the KV store.
- GPU (``-m gpu``): the compiled kernels at larger sizes in bf16/fp16.

The interpreter is chosen when a ``@triton.jit`` function is decorated, so the interpreted
kernels are a fresh copy of ``kernels/msa_triton.py`` loaded under another module name while
the variable is set; whatever imported ``kernels.msa_triton`` before is left untouched.

Every case draws fresh random inputs (its own seed; ``MSA_TEST_SEED`` shifts them all): 1-6
segments per sequence (holes at random offsets, often block-aligned, plus a suffix), ragged
contexts, shuffled packing, caches whose unused blocks and slots hold NaN, and an output buffer
poisoned with NaN.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from kernels import msa_config, msa_plan
from kernels.metadata import build_msa_metadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch
from tests.kernels.msa_cases import SEED, case_seed, check_close, make_case

# --------------------------------------------------------------------------------------------
# CPU: Triton interpreter, float32
# --------------------------------------------------------------------------------------------

# (kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx, config)
# config: None = choose_config; (block_m, block_n, num_splits) forces one.
_INTERP_CASES = [
    ("decode", 3, 16, 1, 4, 64, 150, None),
    ("decode", 2, 32, 2, 3, 64, 200, (4, 32, 3)),  # split-K path
    ("decode", 2, 16, 1, 8, 128, 120, (2, 16, 4)),  # split-K, GQA 8, d 128
    ("decode", 2, 16, 1, 4, 64, 1700, (4, 16, 100)),  # 100 splits: merged 64 a load, a partial group
    ("prefill", 1, 16, 1, 2, 64, 300, (64, 16, 9)),  # 9 splits merged 4 a load (64-token tiles)
    ("prefill", 2, 16, 1, 1, 64, 120, None),
    ("prefill", 2, 32, 1, 3, 64, 140, (8, 32, 1)),
    ("prefill", 1, 16, 1, 4, 128, 100, (4, 16, 2)),  # split-K on prefill tiles
    ("prefill-full", 1, 16, 1, 8, 64, 70, None),
    ("mixed", 3, 16, 1, 4, 64, 100, None),
    ("mixed", 3, 32, 2, 1, 64, 90, (16, 16, 3)),
    ("mixed", 2, 16, 1, 3, 128, 80, None),
]


@pytest.mark.parametrize(
    ("kind", "num_seqs", "block_size", "kv_heads", "group", "head_dim", "max_ctx", "config"),
    _INTERP_CASES,
)
def test_msa_triton_interpreter(
    interp: ModuleType,
    kind: str,
    num_seqs: int,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    max_ctx: int,
    config: tuple[int, int, int] | None,
) -> None:
    seed = case_seed(kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx)
    case = make_case(
        seed, kind=kind, num_seqs=num_seqs, block_size=block_size, num_kv_heads=kv_heads,
        group=group, head_dim=head_dim, max_ctx=max_ctx, dtype=torch.float32,
        pad_tokens=1 if kind == "mixed" else 0,
    )
    cfg = None
    if config is not None:
        cfg = msa_config.MSAConfig(config[0], config[1], 4, 1, config[2])
    out = torch.full_like(case.q, float("nan"))
    res = interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out=out, config=cfg)
    assert res.data_ptr() == out.data_ptr()
    check_close(out, case, torch.float32)


@pytest.mark.parametrize("config", [None, (4, 32, 3), (2, 16, 4)])
def test_msa_triton_interpreter_block_ids_a_turn_ahead_or_not(
    interp: ModuleType, monkeypatch: pytest.MonkeyPatch, config: tuple[int, int, int] | None
) -> None:
    """Small decode tiles walk the same keys whether their block ids are loaded a turn ahead
    (a launch of one wave) or in the turn that uses them: the same bits, both close to the
    reference."""
    case = make_case(
        case_seed("prefetch", config), kind="decode", num_seqs=2, block_size=16, num_kv_heads=2,
        group=4, head_dim=64, max_ctx=170, dtype=torch.float32,
    )
    cfg = None if config is None else msa_config.MSAConfig(config[0], config[1], 4, 1, config[2])
    outs = []
    for prefetch in (False, True):
        monkeypatch.setattr(interp, "_prefetch_block_ids", lambda *args, prefetch=prefetch, **kwargs: prefetch)
        outs.append(interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=cfg))
        check_close(outs[-1], case, torch.float32)
    assert torch.equal(outs[0], outs[1])


def test_small_tiles_load_block_ids_ahead_only_in_one_wave(interp: ModuleType) -> None:
    prefetch = interp._prefetch_block_ids
    # 16-row decode tiles (4 tokens x 4 heads): ahead only when the launch fits one wave
    assert prefetch(4, 4, chunk_merge=False, one_wave=True)
    assert not prefetch(4, 4, chunk_merge=False, one_wave=False)
    # 64-row tiles always; the batch-invariant in-program walk never
    assert prefetch(16, 4, chunk_merge=False, one_wave=False)
    assert not prefetch(16, 4, chunk_merge=True, one_wave=True)


def test_msa_triton_interpreter_allocates_output(interp: ModuleType) -> None:
    case = make_case(
        11, kind="mixed", num_seqs=2, block_size=16, num_kv_heads=1, group=2, head_dim=64,
        max_ctx=40, dtype=torch.float32,
    )
    out = interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)


def test_store_kv_triton_interpreter(interp_store: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5 + SEED)
    num_blocks, block_size, heads, dim, num_tokens = 6, 16, 3, 64, 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k = torch.randn((num_tokens, heads, dim), generator=gen)
    v = torch.randn((num_tokens, heads, dim), generator=gen)
    caches = [torch.randn((num_blocks, block_size, heads, dim), generator=gen) for _ in range(2)]
    expect = [c.clone() for c in caches]
    store_kv_torch(k, v, expect[0], expect[1], slots)
    interp_store.store_kv_triton(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
    # a negative slot (padding) writes nothing
    before = [c.clone() for c in caches]
    interp_store.store_kv_triton(k[:1] + 1, v[:1] + 1, caches[0], caches[1], torch.tensor([-1]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


# --------------------------------------------------------------------------------------------
# CPU: the torch fast path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "prefill", "prefill-full", "mixed"])
@pytest.mark.parametrize(("block_size", "group", "head_dim"), [(16, 1, 64), (32, 3, 64), (16, 4, 128), (32, 8, 64)])
def test_msa_torch_matches_naive(kind: str, block_size: int, group: int, head_dim: int) -> None:
    seed = case_seed(kind, block_size, group, head_dim, "torch")
    case = make_case(
        seed, kind=kind, num_seqs=3, block_size=block_size, num_kv_heads=2, group=group,
        head_dim=head_dim, max_ctx=160, dtype=torch.float32,
        pad_tokens=1 if kind == "mixed" else 0,
    )
    out = msa_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)


def test_msa_torch_batches_equal_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of one length at one position share an SDPA call (consecutive rows or not),
    decodes of different contexts another, the plan is built once and reused; a cap on the
    gather cuts a group into several calls. Every way, the output matches the oracle, and
    NaN left in pool slots past a context never reaches it."""
    from kernels import reference
    from kernels.dispatch import select_attention_backend

    gen = torch.Generator().manual_seed(11)
    block, kv_heads, group, dim = 4, 2, 3, 16
    num_blocks = 40
    k_cache = torch.randn((num_blocks, block, kv_heads, dim), generator=gen)
    v_cache = torch.randn((num_blocks, block, kv_heads, dim), generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * 5 : i * 5 + 5] for i in range(7)]  # 7 sequences, 20 slots each
    # (seq, q_start, q_len, pos_start): three fresh 5-token prompts (rows 0..14), a decode, two
    # 3-token segments at position 7 with a second decode between them
    segments = [(0, 0, 5, 0), (1, 5, 5, 0), (2, 10, 5, 0), (3, 15, 1, 12), (4, 16, 3, 7), (6, 19, 1, 9),
                (5, 20, 3, 7)]
    num_tokens = 23
    for seq, _, q_len, pos in segments:  # NaN in every slot past each context
        for p in range(pos + q_len, 20):
            k_cache[tables[seq][p // block], p % block] = float("nan")
            v_cache[tables[seq][p // block], p % block] = float("nan")
    meta = build_msa_metadata(tables, segments, [-1] * num_tokens, block)
    q = torch.randn((num_tokens, kv_heads * group, dim), generator=gen)
    scale = dim**-0.5
    ref = msa_naive(q, k_cache, v_cache, meta, scale)
    prepared = select_attention_backend("cpu", "torch").prepare(meta, kv_heads * group, kv_heads, dim)
    plan = prepared.plan
    assert isinstance(plan, reference.TorchMSAPlan)
    assert plan.decodes is not None and plan.decodes.tables.shape[0] == 2 and plan.decodes.pad is not None
    shapes = sorted((g.tables.shape[0], g.q_len, g.pos_start, isinstance(g.rows, slice)) for g in plan.groups)
    assert shapes == [(2, 3, 7, False), (3, 5, 0, True)]
    out = msa_torch(q, k_cache, v_cache, prepared, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(reference, "_GATHER_ELEMENTS", 5 * kv_heads * dim)  # one segment per call
    cut = reference.plan_msa_torch(meta, kv_heads, dim)
    assert len(cut.groups) == 5
    torch.testing.assert_close(msa_torch(q, k_cache, v_cache, dataclasses.replace(meta, plan=cut), scale), ref,
                               atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16/fp16
# --------------------------------------------------------------------------------------------

_GPU_CASES = [
    # kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx
    ("decode", 16, 16, 8, 4, 128, 20_000),  # long-context decode: split-K
    ("decode", 1, 16, 8, 4, 128, 33_000),  # one sequence: many splits
    ("decode", 24, 32, 2, 8, 64, 3000),
    ("prefill", 3, 16, 8, 4, 128, 5000),
    ("prefill", 2, 32, 4, 3, 64, 3000),
    ("prefill-full", 1, 16, 8, 4, 128, 4096),
    ("prefill-full", 2, 32, 4, 1, 128, 2000),
    ("mixed", 8, 16, 8, 4, 128, 6000),
    ("mixed", 6, 16, 2, 8, 64, 3000),
    ("mixed", 5, 32, 3, 3, 128, 2500),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("kind", "num_seqs", "block_size", "kv_heads", "group", "head_dim", "max_ctx"), _GPU_CASES
)
def test_msa_triton_gpu(
    compiled: ModuleType,
    dtype: torch.dtype,
    kind: str,
    num_seqs: int,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    max_ctx: int,
) -> None:
    seed = case_seed(kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx, str(dtype))
    case = make_case(
        seed, kind=kind, num_seqs=num_seqs, block_size=block_size, num_kv_heads=kv_heads,
        group=group, head_dim=head_dim, max_ctx=max_ctx, dtype=dtype, device="cuda",
        max_segs=6, pad_tokens=2 if kind == "mixed" else 0,
    )
    out = torch.full_like(case.q, float("nan"))
    compiled.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    torch.cuda.synchronize()
    check_close(out, case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_triton_gpu(compiled_store: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(17 + SEED)
    num_blocks, block_size, heads, dim, num_tokens = 300, 16, 8, 128, 1000
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    k = torch.randn((num_tokens, heads, dim), generator=gen).to("cuda", dtype)
    v = torch.randn((num_tokens, heads, dim), generator=gen).to("cuda", dtype)
    caches = [torch.randn((num_blocks, block_size, heads, dim), generator=gen).to("cuda", dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    store_kv_torch(k, v, expect[0], expect[1], slots)
    compiled_store.store_kv_triton(k, v, caches[0], caches[1], slots)
    torch.cuda.synchronize()
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


def test_compiled_kernel_count_is_none_off_cuda() -> None:
    from kernels.dispatch import compiled_kernel_count

    assert compiled_kernel_count("cpu") is None


@pytest.mark.gpu
def test_compiled_variants_counts_new_specializations_only(compiled: ModuleType) -> None:
    def run(kind: str, kv_heads: int, group: int, head_dim: int) -> None:
        case = make_case(
            case_seed("count", kind, kv_heads, group, head_dim), kind=kind, num_seqs=3, block_size=16,
            num_kv_heads=kv_heads, group=group, head_dim=head_dim, max_ctx=2000,
            dtype=torch.bfloat16, device="cuda",
        )
        compiled.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        torch.cuda.synchronize()

    run("prefill", 8, 4, 128)
    first = compiled.compiled_variants()
    assert first is not None and first >= 1
    run("prefill", 8, 4, 128)  # the same shapes again: nothing new to compile
    assert compiled.compiled_variants() == first
    run("prefill", 3, 5, 64)  # a query-head group no other test uses: new constexprs
    assert compiled.compiled_variants() > first


# --------------------------------------------------------------------------------------------
# GPU: randomized layouts (the batch-invariant mode: test_msa_invariant.py; the launch plans:
# test_msa_plans.py)
# --------------------------------------------------------------------------------------------


def _random_layout(seed: int) -> dict[str, object]:
    """A random MSA layout of the kinds the GPU must run in every dtype."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options: list[object]) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    kind = pick(["decode", "prefill", "prefill-full", "mixed", "holes"])
    return {
        "kind": "prefill" if kind == "holes" else kind,
        "max_segs": 12 if kind == "holes" else 6,
        "num_seqs": int(pick([1, 2, 5, 16])) if kind == "decode" else int(pick([1, 2, 4])),
        "block_size": pick([16, 32, 64]),
        "num_kv_heads": pick([1, 2, 8]),
        "group": pick([1, 2, 4, 5, 8, 16]),
        "head_dim": pick([64, 128]),
        "max_ctx": pick([40, 700, 5000, 20_000, 32_768]),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout_seed", range(24))
def test_msa_triton_gpu_random_layouts(compiled: ModuleType, dtype: torch.dtype, layout_seed: int) -> None:
    """Randomized layouts (block sizes, GQA groups 1-16, head dims, holes at and inside block
    boundaries, many short holes, decode-only, contexts to 32k): every one launches within the
    device's shared memory, and float32 is IEEE-accurate (max abs error <= 1e-5)."""
    layout = _random_layout(case_seed("layout", layout_seed) + SEED)
    case = make_case(case_seed("layout-case", layout_seed), dtype=dtype, device="cuda", **layout)  # type: ignore[arg-type]
    out = torch.full_like(case.q, float("nan"))
    compiled.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    torch.cuda.synchronize()
    check_close(out, case, dtype)
    if dtype == torch.float32:
        assert float((out.double().cpu() - case.ref).abs().max()) <= 1e-5, layout



@pytest.mark.gpu
def test_msa_triton_gpu_wide_kv_tiles(compiled: ModuleType) -> None:
    """The 128-key KV tile of deep prefills (four holes of 512-1,000 tokens in a 20k history,
    Llama-3.1-8B heads, bf16): the planner walks it on the split path, and it gives the
    oracle's output so with the grid tile first and KV head first, and forced at one and two
    splits, and unsplit."""
    case = make_case(
        case_seed("wide-kv-gpu"), kind="prefill", num_seqs=1, block_size=16, num_kv_heads=8, group=4,
        head_dim=128, max_ctx=20_000, dtype=torch.bfloat16, device="cuda", ctxs=[20_000],
        segs=[[(3_000, 512), (9_000, 1_000), (15_001, 700), (19_000, 1_000)]],
    )
    planned = msa_plan.plan_msa(case.meta, 32, 8, 128, torch.device("cuda"), dtype=torch.bfloat16)
    (launch,) = planned.launches
    assert (launch.config.block_n, launch.config.split_path) == (128, True)
    forced = [msa_config.MSAConfig(64, 128, 8, 2, splits, split_path=path) for splits, path in ((1, True), (2, True), (1, False))]
    plans = [msa_plan.MSAStepPlan((dataclasses.replace(launch, heads_first=first),)) for first in (False, True)]
    plans += [msa_plan.plan_msa(case.meta, 32, 8, 128, torch.device("cuda"), config=cfg) for cfg in forced]
    for plan in plans:
        out = torch.full_like(case.q, float("nan"))
        compiled.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale, out=out)
        torch.cuda.synchronize()
        check_close(out, case, torch.bfloat16)
