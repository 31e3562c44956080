"""Where the host's time goes when a mixed step is launched under async scheduling. GPU only.

``python scripts/gpu_async_mixed.py [--decodes 16] [--context 2048] [--prompts 600,3000]``
keeps ``--decodes`` requests decoding and adds one new prompt every few steps, so that mixed
steps (decodes plus a prompt) follow decode steps, and times each phase of the host's work for
every step on the host clock: planning, packing, the attention metadata and launch plan, the
forward pass's enqueue, and collecting the step before. Under async scheduling the device runs
step N while the host launches N+1: a phase that waits for the device (a synchronizing copy or
call) takes about as long as what is left of N, which this table shows as a phase far longer
than the same phase in the synchronous loop.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import asymcache_core.model_runner as model_runner
from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model


class PhaseTimer:
    """Host seconds per phase of the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn):  # noqa: ANN001, ANN202 - a test harness
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0

        return timed


class TimedModel(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, timer: PhaseTimer) -> None:
        super().__init__()
        self.inner = inner
        self.timer = timer

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.timer.current["eager-forward"] += time.perf_counter() - t0


def instrument(engine: Engine, timer: PhaseTimer) -> Callable[[], None]:
    """Wraps the phases of ``engine``'s steps in ``timer``; returns what restores the module
    functions it wrapped."""
    runner = engine.runner
    pack_step, build_msa_metadata = model_runner.pack_step, model_runner.build_msa_metadata
    model_runner.pack_step = timer.wrap("pack", pack_step)
    model_runner.build_msa_metadata = timer.wrap("metadata", build_msa_metadata)
    # NOTE: the backend is a frozen dataclass: set past its __setattr__
    object.__setattr__(runner.backend, "prepare", timer.wrap("launch-plan", runner.backend.prepare))
    if runner.mixed_graphs is not None:
        runner.mixed_graphs.run = timer.wrap("piecewise-run", runner.mixed_graphs.run)
    if runner.decode_graphs is not None:
        runner.decode_graphs.run = timer.wrap("decode-graph", runner.decode_graphs.run)
    runner.model = TimedModel(runner.model, timer)
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    if hasattr(runner, "launch"):
        runner.launch = timer.wrap("launch", runner.launch)
        runner.collect = timer.wrap("collect", runner.collect)
    runner.execute = timer.wrap("execute", runner.execute)

    def restore() -> None:
        model_runner.pack_step, model_runner.build_msa_metadata = pack_step, build_msa_metadata

    return restore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompts", default="600,3000", help="new prompt lengths, comma separated")
    ap.add_argument("--every", type=int, default=6, help="steps between new prompts")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    ap.add_argument("--sync-debug", action="store_true", help="also report synchronizing calls (torch's sync debug mode)")
    ap.add_argument("--profile", action="store_true", help="also print the host's hottest functions in the mixed steps (cProfile)")
    args = ap.parse_args()
    device = torch.device(args.device)
    lengths = [int(v) for v in args.prompts.split(",")]
    max_len = 16384
    loaded = load_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, 0, max_len)
    max_len = min(max_len, loaded.config.max_position_embeddings)  # the CPU check's tiny model has fewer
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for mode in (True, False):
        engine = Engine(
            model=args.model, device=args.device, loaded=loaded, num_kv_blocks=args.decodes * 400 + 4000,
            max_model_len=max_len, max_num_batched_tokens=8192, max_num_seqs=256, async_scheduling=mode if device.type == "cuda" else None,
        )
        timer = PhaseTimer()
        restore = instrument(engine, timer)
        params = SamplingParams(max_tokens=100000, ignore_eos=True)
        for _ in range(args.decodes):
            engine.add_request(torch.randint(0, vocab, (args.context,), generator=gen).tolist(), params)
        for _ in range(8):
            engine.step()
        rows: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        synced: collections.Counter[str] = collections.Counter()
        profiler = cProfile.Profile() if args.profile else None
        loop_start = time.perf_counter()
        for i in range(args.steps):
            kind = "decode"
            if i % args.every == 0:
                n = lengths[(i // args.every) % len(lengths)]
                engine.add_request(torch.randint(0, vocab, (n,), generator=gen).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
                kind = f"+{n}"
            timer.current = collections.defaultdict(float)
            t0 = time.perf_counter()
            if args.sync_debug and device.type == "cuda" and kind != "decode":
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    engine.step()
                torch.cuda.set_sync_debug_mode(0)
                for w in caught:
                    synced[f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"] += 1
            elif profiler is not None and kind != "decode":
                profiler.enable()
                engine.step()
                profiler.disable()
            else:
                engine.step()
            timer.current["step"] = time.perf_counter() - t0
            rows[kind].append(dict(timer.current))
        if device.type == "cuda":
            torch.cuda.synchronize()
        loop_ms = (time.perf_counter() - loop_start) / args.steps * 1e3
        name = "async" if engine.async_scheduling else "sync"
        phases = sorted({p for rs in rows.values() for r in rs for p in r})
        print(f"\n== {name}: host ms per step (median over steps of the kind; the step that adds a prompt plans its mixed step)")
        print(f"{'kind':>8} {'n':>4} " + " ".join(f"{p:>13}" for p in phases))
        for kind, rs in sorted(rows.items()):
            vals = [statistics.median([r.get(p, 0.0) for r in rs]) * 1e3 for p in phases]
            print(f"{kind:>8} {len(rs):>4} " + " ".join(f"{v:>13.2f}" for v in vals))
        print(f"loop: {loop_ms:.2f} ms a step over the {args.steps} steps, prompts and decodes together")
        # the step after the one that added a prompt (its decode collects the mixed step)
        if synced:
            print("synchronizing calls during the mixed steps:")
            for where, n in synced.most_common(12):
                print(f"  {n:>4}  {where}")
        if profiler is not None:
            print(f"host functions of the {sum(len(rs) for k, rs in rows.items() if k != 'decode')} mixed steps (cProfile):")
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
        restore()
        del engine


if __name__ == "__main__":
    main()
