"""What bounds a turn of the batch-invariant decode walk (GPU): one launch's variants, timed.

Run on the GPU machine: ``python scripts/gpu_walk_diag.py [--contexts 2048,8192]``.

The batch-invariant split decode gives each (KV head, 512-key chunk) one program that walks the
chunk's eight 64-key tiles in order, an online softmax over 64 query rows (a decode fills 4 of
them: one token times 4 query heads). This script times the library's launch for a CUDA-graph
decode (:func:`kernels.msa_plan.decode_graph_plan`), walk and merge (one launch since
2026-12-04, no zero fill) and walk alone, beside a stand-alone copy of the walk with one thing
changed at a time:

- ``paged, ids a turn ahead``: K/V rows found through the block table, each tile's block ids
  loaded a turn ahead (what the library does); ``in the turn``: loaded in the turn that uses
  them; ``contiguous``: the pages laid out in order, ids computed, nothing loaded;
- ``no softmax``: the scores go straight to the second dot (no max, exp or sums): what the
  softmax's chain costs (its output is wrong);
- 2 stages instead of 3;
- the library's structure added back one feature at a time: the context read from memory
  before the first block ids, a loop over the program's chunks around the chunk's walk, and the
  tiles every row sees walked apart from the masked ones (two loops).

(Block ids loaded once per chunk and picked from registers with ``tl.gather`` crashed on Triton
3.6 with an illegal address: not kept.) Each variant runs in a process of its own, as a CUDA
graph of 32 launches over 32 distinct KV caches (a step's layers: the KV does not stay in L2
between them); microseconds a launch, median of 20 replays.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

HQ, HKV, D, PAGE, CHUNK, BLOCK_N = 32, 8, 128, 16, 512, 64
G, G_PAD, ROWS = HQ // HKV, 4, 64
LAYERS = 32


@triton.jit
def _walk_kernel(
    q, k_cache, v_cache, bt, o_part, ml_part, ctx, p_ctx, scale_log2,
    stride_kb, stride_ks, stride_kh,
    PAGE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    IDS: tl.constexpr, PREFETCH: tl.constexpr, SOFTMAX: tl.constexpr,
    TABLE: tl.constexpr, NESTED: tl.constexpr, TWO_LOOPS: tl.constexpr, AHEAD: tl.constexpr = False,
):
    """One (KV head, chunk): the chunk's tiles in order. ``IDS``: 0 paged (a load per tile,
    ``PREFETCH`` a turn ahead), 1 contiguous (computed). The library's structure, one feature at a time:
    ``TABLE`` reads the context from memory (``p_ctx``, as the library reads its tile's entry)
    before the first block ids; ``NESTED`` walks the chunk inside a loop over the program's
    chunks; ``TWO_LOOPS`` walks the tiles every row sees, then the masked ones, in two loops."""
    i_kvh, i_c = tl.program_id(0), tl.program_id(1)
    if TABLE:
        # the block table's row comes from the entry too (row 0 here), so the first ids wait
        ctx = tl.load(p_ctx)
        bt = bt + tl.load(p_ctx + 1).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, D)
    m_r = o_r < G
    o_h = i_kvh * G + (o_r % G_PAD)
    b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    o_pos = (o_r * 0 + ctx - 1)
    i_lo = i_c * CHUNK
    i_hi = tl.minimum(i_lo + CHUNK, ctx)
    b_m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    o_t = tl.arange(0, BLOCK_N)
    b_blk = tl.load(bt + (i_lo + o_t) // PAGE, mask=(i_lo + o_t) < ctx, other=0).to(tl.int64)
    # NESTED: the chunk walk inside a loop over the program's chunks (one turn here), as the
    # library's split path; TWO_LOOPS: the tiles every row sees, then the masked ones
    i_full = i_hi
    if TWO_LOOPS:
        i_full = tl.maximum(i_lo, tl.minimum(i_hi, ctx // BLOCK_N * BLOCK_N))
    if NESTED:
        for i_cc in range(i_c, tl.cdiv(ctx, CHUNK), tl.num_programs(1)):
            b_acc, b_m, b_l, b_blk = _walk_tiles(
                b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_cc * CHUNK, i_full, ctx, o_t, o_d, o_pos,
                scale_log2, stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N, IDS, PREFETCH, SOFTMAX,
            )
    elif AHEAD:
        b_acc, b_m, b_l = _walk_tiles_ahead(
            b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_lo, i_full, ctx, o_t, o_d, o_pos, scale_log2,
            stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N,
        )
    else:
        b_acc, b_m, b_l, b_blk = _walk_tiles(
            b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_lo, i_full, ctx, o_t, o_d, o_pos, scale_log2,
            stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N, IDS, PREFETCH, SOFTMAX,
        )
    if TWO_LOOPS:
        b_acc, b_m, b_l, b_blk = _walk_tiles(
            b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_full, i_hi, ctx, o_t, o_d, o_pos, scale_log2,
            stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N, IDS, PREFETCH, SOFTMAX,
        )
    # partials [chunk, KV head, row, D] and [chunk, KV head, row, 2]
    i_part = i_c * tl.num_programs(0) + i_kvh
    p_o = o_part + i_part * (BLOCK_R * D) + o_r[:, None] * D + o_d[None, :]
    tl.store(p_o, b_acc, mask=m_r[:, None])
    p_ml = ml_part + i_part * (BLOCK_R * 2) + o_r * 2
    tl.store(p_ml, b_m, mask=m_r)
    tl.store(p_ml + 1, b_l, mask=m_r)


@triton.jit
def _walk_tiles(
    b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_lo, i_hi, ctx, o_t, o_d, o_pos, scale_log2,
    stride_kb, stride_ks, stride_kh, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IDS: tl.constexpr,
    PREFETCH: tl.constexpr, SOFTMAX: tl.constexpr,
):
    for i_n in range(i_lo, i_hi, BLOCK_N):
        o_n = i_n + o_t
        m_n = o_n < ctx
        if IDS == 0:
            if PREFETCH:
                b_cur = b_blk
                b_blk = tl.load(bt + (o_n + BLOCK_N) // PAGE, mask=(o_n + BLOCK_N) < ctx, other=0).to(tl.int64)
            else:
                b_cur = tl.load(bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        else:
            b_cur = (o_n // PAGE).to(tl.int64)
        o_in = (o_n % PAGE).to(tl.int64)
        o_k = b_cur * stride_kb + o_in * stride_ks + i_kvh * stride_kh
        b_k = tl.load(k_cache + o_k[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(v_cache + o_k[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k))
        if SOFTMAX:
            b_s = tl.where((o_n[None, :] <= o_pos[:, None]) & m_n[None, :], b_s, -1.0e30)
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
            b_p = tl.exp2(b_s * scale_log2 - b_m_new[:, None])
            b_alpha = tl.exp2(b_m - b_m_new)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None]
            b_m = b_m_new
        else:
            b_p = b_s
        b_acc += tl.dot(b_p.to(b_q.dtype), b_v)
    return b_acc, b_m, b_l, b_blk


@triton.jit
def _walk_tiles_ahead(
    b_q, b_acc, b_m, b_l, b_blk, bt, k_cache, v_cache, i_kvh, i_lo, i_hi, ctx, o_t, o_d, o_pos, scale_log2,
    stride_kb, stride_ks, stride_kh, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The paged walk with each tile's scores computed a turn ahead: the next tile's first dot
    is issued before this tile's softmax, so the tensor cores can run it while the softmax's chain
    runs (the same operations on the same values in the same order: the same bits)."""
    # first tile's scores (b_blk holds its block ids); the next tile's ids a turn ahead
    o_n = i_lo + o_t
    o_k = b_blk * stride_kb + (o_n % PAGE).to(tl.int64) * stride_ks + i_kvh * stride_kh
    b_k = tl.load(k_cache + o_k[:, None] + o_d[None, :], mask=(o_n < ctx)[:, None], other=0.0)
    b_s_next = tl.dot(b_q, tl.trans(b_k))
    b_nxt = tl.load(bt + (o_n + BLOCK_N) // PAGE, mask=(o_n + BLOCK_N) < ctx, other=0).to(tl.int64)
    for i_n in range(i_lo, i_hi, BLOCK_N):
        o_n = i_n + o_t
        m_n = o_n < ctx
        b_s = b_s_next
        o_v = b_blk * stride_kb + (o_n % PAGE).to(tl.int64) * stride_ks + i_kvh * stride_kh
        b_v = tl.load(v_cache + o_v[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        # the next tile: its keys, its scores, the ids of the one after
        o_n2 = o_n + BLOCK_N
        m_n2 = (o_n2 < ctx) & (o_n2 < i_hi)
        o_k2 = b_nxt * stride_kb + (o_n2 % PAGE).to(tl.int64) * stride_ks + i_kvh * stride_kh
        b_k2 = tl.load(k_cache + o_k2[:, None] + o_d[None, :], mask=m_n2[:, None], other=0.0)
        b_s_next = tl.dot(b_q, tl.trans(b_k2))
        b_blk = b_nxt
        b_nxt = tl.load(bt + (o_n2 + BLOCK_N) // PAGE, mask=(o_n2 + BLOCK_N) < ctx, other=0).to(tl.int64)
        b_s = tl.where((o_n[None, :] <= o_pos[:, None]) & m_n[None, :], b_s, -1.0e30)
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
        b_p = tl.exp2(b_s * scale_log2 - b_m_new[:, None])
        b_alpha = tl.exp2(b_m - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None]
        b_m = b_m_new
        b_acc += tl.dot(b_p.to(b_q.dtype), b_v)
    return b_acc, b_m, b_l


class Variant(NamedTuple):
    """One stand-alone walk: ``ids`` 0 paged, 1 contiguous; the rest as :func:`_walk_kernel`."""

    name: str
    ids: int
    prefetch: int
    softmax: int
    warps: int
    stages: int
    table: int
    nested: int
    two_loops: int
    ahead: int = 0


VARIANTS = [Variant(*v) for v in [
    ("paged, ids a turn ahead (library)", 0, 1, 1, 4, 3, 0, 0, 0),
    ("paged, ids in the turn", 0, 0, 1, 4, 3, 0, 0, 0),
    ("contiguous", 1, 0, 1, 4, 3, 0, 0, 0),
    ("paged ahead, 2 stages", 0, 1, 1, 4, 2, 0, 0, 0),
    ("paged ahead, no softmax", 0, 1, 0, 4, 3, 0, 0, 0),
    ("+ context read from memory first", 0, 1, 1, 4, 3, 1, 0, 0),
    ("+ chunk loop around the walk", 0, 1, 1, 4, 3, 0, 1, 0),
    ("+ two loops (seen, masked)", 0, 1, 1, 4, 3, 0, 0, 1),
    ("+ all three (the library's structure)", 0, 1, 1, 4, 3, 1, 1, 1),
    ("paged ahead, 8 warps", 0, 1, 1, 8, 3, 0, 0, 0),
    ("scores a turn ahead", 0, 1, 1, 4, 3, 0, 0, 0, 1),
    ("scores a turn ahead, 2 stages", 0, 1, 1, 4, 2, 0, 0, 0, 1),
    ("scores a turn ahead, 8 warps", 0, 1, 1, 8, 3, 0, 0, 0, 1),
]]


def walk(variant: Variant, q, k, v, table, o_part, ml_part, ctx: int, p_ctx, scale: float) -> None:  # type: ignore[no-untyped-def]
    """Launches ``variant`` over ``q [1, HKV * G, D]`` and caches ``[pages, PAGE, HKV, D]``
    into ``o_part [chunks, HKV, rows, D]`` and ``ml_part [chunks, HKV, rows, 2]``."""
    _walk_kernel[(k.shape[2], o_part.shape[0])](
        q, k, v, table, o_part, ml_part, ctx, p_ctx, scale * 1.4426950408889634, k.stride(0), k.stride(1),
        k.stride(2), PAGE=PAGE, G=G, G_PAD=G_PAD, BLOCK_R=o_part.shape[2], BLOCK_N=BLOCK_N, D=k.shape[3],
        CHUNK=CHUNK, IDS=variant.ids, PREFETCH=variant.prefetch, SOFTMAX=variant.softmax,
        TABLE=bool(variant.table), NESTED=bool(variant.nested), TWO_LOOPS=bool(variant.two_loops),
        AHEAD=bool(variant.ahead), num_warps=variant.warps, num_stages=variant.stages,
    )


def graph_us(fns, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds a call of the CUDA graph that runs each of ``fns`` once."""
    from kernels.bench_decode import graph_ms

    return graph_ms(fns, reps) * 1000


def _layers(ctx: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``LAYERS`` distinct ``(q, k_cache, v_cache, block table)`` of one ``ctx``-key decode."""
    pages = ctx // PAGE
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    out = []
    for _ in range(LAYERS):
        k = torch.randn((pages, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn((pages, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn((1, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
        out.append((q, k, v, table))
    return out


def run_variant(index: int, contexts: list[int]) -> None:
    """Times variant ``index`` of :data:`VARIANTS` (-1: the library's launch) at each context and
    prints one ``ctx name us checksum`` line each (a crash takes only this process down)."""
    from unittest import mock

    from kernels import msa_triton as msa_module
    from kernels.metadata import build_msa_metadata
    from kernels.msa_plan import decode_graph_plan

    for ctx in contexts:
        chunks = ctx // CHUNK
        layers = _layers(ctx)
        if index >= 0:
            p_ctx = torch.tensor([ctx, 0], device="cuda", dtype=torch.int32)
            o_part = torch.zeros((chunks, HKV, ROWS, D), device="cuda", dtype=torch.float32)
            ml_part = torch.zeros((chunks, HKV, ROWS, 2), device="cuda", dtype=torch.float32)

            def launch(layer, variant=VARIANTS[index], o_part=o_part, ml_part=ml_part, ctx=ctx, p_ctx=p_ctx):  # type: ignore[no-untyped-def]
                walk(variant, *layer, o_part, ml_part, ctx, p_ctx, D**-0.5)

            launch(layers[0])
            torch.cuda.synchronize()
            check = float(o_part[:, :, :G].double().sum() + ml_part[:, :, :G].double().sum())
            us = graph_us([lambda layer=layer, f=launch: f(layer) for layer in layers])
            print(f"ROW {ctx} {index} {us:.2f} {check:.6e}", flush=True)
            continue
        for label, skip in ((-1, False), (-2, True)):
            fns = []
            for q, k, v, table in layers:
                tiles = torch.tensor([[0, 0, 1, ctx - 1]], device="cuda", dtype=torch.int32)
                plan = decode_graph_plan(tiles, HQ, HKV, ctx, head_dim=D, invariant=True)
                if skip:  # the merge in a kernel of its own, skipped (not in the walk's launch)
                    plan = dataclasses.replace(plan, merge_counts=None)
                meta = build_msa_metadata(
                    [table.tolist()], [(0, 0, 1, ctx - 1)], [int(table[-1]) * PAGE + PAGE - 1], PAGE, device="cuda"
                )
                meta = dataclasses.replace(meta, plan=plan)
                out = torch.empty_like(q)
                fns.append(lambda q=q, k=k, v=v, meta=meta, out=out: msa_module.msa_triton(q, k, v, meta, D**-0.5, out=out))
            if skip:
                class _Skip:
                    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
                        return lambda *a, **kw: None

                with mock.patch.object(msa_module, "_msa_reduce_kernel", _Skip()):
                    us = graph_us(fns)
            else:
                us = graph_us(fns)
            print(f"ROW {ctx} {label} {us:.2f} 0", flush=True)


def check_cpu(ctx: int = 600, kv_heads: int = 2, dim: int = 32, rows: int = 16) -> None:
    """Runs the variants under Triton's interpreter (``TRITON_INTERPRET=1``, float32 on the CPU,
    small heads to keep it short) and checks what the GPU table relies on: the variants that
    keep the walk's math give the same partial states bit for bit (pages in order too, through
    the identity table), and those partials, merged, are attention over the context.
    Raises ``AssertionError``."""
    gen = torch.Generator().manual_seed(0)
    pages, chunks = -(-ctx // PAGE), -(-ctx // CHUNK)
    k = torch.randn((pages, PAGE, kv_heads, dim), generator=gen)
    v = torch.randn((pages, PAGE, kv_heads, dim), generator=gen)
    q = torch.randn((1, kv_heads * G, dim), generator=gen)
    scale = dim**-0.5
    p_ctx = torch.tensor([ctx, 0], dtype=torch.int32)

    def states(variant: Variant, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o_part = torch.zeros((chunks, kv_heads, rows, dim))
        ml_part = torch.zeros((chunks, kv_heads, rows, 2))
        walk(variant, q, k, v, table, o_part, ml_part, ctx, p_ctx, scale)
        return o_part[:, :, :G], ml_part[:, :, :G]

    library_like = VARIANTS[0]
    in_order = torch.arange(pages, dtype=torch.int32)
    contiguous = next(variant for variant in VARIANTS if variant.ids == 1)
    for got, want in zip(states(contiguous, in_order), states(library_like, in_order), strict=True):
        assert torch.equal(got, want), contiguous.name
    table = torch.randperm(pages, generator=gen).to(torch.int32)
    base_o, base_ml = states(library_like, table)
    for variant in VARIANTS[1:]:
        if variant.softmax and variant.ids == 0:
            o_part, ml_part = states(variant, table)
            assert torch.equal(o_part, base_o) and torch.equal(ml_part, base_ml), variant.name
    # merge the chunks (base 2) and compare with attention over the whole context
    m, lsum = base_ml[..., 0], base_ml[..., 1]
    w = torch.exp2(m - m.max(dim=0).values)
    out = (base_o * w[..., None]).sum(0) / (lsum * w).sum(0)[..., None]  # [HKV, G, D]
    keys = k[table.long()].reshape(-1, kv_heads, dim)[:ctx].double()
    values = v[table.long()].reshape(-1, kv_heads, dim)[:ctx].double()
    probs = torch.softmax(torch.einsum("hgd,thd->hgt", q[0].double().reshape(kv_heads, G, dim), keys) * scale, dim=-1)
    ref = torch.einsum("hgt,thd->hgd", probs, values)
    assert float((out.double() - ref).abs().max()) < 1e-4


def main() -> None:
    import subprocess
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--variant", type=int, default=None, help="run one variant here (-1: the library's launch)")
    ap.add_argument("--check-cpu", action="store_true", help="check the variants under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.check_cpu:
        check_cpu()
        print("ok: the walk's variants agree and are attention")
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.variant is not None:
        run_variant(args.variant, contexts)
        return
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; us a launch, {LAYERS} layers' KV")
    names = {-1: "library walk + merge (in the walk's launch)", -2: "library walk only"}
    names |= {i: variant.name for i, variant in enumerate(VARIANTS)}
    rows: dict[tuple[int, int], tuple[float, str]] = {}
    for index in [-1, *range(len(VARIANTS))]:
        proc = subprocess.run(
            [sys.executable, __file__, "--contexts", args.contexts, "--variant", str(index)],
            capture_output=True, text=True, timeout=300,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("ROW "):
                _, ctx, i, us, check = line.split()
                rows[(int(ctx), int(i))] = (float(us), check)
        if proc.returncode != 0:
            print(f"variant {names[index]!r} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
    for ctx in contexts:
        base = rows.get((ctx, -2), (float("nan"), ""))[0]
        ref = rows.get((ctx, 0), (0.0, ""))[1]
        print(f"\n1 x {ctx} keys ({ctx // CHUNK} chunks; KV {2 * ctx * HKV * D * 2 / 1e6:.1f} MB a layer)")
        print("| variant | us | vs library walk | checksum as the library-like walk |")
        print("|---|---:|---:|---|")
        for index in [-1, -2, *range(len(VARIANTS))]:
            if (ctx, index) not in rows:
                print(f"| {names[index]} | failed | | |")
                continue
            us, check = rows[(ctx, index)]
            same = "" if index < 0 else ("same" if check == ref else "differs")
            print(f"| {names[index]} | {us:.1f} | {us / base:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
