"""Benchmark of the Triton MSA kernel against its peers, one table from one run.

``python -m kernels.bench [--quick] [--sweep] [--json PATH]`` on a CUDA machine;
``python -m kernels.bench --decode-sweep`` times only decode launches (batch 1-8, contexts
8k-128k) over tile shapes and KV splits, against the planner's choice and the copy bandwidth;
``python -m kernels.bench --decode-floor`` splits the planner's decode launches into walk and
merge, in both modes, against a kernel that only reads as many bytes (:mod:`kernels.bench_decode`).

Shapes: bf16, head_dim 128, 32 query heads / 8 KV heads, paged caches of 16-token blocks
scattered over a larger pool. Layouts: one sequence of context 4k-32k whose step holds 1-8
segments (``n - 1`` holes of 512 tokens spread over the history plus a 1k suffix), one causal
8k prefill, and decode batches (one token per sequence) at 16k-32k.

Rows (same inputs within a layout):

- ``msa``: :func:`kernels.msa_triton.msa_triton`, one launch (plus its split-K reduce), with
  its launch plan built beforehand (the engine plans once per step for every layer).
- ``loop``: the same kernel called once per segment.
- ``gather+sdpa``: gather the sequence's KV into a contiguous buffer, then one SDPA call per
  segment with a lower-right causal mask (flash backend where SDPA takes it).
- ``flex``: compiled FlexAttention with a block mask expressing the same segments, on
  contiguous KV (no gather timed; the block mask is built outside the timing).
- ``dense``: dense causal SDPA-flash of (nearly) equal FLOPs: the upper mark.

FLOPs count only the unmasked work: ``4 * HQ * D * sum_q (pos_q + 1)``. Decode rows report
achieved bandwidth (K and V of every context read once) against a device-to-device copy
measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.metadata import MSAMetadata, build_msa_metadata
from kernels.msa_config import MSAConfig, choose_config
from kernels.msa_plan import plan_msa
from kernels.msa_triton import msa_triton
from kernels.reference import msa_naive

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclass
class Layout:
    """One benchmark step: ``segs`` per sequence as ``(pos_start, q_len)``, contexts ``ctxs``."""

    name: str
    ctxs: list[int]
    segs: list[list[tuple[int, int]]]
    kind: str = "prefill"  # prefill | decode


@dataclass
class Row:
    layout: str
    method: str
    ms: float
    tflops: float | None = None
    gbps: float | None = None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (CUDA events, via ``triton.testing.do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def segment_layout(ctx: int, num_segs: int, hole: int = 512, suffix: int = 1024) -> Layout:
    """``num_segs - 1`` holes of ``hole`` tokens spread over ``[0, ctx - suffix)`` + suffix."""
    segs = []
    body = ctx - suffix
    for i in range(num_segs - 1):
        start = (i + 1) * body // num_segs
        start = start // PAGE * PAGE
        segs.append((start, hole))
    segs.append((ctx - suffix, suffix))
    return Layout(f"{ctx // 1024}k x{num_segs}seg", [ctx], [segs])


def decode_layout(batch: int, ctx: int) -> Layout:
    return Layout(f"decode {batch}x{ctx // 1024}k", [ctx] * batch, [[(ctx - 1, 1)]] * batch, "decode")


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: MSAMetadata
    tables: list[list[int]]
    qpos: torch.Tensor  # [T] absolute position of each packed query


def make_inputs(layout: Layout, gen: torch.Generator) -> Inputs:
    """Random bf16 q and a paged cache; each sequence's blocks scattered over the pool."""
    blocks = [-(-c // PAGE) for c in layout.ctxs]
    pool = int(sum(blocks) * 1.25) + 8
    perm = torch.randperm(pool, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks:
        tables.append(perm[i : i + n])
        i += n
    k_cache = torch.randn((pool, PAGE, HKV, D), device="cuda", dtype=DTYPE)
    v_cache = torch.randn((pool, PAGE, HKV, D), device="cuda", dtype=DTYPE)
    segments, slots, qpos, start = [], [], [], 0
    for s, segs in enumerate(layout.segs):
        for pos, n in segs:
            segments.append((s, start, n, pos))
            slots += [tables[s][p // PAGE] * PAGE + p % PAGE for p in range(pos, pos + n)]
            qpos += list(range(pos, pos + n))
            start += n
    q = torch.randn((start, HQ, D), device="cuda", dtype=DTYPE)
    meta = build_msa_metadata(tables, segments, slots, PAGE, device="cuda")
    return Inputs(q, k_cache, v_cache, meta, tables, torch.tensor(qpos, device="cuda"))


def planned(meta: MSAMetadata, config: MSAConfig | None = None, invariant: bool = False) -> MSAMetadata:
    """``meta`` with its launch plan attached, as the engine runs it: planned once per step and
    shared by every layer, so the timed calls are the kernels alone (``invariant``: the
    batch-invariant mode's plan)."""
    plan = plan_msa(meta, HQ, HKV, D, meta.block_tables.device, config, dtype=DTYPE, invariant=invariant)
    return dataclasses.replace(meta, plan=plan)


def causal_flops(inp: Inputs) -> float:
    return 4.0 * HQ * D * float((inp.qpos + 1).sum())


def gather_seq(cache: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
    """``[1, HKV, ctx, D]`` contiguous copy of one sequence's first ``ctx`` tokens."""
    idx = torch.tensor(table, device=cache.device)
    return cache.index_select(0, idx).reshape(-1, HKV, D)[:ctx].transpose(0, 1).unsqueeze(0)


def sdpa_segments(inp: Inputs, layout: Layout, scale: float) -> Callable[[], torch.Tensor]:
    """Gather each sequence's KV, then one lower-right-causal SDPA call per segment."""
    from torch.nn.attention.bias import causal_lower_right

    plans = []
    for s, ctx in enumerate(layout.ctxs):
        q_start = sum(n for segs in layout.segs[:s] for _, n in segs)
        segs = []
        for pos, n in layout.segs[s]:
            end = pos + n
            mask = None if pos == 0 else causal_lower_right(n, end)
            segs.append((q_start, n, end, mask))
            q_start += n
        plans.append((s, ctx, segs))
    out = torch.empty_like(inp.q)

    def run(gqa: bool) -> torch.Tensor:
        for s, ctx, segs in plans:
            k = gather_seq(inp.k_cache, inp.tables[s], ctx)
            v = gather_seq(inp.v_cache, inp.tables[s], ctx)
            if not gqa:  # this torch's CausalBias path takes no enable_gqa: expand the heads
                k = k.repeat_interleave(HQ // HKV, dim=1)
                v = v.repeat_interleave(HQ // HKV, dim=1)
            for q_start, n, end, mask in segs:
                qs = inp.q[q_start : q_start + n].transpose(0, 1).unsqueeze(0)
                kw = {"enable_gqa": True} if gqa else {}
                o = F.scaled_dot_product_attention(
                    qs, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                    is_causal=mask is None and n > 1, scale=scale, **kw,
                )
                out[q_start : q_start + n] = o[0].transpose(0, 1)
        return out

    try:
        run(True)
        return lambda: run(True)
    except Exception as exc:  # noqa: BLE001
        print(f"[{layout.name}] sdpa with enable_gqa failed ({exc!r}); expanding heads", file=sys.stderr)
        return lambda: run(False)


def compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile``d FlexAttention, allowed one compiled kernel per layout shape."""
    from torch._dynamo import config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # NOTE: keeps dynamo from falling back to the unfused (score-materialising) path after its
    # default 8 recompiles
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 256)
    return torch.compile(flex_attention, dynamic=False)


@contextmanager
def _planner_set(module: str, name: str, value: object) -> Iterator[None]:
    """Within the block, ``kernels.<module>.<name>`` is ``value`` (one of the planner's rules
    switched back to an earlier choice)."""
    import importlib

    mod = importlib.import_module(f"kernels.{module}")
    saved = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, saved)


def narrow_kv_tiles() -> contextlib.AbstractContextManager[None]:
    """Every launch walks 64-key KV tiles, as before the planner's 128-key tiles for deep
    prefills (``kernels.msa_config._WIDE_KV_MIN_KEYS``)."""
    return _planner_set("msa_config", "_WIDE_KV_MIN_KEYS", 1 << 62)


def split_wide_kv_tiles() -> contextlib.AbstractContextManager[None]:
    """The 128-key KV tiles always run at least two KV splits, as before they ran on the
    split path at one split (``kernels.msa_config._WIDE_KV_MIN_SPLITS``)."""
    return _planner_set("msa_config", "_WIDE_KV_MIN_SPLITS", 2)


def tile_first_grid() -> contextlib.AbstractContextManager[None]:
    """Every launch's grid goes tile first, as before the planner ordered uneven prefill
    launches by KV head first (``kernels.msa_grid_order.HEADS_FIRST_MIN_GAIN``)."""
    return _planner_set("msa_grid_order", "HEADS_FIRST_MIN_GAIN", math.inf)


def flex_fn(inp: Inputs, layout: Layout, scale: float, flex: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention on contiguous KV with a block mask of the same segments."""
    from torch.nn.attention.flex_attention import create_block_mask

    if layout.kind == "decode":
        k = torch.cat([gather_seq(inp.k_cache, t, c) for t, c in zip(inp.tables, layout.ctxs, strict=True)])
        v = torch.cat([gather_seq(inp.v_cache, t, c) for t, c in zip(inp.tables, layout.ctxs, strict=True)])
        q = inp.q.unsqueeze(2)  # [B, HQ, 1, D]
        return lambda: flex(q, k, v, scale=scale, enable_gqa=True)
    assert len(layout.ctxs) == 1
    k = gather_seq(inp.k_cache, inp.tables[0], layout.ctxs[0])
    v = gather_seq(inp.v_cache, inp.tables[0], layout.ctxs[0])
    q = inp.q.transpose(0, 1).unsqueeze(0)  # [1, HQ, T, D]
    qpos = inp.qpos

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= qpos[q_idx]

    bm = create_block_mask(mask_mod, 1, None, q.shape[2], k.shape[2], device="cuda")
    return lambda: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)


def dense_sdpa(length: int, gen_seed: int, backend: str) -> tuple[Callable[[], torch.Tensor], float]:
    """Causal SDPA on ``length`` tokens (heads expanded to MHA, as FA2 runs fastest without
    GQA); ``backend`` is ``flash`` or ``auto`` (SDPA's own pick). Returns the call, its FLOPs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(gen_seed)
    q = torch.randn((1, HQ, length, D), device="cuda", dtype=DTYPE)
    k = torch.randn((1, HQ, length, D), device="cuda", dtype=DTYPE)
    v = torch.randn((1, HQ, length, D), device="cuda", dtype=DTYPE)

    def run() -> torch.Tensor:
        if backend == "flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run, 4.0 * HQ * D * length * (length + 1) / 2


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + written) / time, in GB/s."""
    x = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6


def correctness() -> tuple[float, float]:
    """Relative and max abs error of msa_triton vs msa_naive (float64) on a 4k, 4-seg step."""
    gen = torch.Generator().manual_seed(123)
    lay = segment_layout(4096, 4, hole=256, suffix=512)
    lay.segs[0].insert(0, (0, 1))  # a decode-like single token at position 0 too
    lay.segs[0] = sorted(lay.segs[0])
    inp = make_inputs(lay, gen)
    scale = D**-0.5
    out = torch.full_like(inp.q, float("nan"))
    msa_triton(inp.q, inp.k_cache, inp.v_cache, inp.meta, scale, out=out)
    ref = msa_naive(inp.q.double(), inp.k_cache.double(), inp.v_cache.double(), inp.meta, scale)
    err = out.double() - ref
    return float(err.norm() / ref.norm()), float(err.abs().max().nan_to_num(float("inf")))


def run_layout(
    layout: Layout, flex: Callable[..., torch.Tensor] | None, seed: int, rows: list[Row]
) -> None:
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(layout, gen)
    scale = D**-0.5
    flops = causal_flops(inp)
    kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * inp.k_cache.element_size()

    def record(method: str, ms: float, note: str = "") -> None:
        rows.append(Row(layout.name, method, ms, flops / ms / 1e9, kv_bytes / ms / 1e6, note))

    meta = planned(inp.meta)
    launch = meta.plan.launches[0]
    cfg = launch.config
    record("msa", bench_ms(lambda: msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale)),
           f"bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} split{launch.num_splits}"
           + (" heads first" if launch.heads_first else ""))
    if layout.kind == "prefill" and inp.meta.num_segments > 1:
        per_seg = []
        for seq, q_start, q_len, pos in inp.meta.host_segments:
            m = build_msa_metadata(inp.tables, [(seq, 0, q_len, pos)], [0] * q_len, PAGE, device="cuda")
            per_seg.append((inp.q[q_start : q_start + q_len], planned(m)))

        def loop() -> None:
            for qs, m in per_seg:
                msa_triton(qs, inp.k_cache, inp.v_cache, m, scale)

        record("loop", bench_ms(loop))
    try:
        record("gather+sdpa", bench_ms(sdpa_segments(inp, layout, scale)))
    except Exception as exc:  # noqa: BLE001 - report, keep the table going
        print(f"[{layout.name}] gather+sdpa failed: {exc!r}", file=sys.stderr)
    if flex is not None:
        try:
            fn = flex_fn(inp, layout, scale, flex)
            fn()
            record("flex", bench_ms(fn), "contiguous KV")
        except Exception as exc:  # noqa: BLE001
            print(f"[{layout.name}] flex failed: {exc!r}", file=sys.stderr)
    if layout.kind == "prefill":
        length = max(128, round(math.sqrt(flops / (2.0 * HQ * D)) / 128) * 128)
        for backend in ("flash", "auto"):
            run, dense_flops = dense_sdpa(length, seed, backend)
            ms = bench_ms(run)
            rows.append(Row(layout.name, f"dense-{backend} {length}", ms, dense_flops / ms / 1e9, None,
                            "causal, MHA, contiguous"))


def sweep(rows: list[Row]) -> None:
    """Times a few launch configurations on representative layouts."""
    scale = D**-0.5
    # NOTE: (64, 32, 8, 3) and (32, 64, 8, 3) are the prefill tiles that compile without
    # spills (python -m kernels.offline_compile, Triton 3.6: the default 256 x 64 tile spills
    # 128 bytes a thread)
    cases = [
        (segment_layout(16384, 4), [(64, 64, 8, 3), (64, 32, 8, 3), (32, 64, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3)]),
        (segment_layout(4096, 1), [(64, 64, 8, 3), (64, 128, 8, 2)]),
        (segment_layout(16384, 1), [(64, 64, 8, 3), (64, 32, 8, 3), (32, 64, 8, 3)]),
        (Layout("causal 8k", [8192], [[(0, 8192)]]), [(64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 3), (32, 64, 8, 3)]),
        (decode_layout(8, 32768), [(4, 64, 2, 3), (4, 128, 4, 3)]),
    ]
    for layout, configs in cases:
        inp = make_inputs(layout, torch.Generator().manual_seed(7))
        base = choose_config(inp.meta, HQ, HKV, D, inp.q.device)
        splits = sorted({1, base.num_splits, max(1, base.num_splits // 2), base.num_splits * 2})
        for bm, bn, w, s in configs:
            for sp in splits:
                cfg = MSAConfig(bm, bn, w, s, sp)
                try:
                    meta = planned(inp.meta, cfg)
                    ms = bench_ms(lambda meta=meta, inp=inp: msa_triton(inp.q, inp.k_cache, inp.v_cache, meta, scale))
                except Exception as exc:  # noqa: BLE001
                    print(f"sweep {layout.name} {cfg} failed: {exc!r}", file=sys.stderr)
                    continue
                flops = causal_flops(inp)
                kv_bytes = 2.0 * sum(layout.ctxs) * HKV * D * 2
                rows.append(Row(layout.name, "sweep", ms, flops / ms / 1e9, kv_bytes / ms / 1e6,
                                f"bm{bm} bn{bn} w{w} s{s} split{sp}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer layouts")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument("--decode-sweep", action="store_true", help="only the decode launch sweep")
    parser.add_argument("--decode-floor", action="store_true",
                        help="only the decode launch breakdown against read floors (kernels.bench_decode)")
    parser.add_argument("--json", default=None, help="write all rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.decode_sweep or args.decode_floor:
        from kernels.bench_decode import decode_floor, decode_sweep

        copy_gbps = copy_bandwidth()
        print(f"device: {torch.cuda.get_device_name()}, copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
        rows = decode_floor(copy_gbps) if args.decode_floor else decode_sweep(copy_gbps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_gbps": copy_gbps, "rows": [r.__dict__ for r in rows]}, f, indent=1)
        return 0
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}")
    rel, max_abs = correctness()
    print(f"correctness vs msa_naive(float64), 4k x5 segments bf16: rel {rel:.2e}, max abs {max_abs:.2e}")
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")

    flex = None
    try:
        flex = compiled_flex()
    except Exception as exc:  # noqa: BLE001
        print(f"FlexAttention unavailable: {exc!r}", file=sys.stderr)

    if args.quick:
        grid = [(16384, 4), (8192, 8)]
        decodes = [(16, 16384)]
    else:
        grid = [(4096, 1), (4096, 4), (8192, 2), (8192, 4), (8192, 8), (16384, 1), (16384, 4),
                (16384, 8), (32768, 4), (32768, 8)]
        decodes = [(8, 16384), (16, 16384), (8, 32768), (32, 32768), (1, 32768)]
    layouts = [segment_layout(c, n) for c, n in grid]
    layouts.append(Layout("causal 8k", [8192], [[(0, 8192)]]))
    layouts += [decode_layout(b, c) for b, c in decodes]
    rows: list[Row] = []
    for i, layout in enumerate(layouts):
        run_layout(layout, flex, 1000 + i, rows)
        torch.cuda.empty_cache()
        done = ", ".join(f"{r.method} {r.ms:.3f}" for r in rows if r.layout == layout.name)
        print(f"[{time.time() - t0:5.0f} s] {layout.name}: {done}", flush=True)
    if args.sweep:
        sweep(rows)
        print(f"[{time.time() - t0:5.0f} s] sweep done", flush=True)

    print_table(rows, copy_gbps)
    print_targets(rows, copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rel_err": rel, "max_abs_err": max_abs,
                       "rows": [r.__dict__ for r in rows]}, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")
    return 0


def print_table(rows: list[Row], copy_gbps: float) -> None:
    msa = {r.layout: r for r in rows if r.method == "msa"}
    print()
    print("| layout | method | ms | TFLOP/s | GB/s (KV) | msa speedup | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        base = msa.get(r.layout)
        speed = f"{r.ms / base.ms:.2f}x" if base is not None and r.method != "sweep" else ""
        tf = f"{r.tflops:.0f}" if r.tflops is not None else ""
        bw = f"{r.gbps:.0f} ({r.gbps / copy_gbps:.0%})" if r.gbps is not None and "decode" in r.layout else ""
        print(f"| {r.layout} | {r.method} | {r.ms:.3f} | {tf} | {bw} | {speed} | {r.note} |")


def print_targets(rows: list[Row], copy_gbps: float) -> None:
    by = {(r.layout, r.method): r for r in rows}
    msa = [r for r in rows if r.method == "msa"]
    print()
    loop = [(r.layout, by[(r.layout, "loop")].ms / r.ms) for r in msa
            if (r.layout, "loop") in by and int(r.layout.split("x")[1].rstrip("seg")) >= 4]
    if loop:
        worst = min(loop, key=lambda x: x[1])
        print(f"target msa >= 1.3x loop (>= 4 segments): worst {worst[1]:.2f}x ({worst[0]})")
    flex = [(r.layout, by[(r.layout, "flex")].ms / r.ms) for r in msa if (r.layout, "flex") in by]
    if flex:
        worst = min(flex, key=lambda x: x[1])
        print(f"target msa >= 1.0x flex (every layout): worst {worst[1]:.2f}x ({worst[0]})")
    c8 = by.get(("causal 8k", "msa"))
    dense = [r for r in rows if r.layout == "causal 8k" and r.method.startswith("dense-flash")]
    if c8 is not None and dense and c8.tflops and dense[0].tflops:
        print(f"target msa >= 70% of dense SDPA-flash at 8k: {c8.tflops / dense[0].tflops:.0%} "
              f"({c8.tflops:.0f} vs {dense[0].tflops:.0f} TFLOP/s)")
    dec = [(r.layout, (r.gbps or 0) / copy_gbps) for r in msa if r.layout.startswith("decode")
           and int(r.layout.split()[1].split("x")[0]) >= 8 and int(r.layout.split("x")[1].rstrip("k")) >= 16]
    if dec:
        worst = min(dec, key=lambda x: x[1])
        print(f"target decode >= 70% of copy bandwidth (ctx >= 16k, batch >= 8): worst {worst[1]:.0%} ({worst[0]})")


if __name__ == "__main__":
    raise SystemExit(main())
