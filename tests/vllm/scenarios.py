"""Scenarios on a real in-process vLLM, one per subprocess; the result is JSON on the last line.

Usage: ``python tests/vllm/scenarios.py {agent,load,order,implicit} MODEL_DIR {plugin,baseline,entrypoint}
[PROFILE_JSON]`` (``entrypoint``: no ``scheduler_cls``; the ``vllm.general_plugins`` function
with ``$ASYMCACHE_VLLM_SCHEDULER`` picks the scheduler).

NOTE: one engine per process: vLLM keeps process-wide state (distributed groups, compile
caches), so the tests start a fresh interpreter per configuration.

The ``agent`` scenario, on a pool of 20 blocks of 32 tokens:

1. job K runs a turn and pauses longer than its pin's TTL (its pin must expire);
2. job J runs a turn (not its last step: pinned for the estimator's TTL) and "runs a tool";
3. job D runs its last step (its blocks lose all value) and an anonymous request F1 runs;
4. request F2 needs more blocks than are free without evicting: something is evicted;
5. job J's next turn (its first prompt + output + the tool's result) arrives within the TTL.

After every request the scenario records, for every prompt seen so far, which of its block
hashes are still cached, so orphans (a cached block whose ancestor is gone) are visible.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SCHEDULER_CLS = "asymcache_core.integrations.vllm.scheduler.AsymCacheScheduler"


def tokens(base: int, n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids, distinct per ``base``."""
    return [base + (i * 7) % 997 for i in range(n)]


def make_llm(model: str, mode: str, profile: str | None) -> Any:
    """An in-process vLLM with a 20-block pool of 32-token blocks (vLLM's scheduling policy
    from ``$SCENARIO_SCHEDULING_POLICY`` when set)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if mode == "entrypoint":
        from asymcache_core.integrations.vllm.plugin import ENV, register

        os.environ[ENV] = "1"
        register()
    elif mode == "plugin":
        kwargs["scheduler_cls"] = SCHEDULER_CLS
        if profile:
            kwargs["additional_config"] = {"asymcache": {"latency_profile": profile}}
    if os.environ.get("SCENARIO_SCHEDULING_POLICY"):
        kwargs["scheduling_policy"] = os.environ["SCENARIO_SCHEDULING_POLICY"]
    return LLM(
        model=model,
        block_size=32,
        enable_prefix_caching=True,
        num_gpu_blocks_override=20,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.15,
        **kwargs,
    )


def load(model: str, mode: str, profile: str | None) -> dict[str, Any]:
    """Starts the engine, runs one request, reports the scheduler and queue classes."""
    from vllm import SamplingParams

    llm = make_llm(model, mode, profile)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    out = llm.generate(
        [{"prompt_token_ids": tokens(1000, 70)}],
        SamplingParams(max_tokens=4, temperature=0.0, extra_args={"job_id": "L", "pin_ttl_s": 9}),
        use_tqdm=False,
    )[0]
    plugin = hasattr(scheduler, "asymcache_stats")
    return {
        "scheduler": type(scheduler).__name__,
        "queue": type(scheduler.kv_cache_manager.block_pool.free_block_queue).__name__,
        "output": list(out.outputs[0].token_ids),
        "pinned_jobs": scheduler.asymcache_stats()["pinned_jobs"] if plugin else None,
        "parallel": parallel_sampling(llm, scheduler) if plugin else None,
    }


def parallel_sampling(llm: Any, scheduler: Any) -> dict[str, Any]:
    """A turn of job N with three sampled choices (vLLM's child requests), then N's next turn
    continuing one of them: the ids vLLM gave the choices, the cached blocks each held as it
    was freed, and N's pin and statistics after each turn."""
    from vllm import SamplingParams

    added: list[str] = []
    freed: dict[str, list[int]] = {}
    orig_add, orig_free = scheduler.add_request, scheduler._free_request

    def add_request(request: Any) -> None:
        added.append(request.request_id)
        orig_add(request)

    def free_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = scheduler.kv_cache_manager.get_blocks(request.request_id).blocks[0]
        freed[request.request_id] = [b.block_id for b in blocks if b.block_hash is not None]
        return orig_free(request, *args, **kwargs)

    scheduler.add_request, scheduler._free_request = add_request, free_request
    pins, stats = scheduler.asymcache_pins, scheduler.asymcache_job_stats
    made = pins.stats.pins
    prompt = tokens(5000, 70)
    # NOTE: vLLM takes n > 1 only with sampling; no seed (see audit_scenarios.py)
    params = SamplingParams(max_tokens=30, temperature=1.0, n=3, extra_args={"job_id": "N", "pin_ttl_s": 60})
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    report: dict[str, Any] = {
        "choices": len(out.outputs),
        "child_ids": list(added),
        "freed": {rid: freed[rid] for rid in added},
        "pinned": sorted(pins.pins["N"].block_ids) if "N" in pins.pins else [],
        "pins_made": pins.stats.pins - made,
        "replaced": pins.stats.released_other,
        "turns": scheduler.asymcache_controller._turns.get("N"),
        "turn_sizes": list(stats.state("N").new_tokens),
        "running": stats.state("N").running,
    }
    nxt = prompt + list(out.outputs[1].token_ids) + tokens(6000, 10)
    last = SamplingParams(max_tokens=4, temperature=0.0, extra_args={"job_id": "N", "is_last_step": 1})
    done = llm.generate([{"prompt_token_ids": nxt}], last, use_tqdm=False)[0]
    report["next_cached_tokens"] = done.num_cached_tokens
    report["released_next_request"] = pins.stats.released_next_request
    report["pinned_after"] = sorted(pins.pins)
    report["state_left"] = [len(scheduler._asymcache_hints), scheduler.asymcache_turns.in_flight()]
    return report


def agent(model: str, mode: str, profile: str | None) -> dict[str, Any]:
    """Runs the ``agent`` scenario (module docstring) and reports what happened."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    plugin = mode != "baseline"
    llm = make_llm(model, mode, profile)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    # NOTE: the engine's internal request ids differ from the outputs'; requests run one at a
    # time, so the chain added last belongs to the request that just ran.
    added: list[list[Any]] = []
    chains: dict[str, list[Any]] = {}
    orig_add = scheduler.add_request

    def add_request(request: Any) -> None:
        added.append(list(request.block_hashes))
        orig_add(request)

    scheduler.add_request = add_request
    report: dict[str, Any] = {
        "scheduler": type(scheduler).__name__,
        "queue": type(pool.free_block_queue).__name__,
        "requests": {},
        "orphans": [],
    }

    def resident(name: str) -> list[bool]:
        return [
            pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(h, 0))
            is not None
            for h in chains[name]
        ]

    def run(name: str, prompt: list[int], **extra: Any) -> Any:
        params = SamplingParams(max_tokens=8, temperature=0.0, extra_args=extra or None)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        chains[name] = added[-1]
        report["requests"][name] = {
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens,
            "output": list(out.outputs[0].token_ids),
        }
        for req_name in report["requests"]:
            flags = resident(req_name)
            first_miss = flags.index(False) if False in flags else len(flags)
            if any(flags[first_miss:]):
                report["orphans"].append({"after": name, "request": req_name, "resident": flags})
        return out

    run("k1", tokens(1000, 100), job_id="K", is_last_step=0, tool_name="slow")
    time.sleep(2.3)  # longer than K's 2 s TTL (cold-start estimate)
    j_prompt = tokens(3000, 200)
    j1 = run("j1", j_prompt, job_id="J", is_last_step=0, tool_name="grep")
    t_pause = time.monotonic()
    run("d1", tokens(5000, 160), job_id="D", is_last_step=1)
    run("f1", tokens(7000, 128))
    queue = pool.free_block_queue
    predicted = [b.block_id for b in queue.get_all_free_blocks() if b.block_hash is not None]
    evicted: list[int] = []
    orig_evict = pool._maybe_evict_cached_block

    def maybe_evict(block: Any) -> bool:
        if block.block_hash is not None:
            evicted.append(block.block_id)
        return orig_evict(block)

    pool._maybe_evict_cached_block = maybe_evict
    run("f2", tokens(9000, 300))
    pool._maybe_evict_cached_block = orig_evict
    report["f2_predicted"] = predicted
    report["f2_evicted"] = evicted
    report["pause_s"] = time.monotonic() - t_pause
    j2_prompt = j_prompt + list(j1.outputs[0].token_ids) + tokens(11000, 10)
    run("j2", j2_prompt, job_id="J", is_last_step=1)
    report["resident_after"] = {
        name: sum(resident(name)) for name in report["requests"]
    }
    if plugin:
        report["stats"] = scheduler.asymcache_stats()
        report["latency_source"] = scheduler.asymcache_scorer.latency.source
    return report


def order(model: str, mode: str, profile: str | None) -> dict[str, Any]:
    """The ``order`` scenario: admission order of a long uncached prompt and a mostly cached one.

    A 320-token context W runs and stays cached (10 of the 20 blocks). Then, in one batch, a
    400-token uncached prompt L arrives before S = W + 40 new tokens. The pool cannot hold both:
    FCFS admits L, whose blocks displace part of W, so S waits and refills; the least work
    first admits S (40 tokens to compute) while W is still cached. ``$ASYMCACHE_VLLM_OPTIONS``
    picks the order (and ``least_work_patience``: S arrives microseconds after L, so only a
    patience that small gives L its turn first).
    """
    from vllm import SamplingParams

    llm = make_llm(model, mode, profile)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    admitted: list[int] = []
    orig_schedule = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        output = orig_schedule(*args, **kwargs)
        admitted.extend(len(new.prompt_token_ids or []) for new in output.scheduled_new_reqs)
        return output

    scheduler.schedule = schedule
    params = SamplingParams(max_tokens=8, temperature=0.0)
    warm = tokens(3000, 320)
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    admitted.clear()
    long_prompt, short_prompt = tokens(5000, 400), warm + tokens(7000, 40)
    outs = llm.generate([{"prompt_token_ids": long_prompt}, {"prompt_token_ids": short_prompt}], params, use_tqdm=False)
    return {
        "order": scheduler.asymcache_options.order,
        "patience": scheduler.asymcache_options.least_work_patience,
        "admitted_prompt_lengths": admitted,
        "cached_tokens": {"long": outs[0].num_cached_tokens, "short": outs[1].num_cached_tokens},
        "outputs": {"long": list(outs[0].outputs[0].token_ids), "short": list(outs[1].outputs[0].token_ids)},
    }


def implicit(model: str, mode: str, profile: str | None) -> dict[str, Any]:
    """The ``implicit`` scenario: a conversation whose requests name no job.

    Turn 1 runs a prompt A; turn 2 sends A + its reply + a tool's result; an unrelated prompt B
    runs; then a fork of turn 1 (A + its reply + other text); an hour later (the scheduler's
    clock moved), another prompt. The scheduler's implicit jobs (``$ASYMCACHE_VLLM_OPTIONS`` may
    turn them off) are read after each.
    """
    from vllm import SamplingParams

    llm = make_llm(model, mode, profile)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=8, temperature=0.0)
    report: dict[str, Any] = {"turns": {}}

    def run(name: str, prompt: list[int]) -> list[int]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        stats = scheduler.asymcache_stats()
        report["turns"][name] = {
            "output": list(out.outputs[0].token_ids), "cached_tokens": out.num_cached_tokens,
            "pinned_jobs": stats["pinned_jobs"], "implicit_jobs": stats["implicit_jobs"],
            # the jobs Continuum decided a pin for (its TTL rule may choose none for a short pause)
            "decided_jobs": [d.job_id for d in scheduler.asymcache_controller.decisions],
        }
        return list(out.outputs[0].token_ids)

    first = tokens(1000, 100)
    reply = run("first", first)
    run("second", first + reply + tokens(2000, 20))
    run("other", tokens(4000, 90))
    run("fork", first + reply + tokens(3000, 20))
    report["tracked_jobs"] = scheduler.asymcache_stats()["tracked_jobs"]
    # an hour later: the idle jobs' state is dropped at the next step (not the new request's)
    scheduler.asymcache_clock = lambda: time.monotonic() + 3600.0
    run("late", tokens(6000, 50))
    report["tracked_jobs_later"] = scheduler.asymcache_stats()["tracked_jobs"]
    return report


def main(argv: list[str]) -> int:
    """Entry point: prints the scenario's JSON report as the last line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    name, model, mode = argv[1], argv[2], argv[3]
    profile = argv[4] if len(argv) > 4 else None
    scenarios = {"agent": agent, "load": load, "order": order, "implicit": implicit}
    if name not in scenarios or mode not in ("plugin", "baseline", "entrypoint"):
        raise SystemExit(f"usage: scenarios.py {{agent,load,order,implicit}} MODEL {{plugin,baseline,entrypoint}}; got {name} {mode}")
    report = scenarios[name](model, mode, profile)
    print("\n" + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
