"""MSA launch plans (:mod:`kernels.msa_plan`): the CUDA-graph decode plan, the step's tile
classes and KV splits, each run under Triton's interpreter against the float64 oracle."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from kernels import msa_config, msa_grid_order, msa_plan
from kernels.metadata import build_msa_metadata
from kernels.reference import msa_naive
from tests.kernels.msa_cases import Case, case_seed, check_close, make_case


@pytest.mark.parametrize(("group", "max_ctx", "max_context"), [(4, 150, 400), (2, 1100, 1400)])
def test_msa_triton_interpreter_decode_graph_plan(
    interp: ModuleType, group: int, max_ctx: int, max_context: int
) -> None:
    """The CUDA-graph launch: a fixed KV chunk sized for ``max_context`` (splits past a context
    do no work), one tile per sequence from a device table, padding tiles writing zeros."""
    case = make_case(
        case_seed("graph", group, max_ctx), kind="decode", num_seqs=3, block_size=16, num_kv_heads=2,
        group=group, head_dim=64, max_ctx=max_ctx, dtype=torch.float32,
    )
    num_pad = 2
    tiles = [(seq, q_start, q_len, pos) for seq, q_start, q_len, pos in case.meta.host_segments]
    tiles += [(0, len(tiles) + i, 0, 0) for i in range(num_pad)]  # padding rows
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
        case_seed("graph-chunk", group, max_ctx), kind="decode", num_seqs=3, block_size=16, num_kv_heads=2,
        group=group, head_dim=64, max_ctx=max_ctx, dtype=torch.float32,
    )
    tiles = [(seq, q_start, q_len, pos) for seq, q_start, q_len, pos in case.meta.host_segments]
    tiles += [(0, len(tiles), 0, 0)]
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
            case_seed("classes", seed), kind="mixed", num_seqs=4, block_size=16, num_kv_heads=1, group=4,
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
    gen = torch.Generator().manual_seed(case_seed("deep-hole"))
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
    cfg = msa_config.choose_config(long, 32, 8, 128, torch.device("cpu"))
    assert cfg.num_splits > 1 and cfg.block_m * 4 == 16
    cfg = msa_config.choose_config(case.meta, 4, 1, 64, torch.device("cpu"))
    assert cfg.num_splits == 1


def test_choose_config_walks_deep_prefills_in_wide_kv_tiles(interp: ModuleType) -> None:
    """Prefill tiles of 256 rows whose queries see >= 8k keys on average walk 128-key tiles,
    two stages deep, on the kernel's split path; fresh prompts, shallow holes and tiles that would not fit the
    shared memory (float32) keep 64-key tiles. The wide tile gives the oracle's output, split
    and at one split on the split path (every tile writing its output directly)."""
    cpu = torch.device("cpu")

    def config(segments: list[tuple[int, int, int, int]], dtype: torch.dtype = torch.bfloat16) -> msa_config.MSAConfig:
        blocks = -(-max(pos + n for _, _, n, pos in segments) // 16)
        tokens = sum(n for _, _, n, _ in segments)
        meta = build_msa_metadata([[0] * blocks], segments, [0] * tokens, 16)
        return msa_config.choose_config(meta, 32, 8, 128, cpu, dtype)

    deep = [(0, 0, 512, 7_000), (0, 512, 512, 15_000), (0, 1024, 1024, 31_000)]  # a 32k history's holes
    wide = config(deep)
    assert (wide.block_m * 4, wide.block_n, wide.num_stages, wide.split_path) == (256, 128, 2, True)
    fresh = config([(0, 0, 8192, 0)])  # a fresh 8k prompt: 4k keys a query on average
    assert fresh.block_n == 64 and not fresh.split_path
    shallow = config([(0, 0, 512, 2_000), (0, 512, 1024, 7_000)])
    assert shallow.block_n == 64
    assert config(deep, torch.float32).block_n < 128  # 256 x 128 float32 tiles do not fit

    case = make_case(
        case_seed("wide-kv"), kind="prefill", num_seqs=1, block_size=16, num_kv_heads=1, group=4,
        head_dim=64, max_ctx=420, dtype=torch.float32,
    )
    for cfg in (msa_config.MSAConfig(64, 128, 8, 2, 2), msa_config.MSAConfig(64, 128, 8, 2, 1, split_path=True)):
        for heads_first in (False, True):
            plan = msa_plan.plan_msa(case.meta, 4, 1, 64, cpu, config=cfg)
            plan = msa_plan.MSAStepPlan(tuple(dataclasses.replace(lp, heads_first=heads_first) for lp in plan.launches))
            out = torch.full_like(case.q, float("nan"))
            interp.msa_triton(case.q, case.k_cache, case.v_cache, dataclasses.replace(case.meta, plan=plan), case.scale, out=out)
            check_close(out, case, torch.float32)


def test_plan_msa_orders_uneven_prefill_launches_by_kv_head_first() -> None:
    """Library prefill launches whose tiles sit at many depths go KV head first (the deepest
    tile of every head starts first); a chunk deep in one prompt, where every tile is about
    as deep, decode launches, launches that fit the GPU at once and the batch-invariant mode
    keep the tile first."""
    cpu = torch.device("cpu")

    def plan(segments: list[tuple[int, int, int, int]], invariant: bool = False) -> msa_plan.MSAStepPlan:
        blocks = -(-max(pos + n for _, _, n, pos in segments) // 16)
        tokens = sum(n for _, _, n, _ in segments)
        meta = build_msa_metadata([[0] * blocks], segments, [0] * tokens, 16)
        return msa_plan.plan_msa(meta, 32, 8, 128, cpu, invariant=invariant)

    holes = [(0, 512 * i, 512, 4096 * (i + 1)) for i in range(7)] + [(0, 3584, 1024, 31_744)]  # 32k, 8 segments
    deep_chunk = [(0, 0, 8192, 24_576)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_config, "_num_sms", lambda device: 132)
        assert [lp.heads_first for lp in plan(holes).launches] == [True]
        assert [lp.heads_first for lp in plan(deep_chunk).launches] == [False]
        assert not any(lp.heads_first for lp in plan(holes, invariant=True).launches)
        mixed = plan(holes + [(0, 4608, 1, 40_000)])  # a decode beside: its own launch
        assert [lp.heads_first for lp in mixed.launches] == [True, False]
        assert not plan([(0, 0, 512, 30_000)]).launches[0].heads_first  # 8 tiles x 8 heads < 132 SMs
    # the model alone: one deep tile among shallow ones runs on alone by tile first
    assert msa_grid_order.heads_first_pays([32_000] * 16 + [4_000] * 56, 8, 1 << 30, 132)
    assert not msa_grid_order.heads_first_pays([30_000] * 128, 8, 1 << 30, 132)


def _heads_first_gain_loop(tile_keys: list[int], num_kv_heads: int, chunk: int, num_sms: int) -> float:
    """The grid-order model, program by program: the modelled makespan by tile first over the
    one by KV head first (the reference twin of ``msa_grid_order.heads_first_pays``)."""
    fixed = msa_grid_order.TILE_FIXED_KEYS
    done = by_tile = by_head = 0.0
    for i_split in range(-(-max(tile_keys) // chunk)):
        costs = [min(chunk, k - i_split * chunk) + fixed for k in tile_keys if k > i_split * chunk]
        head_work = sum(costs)
        before = 0.0
        for cost in costs:
            by_tile = max(by_tile, (done + (num_kv_heads - 1) * head_work + before) / num_sms + cost)
            by_head = max(by_head, (done + num_kv_heads * before + (num_kv_heads - 1) * cost) / num_sms + cost)
            before += cost
        done += num_kv_heads * head_work
    work = done / num_sms
    return max(by_tile, work) / max(by_head, work)


def test_heads_first_model_matches_its_program_by_program_twin() -> None:
    gen = torch.Generator().manual_seed(case_seed("grid-order"))
    decided = set()
    for _ in range(200):
        num_tiles = int(torch.randint(20, 300, (1,), generator=gen))
        ctx = [2_000, 8_000, 32_000, 131_072][int(torch.randint(4, (1,), generator=gen))]
        chunk = [1 << 30, 4096, 16_384][int(torch.randint(3, (1,), generator=gen))]
        keys = sorted(torch.randint(1, ctx + 1, (num_tiles,), generator=gen).tolist(), reverse=True)
        gain = _heads_first_gain_loop(keys, 8, chunk, 132)
        if abs(gain - msa_grid_order.HEADS_FIRST_MIN_GAIN) < 1e-9:
            continue
        decision = msa_grid_order.heads_first_pays(keys, 8, chunk, 132)
        assert decision == (gain >= msa_grid_order.HEADS_FIRST_MIN_GAIN), (num_tiles, ctx, chunk, gain)
        decided.add(decision)
    assert decided == {True, False}  # the draws reach both answers
