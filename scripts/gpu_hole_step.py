"""What refilling a hole costs on the GPU, against recomputing the same tokens as a suffix.

``python scripts/gpu_hole_step.py [--model dummy:llama-3.1-8b] [--history 6000] [--new 1000]``
prefills a ``history``-token job, evicts ``R`` tokens of it by hand and times the one
engine step that brings it back with ``new`` fresh tokens: the evicted blocks at the front of
the history (what ``asymcache`` evicts first), in its middle, or at its end (what
``vllm-apc`` evicts: one contiguous segment). Every case computes the same number of tokens;
the table splits the step into scheduling, input preparation, forward and sampling beside the
latency profile's prediction, then the busiest kernels of one step of each kind are listed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_profile_mixed import instrument, sync  # NOTE: a sibling script (scripts/ is on sys.path)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model
from asymcache_core.request import Request

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def evicted_blocks(where: str, num_blocks: int, count: int) -> range:
    """Logical blocks of a ``num_blocks``-block history that a case evicts."""
    if where == "front":
        return range(3, 3 + count)  # NOTE: after a 48-token system prompt, as in the chat trace
    if where == "middle":
        start = (num_blocks - count) // 2
        return range(start, start + count)
    return range(num_blocks - count, num_blocks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--profile", default="bench_traces/profile_h200_llama8b.json")
    ap.add_argument("--history", type=int, default=6000, help="tokens of the job before the turn")
    ap.add_argument("--new", type=int, default=1000, help="fresh tokens of the turn")
    ap.add_argument("--recompute", type=int, nargs="+", default=[256, 1024],
                    help="evicted tokens (multiples of the block size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of the script)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    loaded = load_model(args.model, dev, dtype, seed=0)
    engine = Engine(model=args.model, device=args.device, loaded=loaded, num_kv_blocks=8192,
                    max_num_batched_tokens=8192, max_model_len=32768, eviction_policy="asymcache",
                    latency_profile=args.profile or None)
    phases = instrument(engine.runner)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(1000, vocab - 1000, (48,), generator=gen).tolist()
    bs = engine.block_size
    jobs = iter(range(1_000_000))

    def turn(where: str, recompute: int) -> None:
        """Prefills a fresh job, evicts ``recompute`` tokens of it, adds the next turn."""
        sid = f"s{next(jobs)}"
        history = system + torch.randint(1000, vocab - 1000, (args.history - 48,), generator=gen).tolist()
        first = engine.generate([history], ONE, job_ids=[sid])[0]
        context = history + first.token_ids
        prompt = context + torch.randint(1000, vocab - 1000, (args.new,), generator=gen).tolist()
        hashes = engine.kv.ensure_hashes(Request("probe", prompt, ONE, 0.0))
        num_blocks = len(context) // bs
        for idx in evicted_blocks(where, num_blocks, recompute // bs):
            block_id = engine.pool.lookup(hashes[idx])
            assert block_id is not None, (where, idx)
            engine.pool.evict_block(block_id)
        engine.add_request(prompt, ONE, job_id=sid)

    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.model}, history {args.history}, new {args.new}, "
          f"profile {args.profile}")
    print("| evicted | where | tokens | segments | hole tokens | step ms | schedule | prepare | forward | "
          "sample | predicted ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for recompute in args.recompute:
        for where in ("front", "middle", "end"):
            rows = []
            for rep in range(args.repeats + 1):
                turn(where, recompute)
                for bucket in phases.values():
                    bucket.clear()
                sync()
                start = time.perf_counter()
                outs = engine.step()
                sync()
                wall = time.perf_counter() - start
                assert outs and outs[0].finished
                stats = engine.step_log[-1]
                if rep:  # the first of each shape compiles or allocates
                    parts = {k: sum(v) for k, v in phases.items()}
                    rows.append((wall, stats.schedule_s, parts.get("prepare", 0.0), parts.get("forward", 0.0),
                                 parts.get("sample", 0.0), stats.predicted_s, stats.num_tokens,
                                 stats.num_segments, stats.num_hole_tokens))
            med = [statistics.median(col) for col in zip(*rows, strict=True)]
            ms = [m * 1e3 for m in med[:6]]
            print(f"| {recompute} | {where} | {med[6]:.0f} | {med[7]:.0f} | {med[8]:.0f} | {ms[0]:.1f} | "
                  f"{ms[1]:.2f} | {ms[2]:.2f} | {ms[3]:.1f} | {ms[4]:.2f} | {ms[5]:.1f} |")
    for where in ("front", "end"):
        turn(where, max(args.recompute))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        events = prof.key_averages()
        kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"evicted at the {where}: {gpu_ms:.2f} ms of kernels")
        for e in kernels[:10]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<4d} {e.key[:90]}")


if __name__ == "__main__":
    main()
