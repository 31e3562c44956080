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
import statistics

import torch
from gpu_profile_step import (  # NOTE: a sibling script (scripts/ is on sys.path)
    copy_bandwidth,
    step_times,
)

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

CASES = ((1, 60_000), (2, 60_000), (4, 8_000), (4, 45_000), (8, 6_000), (8, 18_000), (16, 16_000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    args = ap.parse_args()
    dev = torch.device("cuda")
    loaded = load_model(args.model, dev, torch.bfloat16, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = copy_bandwidth(dev)
    cfg = loaded.config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    largest = max(batch * (context + 1 + args.rounds * args.steps * 2 + 16) for batch, context in CASES)
    # NOTE: the library kernels: the batch-invariant default's chunk is fixed, so there the
    # captured and the per-replay chunk are one
    engine = Engine(model=args.model, device="cuda", loaded=loaded, num_kv_blocks=largest // 16 + 64,
                    max_num_batched_tokens=8192, batch_invariant=False)
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "the engine captured no decode graphs"
    per_replay = graphs._graph_chunk

    def captured(plan, max_ctx):  # type: ignore[no-untyped-def]
        return plan.chunk

    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.model}, max_model_len "
          f"{engine.max_model_len}: copy {bandwidth / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.1f} GB")
    print("| batch | context | graph | captured chunk | captured ms | per-replay chunk | per-replay ms | speed-up | weights + KV floor ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for batch, context in CASES:
        max_tokens = args.rounds * args.steps * 2 + 8
        for _ in range(batch):
            prompt = torch.randint(1000, vocab - 1000, (context,), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()
        size = next(s for s in graphs.sizes if s >= batch)
        plan = graphs.plans[size]
        times: dict[str, list[float]] = {"captured": [], "per-replay": []}
        step_times(engine, 2)  # warm-up
        for _ in range(args.rounds):
            for name, fn in (("captured", captured), ("per-replay", per_replay)):
                graphs._graph_chunk = fn
                times[name] += step_times(engine, args.steps)
        graphs._graph_chunk = per_replay
        chunk_now = per_replay(plan, context + 1)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        floor = (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth * 1e3
        print(f"| {batch} | {context} | {size} | {plan.chunk} | {ms['captured']:.2f} | {chunk_now} | "
              f"{ms['per-replay']:.2f} | {ms['captured'] / ms['per-replay']:.2f}x | {floor:.2f} |", flush=True)
        while engine.has_unfinished():
            engine.step()
    engine.check_integrity()


if __name__ == "__main__":
    main()
