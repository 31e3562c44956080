"""The least-work order's tracked prefix hits inside a real in-process vLLM, against its lookup.

Usage: ``python tests/vllm/order_hits_scenario.py MODEL_DIR`` (the options come from
``$ASYMCACHE_VLLM_OPTIONS``; ``order: least-work`` is what makes the scheduler track hits). The
JSON report is the last line.

On the scenarios' pool (20 blocks of 32 tokens, 4 requests at most in flight) two batches of
twelve prompts in three families of shared prefixes run, each prompt longer than the last, with
a prefix-cache reset between the batches: admissions evict each other's blocks and decodes
that find no free block preempt requests back to the waiting queue with output tokens (their
hash chains grew). Before and after every ``schedule()`` call, each waiting request's tracked
hit (``scheduler.asymcache_prefix_hits``) is compared with vLLM's own
``coordinator.find_longest_cache_hit``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from scenarios import make_llm, tokens


def run(model: str) -> dict[str, Any]:
    """Runs the two batches; returns the comparison counts and the outputs."""
    from vllm import SamplingParams

    llm = make_llm(model, "plugin", None)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    hits = scheduler.asymcache_prefix_hits
    report: dict[str, Any] = {
        "options": scheduler.asymcache_options.__dict__,
        "tracking": hits is not None,
        "checks": 0,
        "nonzero_hits": 0,
        "preempted_checks": 0,
        "mismatches": [],
        "evictions": 0,
        "steps": 0,
    }
    orig_remove = pool._remove_cached_block_hashes

    def remove_counting(block: Any) -> Any:
        removed = orig_remove(block)
        report["evictions"] += bool(removed)
        return removed

    pool._remove_cached_block_hashes = remove_counting

    def compare(when: str) -> None:
        for request in scheduler.waiting:
            if not manager.prefix_cache_lookup_enabled(request) or hits is None:
                continue
            _, full, _ = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1
            )
            tracked = hits.hit_tokens(request.request_id, request.block_hashes, request.num_tokens)
            report["checks"] += 1
            report["nonzero_hits"] += full > 0
            report["preempted_checks"] += request.num_output_tokens > 0
            if tracked != full:
                report["mismatches"].append([when, request.request_id, tracked, full])

    orig_schedule = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        compare("before")
        output = orig_schedule(*args, **kwargs)
        compare("after")
        report["steps"] += 1
        return output

    scheduler.schedule = schedule
    prefixes = [tokens(1000 * (f + 1), 64 + 32 * f) for f in range(3)]
    prompts = [prefixes[i % 3] + tokens(5000 + 100 * i, 20 + 17 * i) for i in range(12)]
    params = [SamplingParams(max_tokens=24 + 8 * (i % 4), temperature=0.0) for i in range(12)]
    outputs = []
    for batch in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
        if batch == 0:
            report["reset"] = llm.reset_prefix_cache()
    report["outputs_repeat"] = outputs[0] == outputs[1]
    report["tracked_after"] = None if hits is None else len(hits)
    return report


def main(argv: list[str]) -> int:
    """Entry point: prints the JSON report as the last line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print("\n" + json.dumps(run(argv[1])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
