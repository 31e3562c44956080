"""The CPU's few-row linear forms against ``F.linear``, on a model's own weight shapes.

``python scripts/bench_cpu_linear.py [--rows 1,2,3,4,8,16,32] [--rounds 5] [--engine 1,3,8,16]``
times, per row count and projection of SmolLM2-135M (the embedded default: fused q/k/v, o, fused
gate/up, down, the tied LM head), each form of :mod:`kernels.cpu_linear`: ``F.linear(x, w)``
(what transformers runs), the weight-left product, and oneDNN's product on a weight packed once
(the weight-left form only on two or more threads). The weights are cycled through copies that
together exceed the last-level cache many times, so that each call reads its weight from memory
as a decode step does. Medians of alternating rounds, as GB/s of weights read, and each form's
speed-up over ``F.linear``. The script first prints the engine's probe and the form it picks
for each row count (:func:`kernels.cpu_linear.few_row_forms`).

``--engine B,...``: then one engine on the packaged SmolLM2-135M (fp32) decodes 32 greedy tokens
for a batch of ``B`` 128-token random prompts with ``F.linear`` and with the engine's op (the
backend's dense ops swapped between rounds, which alternate), and prints the median decode step
and whether both gave the same tokens. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.cpu_linear import (
    FORM_OPS,
    FORMS,
    PROBE_ROWS,
    few_row_forms,
    onednn_available,
    onednn_weight,
    pick_form,
    probe_forms,
)

# (name, N, K) of SmolLM2-135M: hidden 576, 9 q and 3 KV heads of 64, MLP 1536, vocab 49152.
SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate/up", 3072, 576),
    ("down", 576, 1536),
    ("lm head", 49152, 576),
)
COLD_BYTES = 400e6  # weights cycled per timing: >10x the 32 MB L3 of the machines measured


def _time_calls(calls: list[Callable[[], torch.Tensor]], passes: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (passes * len(calls)) * 1e3


def time_engine(batches: list[int], rounds: int) -> None:
    """Decode steps of one engine with ``F.linear`` and with the engine's own op, alternating."""
    import dataclasses

    from asymcache_core import Engine, SamplingParams
    from asymcache_core.loaders import load_model
    from eval.bench_engine import _prompts
    from kernels.dispatch import CPU_DENSE_OPS, DEFAULT_DENSE_OPS

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, 0)
    print(f"{'batch':>5} {'F.linear step ms':>17} {'engine op step ms':>18} {'speed-up':>9} {'tokens equal':>13}")
    for batch in batches:
        prompts = _prompts(batch, 128, loaded.config.vocab_size, 0)
        engine = Engine(model=loaded.name, loaded=loaded, num_kv_blocks=batch * 12 + 64, max_num_batched_tokens=4096)
        ours = engine.runner.backend
        arms = {"F.linear": dataclasses.replace(ours, dense=DEFAULT_DENSE_OPS), "engine": dataclasses.replace(ours, dense=CPU_DENSE_OPS)}
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
        base, new = statistics.median(steps["F.linear"]), statistics.median(steps["engine"])
        same = tokens["F.linear"] == tokens["engine"]
        print(f"{batch:>5} {base:>17.1f} {new:>18.1f} {base / new:>8.2f}x {str(same):>13}", flush=True)
        engine.runner.backend = ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-lm-head-rows", type=int, default=16, help="the engine's LM head sees the sampled rows only")
    parser.add_argument("--engine", default="", help="batch sizes of the engine's decode A/B (none: skipped)")
    args = parser.parse_args()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    print(f"# torch {torch.__version__}, {threads} threads, float32, weights read from memory")
    probe = probe_forms(threads)
    for rows in PROBE_ROWS:
        times = ", ".join(f"{f} {ms:.3f}" for f, ms in probe[rows].items())
        print(f"# probe at {rows} rows (ms a call): {times}; fastest of the others: {pick_form(probe[rows])}")
    print(f"# the engine's forms by row bucket: {few_row_forms(threads)}")
    forms = [f for f in FORMS if (f != "weight-left" or threads >= 2) and (f != "onednn" or onednn_available())]
    print(f"{'rows':>5} {'projection':<9} " + " ".join(f"{f + ' GB/s':>16}" for f in forms)
          + " " + " ".join(f"{f + ' x':>14}" for f in forms[1:]))
    for num in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            if name == "lm head" and num > args.max_lm_head_rows:
                continue
            copies = max(2, int(COLD_BYTES // (n * k * 4)))
            weights = [torch.randn(n, k) for _ in range(copies)]
            if "onednn" in forms:
                for w in weights:
                    onednn_weight(w)  # packed once, as the engine's weights are
            x = torch.randn(num, k)
            calls = {f: [lambda w=w, x=x, op=FORM_OPS[f]: op(x, w) for w in weights] for f in forms}
            times: dict[str, list[float]] = {f: [] for f in forms}
            for r in range(args.rounds):
                for f in forms if r % 2 == 0 else reversed(forms):
                    times[f].append(_time_calls(calls[f]))
            ms = {f: statistics.median(t) for f, t in times.items()}
            gbs = {f: n * k * 4 / (ms[f] * 1e-3) / 1e9 for f in forms}
            print(f"{num:>5} {name:<9} " + " ".join(f"{gbs[f]:>16.1f}" for f in forms)
                  + " " + " ".join(f"{ms['library'] / ms[f]:>13.2f}x" for f in forms[1:]), flush=True)
            del weights
    if args.engine:
        time_engine([int(b) for b in args.engine.split(",")], max(args.rounds, 2))


if __name__ == "__main__":
    main()
