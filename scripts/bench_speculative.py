"""N-gram speculative decoding against plain decoding on the CPU, side by side in one run.

``PYTHONPATH=$PWD python scripts/bench_speculative.py [--repeats 3] [--tokens 96] [--batches 1,8]``

The packaged SmolLM2-135M-Instruct (fp32), greedy, EOS ignored. Three prompts an agent sends:
``copy`` (repeat a block of code: a file rewritten with an edit), ``json`` (a tool result
echoed as JSON), ``chat`` (a free answer: little to copy, the drafts' cost shows). Each batch
runs the same prompt ``B`` times (distinct request ids). Two engines share the weights: without
drafts and with vLLM's ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min":
2, "prompt_lookup_max": 4}``, alternating, each measured after a warm-up; the table prints the
medians of the output tokens per second, the steps, the drafts kept per verified step, and
whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model

CODE = (
    "def load(path):\n    with open(path) as f:\n        return f.read()\n\n"
    "def save(path, text):\n    with open(path, 'w') as f:\n        f.write(text)\n\n"
    "def count_lines(path):\n    return len(load(path).splitlines())\n"
)
RESULT = '{"files": ["src/app.py", "src/util.py", "tests/test_app.py"], "status": "ok", "lines": [120, 48, 64]}'
PROMPTS = {
    "copy": f"Rewrite this file exactly, renaming load to read_file:\n{CODE}",
    "json": f"The tool returned:\n{RESULT}\nRepeat the tool result exactly as JSON.",
    "chat": "Explain in a few sentences why the sky is blue.",
}


def _run(engine: Engine, ids: list[int], batch: int, tokens: int) -> tuple[float, int, list[list[int]], tuple[int, int]]:
    spec = engine.scheduler.speculation
    before = (len(engine.step_log), spec.num_drafts, spec.num_accepted_tokens)
    start = time.perf_counter()
    outs = engine.generate([ids] * batch, SamplingParams(max_tokens=tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    steps = len(engine.step_log) - before[0]
    return seconds, steps, [o.token_ids for o in outs], (spec.num_drafts - before[1], spec.num_accepted_tokens - before[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engines = {
        "plain": Engine(model=loaded.name, loaded=loaded, num_kv_blocks=512),
        "ngram": Engine(model=loaded.name, loaded=loaded, num_kv_blocks=512, speculative_config=spec),
    }
    tok = loaded.tokenizer
    print(f"threads {torch.get_num_threads()}, {args.tokens} tokens, k={args.k}, medians of {args.repeats}")
    print("| prompt | batch | plain tok/s | ngram tok/s | speed-up | plain steps | ngram steps | kept a step | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, text in PROMPTS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False))
        for batch in (int(b) for b in args.batches.split(",")):
            for engine in engines.values():
                _run(engine, ids, batch, 8)  # warm-up
            rates: dict[str, list[float]] = {k: [] for k in engines}
            steps: dict[str, int] = {}
            tokens: dict[str, list[list[int]]] = {}
            kept = (0, 0)
            for _ in range(args.repeats):
                for key, engine in engines.items():
                    seconds, n, out, drafts = _run(engine, ids, batch, args.tokens)
                    rates[key].append(batch * args.tokens / seconds)
                    steps[key], tokens[key] = n, out
                    if key == "ngram":
                        kept = drafts
            plain, ngram = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
            per_step = kept[1] / kept[0] if kept[0] else 0.0
            print(f"| {name} | {batch} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.2f}x | {steps['plain']} | "
                  f"{steps['ngram']} | {per_step:.2f} | {'yes' if tokens['plain'] == tokens['ngram'] else 'no'} |")


if __name__ == "__main__":
    main()
