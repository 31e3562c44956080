"""What a step with n-gram drafts costs on the GPU against a decode step. GPU machine only.

``python scripts/gpu_speculative.py [--model dummy:llama-3.1-8b] [--k 2,4]``

Dummy weights write no text worth drafting, so the drafts are forced: every step of the
speculating engine verifies ``k`` drafts a sequence (the proposer is replaced by one that
always proposes ``k`` tokens). Printed per batch size and context: the median step of the
default engine (async scheduling, CUDA graphs, batch-invariant) on decode-only steps, the
median verifying step (synchronous, piecewise graphs) and the break-even: the drafts a step must
keep for the speculating engine to yield tokens as fast (``verify / decode - 1``). Then one
check that the tokens are the same with real drafts (the tiny dummy model, greedy and seeded
random, whose outputs repeat enough to be drafted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_profile_step import step_times  # noqa: E402 - a script beside this one


def _median_step_ms(engine: Engine, steps: int) -> float:
    return statistics.median(step_times(engine, steps)) * 1e3


def _measure(engine: Engine, batch: int, context: int, k: int) -> float:
    vocab = engine.model_config.vocab_size
    margin = min(1000, vocab // 8)  # clear of the special tokens at both ends of the vocabulary
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(margin, vocab - margin, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    if k and engine.scheduler.proposer is not None:
        # NOTE: forced drafts: k tokens every step (the last token repeated)
        engine.scheduler.proposer.propose = lambda rid, tokens, limit: [tokens[-1]] * min(k, limit)  # type: ignore[method-assign]
        for r in engine.scheduler.running:
            r.draft_token_ids = [r.all_token_ids[-1]] * k
    _median_step_ms(engine, 3)
    ms = _median_step_ms(engine, 15)
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--cases", default="1x2048,8x2048,32x2048")
    args = ap.parse_args()
    loaded = load_model(args.model, torch.device("cuda"), torch.bfloat16, seed=0)
    common = {"model": args.model, "device": "cuda", "loaded": loaded, "num_kv_blocks": 8192,
              "max_num_batched_tokens": 8192, "max_model_len": 32768}
    ks = [int(k) for k in args.k.split(",")]
    plain = Engine(**common)
    spec = {k: Engine(**common, speculative_config={"method": "ngram", "num_speculative_tokens": k}) for k in ks}
    print(f"{args.model}, {torch.cuda.get_device_name()}")
    print("| batch | context | decode step ms | " + " | ".join(f"k={k} step ms | k={k} break-even kept" for k in ks) + " |")
    print("|---:|---:|---:|" + "---:|---:|" * len(ks))
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        decode = _measure(plain, batch, context, 0)
        cells = []
        for k in ks:
            verify = _measure(spec[k], batch, context, k)
            cells.append(f"{verify:.2f} | {verify / decode - 1:.2f}")
        print(f"| {batch} | {context} | {decode:.2f} | " + " | ".join(cells) + " |")
    del plain, spec
    tiny = load_model("dummy:tiny", torch.device("cuda"), torch.bfloat16, seed=0)
    prompt = torch.randint(100, 400, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [SamplingParams(max_tokens=64, ignore_eos=True), SamplingParams(max_tokens=64, temperature=0.8, seed=5,
                                                                             ignore_eos=True)]
    runs = {}
    for key, config in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})):
        engine = Engine(model="dummy:tiny", device="cuda", loaded=tiny, num_kv_blocks=256, speculative_config=config)
        runs[key] = [engine.generate([prompt], p)[0].token_ids for p in params]
        if key == "ngram":
            stats = engine.scheduler.speculation
    print(f"tiny dummy model: same tokens {runs['plain'] == runs['ngram']}, drafts kept {stats.num_accepted_tokens} "
          f"of {stats.num_draft_tokens} in {stats.num_drafts} verified steps")


if __name__ == "__main__":
    main()
