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
import os
import zlib
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from kernels import msa_plan
from kernels.metadata import MSAMetadata, build_msa_metadata
from kernels.reference import msa_naive, msa_torch, store_kv_torch

_SEED = int(os.environ.get("MSA_TEST_SEED", "0"))

# (relative Frobenius error, max abs error) bounds against the float64 oracle.
def _seed(*parts: object) -> int:
    """A stable per-case seed (``hash`` of strings changes between processes)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


_TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 2e-2),
    torch.bfloat16: (1.5e-2, 6e-2),
}


@dataclass
class Case:
    """One random MSA step: inputs, metadata and the float64 reference output."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: MSAMetadata
    scale: float
    ref: torch.Tensor
    covered: torch.Tensor  # [T] bool, token belongs to a segment


def _segments_for(
    gen: torch.Generator, ctx: int, kind: str, block_size: int, max_segs: int
) -> list[tuple[int, int]]:
    """``(pos_start, q_len)`` segments of one sequence of context ``ctx`` (sorted, disjoint)."""
    if kind == "decode":
        return [(ctx - 1, 1)]

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if kind == "prefill-full":
        return [(0, ctx)]
    suffix = randint(1, max(1, min(ctx - 1, 3 * block_size)))
    segs = [(ctx - suffix, suffix)]
    n_holes = randint(0, max_segs - 1)
    free_end = ctx - suffix
    for _ in range(n_holes):
        if free_end < 2:
            break
        start = randint(0, free_end - 1)
        if randint(0, 2) > 0:  # mostly block-aligned holes
            start = start // block_size * block_size
        length = randint(1, min(free_end - start, 2 * block_size + 5))
        segs.append((start, length))
        free_end = start - 1  # keep a gap of at least one cached token
    return sorted(segs)


def make_case(
    seed: int,
    *,
    kind: str,
    num_seqs: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_ctx: int,
    dtype: torch.dtype,
    device: str = "cpu",
    max_segs: int = 6,
    pad_tokens: int = 0,
    ctxs: list[int] | None = None,
) -> Case:
    """Builds a random step; ``kind`` is decode, prefill (holes + suffix), prefill-full or mixed.
    ``ctxs`` sets the sequences' contexts (``num_seqs`` of them) instead of drawing them."""
    gen = torch.Generator().manual_seed(seed + 7919 * _SEED)
    drawn = torch.randint(2, max_ctx + 1, (num_seqs,), generator=gen).tolist()
    ctxs = drawn if ctxs is None else ctxs
    assert len(ctxs) == num_seqs
    kinds = [kind] * num_seqs
    if kind == "mixed":
        kinds = ["decode" if i % 2 == 0 else "prefill" for i in range(num_seqs)]
    blocks_per_seq = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that belong to nobody
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    valid = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for table, ctx in zip(tables, ctxs, strict=True):
        valid[table] = True
        valid[table[-1], ctx - (len(table) - 1) * block_size :] = False
    k_cache[~valid] = float("nan")  # nothing outside a context may leak into the result
    v_cache[~valid] = float("nan")

    seg_list = []  # (seq, pos_start, q_len)
    for s, (ctx, k) in enumerate(zip(ctxs, kinds, strict=True)):
        seg_list += [(s, p, n) for p, n in _segments_for(gen, ctx, k, block_size, max_segs)]
    order = torch.randperm(len(seg_list), generator=gen).tolist()
    segments, slots, q_start = [], [], 0
    for j in order:
        seq, pos, n = seg_list[j]
        segments.append((seq, q_start, n, pos))
        slots += [tables[seq][p // block_size] * block_size + p % block_size for p in range(pos, pos + n)]
        q_start += n
    covered = torch.ones(q_start + pad_tokens, dtype=torch.bool)
    if pad_tokens:
        covered[q_start:] = False
        slots += [-1] * pad_tokens
    num_tokens = q_start + pad_tokens
    q = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen, dtype=torch.float64)
    meta = build_msa_metadata(tables, segments, slots, block_size, device=device)
    scale = head_dim**-0.5
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    ref = msa_naive(q, k_cache, v_cache, meta, scale).cpu()

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    return Case(cast(q), cast(k_cache), cast(v_cache), meta, scale, ref, covered)


def check_close(out: torch.Tensor, case: Case, dtype: torch.dtype) -> None:
    """Fails unless every element was written and ``out`` matches the oracle within bounds."""
    out = out.detach().to("cpu", torch.float64)
    assert out.shape == case.ref.shape
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} elements not written/finite"
    ref = case.ref
    if not case.covered.all():
        assert (out[~case.covered] == 0).all(), "rows outside segments must be zero"
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    max_abs = float((out - ref).abs().max())
    rel_tol, abs_tol = _TOL[dtype]
    assert rel <= rel_tol and max_abs <= abs_tol, f"rel {rel:.3g} (<= {rel_tol}), max abs {max_abs:.3g} (<= {abs_tol})"


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
    seed = _seed(kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx)
    case = make_case(
        seed, kind=kind, num_seqs=num_seqs, block_size=block_size, num_kv_heads=kv_heads,
        group=group, head_dim=head_dim, max_ctx=max_ctx, dtype=torch.float32,
        pad_tokens=1 if kind == "mixed" else 0,
    )
    cfg = None
    if config is not None:
        cfg = msa_plan.MSAConfig(config[0], config[1], 4, 1, config[2])
    out = torch.full_like(case.q, float("nan"))
    res = interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out=out, config=cfg)
    assert res.data_ptr() == out.data_ptr()
    check_close(out, case, torch.float32)


def test_msa_triton_interpreter_allocates_output(interp: ModuleType) -> None:
    case = make_case(
        11, kind="mixed", num_seqs=2, block_size=16, num_kv_heads=1, group=2, head_dim=64,
        max_ctx=40, dtype=torch.float32,
    )
    out = interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)


def test_store_kv_triton_interpreter(interp: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5 + _SEED)
    num_blocks, block_size, heads, dim, num_tokens = 6, 16, 3, 64, 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k = torch.randn((num_tokens, heads, dim), generator=gen)
    v = torch.randn((num_tokens, heads, dim), generator=gen)
    caches = [torch.randn((num_blocks, block_size, heads, dim), generator=gen) for _ in range(2)]
    expect = [c.clone() for c in caches]
    store_kv_torch(k, v, expect[0], expect[1], slots)
    interp.store_kv_triton(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
    # a negative slot (padding) writes nothing
    before = [c.clone() for c in caches]
    interp.store_kv_triton(k[:1] + 1, v[:1] + 1, caches[0], caches[1], torch.tensor([-1]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


@pytest.mark.parametrize(("group", "max_ctx", "max_context"), [(4, 150, 400), (2, 1100, 1400)])
def test_msa_triton_interpreter_decode_graph_plan(
    interp: ModuleType, group: int, max_ctx: int, max_context: int
) -> None:
    """The CUDA-graph launch: a fixed KV chunk sized for ``max_context`` (splits past a context
    do no work), one tile per sequence from a device table, padding tiles writing zeros."""
    case = make_case(
        _seed("graph", group, max_ctx), kind="decode", num_seqs=3, block_size=16, num_kv_heads=2,
        group=group, head_dim=64, max_ctx=max_ctx, dtype=torch.float32,
    )
    num_pad = 2
    tiles = [(seq, q_start, q_len, pos) for seq, q_start, q_len, pos in case.meta.host_segments]
    tiles += [(0, 0, 0, 0)] * num_pad
    plan = msa_plan.decode_graph_plan(torch.tensor(tiles, dtype=torch.int32), 2 * group, 2, max_context)
    if max_context > 512:
        # the split-K path: some contexts span two chunks, others leave splits idle
        assert plan.num_splits > 1
        ends = [pos + 1 for _, _, _, pos in tiles[:-num_pad]]
        assert max(ends) > plan.chunk and min(ends) <= plan.chunk
    q = torch.cat((case.q, torch.randn((num_pad, *case.q.shape[1:]))))
    meta = dataclasses.replace(case.meta, plan=plan)
    out = torch.full_like(q, float("nan"))
    interp.msa_triton(q, case.k_cache, case.v_cache, meta, case.scale, out=out)
    assert (out[-num_pad:] == 0).all()
    check_close(out[:-num_pad], case, torch.float32)


@pytest.mark.parametrize(("group", "max_ctx"), [(4, 150), (2, 1100)])
def test_msa_triton_interpreter_decode_graph_chunk_set_per_replay(
    interp: ModuleType, group: int, max_ctx: int
) -> None:
    """A graph plan sized for a long ``max_model_len`` reads its keys per split from a device
    buffer: set for the batch's longest context, the same grid splits that context instead of
    leaving it to one program per KV head; output unchanged."""
    case = make_case(
        _seed("graph-chunk", group, max_ctx), kind="decode", num_seqs=3, block_size=16, num_kv_heads=2,
        group=group, head_dim=64, max_ctx=max_ctx, dtype=torch.float32,
    )
    tiles = [(seq, q_start, q_len, pos) for seq, q_start, q_len, pos in case.meta.host_segments]
    tiles += [(0, 0, 0, 0)]
    buffer = torch.zeros(1, dtype=torch.int32)
    plan = msa_plan.decode_graph_plan(torch.tensor(tiles, dtype=torch.int32), 2 * group, 2, 8192, chunk_buffer=buffer)
    assert plan.chunk_buffer is buffer and int(buffer) == plan.chunk  # the capture's value
    longest = max(pos + 1 for _, _, _, pos in tiles[:-1])
    assert longest <= plan.chunk  # sized for 8192: the whole batch would sit in one split
    chunk = msa_plan.decode_graph_chunk(plan, longest)
    assert chunk % plan.config.block_n == 0 and -(-longest // chunk) <= plan.num_splits
    if longest > 2 * plan.config.block_n:
        assert chunk < longest  # now the longest context spans several splits
    buffer.fill_(chunk)
    q = torch.cat((case.q, torch.randn((1, *case.q.shape[1:]))))
    out = torch.full_like(q, float("nan"))
    interp.msa_triton(q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale, out=out)
    assert (out[-1] == 0).all()
    check_close(out[:-1], case, torch.float32)
    # the kernels really read the buffer: a chunk too small for the grid drops keys
    block_n = plan.config.block_n
    assert longest > plan.num_splits * block_n
    buffer.fill_(block_n)
    wrong = interp.msa_triton(q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale)
    assert not torch.allclose(wrong[:-1], out[:-1], atol=1e-3)


def test_decode_graph_chunk_bounds(interp: ModuleType) -> None:
    """Whole KV tiles, never more than the capture's chunk, never more splits than the grid."""
    plan = msa_plan.decode_graph_plan(torch.zeros((8, 4), dtype=torch.int32), 32, 8, 131072)
    block_n = plan.config.block_n
    for max_ctx in (1, 63, 64, 65, 5000, 18000, 131072):
        chunk = msa_plan.decode_graph_chunk(plan, max_ctx)
        assert block_n <= chunk <= plan.chunk and chunk % block_n == 0
        assert -(-max_ctx // chunk) <= plan.num_splits
    assert msa_plan.decode_graph_chunk(plan, 131072) == plan.chunk


def test_plan_msa_is_what_msa_triton_plans(interp: ModuleType) -> None:
    """A plan made once per step gives the same output as planning inside the call."""
    case = make_case(
        21, kind="mixed", num_seqs=3, block_size=16, num_kv_heads=1, group=4, head_dim=64,
        max_ctx=90, dtype=torch.float32, pad_tokens=1,
    )
    plan = msa_plan.plan_msa(case.meta, 4, 1, 64, torch.device("cpu"))
    assert plan.num_tiles >= case.meta.num_segments and plan.covered_rows == case.q.shape[0] - 1
    planned = interp.msa_triton(
        case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale
    )
    check_close(planned, case, torch.float32)
    assert torch.equal(planned, interp.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale))


def test_plan_msa_gives_short_segments_their_own_split_launch(interp: ModuleType) -> None:
    """Decodes and one-block holes next to a prefill chunk: two launches, the short class with
    decode tiles split over a long context; the output is the same as the oracle's."""
    for seed in range(200):  # the first random step with a long decode and a long segment
        case = make_case(
            _seed("classes", seed), kind="mixed", num_seqs=4, block_size=16, num_kv_heads=1, group=4,
            head_dim=64, max_ctx=1500, dtype=torch.float32, pad_tokens=1,
        )
        segs = case.meta.host_segments
        if any(s[2] == 1 and s[3] > 1100 for s in segs) and any(s[2] > 16 for s in segs):
            break
    else:
        pytest.fail("no step with a long decode and a long segment among 200 seeds")
    plan = msa_plan.plan_msa(case.meta, 4, 1, 64, torch.device("cpu"))
    long_launch, short_launch = plan.launches
    assert long_launch.config.block_m >= 32 and short_launch.config.block_m * 4 <= 64
    assert short_launch.num_splits > 1
    assert plan.covered_rows == case.q.shape[0] - 1
    out = torch.full_like(case.q, float("nan"))
    interp.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale, out=out)
    check_close(out, case, torch.float32)


def test_plan_msa_splits_a_deep_tile_beside_shallow_ones(interp: ModuleType) -> None:
    """A multi-block hole deep in one history next to prefill chunks at the start of others:
    the deep tile alone would be the launch's critical path, so its context is split (chunks
    of >= ``min_split_keys``), while the shallow tiles, within one chunk, write their output
    directly."""
    gen = torch.Generator().manual_seed(_seed("deep-hole"))
    bs, heads, group, dim = 16, 1, 4, 64
    ctxs = [2600, 120, 100]
    tables, start = [], 0
    for c in ctxs:
        n = -(-c // bs)
        tables.append(list(range(start, start + n)))
        start += n
    k_cache = torch.randn((start, bs, heads, dim), generator=gen, dtype=torch.float64)
    v_cache = torch.randn((start, bs, heads, dim), generator=gen, dtype=torch.float64)
    # seq 0: a 48-token hole at 2400 (tile contexts ~2450); seqs 1, 2: prefill from 0
    segs = [(0, 2400, 48), (1, 0, 120), (2, 0, 100)]
    segments, slots, q_start = [], [], 0
    for seq, pos, n in segs:
        segments.append((seq, q_start, n, pos))
        slots += [tables[seq][p // bs] * bs + p % bs for p in range(pos, pos + n)]
        q_start += n
    q = torch.randn((q_start, heads * group, dim), generator=gen, dtype=torch.float64)
    meta = build_msa_metadata(tables, segments, slots, bs)
    scale = dim**-0.5
    ref = msa_naive(q, k_cache, v_cache, meta, scale)
    # NOTE: 1024 keys a chunk instead of the GPU's 4096 keeps the interpreted case small
    (unsplit,) = msa_plan.plan_msa(meta, heads * group, heads, dim, torch.device("cpu")).launches
    assert unsplit.num_splits == 1  # 2448 keys: under the default 4096-key chunk
    plan = msa_plan.plan_msa(meta, heads * group, heads, dim, torch.device("cpu"), min_split_keys=1024)
    (launch,) = plan.launches
    assert launch.num_splits > 1 and launch.chunk >= 1024
    deepest = max(int(t[3] + t[2]) for t in launch.tiles)
    shallow = sorted(int(t[3] + t[2]) for t in launch.tiles)[0]
    assert deepest > launch.chunk >= shallow  # merged tiles and directly written ones
    out = torch.full((q_start, heads * group, dim), float("nan"))
    case = Case(q.float(), k_cache.float(), v_cache.float(), meta, scale, ref, torch.ones(q_start, dtype=torch.bool))
    interp.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(meta, plan=plan), scale, out=out)
    check_close(out, case, torch.float32)


def test_choose_config_splits_long_decode(interp: ModuleType) -> None:
    case = make_case(
        3, kind="decode", num_seqs=1, block_size=16, num_kv_heads=1, group=4, head_dim=64,
        max_ctx=40, dtype=torch.float32,
    )
    long = build_msa_metadata([[0] * 1024], [(0, 0, 1, 16_000)], [0], 16)
    cfg = msa_plan.choose_config(long, 32, 8, 128, torch.device("cpu"))
    assert cfg.num_splits > 1 and cfg.block_m * 4 == 16
    cfg = msa_plan.choose_config(case.meta, 4, 1, 64, torch.device("cpu"))
    assert cfg.num_splits == 1


# --------------------------------------------------------------------------------------------
# CPU: the torch fast path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "prefill", "prefill-full", "mixed"])
@pytest.mark.parametrize(("block_size", "group", "head_dim"), [(16, 1, 64), (32, 3, 64), (16, 4, 128), (32, 8, 64)])
def test_msa_torch_matches_naive(kind: str, block_size: int, group: int, head_dim: int) -> None:
    seed = _seed(kind, block_size, group, head_dim, "torch")
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
    seed = _seed(kind, num_seqs, block_size, kv_heads, group, head_dim, max_ctx, str(dtype))
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
def test_store_kv_triton_gpu(compiled: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(17 + _SEED)
    num_blocks, block_size, heads, dim, num_tokens = 300, 16, 8, 128, 1000
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    k = torch.randn((num_tokens, heads, dim), generator=gen).to("cuda", dtype)
    v = torch.randn((num_tokens, heads, dim), generator=gen).to("cuda", dtype)
    caches = [torch.randn((num_blocks, block_size, heads, dim), generator=gen).to("cuda", dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    store_kv_torch(k, v, expect[0], expect[1], slots)
    compiled.store_kv_triton(k, v, caches[0], caches[1], slots)
    torch.cuda.synchronize()
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


def test_compiled_kernel_count_is_none_off_cuda() -> None:
    from kernels.dispatch import compiled_kernel_count

    assert compiled_kernel_count("cpu") is None


@pytest.mark.gpu
def test_compiled_variants_counts_new_specializations_only(compiled: ModuleType) -> None:
    def run(kind: str, kv_heads: int, group: int, head_dim: int) -> None:
        case = make_case(
            _seed("count", kind, kv_heads, group, head_dim), kind=kind, num_seqs=3, block_size=16,
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
# Batch-invariant mode: a query row gives the same bits whatever shares its launch
# --------------------------------------------------------------------------------------------


def _single_rows(case: Case, rows: list[int]) -> list[tuple[torch.Tensor, MSAMetadata]]:
    """Each packed row of ``case`` alone, as a one-token segment at its position."""
    tables = case.meta.block_tables.cpu().tolist()
    located = {}
    for seq, q_start, q_len, pos in case.meta.host_segments:
        for i in range(q_len):
            located[q_start + i] = (seq, pos + i)
    alone = []
    for row in rows:
        seq, pos = located[row]
        meta = build_msa_metadata(tables, [(seq, 0, 1, pos)], [-1], case.meta.block_size, device=case.q.device)
        alone.append((case.q[row : row + 1], meta))
    return alone


def _invariant_case(
    device: str, dtype: torch.dtype, group: int, head_dim: int, max_ctx: int, seed: int, kind: str = "mixed",
    ctxs: list[int] | None = None,
) -> Case:
    return make_case(
        seed, kind=kind, num_seqs=4, block_size=16, num_kv_heads=2, group=group,
        head_dim=head_dim, max_ctx=max_ctx, dtype=dtype, device=device, max_segs=3, ctxs=ctxs,
    )


def _check_invariant(module: ModuleType, case: Case, dtype: torch.dtype, rows: list[int]) -> None:
    """The step's rows, planned every way the invariant mode may plan them (one program per
    tile merging its chunks, or chunks spread over programs and merged after), equal each
    other bit for bit and are accurate; on the GPU the same rows computed alone equal them too.

    NOTE: the interpreter's dots are numpy's BLAS, whose result for a row depends on where the
    row sits in the tile (measured: OpenBLAS 0.3.31), so "alone" is checked on the GPU only.
    """
    heads, kv_heads, dim = case.q.shape[1], case.k_cache.shape[2], case.q.shape[2]
    device = case.q.device
    outs = []
    for partial_bytes in (0, 1 << 40):  # 0: no split partials, in-program merge; else split
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(msa_plan, "_INVARIANT_PARTIAL_BYTES", partial_bytes)
            plan = msa_plan.plan_msa(case.meta, heads, kv_heads, dim, device, dtype=dtype, invariant=True)
            out = torch.full_like(case.q, float("nan"))
            module.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale, out=out)
        outs.append((plan, out))
    (merged_plan, merged), (split_plan, split) = outs
    assert all(launch.num_splits == 1 for launch in merged_plan.launches)
    assert any(launch.num_splits > 1 for launch in split_plan.launches), "no launch took the split path"
    assert torch.equal(merged, split)
    # fewer programs than chunks: each walks every second (third) chunk, partials by chunk
    for splits in (2, 3):
        launches = [
            dataclasses.replace(launch, num_splits=min(splits, launch.num_splits), num_chunks=launch.partial_slots)
            if launch.num_splits > 1 else launch
            for launch in split_plan.launches
        ]
        fewer_plan = dataclasses.replace(split_plan, launches=tuple(launches))
        assert any(1 < launch.num_splits < launch.num_chunks for launch in fewer_plan.launches)
        fewer = torch.full_like(case.q, float("nan"))
        module.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=fewer_plan), case.scale, out=fewer)
        assert torch.equal(merged, fewer), f"{splits} programs per tile"
    check_close(merged, case, dtype)
    if device.type != "cuda":
        return
    for row, (q_row, meta) in zip(rows, _single_rows(case, rows), strict=True):
        plan = msa_plan.plan_msa(meta, heads, kv_heads, dim, device, dtype=dtype, invariant=True)
        alone = module.msa_triton(q_row, case.k_cache, case.v_cache, dataclasses.replace(meta, plan=plan), case.scale)
        assert torch.equal(alone[0], merged[row]), f"row {row} differs alone"


def _rows_to_check(case: Case, count: int) -> list[int]:
    """The last rows of the longest segment and every decode: chunk boundaries and short tiles."""
    segs = sorted(case.meta.host_segments, key=lambda s: -s[2])
    longest = segs[0]
    rows = list(range(longest[1] + max(0, longest[2] - count), longest[1] + longest[2]))
    rows += [s[1] for s in case.meta.host_segments if s[2] == 1]
    return rows


def test_msa_triton_interpreter_batch_invariant(interp: ModuleType) -> None:
    """Contexts past several fixed chunks, holes and decodes in one step."""
    case = _invariant_case("cpu", torch.float32, group=2, head_dim=16, max_ctx=5200, seed=_seed("bi", 3))
    assert max(s[3] + s[2] for s in case.meta.host_segments) > 2 * msa_plan.INVARIANT_CHUNK
    _check_invariant(interp, case, torch.float32, _rows_to_check(case, 3))


def test_msa_triton_interpreter_batch_invariant_decodes(interp: ModuleType) -> None:
    """Decode tiles over many chunks, spread over programs as on an H200: the split merge
    folds every chunk, in order, to the in-program walk's bits."""
    case = _invariant_case(
        "cpu", torch.float32, group=4, head_dim=16, max_ctx=5200, seed=_seed("bi-decode", 4), kind="decode"
    )
    with pytest.MonkeyPatch.context() as mp:
        # an H200's SMs: 4 decodes x 2 KV heads are too few programs, so the chunks spread
        mp.setattr(msa_plan, "_num_sms", lambda device: 132)
        plan = msa_plan.plan_msa(case.meta, 8, 2, 16, torch.device("cpu"), dtype=torch.float32, invariant=True)
        (launch,) = plan.launches
        chunks = -(-max(s[3] + s[2] for s in case.meta.host_segments) // msa_plan.INVARIANT_CHUNK)
        assert 1 < launch.num_splits and chunks >= 4
        _check_invariant(interp, case, torch.float32, _rows_to_check(case, 4))


def test_msa_triton_interpreter_batch_invariant_split_with_one_chunk_contexts(interp: ModuleType) -> None:
    """A split launch whose short decodes fit one chunk: those tiles fold and write their rows
    themselves (the merge skips them), to the in-program walk's bits."""
    chunk = msa_plan.INVARIANT_CHUNK
    ctxs = [chunk // 2, 4 * chunk + 100, 37, chunk]  # one chunk, five, one, exactly one
    case = _invariant_case(
        "cpu", torch.float32, group=4, head_dim=16, max_ctx=max(ctxs), seed=_seed("bi-one-chunk", 5),
        kind="decode", ctxs=ctxs,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_plan, "_num_sms", lambda device: 132)
        (launch,) = msa_plan.plan_msa(case.meta, 8, 2, 16, torch.device("cpu"), dtype=torch.float32, invariant=True).launches
        assert launch.num_splits > 1
        _check_invariant(interp, case, torch.float32, [s[1] for s in case.meta.host_segments])


def _check_decode_graph_invariant(module: ModuleType, case: Case, dtype: torch.dtype, max_context: int) -> None:
    """A batch-invariant CUDA-graph decode launch (:func:`~kernels.msa_plan.decode_graph_plan`:
    tile ``i`` is sequence ``i``, splits sized for ``max_context``) gives the bits of the step's
    own plan (one program per tile merging its chunks), with padding tiles writing zeros, the
    whole grid of splits or fewer programs than chunks (each walking several)."""
    heads, kv_heads, dim = case.q.shape[1], case.k_cache.shape[2], case.q.shape[2]
    device = case.q.device
    segments = case.meta.host_segments
    assert all((q_start, q_len) == (i, 1) for i, (_, q_start, q_len, _) in enumerate(segments))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_plan, "_INVARIANT_PARTIAL_BYTES", 0)
        own = msa_plan.plan_msa(case.meta, heads, kv_heads, dim, device, dtype=dtype, invariant=True)
    merged = torch.full_like(case.q, float("nan"))
    module.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=own), case.scale, out=merged)
    num, pad = len(segments), 2
    tiles = torch.tensor([(i, i, 1, pos) for i, (_, _, _, pos) in enumerate(segments)] + [(0, 0, 0, 0)] * pad,
                         dtype=torch.int32, device=device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_plan, "_num_sms", lambda device: 132)
        plan = msa_plan.decode_graph_plan(tiles, heads, kv_heads, max_context, head_dim=dim, dtype=dtype, invariant=True)
    assert plan.invariant and plan.num_splits > 1
    # the graph's table: row i is tile i's sequence, as wide as max_context (or as the step's
    # own table, padded wider), rows past the batch for the padding tiles
    block_size = case.k_cache.shape[1]
    width = max(-(-max_context // block_size), case.meta.block_tables.shape[1])
    tables = torch.zeros((num + pad, width), dtype=torch.int32, device=device)
    seqs = torch.tensor([seq for seq, _, _, _ in segments], device=device)
    tables[:num, : case.meta.block_tables.shape[1]] = case.meta.block_tables[seqs]
    q = torch.cat((case.q, torch.randn((pad, *case.q.shape[1:]), device=device).to(dtype)))
    for splits in (plan.num_splits, 2):
        launch = dataclasses.replace(plan, num_splits=splits)
        out = torch.full_like(q, float("nan"))
        meta = dataclasses.replace(case.meta, block_tables=tables, plan=launch)
        module.msa_triton(q, case.k_cache, case.v_cache, meta, case.scale, out=out)
        assert torch.equal(out[:num], merged), f"{splits} programs per tile"
        assert (out[num:] == 0).all()
    check_close(merged, case, dtype)


def test_msa_triton_interpreter_batch_invariant_decode_graph(interp: ModuleType) -> None:
    chunk = msa_plan.INVARIANT_CHUNK
    ctxs = [chunk // 2, 2 * chunk + 100, 37, chunk, chunk + 1]  # 1, 3, 1, 1, 2 chunks
    case = make_case(
        _seed("bi-graph", 5), kind="decode", num_seqs=len(ctxs), block_size=16, num_kv_heads=2, group=4,
        head_dim=16, max_ctx=max(ctxs), dtype=torch.float32, ctxs=ctxs,
    )
    _check_decode_graph_invariant(interp, case, torch.float32, 4 * chunk)


def test_invariant_config_is_the_same_for_every_step(interp: ModuleType) -> None:
    cpu = torch.device("cpu")
    decode = _invariant_case("cpu", torch.float32, group=4, head_dim=64, max_ctx=300, seed=1)
    plans = [
        msa_plan.plan_msa(c.meta, 8, 2, 64, cpu, dtype=torch.bfloat16, invariant=True)
        for c in (decode, _invariant_case("cpu", torch.float32, group=4, head_dim=64, max_ctx=9000, seed=2))
    ]
    launches = [launch for plan in plans for launch in plan.launches]
    # what sets a row's bits is fixed: the KV tile and the chunk; tile heights may differ
    assert {launch.config.block_n for launch in launches} == {64}
    assert {launch.chunk for launch in launches} == {msa_plan.INVARIANT_CHUNK}
    assert all(launch.invariant for launch in launches)
    graph = msa_plan.decode_graph_plan(
        torch.zeros((4, 4), dtype=torch.int32), 8, 2, 131072, head_dim=64, invariant=True
    )
    assert graph.config == plans[0].launches[-1].config  # the short (decode) launch of a step
    assert graph.chunk == msa_plan.INVARIANT_CHUNK and graph.chunk_buffer is None
    assert msa_plan.decode_graph_chunk(graph, 10) == msa_plan.INVARIANT_CHUNK


@pytest.mark.parametrize("group", [1, 3])
def test_msa_tiled_rows_equal_alone(group: int) -> None:
    """The batch-invariant torch path: every checked row alone gives the same bits as inside
    its step (a prefill chunk, holes, decodes), and the step is accurate."""
    from kernels.reference import msa_tiled

    case = _invariant_case("cpu", torch.float32, group=group, head_dim=32, max_ctx=700, seed=_seed("tiled", group))
    out = msa_tiled(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)
    rows = _rows_to_check(case, 40)
    for row, (q_row, meta) in zip(rows, _single_rows(case, rows), strict=True):
        alone = msa_tiled(q_row, case.k_cache, case.v_cache, meta, case.scale)
        assert torch.equal(alone[0], out[row]), f"row {row} differs alone"


# (block_size, kv_heads, group, head_dim, max_ctx)
_GPU_INVARIANT_CASES = [(16, 8, 4, 128, 9000), (32, 2, 8, 64, 20_000), (16, 4, 1, 128, 33_000), (64, 1, 16, 64, 5000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "max_ctx"), _GPU_INVARIANT_CASES)
def test_msa_triton_gpu_batch_invariant(
    compiled: ModuleType, dtype: torch.dtype, block_size: int, kv_heads: int, group: int, head_dim: int, max_ctx: int
) -> None:
    case = make_case(
        _seed("bi-gpu", block_size, kv_heads, group, head_dim, max_ctx), kind="mixed", num_seqs=4,
        block_size=block_size, num_kv_heads=kv_heads, group=group, head_dim=head_dim, max_ctx=max_ctx,
        dtype=dtype, device="cuda", max_segs=4,
    )
    _check_invariant(compiled, case, dtype, _rows_to_check(case, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "max_context"), [
    (16, 8, 4, 128, 16384), (32, 2, 8, 64, 8192), (16, 4, 1, 128, 40_000),
])
def test_msa_triton_gpu_batch_invariant_decode_graph(
    compiled: ModuleType, dtype: torch.dtype, block_size: int, kv_heads: int, group: int, head_dim: int,
    max_context: int,
) -> None:
    chunk = msa_plan.INVARIANT_CHUNK
    ctxs = [chunk // 2, chunk, chunk + 1, 7 * chunk + 13, max_context - 3, 2048, 333, 3 * chunk]
    case = make_case(
        _seed("bi-graph-gpu", block_size, kv_heads, group, head_dim), kind="decode", num_seqs=len(ctxs),
        block_size=block_size, num_kv_heads=kv_heads, group=group, head_dim=head_dim, max_ctx=max(ctxs),
        dtype=dtype, device="cuda", ctxs=ctxs,
    )
    _check_decode_graph_invariant(compiled, case, dtype, max_context)


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
    layout = _random_layout(_seed("layout", layout_seed) + _SEED)
    case = make_case(_seed("layout-case", layout_seed), dtype=dtype, device="cuda", **layout)  # type: ignore[arg-type]
    out = torch.full_like(case.q, float("nan"))
    compiled.msa_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    torch.cuda.synchronize()
    check_close(out, case, dtype)
    if dtype == torch.float32:
        assert float((out.double().cpu() - case.ref).abs().max()) <= 1e-5, layout
