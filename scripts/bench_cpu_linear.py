"""The CPU's few-row linear op against ``F.linear``, on a model's own weight shapes.

``python scripts/bench_cpu_linear.py [--rows 1,2,4,8,16,32,64,128] [--rounds 5] [--engine 1,16]``
times, per row count and projection of SmolLM2-135M (the embedded default: fused q/k/v, o, fused
gate/up, down, the tied LM head), ``F.linear(x, w)`` (what transformers and the engine ran
before) and :func:`kernels.cpu_linear.linear_weight_left` (the engine's CPU op where
:func:`kernels.cpu_linear.weight_left_pays`; the script prints the probe's times and choice).
The weights are cycled through copies that together exceed the last-level cache many times, so
that each call reads its weight from memory as a decode step does. Medians of alternating
rounds, the ratio, and whether the two give the same bits.

``--engine B,...``: then one engine on the packaged SmolLM2-135M (fp32) decodes 32 greedy tokens
for a batch of ``B`` 128-token random prompts with either op (the backend's dense ops swapped
between rounds, which alternate), and prints the median decode step and whether both ops gave
the same tokens. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_linear import linear_weight_left, probe_weight_left, weight_left_wins

# (name, N, K) of SmolLM2-135M: hidden 576, 9 q and 3 KV heads of 64, MLP 1536, vocab 49152.
SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate/up", 3072, 576),
    ("down", 576, 1536),
    ("lm head", 49152, 576),
)
COLD_BYTES = 400e6  # weights cycled per timing: >10x the 32 MB L3 of the machine measured


def _time_calls(calls: list[Callable[[], torch.Tensor]], passes: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (passes * len(calls)) * 1e3


def time_engine(batches: list[int], rounds: int) -> None:
    """Decode steps of one engine with ``F.linear`` and with the weight-left op, alternating."""
    import dataclasses

    from asymcache_core import Engine, SamplingParams
    from asymcache_core.loaders import load_model
    from eval.bench_engine import _prompts
    from kernels.dispatch import CPU_DENSE_OPS, DEFAULT_DENSE_OPS

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, 0)
    print(f"{'batch':>5} {'F.linear step ms':>17} {'weight-left step ms':>20} {'speed-up':>9} {'tokens equal':>13}")
    for batch in batches:
        prompts = _prompts(batch, 128, loaded.config.vocab_size, 0)
        engine = Engine(model=loaded.name, loaded=loaded, num_kv_blocks=batch * 12 + 64, max_num_batched_tokens=4096)
        ours = engine.runner.backend
        weight_left = dataclasses.replace(CPU_DENSE_OPS, linear=linear_weight_left)
        arms = {"F.linear": dataclasses.replace(ours, dense=DEFAULT_DENSE_OPS), "weight-left": dataclasses.replace(ours, dense=weight_left)}
        steps: dict[str, list[float]] = {name: [] for name in arms}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(rounds):
            for name in arms if r % 2 == 0 else reversed(arms):
                engine.runner.backend = arms[name]
                engine.reset_prefix_cache()  # every round prefills afresh
                ids = [engine.add_request(p, SamplingParams(max_tokens=33, ignore_eos=True)) for p in prompts]
                engine.step()  # the prefill, not timed
                start, count, outs = time.perf_counter(), 0, {}
                while engine.has_unfinished():
                    for out in engine.step():
                        outs[out.request_id] = out
                    count += 1
                steps[name].append((time.perf_counter() - start) / count * 1e3)
                tokens[name] = [list(outs[i].token_ids) for i in ids]
        base, new = statistics.median(steps["F.linear"]), statistics.median(steps["weight-left"])
        same = tokens["F.linear"] == tokens["weight-left"]
        print(f"{batch:>5} {base:>17.1f} {new:>20.1f} {base / new:>8.2f}x {str(same):>13}", flush=True)
        engine.runner.backend = ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-lm-head-rows", type=int, default=16, help="the engine's LM head sees the sampled rows only")
    parser.add_argument("--engine", default="", help="batch sizes of the engine's decode A/B (none: skipped)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, float32, weights read from memory")
    library_ms, left_ms = probe_weight_left()
    print(f"# the engine's probe: F.linear {library_ms:.3f} ms, weight-left {left_ms:.3f} ms at 2 rows of a 3072 x 576"
          f" weight: {'weight-left' if weight_left_wins(library_ms, left_ms) else 'F.linear'}")
    print(f"{'rows':>5} {'projection':<9} {'F.linear ms':>12} {'weight-left ms':>15} {'speed-up':>9} {'same bits':>10}")
    for num in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            if name == "lm head" and num > args.max_lm_head_rows:
                continue
            copies = max(2, int(COLD_BYTES // (n * k * 4)))
            weights = [torch.randn(n, k) for _ in range(copies)]
            x = torch.randn(num, k)
            library = [lambda w=w, x=x: F.linear(x, w) for w in weights]
            ours = [lambda w=w, x=x: linear_weight_left(x, w) for w in weights]
            a, b = [], []
            for _ in range(args.rounds):
                a.append(_time_calls(library))
                b.append(_time_calls(ours))
            base, new = statistics.median(a), statistics.median(b)
            same = torch.equal(F.linear(x, weights[0]), linear_weight_left(x, weights[0]))
            print(f"{num:>5} {name:<9} {base:>12.3f} {new:>15.3f} {base / new:>8.2f}x {str(same):>10}", flush=True)
            del weights
    if args.engine:
        time_engine([int(b) for b in args.engine.split(",")], max(args.rounds, 2))


if __name__ == "__main__":
    main()
