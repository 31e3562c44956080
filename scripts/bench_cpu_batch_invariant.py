"""The CPU engine's batch-invariant mode against its default, side by side in one process.

``PYTHONPATH=. python scripts/bench_cpu_batch_invariant.py [--rounds 5] [--batches 1,16]``:
for each batch size, one engine of each mode on the packaged SmolLM2 (float32), sharing the
loaded weights; each round (the modes alternating, their order flipping) prefills ``B``
fresh 128-token random prompts in one step, then decodes 32 tokens each. Prints per mode the
prefill step and the decode step in ms (median and fastest round) and the mode's cost against
the default, and whether the greedy tokens agree (they need not: the modes round differently).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model
from eval.bench_engine import _prompts
from kernels.cpu_linear import onednn_available

MODES = ("default", "batch-invariant")


def one_round(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(prefill s, decode s per step, tokens) of one round on fresh prompts."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    outs = {o.request_id: o for o in engine.step() if o.finished}
    prefill = time.perf_counter() - start
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    decode = (time.perf_counter() - start - prefill) / new_tokens
    return prefill, decode, [outs[i].token_ids for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN linear op: {onednn_available()}")
    print(f"{'batch':>5} {'mode':<16} {'prefill ms':>11} {'fastest':>8} {'decode ms':>10} {'fastest':>8} {'prefill x':>10} {'decode x':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        blocks = batch * (-(-(args.prompt_len + args.new_tokens + 1) // 16) + 1) + 16
        engines = {
            mode: Engine(model=loaded.name, loaded=loaded, num_kv_blocks=blocks, batch_invariant=mode != "default",
                         max_num_batched_tokens=max(2048, batch * args.prompt_len))
            for mode in MODES
        }
        prompts = _prompts(batch, args.prompt_len, loaded.config.vocab_size, 0)
        times: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in MODES}
        tokens: dict[str, list[list[int]]] = {}
        for engine in engines.values():
            one_round(engine, prompts[:1], 2)  # warm-up (and the batch-invariant mode's checks)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                prefill, decode, tokens[mode] = one_round(engines[mode], prompts, args.new_tokens)
                times[mode][0].append(prefill * 1e3)
                times[mode][1].append(decode * 1e3)
        base = {k: statistics.median(v) for k, v in zip(("p", "d"), times["default"], strict=True)}
        for mode in MODES:
            pre, dec = times[mode]
            print(f"{batch:>5} {mode:<16} {statistics.median(pre):>11.1f} {min(pre):>8.1f} {statistics.median(dec):>10.1f} "
                  f"{min(dec):>8.1f} {statistics.median(pre) / base['p']:>9.2f}x {statistics.median(dec) / base['d']:>8.2f}x")
        same = sum(a == b for a, b in zip(tokens[MODES[0]], tokens[MODES[1]], strict=True))
        print(f"{'':>5} greedy tokens equal in {same} of {batch} sequences")


if __name__ == "__main__":
    main()
