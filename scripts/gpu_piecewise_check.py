"""Piecewise CUDA graphs against the eager forward, step by step. GPU machine only.

``python scripts/gpu_piecewise_check.py [--model dummy:tiny] [--dtype float32]`` runs a small
chunked workload (prefill chunks beside decodes) and, for every step that fits a piecewise
size, computes the logits three ways before the engine samples: the eager forward (what the
engine samples from here), the captured pieces, and the same pieces run eagerly. It prints
the largest logit difference and whether the greedy tokens agree, per step.
"""

from __future__ import annotations

import argparse

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.piecewise_graphs import PiecewiseGraphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    engine = Engine(model=args.model, device="cuda", dtype=args.dtype, num_kv_blocks=512, max_num_seqs=8,
                    max_model_len=2048, max_num_batched_tokens=96, mixed_graph_max_tokens=256)
    runner = engine.runner
    captured = runner.mixed_graphs
    assert captured is not None
    uncaptured = PiecewiseGraphs(runner.model, runner.kv_caches, runner.backend, captured.sizes, runner.device,
                                 capture=False)
    runner.mixed_graphs = None  # the engine samples from the eager forward
    original_model = runner.model
    vocab = engine.model_config.vocab_size
    rows_seen: list[str] = []

    def checking_model(ids, positions, kv_caches, meta, backend, rows):  # type: ignore[no-untyped-def]
        ids_l, pos_l = ids.tolist(), positions.tolist()
        slots = meta.slot_mapping.tolist()
        results = {}
        with torch.inference_mode():
            results["pieces"] = uncaptured.run(ids_l, pos_l, slots, meta, rows)
            got = captured.run(ids_l, pos_l, slots, meta, rows)
            results["graphs"] = None if got is None else got.clone()
        eager = original_model(ids, positions, kv_caches, meta, backend, rows)
        line = [f"{len(ids_l):5d}", f"{captured.size_for(len(ids_l))}"]
        for name in ("graphs", "pieces"):
            other = results[name]
            if other is None or eager.numel() == 0:
                line += ["-", "-"]
                continue
            diff = (other - eager).abs().max().item()
            same = bool((other.argmax(-1) == eager.argmax(-1)).all())
            line += [f"{diff:.2e}", "yes" if same else "NO"]
        rows_seen.append("| " + " | ".join(line) + " |")
        return eager

    runner.model = checking_model  # type: ignore[assignment]
    prompts = [[(10 + i + j) % (vocab - 10) for j in range(n)] for i, n in enumerate((5, 40, 77, 130, 200))]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    steps = 0
    while engine.has_unfinished() and steps < args.steps:
        engine.step()
        steps += 1
    print(f"# {torch.cuda.get_device_name(0)}, {args.model} {args.dtype}, sizes {captured.sizes}")
    print("| tokens | size | graphs max diff | graphs argmax | pieces max diff | pieces argmax |")
    print("|---:|---:|---:|---|---:|---|")
    print("\n".join(rows_seen))


if __name__ == "__main__":
    main()
