"""The host KV tier on the GPU: copy bandwidth, exactness, and overlap with decode steps.

Run on the GPU machine::

    python scripts/gpu_host_tier.py [--model dummy:llama-3.1-8b] [--json OUT.json]

Prints three tables:

1. Copy bandwidth of :class:`~asymcache_core.kv_transfer.HostKVCache` (pinned host memory,
   whole blocks through the staging buffer) per direction and batch of blocks, against a plain
   pinned ``copy_`` of the same bytes: the ``h2d_bytes_per_s`` / ``d2h_bytes_per_s`` of a profile.
2. The multi-session multi-turn script under a tight pool with a host tier, every policy,
   batch-invariant mode, against an unbounded pool: greedy tokens that agree, blocks reloaded.
3. A decode step at batch 32 alone, and while the copy streams move blocks both ways: the cost
   of the copies to the compute they overlap. ``--profile-overlap`` adds the busiest GPU kernels
   and copies of those steps per stream (torch profiler), and ``--only-overlap`` skips the
   first two tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asymcache_core import Engine
from asymcache_core.host_tier import KVTransfers
from asymcache_core.kv_transfer import HostKVCache
from asymcache_core.loaders import load_model
from kernels.block_copy import DEFAULT_LAUNCH, CopyLaunch
from scripts.gpu_batch_invariant import multi_turn, start_decodes

DEVICE = "cuda"


def timed_copies(host: HostKVCache, transfers: KVTransfers, launch: CopyLaunch | None) -> float:
    """Median seconds of issuing ``transfers`` until they land, the staging passes run by the
    block-copy kernel with ``launch`` or (``None``) by torch's index ops."""
    kept, host.copy_launch = host.copy_launch, launch
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.issue(transfers)
        host.wait_all()
        times.append(time.perf_counter() - start)
    host.copy_launch = kept
    return statistics.median(times[1:])


def bandwidth(engine: Engine, sizes: tuple[int, ...] = (16, 64, 256, 1024)) -> list[dict[str, float]]:
    cache = engine.runner.kv_cache  # type: ignore[attr-defined]
    host = HostKVCache(cache, num_slots=max(sizes) * 2)
    num_blocks = cache.shape[2]
    rows = []
    for n in sizes:
        blocks = torch.randperm(num_blocks)[:n].tolist()
        slots = torch.randperm(host.host.shape[0])[:n].tolist()
        for name, transfers in (
            ("d2h", KVTransfers(0, list(zip(blocks, slots, strict=True)), [], None)),
            ("h2d", KVTransfers(1, [], list(zip(slots, blocks, strict=True)), None)),
        ):
            seconds, torch_seconds = (timed_copies(host, transfers, launch) for launch in (DEFAULT_LAUNCH, None))
            nbytes = n * host.slot_bytes
            plain = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
            dev = torch.empty_like(plain, device=DEVICE)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                (plain.copy_(dev, non_blocking=True) if name == "d2h" else dev.copy_(plain, non_blocking=True))
            torch.cuda.synchronize()
            plain_s = (time.perf_counter() - start) / 3
            rows.append({"direction": name, "blocks": n, "GB/s": nbytes / seconds / 1e9,
                         "torch index ops GB/s": nbytes / torch_seconds / 1e9, "plain GB/s": nbytes / plain_s / 1e9})
            print(f"| {name} | {n} | {nbytes / 2**20:.0f} MiB | {rows[-1]['GB/s']:.1f} | "
                  f"{rows[-1]['torch index ops GB/s']:.1f} | {rows[-1]['plain GB/s']:.1f} |", flush=True)
    return rows


def exactness(loaded, model: str) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    common = dict(model=model, device=DEVICE, loaded=loaded, enforce_eager=True, batch_invariant=True,
                  max_num_batched_tokens=8192)
    reference = multi_turn(Engine(num_kv_blocks=8192, eviction_policy="vllm-apc", **common))
    rows = []
    for policy in ("lru", "vllm-apc", "pensieve", "asymcache"):
        engine = Engine(num_kv_blocks=160, eviction_policy=policy, num_host_kv_blocks=512, **common)
        outs = multi_turn(engine)
        stats = engine.stats()
        agree = sum(a == b for a, b in zip(outs, reference, strict=True)) / len(reference)
        rows.append({"policy": policy, "turns_equal": agree, "reloaded": stats.host_reloaded_blocks_total,
                     "offloaded": stats.host_offloaded_blocks_total, "evictions": stats.evictions_total,
                     "computed": stats.engine_computed_tokens_total})
        print(f"| {policy} | {agree:.0%} | {stats.host_offloaded_blocks_total} | {stats.host_reloaded_blocks_total} | "
              f"{stats.evictions_total} | {stats.engine_computed_tokens_total} |", flush=True)
    return rows


def overlap(loaded, model: str, batch: int = 32, context: int = 4096, moving: int = 256,  # type: ignore[no-untyped-def]
            profile_steps: int = 0, launches: tuple[CopyLaunch, ...] = (DEFAULT_LAUNCH,)) -> list[dict[str, object]]:
    """Decode steps alone and beside copies both ways, with each way of gathering blocks: the
    block-copy kernel (each of ``launches``; the first is the default on CUDA) and torch's
    index ops (before it)."""
    engine = Engine(model=model, device=DEVICE, loaded=loaded, num_kv_blocks=16384, num_host_kv_blocks=4096)
    alone = start_decodes(engine, batch, context, max_tokens=40 + (len(launches) + 1) * (15 + profile_steps), seed=3)
    host = engine.runner.host_cache  # type: ignore[attr-defined]
    held = {b for r in engine.scheduler.running for b in engine.kv.held_blocks(r)}
    spare = [b for b in range(engine.num_blocks) if b not in held][: 2 * moving]
    ticket = [10_000]

    def busy_step() -> None:
        # both copy streams move ``moving`` blocks (512 MiB each way for an 8B model) during the step
        ticket[0] += 1
        host.issue(KVTransfers(ticket[0], list(zip(spare[:moving], range(moving), strict=True)),
                               list(zip(range(moving, 2 * moving), spare[moving:], strict=True)), None))
        engine.step()

    variants = copy_choices(launches)
    gather_rates(host, spare[:64], variants)
    rows: list[dict[str, object]] = []
    main = torch.cuda.current_stream()
    for name, launch in variants:
        host.copy_launch = launch
        times = []
        for _ in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            busy_step()
            main.synchronize()  # the decode step's stream only: the copies run on their own streams
            times.append(time.perf_counter() - start)
            host.wait_all()
        copy_total = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            busy_step()
            torch.cuda.synchronize()
            copy_total.append(time.perf_counter() - start)
        row: dict[str, object] = {"copies": name, "decode_ms": alone,
                                  "decode_with_copies_ms": statistics.median(times[2:]) * 1e3,
                                  "step_and_copies_done_ms": statistics.median(copy_total) * 1e3}
        rows.append(row)
        print(f"| {batch} | {context} | {name} | {alone:.2f} | {row['decode_with_copies_ms']:.2f} | "
              f"{row['step_and_copies_done_ms']:.2f} | {moving * host.slot_bytes / 2**20:.0f} MiB |", flush=True)
        if profile_steps:
            profile_busy_steps(busy_step, host, profile_steps)
    return rows


def copy_choices(launches: tuple[CopyLaunch, ...]) -> list[tuple[str, CopyLaunch | None]]:
    """``(name, launch)`` of each block-copy launch, then torch's index ops (``None``)."""
    named: list[tuple[str, CopyLaunch | None]] = [
        (f"kernel {la.programs or '4/SM'} x {la.block} x {la.num_warps}w", la) for la in launches
    ]
    return [*named, ("torch index ops", None)]


def gather_rates(host: HostKVCache, blocks: list[int], choices: list[tuple[str, CopyLaunch | None]]) -> None:
    """Prints how fast each choice gathers ``blocks`` into the staging buffer on an idle GPU:
    bytes moved once, over the kernel time (CUDA events, median of 10)."""
    from kernels import block_copy

    assert host.offload_staging is not None
    ids = torch.tensor(blocks, dtype=torch.long, device=host.device)
    staging = host.staged(host.offload_staging)
    nbytes = len(blocks) * host.slot_bytes
    calls = [(name, lambda la=la: block_copy.gather_blocks(host.pieces, ids, staging, la)) for name, la in choices]
    print(f"\ngathering {len(blocks)} blocks ({nbytes / 2**20:.0f} MiB) into the staging buffer, idle GPU:")
    for name, call in calls:
        call()
        times = []
        for _ in range(10):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        ms = statistics.median(times)
        print(f"  {name}: {ms * 1e3:.0f} us, {nbytes / ms / 1e6:.0f} GB/s")


def profile_busy_steps(busy_step, host: HostKVCache, steps: int) -> None:  # type: ignore[no-untyped-def]
    """Prints the GPU work of ``steps`` decode steps with copies both ways, by stream and kernel."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            busy_step()
            torch.cuda.synchronize()
            host.wait_all()
    per_kernel: dict[tuple[int, str], list[float]] = defaultdict(list)
    spans: dict[int, list[float]] = defaultdict(lambda: [float("inf"), 0.0, 0.0])
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        stream = int(getattr(event, "stream", -1) or -1)
        start, dur = event.time_range.start, event.time_range.elapsed_us()
        per_kernel[(stream, event.name[:70])].append(dur)
        span = spans[stream]
        span[0], span[1], span[2] = min(span[0], start), max(span[1], start + dur), span[2] + dur
    print(f"\nGPU work of {steps} steps with copies, per stream (us a step):")
    for stream, (first, last, busy) in sorted(spans.items()):
        print(f"  stream {stream}: busy {busy / steps:.0f}, first-to-last {(last - first) / steps:.0f}")
    print("| stream | kernel or copy | calls a step | us a step | us a call |\n|---|---|---:|---:|---:|")
    rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:20]
    for (stream, name), durs in rows:
        print(f"| {stream} | {name} | {len(durs) / steps:.1f} | {sum(durs) / steps:.0f} | {statistics.mean(durs):.1f} |")
    cpu = sorted((e for e in prof.key_averages() if e.key.startswith(("cuda", "aten::index", "aten::copy_"))),
                 key=lambda e: -e.cpu_time_total)[:8]
    print("host time a step (ms): " + ", ".join(f"{e.key} {e.cpu_time_total / steps / 1e3:.2f}" for e in cpu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-exactness", action="store_true", help="only the bandwidth and overlap tables")
    parser.add_argument("--only-overlap", action="store_true", help="only the overlap table")
    parser.add_argument("--profile-overlap", type=int, default=0, metavar="STEPS",
                        help="also profile this many of the overlap's steps (kernels and copies per stream)")
    parser.add_argument("--copy-launches", default=None, metavar="PxBxW,...",
                        help="block-copy launches the overlap table compares (programs x block x warps)")
    args = parser.parse_args()
    launches = tuple(CopyLaunch(*(int(v) for v in item.split("x"))) for item in args.copy_launches.split(",")) \
        if args.copy_launches else (DEFAULT_LAUNCH,)
    loaded = load_model(args.model, torch.device(DEVICE), torch.bfloat16, 0)
    result: dict[str, object] = {}
    if not args.only_overlap:
        print("\n| direction | blocks | bytes | HostKVCache GB/s | with torch index ops | plain pinned copy GB/s |\n|---|---|---|---|---|---|")
        engine = Engine(model=args.model, device=DEVICE, loaded=loaded, num_kv_blocks=4096, enforce_eager=True)
        result["bandwidth"] = bandwidth(engine)
        del engine
    if not (args.skip_exactness or args.only_overlap):
        print("\n| policy | turns equal (BI) | offloaded | reloaded | evictions | computed |\n|---|---|---|---|---|---|")
        result["exactness"] = exactness(loaded, args.model)
    print("\n| batch | context | block gathers | decode ms | decode ms while copying | step + copies landed ms | moved each way |"
          "\n|---|---|---|---|---|---|---|")
    result["overlap"] = overlap(loaded, args.model, profile_steps=args.profile_overlap, launches=launches)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
