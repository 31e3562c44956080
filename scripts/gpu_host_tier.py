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
   of the copies to the compute they overlap.
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
from scripts.gpu_batch_invariant import multi_turn, start_decodes

DEVICE = "cuda"


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
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                host.issue(transfers)
                host.wait_all()
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            nbytes = n * host.slot_bytes
            plain = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
            dev = torch.empty_like(plain, device=DEVICE)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                (plain.copy_(dev, non_blocking=True) if name == "d2h" else dev.copy_(plain, non_blocking=True))
            torch.cuda.synchronize()
            plain_s = (time.perf_counter() - start) / 3
            rows.append({"direction": name, "blocks": n, "GB/s": nbytes / seconds / 1e9, "plain GB/s": nbytes / plain_s / 1e9})
            print(f"| {name} | {n} | {nbytes / 2**20:.0f} MiB | {rows[-1]['GB/s']:.1f} | {rows[-1]['plain GB/s']:.1f} |", flush=True)
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


def overlap(loaded, model: str, batch: int = 32, context: int = 4096, moving: int = 256) -> dict[str, float]:  # type: ignore[no-untyped-def]
    engine = Engine(model=model, device=DEVICE, loaded=loaded, num_kv_blocks=16384, num_host_kv_blocks=4096)
    alone = start_decodes(engine, batch, context, max_tokens=80, seed=3)
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

    times = []
    main = torch.cuda.current_stream()
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
    copy_s = moving * host.slot_bytes / 40e9
    row = {"decode_ms": alone, "decode_with_copies_ms": statistics.median(times[2:]) * 1e3,
           "step_and_copies_done_ms": statistics.median(copy_total) * 1e3, "copy_ms_each_way_at_40GBps": copy_s * 1e3}
    print(f"| {batch} | {context} | {alone:.2f} | {row['decode_with_copies_ms']:.2f} | "
          f"{row['step_and_copies_done_ms']:.2f} | {moving * host.slot_bytes / 2**20:.0f} MiB |", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-exactness", action="store_true", help="only the bandwidth and overlap tables")
    args = parser.parse_args()
    loaded = load_model(args.model, torch.device(DEVICE), torch.bfloat16, 0)
    print("\n| direction | blocks | bytes | HostKVCache GB/s | plain pinned copy GB/s |\n|---|---|---|---|---|")
    engine = Engine(model=args.model, device=DEVICE, loaded=loaded, num_kv_blocks=4096, enforce_eager=True)
    result: dict[str, object] = {"bandwidth": bandwidth(engine)}
    del engine
    if not args.skip_exactness:
        print("\n| policy | turns equal (BI) | offloaded | reloaded | evictions | computed |\n|---|---|---|---|---|---|")
        result["exactness"] = exactness(loaded, args.model)
    print("\n| batch | context | decode ms | decode ms while copying | step + copies landed ms | moved each way |"
          "\n|---|---|---|---|---|---|")
    result["overlap"] = overlap(loaded, args.model)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
