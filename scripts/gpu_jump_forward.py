"""Jump-forward decoding on and off through the engine on the GPU: what a forced run costs there.

``python scripts/gpu_jump_forward.py [--cases 1x2048,8x2048,32x2048] [--patterns 16:4,32:8] [--shares 1,0.25]``

On the CPU a step's cost grows with its tokens, so appending a grammar's forced tokens and
computing them in one step saves the decode steps they would take (BENCHMARKS.md, "Jump-forward:
forced tool calls on the CPU"). On the GPU a decode step replays a CUDA graph, and the step after
a jump carries several tokens of one request: a mixed step (piecewise graphs), which may cost
more than the decode steps it saves. This script measures it (on an H100, 2026-12-07: 1.07-1.20x
faster with it on at batch 1-32, so ``EngineConfig.jump_forward`` defaults to on on CUDA too;
BENCHMARKS.md, "Jump-forward").

The requests' one logits processor (:class:`PeriodicForcing`) lets ``FREE`` tokens be sampled,
then keeps ``FORCED`` tokens alone one after another (a tool call's fixed text between its free
values), again and again. Dummy Llama-3.1-8B bf16, the defaults (batch-invariant, CUDA graphs,
async scheduling), greedy. Per case and pattern: the wall time of a batch of requests from
their arrival to their last token (alternating rounds, median), the engine's steps, the tokens
jumped, and whether the outputs are the same bits with jump-forward on and off (the batch-
invariant mode makes them so whatever the steps' composition).

``--shares`` sets the fraction of a batch's requests that force tokens (the rest sample every
token): with a share below 1 the free requests ride in the mixed steps that a jump makes, so
the table also gives their own time to their last token ("free ms"), off and on.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.jump_forward import PositionForcing

SETTINGS = ("off", "on")


class PeriodicForcing(PositionForcing):
    """Samples ``free`` tokens, then forces ``forced`` fixed ones; repeats.

    The forced ids depend only on the position, so the outputs of two runs agree exactly where
    their free tokens do.

    Args:
        free: tokens sampled freely in a period.
        forced: tokens forced after them.
        vocab: the model's vocabulary size.
    """

    def __init__(self, free: int, forced: int, vocab: int) -> None:
        self.free, self.forced, self.vocab = free, forced, vocab

    def forced_at(self, position: int) -> int | None:
        offset = position % (self.free + self.forced)
        return None if offset < self.free else (7 * position + 11) % self.vocab


def run_batch(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[float], list[list[int]]]:
    """(each request's seconds from the first arrival to its last token, each one's output ids)."""
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals, done_at = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
                done_at[out.request_id] = time.perf_counter() - start
    return [done_at[i] for i in ids], [finals[i] for i in ids]


def main() -> None:
    from asymcache_core.loaders import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--cases", default="1x2048,8x2048,32x2048", help="BATCHxCONTEXT,...")
    ap.add_argument("--patterns", default="16:4,32:8", help="FREE:FORCED,...")
    ap.add_argument("--shares", default="1", help="fractions of a batch's requests that force tokens, FRACTION,...")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    patterns = [tuple(int(v) for v in p.split(":")) for p in args.patterns.split(",")]
    shares = [float(v) for v in args.shares.split(",")]
    if any(not 0 < v <= 1 for v in shares):
        raise SystemExit("--shares: each fraction must be in (0, 1]")
    os.environ.setdefault("ASYMCACHE_CACHE_DIR", tempfile.mkdtemp(prefix="jump-forward-"))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    longest = max(c for _, c in cases) + args.tokens + 16
    max_len = 1 << (longest - 1).bit_length()
    loaded = load_model(args.model, device, dtype, 0, max_len)
    vocab = loaded.config.vocab_size
    blocks = max(b * (c + args.tokens) // 16 + 64 for b, c in cases) + 256
    engines = {
        s: Engine(model=args.model, device=args.device, loaded=loaded, num_kv_blocks=blocks, max_model_len=max_len,
                  max_num_seqs=max(b for b, _ in cases), jump_forward=s == "on")
        for s in SETTINGS
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, {args.model} {dtype}; {args.tokens} output tokens a request; median of {args.rounds} rounds")
    print("\n| batch x context | free:forced | forcing | jumped | steps off | steps on | ms off | ms on | off / on "
          "| free ms off | free ms on | same bits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator().manual_seed(0)
    all_same = True
    for batch, context in cases:
        prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
        seen: set[tuple[int, int, int]] = set()
        for (free, forced), share in itertools.product(patterns, shares):
            forcing = max(1, round(share * batch))
            if (free, forced, forcing) in seen:  # a small batch rounds two shares to one count
                continue
            seen.add((free, forced, forcing))
            forcing_params = SamplingParams(
                max_tokens=args.tokens, ignore_eos=True,
                logits_processors=(PeriodicForcing(free, forced, vocab),),
            )
            free_params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
            # NOTE: the forcing requests spread evenly through the batch, not bunched at its front.
            forces = [i * forcing // batch != (i + 1) * forcing // batch for i in range(batch)]
            params = [forcing_params if f else free_params for f in forces]
            times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            free_times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            steps: dict[str, int] = {}
            jumped = 0
            outputs: dict[str, list[list[int]]] = {}
            for rnd in range(args.rounds + 1):  # round 0 warms the graphs up, untimed
                for s in SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]:
                    eng = engines[s]
                    eng.reset_prefix_cache()
                    before_steps = len(eng.step_log)
                    before_jumped = eng.stats().engine_jump_forward_tokens_total
                    done_at, outs = run_batch(eng, prompts, params)
                    if rnd:
                        times[s].append(max(done_at))
                        free_done = [t for t, f in zip(done_at, forces, strict=True) if not f]
                        if free_done:
                            free_times[s].append(max(free_done))
                    steps[s] = len(eng.step_log) - before_steps
                    if s == "on":
                        jumped = eng.stats().engine_jump_forward_tokens_total - before_jumped
                    outputs.setdefault(s, outs)
                    all_same = all_same and outputs[s] == outs
            same = outputs["on"] == outputs["off"]
            all_same = all_same and same
            ms = {s: 1e3 * statistics.median(t) for s, t in times.items()}
            free_ms = {s: f"{1e3 * statistics.median(t):.1f}" if t else "-" for s, t in free_times.items()}
            print(f"| {batch} x {context} | {free}:{forced} | {forcing}/{batch} | "
                  f"{jumped / forcing / args.tokens:.0%} | {steps['off']} | "
                  f"{steps['on']} | {ms['off']:.1f} | {ms['on']:.1f} | {ms['off'] / ms['on']:.2f}x | "
                  f"{free_ms['off']} | {free_ms['on']} | {same} |", flush=True)
    print(f"\nevery output the same with jump-forward on and off: {all_same}")
    if not all_same:
        raise SystemExit("jump-forward changed an output")


if __name__ == "__main__":
    main()
