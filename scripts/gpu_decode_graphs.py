"""Decode-graph replays on long contexts: the captured KV split against the per-replay one.
GPU machine only.

``PYTHONPATH=$PWD python scripts/gpu_decode_graphs.py [--model dummy:llama-3.1-8b]`` builds one
engine with the model's own ``max_model_len`` (131,072 tokens for Llama-3.1-8B, as the bench
harness runs it), prefills each (batch, context) case once, then times decode-only steps
(median ``engine.step()`` wall time) in alternating rounds: the keys per split the graph was
captured with (sized for ``max_model_len``, as a graph without the per-replay split runs) and the keys per split
set for the batch's longest context before each replay (``decode_graph_chunk``). Beside them:
the floor of reading the weights and the batch's KV once at the measured copy bandwidth.
BENCHMARKS.md ("Decode steps on long contexts") holds its current results.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from gpu_profile_step import (  # NOTE: a sibling script (scripts/ is on sys.path)
    copy_bandwidth,
    step_times,
)

from asymcache_core import Engine, SamplingParams
from asymcache_core.cuda_graphs import DecodeGraphs
from asymcache_core.loaders import load_model

CASES = ((1, 60_000), (2, 60_000), (4, 8_000), (4, 45_000), (8, 6_000), (8, 18_000), (16, 16_000))


class DecodeBench(NamedTuple):
    """An engine for timing decode replays, and the figures of its floors."""

    engine: Engine
    graphs: DecodeGraphs
    weight_bytes: int
    bandwidth: float  # bytes per second of a device-to-device copy
    kv_bytes_per_token: int

    def floor_ms(self, batch: int, context: int) -> float:
        """Reading the weights and the batch's KV once at the copy bandwidth."""
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth * 1e3

    def header(self, model: str) -> str:
        return (f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {model}, max_model_len "
                f"{self.engine.max_model_len}: copy {self.bandwidth / 1e12:.2f} TB/s, weights "
                f"{self.weight_bytes / 1e9:.1f} GB")


def decode_bench(model: str, cases: tuple[tuple[int, int], ...], extra_tokens: int, **engine_args: Any) -> DecodeBench:
    """One bf16 engine on the GPU with the model's own ``max_model_len`` and room for every
    (batch, context) case plus ``extra_tokens`` decoded per sequence."""
    dev = torch.device("cuda")
    loaded = load_model(model, dev, torch.bfloat16, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = copy_bandwidth(dev)
    cfg = loaded.config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    largest = max(batch * (context + 1 + extra_tokens + 16) for batch, context in cases)
    engine = Engine(model=model, device="cuda", loaded=loaded, num_kv_blocks=largest // 16 + 64,
                    max_num_batched_tokens=8192, **engine_args)
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "the engine captured no decode graphs"
    return DecodeBench(engine, graphs, weight_bytes, bandwidth, kv_bytes_per_token)


def prefill_case(engine: Engine, batch: int, context: int, max_tokens: int, gen: torch.Generator) -> None:
    """Adds ``batch`` random prompts of ``context`` tokens and steps until they are prefilled."""
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(1000, vocab - 1000, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()


def alternating_ms(engine: Engine, settings: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, float]:
    """Median decode ``engine.step()`` wall time (ms) under each setting, timed in ``rounds``
    alternating rounds of ``steps`` steps after two warm-up steps (the caller restores its
    default afterwards)."""
    times: dict[str, list[float]] = {name: [] for name in settings}
    step_times(engine, 2)
    for _ in range(rounds):
        for name, apply in settings.items():
            apply()
            times[name] += step_times(engine, steps)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    args = ap.parse_args()
    # NOTE: the library kernels: the batch-invariant mode's chunk is fixed, so there the
    # per-replay chunk is the captured one (its graphs differ per context limit instead:
    # scripts/gpu_graph_contexts.py)
    bench = decode_bench(args.model, CASES, args.rounds * args.steps * 2, batch_invariant=False)
    engine, graphs = bench.engine, bench.graphs
    per_replay = graphs._graph_chunk

    def captured(plan, max_ctx):  # type: ignore[no-untyped-def]
        return plan.chunk

    print(bench.header(args.model))
    print("| batch | context | graph | captured chunk | captured ms | per-replay chunk | per-replay ms | speed-up | weights + KV floor ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for batch, context in CASES:
        prefill_case(engine, batch, context, args.rounds * args.steps * 2 + 8, gen)
        size = next(s for s in graphs.sizes if s >= batch)
        plan = graphs.plans[(size, graphs.context_limit(size, context + 1))]
        ms = alternating_ms(
            engine,
            {name: functools.partial(setattr, graphs, "_graph_chunk", fn)
             for name, fn in (("captured", captured), ("per-replay", per_replay))},
            args.rounds, args.steps,
        )
        graphs._graph_chunk = per_replay
        chunk_now = per_replay(plan, context + 1)
        floor = bench.floor_ms(batch, context)
        print(f"| {batch} | {context} | {size} | {plan.chunk} | {ms['captured']:.2f} | {chunk_now} | "
              f"{ms['per-replay']:.2f} | {ms['captured'] / ms['per-replay']:.2f}x | {floor:.2f} |", flush=True)
        while engine.has_unfinished():
            engine.step()
    engine.check_integrity()


if __name__ == "__main__":
    main()
