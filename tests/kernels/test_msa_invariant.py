"""The MSA kernels' batch-invariant mode: a query row gives the same bits whatever shares its
launch (interpreter on the CPU, compiled on the GPU), the CUDA-graph decode plan included."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from kernels import msa_config, msa_plan
from kernels.metadata import MSAMetadata, build_msa_metadata
from tests.kernels.msa_cases import Case, case_seed, check_close, make_case

# NOTE: the interpreter runs a kernel's every turn in Python, so its tests of the chunked walk
# and merge take a 128-key chunk (two 64-key turns, as the 512-key default takes eight): the
# same code paths (turns within a chunk, folds across chunks, eight chunk states a merge
# turn) over a quarter of the keys. The default chunk runs in the one-chunk interpreter test
# and in every GPU test.
SHORT_CHUNK = 128


@pytest.fixture
def short_chunk(monkeypatch: pytest.MonkeyPatch) -> int:
    """:data:`kernels.msa_plan.INVARIANT_CHUNK` set to :data:`SHORT_CHUNK` for one test."""
    monkeypatch.setattr(msa_plan, "INVARIANT_CHUNK", SHORT_CHUNK)
    return SHORT_CHUNK


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


def test_msa_triton_interpreter_batch_invariant(interp: ModuleType, short_chunk: int) -> None:
    """Contexts past several fixed chunks, holes and decodes in one step."""
    case = _invariant_case("cpu", torch.float32, group=2, head_dim=16, max_ctx=6 * short_chunk, seed=case_seed("bi", 3))
    assert max(s[3] + s[2] for s in case.meta.host_segments) > 2 * msa_plan.INVARIANT_CHUNK
    with pytest.MonkeyPatch.context() as mp:
        # more SMs than the step's few tiles: programs left for its chunks to spread over
        mp.setattr(msa_config, "_num_sms", lambda device: 8)
        _check_invariant(interp, case, torch.float32, _rows_to_check(case, 3))


def test_msa_triton_interpreter_batch_invariant_decodes(interp: ModuleType, short_chunk: int) -> None:
    """Decode tiles over many chunks, spread over programs as on an H200: the split merge
    folds every chunk, in order, to the in-program walk's bits."""
    case = _invariant_case(
        "cpu", torch.float32, group=4, head_dim=16, max_ctx=6 * short_chunk, seed=case_seed("bi-decode", 4), kind="decode"
    )
    with pytest.MonkeyPatch.context() as mp:
        # an H200's SMs: 4 decodes x 2 KV heads are too few programs, so the chunks spread
        mp.setattr(msa_config, "_num_sms", lambda device: 132)
        plan = msa_plan.plan_msa(case.meta, 8, 2, 16, torch.device("cpu"), dtype=torch.float32, invariant=True)
        (launch,) = plan.launches
        chunks = -(-max(s[3] + s[2] for s in case.meta.host_segments) // msa_plan.INVARIANT_CHUNK)
        assert 1 < launch.num_splits and chunks >= 4
        _check_invariant(interp, case, torch.float32, _rows_to_check(case, 4))


def _check_split_decodes(interp: ModuleType, ctxs: list[int], seed: int, min_splits: int) -> None:
    """Decodes of contexts ``ctxs`` planned as on an H200 (chunks spread over more than
    ``min_splits`` programs) give the in-program walk's bits (:func:`_check_invariant`)."""
    case = _invariant_case(
        "cpu", torch.float32, group=4, head_dim=16, max_ctx=max(ctxs), seed=seed, kind="decode", ctxs=ctxs
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_config, "_num_sms", lambda device: 132)
        (launch,) = msa_plan.plan_msa(case.meta, 8, 2, 16, torch.device("cpu"), dtype=torch.float32, invariant=True).launches
        assert launch.num_splits > min_splits
        _check_invariant(interp, case, torch.float32, [s[1] for s in case.meta.host_segments])


def test_msa_triton_interpreter_batch_invariant_split_with_one_chunk_contexts(interp: ModuleType) -> None:
    """A split launch whose short decodes fit one chunk: those tiles fold and write their rows
    themselves (the merge skips them), to the in-program walk's bits."""
    chunk = msa_plan.INVARIANT_CHUNK
    # one chunk, five, one, exactly one
    _check_split_decodes(interp, [chunk // 2, 4 * chunk + 100, 37, chunk], case_seed("bi-one-chunk", 5), 1)


def test_msa_triton_interpreter_batch_invariant_merge_over_many_turns(interp: ModuleType, short_chunk: int) -> None:
    """The split merge folds eight chunk states a loop turn: contexts of 18, 9, 8 and 1 chunks
    (a partial last turn, a last turn of one chunk, one full turn, none to merge) give the
    in-program walk's bits."""
    chunk = msa_plan.INVARIANT_CHUNK
    _check_split_decodes(interp, [17 * chunk + 5, 9 * chunk, 3, 8 * chunk], case_seed("bi-many-turns", 6), 8)


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
    tiles = torch.tensor([(i, i, 1, pos) for i, (_, _, _, pos) in enumerate(segments)]
                         + [(i, i, 0, 0) for i in range(num, num + pad)], dtype=torch.int32, device=device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_config, "_num_sms", lambda device: 132)
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
    assert plan.covered_rows == num + pad and plan.merge_counts is not None
    # the merge in the walk's launch (the default), twice on one plan (the counts reset), the
    # merge kernel, and one program a tile (the in-program walk a large batch's graph takes);
    # the grid by tile or by KV head first
    variants = [(plan.num_splits, plan.merge_counts, False), (2, plan.merge_counts, False), (2, None, False),
                (1, None, False), (plan.num_splits, plan.merge_counts, True)]
    for splits, counts, heads_first in variants:
        launch = dataclasses.replace(plan, num_splits=splits, merge_counts=counts, heads_first=heads_first)
        for _ in range(2 if counts is not None else 1):
            out = torch.full_like(q, float("nan"))
            meta = dataclasses.replace(case.meta, block_tables=tables, plan=launch)
            module.msa_triton(q, case.k_cache, case.v_cache, meta, case.scale, out=out)
            assert torch.equal(out[:num], merged), f"{splits} programs per tile, merge counts {counts is not None}, heads first {heads_first}"
            assert (out[num:] == 0).all()
            assert not plan.merge_counts.any()
    check_close(merged, case, dtype)


def test_msa_triton_interpreter_batch_invariant_decode_graph(interp: ModuleType, short_chunk: int) -> None:
    chunk = short_chunk
    ctxs = [chunk // 2, 2 * chunk + 100, 37, chunk, chunk + 1]  # 1, 3, 1, 1, 2 chunks
    case = make_case(
        case_seed("bi-graph", 5), kind="decode", num_seqs=len(ctxs), block_size=16, num_kv_heads=2, group=4,
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
    from kernels.msa_tiled import msa_tiled

    case = _invariant_case("cpu", torch.float32, group=group, head_dim=32, max_ctx=700, seed=case_seed("tiled", group))
    out = msa_tiled(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)
    rows = _rows_to_check(case, 40)
    for row, (q_row, meta) in zip(rows, _single_rows(case, rows), strict=True):
        alone = msa_tiled(q_row, case.k_cache, case.v_cache, meta, case.scale)
        assert torch.equal(alone[0], out[row]), f"row {row} differs alone"


@pytest.mark.parametrize("group", [1, 3])
def test_msa_tiled_decodes_batched_equal_alone(group: int) -> None:
    """A step of many decodes: contexts within one tile, at and across tile edges and tile
    counts of several batches (padded to their batch's widest), some sequences twice. Each
    decode's bits are its bits alone, and the step is accurate."""
    from kernels.msa_tiled import TILE_KEYS, msa_tiled

    ctxs = [1, 5, TILE_KEYS, TILE_KEYS + 1, 2 * TILE_KEYS - 1, 3 * TILE_KEYS, 300, 700, 4 * TILE_KEYS + 2, 129]
    case = make_case(
        case_seed("tiled-decodes", group), kind="decode", num_seqs=len(ctxs), block_size=16, num_kv_heads=2,
        group=group, head_dim=32, max_ctx=max(ctxs), dtype=torch.float32, ctxs=ctxs,
    )
    assert len(case.meta.host_segments) == len(ctxs)
    out = msa_tiled(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    check_close(out, case, torch.float32)
    rows = [seg[1] for seg in case.meta.host_segments]
    for row, (q_row, meta) in zip(rows, _single_rows(case, rows), strict=True):
        alone = msa_tiled(q_row, case.k_cache, case.v_cache, meta, case.scale)
        assert torch.equal(alone[0], out[row]), f"decode row {row} differs alone"


def test_msa_tiled_plans_a_step_once_and_batches_decodes_by_width() -> None:
    from kernels.msa_tiled import (
        DECODE_BATCH_KEYS,
        TILE_KEYS,
        _decode_batches,
        msa_tiled,
        prepare_msa_tiled,
    )

    # by position; a batch closes where its padded width doubles or its keys pass the budget
    segs = [(i, i, 1, pos) for i, pos in enumerate([10, 70, 100, 127, 128, 300, 5000])]
    widths = [[-(-(s[3] + 1) // TILE_KEYS) * TILE_KEYS for s in batch] for batch in _decode_batches(segs)]
    assert widths == [[64], [128, 128, 128, 192], [320], [5056]]
    many = [(i, i, 1, 1000) for i in range(9)]  # 1,024 keys each: four to a batch
    assert [len(b) for b in _decode_batches(many)] == [4, 4, 1] and 4 * 1024 <= DECODE_BATCH_KEYS
    # a step planned once (the backend's prepare) gives the bits of one planned in the call
    case = _invariant_case("cpu", torch.float32, group=3, head_dim=32, max_ctx=500, seed=case_seed("tiled-plan", 1))
    prepared = prepare_msa_tiled(case.meta, case.q.shape[1], case.k_cache.shape[2], case.q.shape[2])
    assert prepared.plan is not None and len(prepared.plan.calls) >= 2
    planned = msa_tiled(case.q, case.k_cache, case.v_cache, prepared, case.scale)
    assert torch.equal(planned, msa_tiled(case.q, case.k_cache, case.v_cache, case.meta, case.scale))
    check_close(planned, case, torch.float32)


# (block_size, kv_heads, group, head_dim, max_ctx)
_GPU_INVARIANT_CASES = [(16, 8, 4, 128, 9000), (32, 2, 8, 64, 20_000), (16, 4, 1, 128, 33_000), (64, 1, 16, 64, 5000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "max_ctx"), _GPU_INVARIANT_CASES)
def test_msa_triton_gpu_batch_invariant(
    compiled: ModuleType, dtype: torch.dtype, block_size: int, kv_heads: int, group: int, head_dim: int, max_ctx: int
) -> None:
    case = make_case(
        case_seed("bi-gpu", block_size, kv_heads, group, head_dim, max_ctx), kind="mixed", num_seqs=4,
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
        case_seed("bi-graph-gpu", block_size, kv_heads, group, head_dim), kind="decode", num_seqs=len(ctxs),
        block_size=block_size, num_kv_heads=kv_heads, group=group, head_dim=head_dim, max_ctx=max(ctxs),
        dtype=dtype, device="cuda", ctxs=ctxs,
    )
    _check_decode_graph_invariant(compiled, case, dtype, max_context)
