"""A decode step beside reloads whose host slots are consecutive but reversed: the step's copies
sorted by host slot (``kv_transfer.staging_passes``, the default) against table order. GPU only.

``python scripts/gpu_copy_order.py [--model dummy:llama-3.1-8b] [--blocks 256]`` prints the
median decode step (batch 32, 4k context, CUDA graphs) alone and while ``--blocks`` blocks are
reloaded each step, in alternating rounds of ten steps: a request's blocks come back from
consecutive slots in another order than its block table, and in table order every block is one
host-device copy call on the engine's thread before the step is launched.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import asymcache_core.kv_transfer as kv_transfer
from asymcache_core import Engine
from asymcache_core.host_tier import KVTransfers
from asymcache_core.loaders import load_model
from scripts.gpu_batch_invariant import start_decodes


def table_order(pairs: list[tuple[int, int]], key: int, size: int) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Staging passes in the order the step listed its copies (the path before sorting)."""
    chunks = [pairs[first : first + size] for first in range(0, len(pairs), size)]
    return [(chunk, kv_transfer._runs(chunk, key)) for chunk in chunks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--blocks", type=int, default=256)
    args = parser.parse_args()
    loaded = load_model(args.model, torch.device("cuda"), torch.bfloat16, 0)
    engine = Engine(model=args.model, device="cuda", loaded=loaded, num_kv_blocks=16384, num_host_kv_blocks=4096)
    alone = start_decodes(engine, 32, 4096, max_tokens=120, seed=3)
    host = engine.runner.host_cache  # type: ignore[attr-defined]
    held = {b for r in engine.scheduler.running for b in engine.kv.held_blocks(r)}
    spare = [b for b in range(engine.num_blocks) if b not in held][: args.blocks]
    slots = list(reversed(range(args.blocks, 2 * args.blocks)))
    ticket = [20_000]
    sorted_passes = kv_transfer.staging_passes
    times: dict[str, list[float]] = {"table order": [], "sorted by slot": []}
    for _ in range(2):
        for name, passes in (("table order", table_order), ("sorted by slot", sorted_passes)):
            kv_transfer.staging_passes = passes  # type: ignore[assignment]
            for _ in range(10):
                ticket[0] += 1
                torch.cuda.synchronize()
                start = time.perf_counter()
                host.issue(KVTransfers(ticket[0], [], list(zip(slots, spare, strict=True)), None))
                engine.step()
                torch.cuda.current_stream().synchronize()
                times[name].append(time.perf_counter() - start)
                host.wait_all()
    kv_transfer.staging_passes = sorted_passes
    print(f"decode alone {alone:.2f} ms; {args.blocks} blocks reloaded a step from reversed consecutive slots:")
    for name, values in times.items():
        print(f"  {name}: step while copying {statistics.median(values) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
