"""The batch-invariant mode on the GPU: exactness, and its cost against the library kernels.

Run on the GPU machine::

    python scripts/gpu_batch_invariant.py [--model dummy:llama-3.1-8b] [--json OUT.json]

Prints three tables:

1. One request alone and inside a batch of 64 (CUDA graphs on): how many of its output
   tokens' logits are bitwise equal, per mode.
2. A multi-session multi-turn script under a tight pool (eager steps, two chunk budgets), every
   policy against an unbounded pool: greedy tokens that agree, per mode.
3. Cost: decode step at batch 1 and 32, an 8k-token prefill, and a 32-request chat, per mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

MODES = {"library-kernels": False, "batch-invariant": True}  # the engine runs the second by default on the GPU
DEVICE = "cuda"


def release_device_memory() -> None:
    """Frees the device memory of engines no longer referenced (an engine's parts refer to each
    other, so only the collector frees its KV pool)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits (on the host), per request id, in step order."""
    log: dict[str, list[torch.Tensor]] = defaultdict(list)
    # NOTE: the engines here plan synchronously (async_scheduling=False): with async scheduling
    # greedy rows take their argmax on the device and never reach _sample.
    sample = engine.runner._sample

    def spy(plan, sample_index, logits, **kwargs):  # type: ignore[no-untyped-def]
        for row, index in enumerate(sample_index):
            log[plan.scheduled[index].request.request_id].append(logits[row].to("cpu", torch.float32, copy=True))
        return sample(plan, sample_index, logits, **kwargs)

    engine.runner._sample = spy  # type: ignore[method-assign]
    return log


def random_prompt(gen: torch.Generator, vocab: int, length: int) -> list[int]:
    margin = min(1000, vocab // 8)  # clear of the special tokens at both ends of the vocabulary
    return torch.randint(margin, vocab - margin, (length,), generator=gen).tolist()


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def alone_vs_batch(loaded, model: str, invariant: bool) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    """``(equal tokens, tokens, max |diff|)`` of one request's logits alone and among 63 others."""
    gen = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    target = random_prompt(gen, vocab, 700)
    others = [random_prompt(gen, vocab, int(torch.randint(50, 1500, (1,), generator=gen))) for _ in range(63)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = []
    for batch in ([], others):
        engine = Engine(model=model, device=DEVICE, loaded=loaded, async_scheduling=False, num_kv_blocks=8192, max_num_seqs=64,
                        batch_invariant=invariant)
        log = record_logits(engine)
        ids = [engine.add_request(p, params) for p in batch[:31]]
        rid = engine.add_request(target, params)
        ids += [engine.add_request(p, params) for p in batch[31:]]
        drain(engine)
        runs.append(log[rid])
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    equal = sum(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(*runs, strict=True))
    return equal, len(runs[0]), diff


def multi_turn(engine: Engine, jobs: int = 6, turns: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    vocab = engine.model_config.vocab_size
    system = random_prompt(gen, vocab, 512)
    ctx = {s: system + random_prompt(gen, vocab, 200) for s in range(jobs)}
    outs = []
    for turn in range(turns):
        ids = {
            s: engine.add_request(ctx[s], SamplingParams(max_tokens=16, ignore_eos=True), job_id=f"s{s}",
                                  is_last_step=turn == turns - 1)
            for s in range(jobs)
        }
        done: dict[str, list[int]] = {}
        while len(done) < jobs:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        for s in range(jobs):
            outs.append(done[ids[s]])
            ctx[s] = ctx[s] + done[ids[s]] + random_prompt(gen, vocab, 120)
    engine.check_integrity()
    return outs


def policy_grid(loaded, model: str, modes: dict[str, bool] = MODES) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    rows = []
    release_device_memory()
    for name, invariant in modes.items():
        for budget in (8192, 512):
            common = dict(model=model, device=DEVICE, loaded=loaded, async_scheduling=False, enforce_eager=True, batch_invariant=invariant,
                          max_num_batched_tokens=budget)
            unbounded = Engine(num_kv_blocks=8192, eviction_policy="vllm-apc", **common)
            reference = multi_turn(unbounded)
            # NOTE: an 8B's 8,192-block pool is 16 GiB: freed before the next engine, so the
            # grid fits an 80 GB H100 beside the shared weights
            del unbounded
            release_device_memory()
            for policy in ("lru", "vllm-apc", "pensieve", "asymcache"):
                engine = Engine(num_kv_blocks=160, eviction_policy=policy, **common)
                outs = multi_turn(engine)
                agree = sum(a == b for a, b in zip(outs, reference, strict=True)) / len(reference)
                tokens = sum(sum(x == y for x, y in zip(a, b, strict=True)) for a, b in zip(outs, reference, strict=True))
                rows.append({"mode": name, "budget": budget, "policy": policy, "turns_equal": agree,
                             "tokens_equal": tokens / sum(len(r) for r in reference),
                             "holes": engine.counters.hole_tokens, "evictions": engine.pool.num_evictions})
                print(f"| {name} | {budget} | {policy} | {agree:.0%} | {rows[-1]['tokens_equal']:.1%} | "
                      f"{engine.counters.hole_tokens} | {engine.pool.num_evictions} |", flush=True)
                del engine
                release_device_memory()
    return rows


def step_ms(engine: Engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def start_decodes(engine: Engine, batch: int, context: int, max_tokens: int, seed: int) -> float:
    """Prefills ``batch`` random prompts of ``context`` tokens, warms up, and returns the median
    decode step (ms) of the batch."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        engine.add_request(random_prompt(gen, vocab, context), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    step_ms(engine, 3)
    return step_ms(engine, 20)


def decode_ms(engine: Engine, batch: int, context: int) -> float:
    ms = start_decodes(engine, batch, context, max_tokens=40, seed=batch)
    drain(engine)
    return ms


def prefill_tokens_per_s(engine: Engine, length: int = 8192) -> float:
    gen = torch.Generator().manual_seed(5)
    vocab = engine.model_config.vocab_size
    best = 0.0
    for _ in range(3):
        engine.add_request(random_prompt(gen, vocab, length), SamplingParams(max_tokens=1, ignore_eos=True))
        sync()
        start = time.perf_counter()
        drain(engine)
        sync()
        best = max(best, length / (time.perf_counter() - start))
    return best


def chat_seconds(engine: Engine, requests: int = 32) -> float:
    gen = torch.Generator().manual_seed(9)
    vocab = engine.model_config.vocab_size
    for _ in range(requests):
        engine.add_request(random_prompt(gen, vocab, 1024), SamplingParams(max_tokens=64, ignore_eos=True))
    sync()
    start = time.perf_counter()
    drain(engine)
    sync()
    return time.perf_counter() - start


def cost(loaded, model: str, modes: dict[str, bool] = MODES) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    figures: dict[str, dict[str, float]] = {}
    for name, invariant in modes.items():
        engine = Engine(model=model, device=DEVICE, loaded=loaded, async_scheduling=False, num_kv_blocks=16384, max_num_batched_tokens=8192,
                        max_model_len=32768, batch_invariant=invariant)
        chat_seconds(engine, 4)  # warm-up: compiles every kernel variant the runs use
        figures[name] = {
            "decode_b1_ms": decode_ms(engine, 1, 2048),
            "decode_b32_ms": decode_ms(engine, 32, 2048),
            "prefill_8k_tok_s": prefill_tokens_per_s(engine),
            "chat_32_s": chat_seconds(engine),
        }
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return figures


def kernel_profile(loaded, model: str, top: int = 12) -> None:  # type: ignore[no-untyped-def]
    """Per mode, the GPU time by kernel of a decode step at batch 1 and 32 (2k contexts, eager)
    and of an 8k prefill."""
    from torch.profiler import ProfilerActivity, profile

    for name, invariant in MODES.items():
        engine = Engine(model=model, device=DEVICE, loaded=loaded, async_scheduling=False, num_kv_blocks=16384, max_num_batched_tokens=8192,
                        max_model_len=32768, batch_invariant=invariant, enforce_eager=True)
        chat_seconds(engine, 4)
        for what in ("decode_b1", "decode_b32", "prefill_8k"):
            gen = torch.Generator().manual_seed(1)
            vocab = engine.model_config.vocab_size
            longest = engine.max_model_len - 16
            if what.startswith("decode"):
                for _ in range(int(what.removeprefix("decode_b"))):
                    engine.add_request(random_prompt(gen, vocab, min(2048, longest)),
                                       SamplingParams(max_tokens=8, ignore_eos=True))
                while engine.scheduler.waiting or any(
                    r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
                ):
                    engine.step()
                engine.step()
            else:
                engine.add_request(random_prompt(gen, vocab, min(8192, longest)), SamplingParams(max_tokens=1, ignore_eos=True))
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                sync()
            drain(engine)
            rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0]
            rows.sort(key=lambda r: -r[1])
            total = sum(r[1] for r in rows)
            print(f"### {name} {what}: {total / 1e3:.2f} ms GPU", flush=True)
            for key, t, count in rows[:top]:
                print(f"  {t / 1e3:8.3f} ms {count:5d}x  {key[:90]}")
        del engine
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: batch, policies, cost")
    ap.add_argument("--extra", default="", help="extra parts to run: profile (GPU time by kernel)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of modes to time: library-kernels, batch-invariant")
    ap.add_argument("--invariant-programs-per-sm", type=int, default=None,
                    help="override kernels.msa_plan._INVARIANT_PROGRAMS_PER_SM (an ablation of the split rule)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script with a tiny model")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    skip = set(filter(None, args.skip.split(",")))
    modes = {name: MODES[name] for name in args.modes.split(",")}
    if args.invariant_programs_per_sm is not None:
        from kernels import msa_plan

        msa_plan._INVARIANT_PROGRAMS_PER_SM = args.invariant_programs_per_sm
    dtype = torch.bfloat16 if DEVICE.startswith("cuda") else torch.float32
    name = torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.model} {dtype}", flush=True)
    loaded = load_model(args.model, torch.device(DEVICE), dtype, seed=0)
    result: dict[str, object] = {}
    if "batch" not in skip:
        print("| mode | logits bitwise equal, alone vs in a batch of 64 | max abs diff |\n|---|---:|---:|")
        result["alone_vs_batch"] = {}
        for name, invariant in MODES.items():
            equal, total, diff = alone_vs_batch(loaded, args.model, invariant)
            result["alone_vs_batch"][name] = {"equal": equal, "tokens": total, "max_abs_diff": diff}  # type: ignore[index]
            print(f"| {name} | {equal}/{total} | {diff:.3g} |", flush=True)
    if "policies" not in skip:
        print("| mode | chunk budget | policy | turns equal to unbounded | tokens equal | hole tokens | evictions |")
        print("|---|---:|---|---:|---:|---:|---:|")
        result["policies"] = policy_grid(loaded, args.model)
    if "profile" in args.extra.split(","):
        kernel_profile(loaded, args.model)
    if "cost" not in skip:
        figures = cost(loaded, args.model, modes)
        result["cost"] = figures
        print("| figure | " + " | ".join(figures) + " | ratio |\n|---|" + "---:|" * (len(figures) + 1))
        for key in next(iter(figures.values())):
            values = [figures[name][key] for name in figures]
            ratio = ""
            if len(values) == 2:
                slower = values[1] / values[0] if not key.endswith("tok_s") else values[0] / values[1]
                ratio = f"{slower:.2f}x slower"
            print(f"| {key} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {ratio} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
