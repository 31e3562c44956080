"""Jump-forward decoding on and off, side by side in one process: tool-calling agent jobs.

``PYTHONPATH=. python scripts/bench_jump_forward.py [--jobs 8] [--concurrency 1,8] [--rounds 2]``:
for each concurrency, each round (the settings alternating, their order flipping) runs
``--jobs`` agent jobs, that many at a time, through :class:`~agent_runtime.runtime.AgentRuntime`
on the packaged SmolLM2 (float32, CPU): each job makes ``--tool-turns`` forced tool calls
(hermes format, xgrammar-constrained: ``required`` over two tools) with real tool results, then
answers (``tool_choice: none``). Prints per concurrency and setting the mean job completion
time, the wall time of the round, the engine steps, the generated and the jumped tokens, and
the speed-up; checks that every job's messages are the same with jump-forward on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from typing import Literal

import torch

from agent_runtime.runtime import AgentRuntime
from asymcache_core import Engine
from asymcache_core.loaders import load_model

SETTINGS = ("off", "on")
ITEMS = ("apples", "a blue kettle", "pears", "three lamps", "tea", "the red bicycle")


async def lookup(key: Literal["apples", "kettle", "pears", "lamps", "tea", "bicycle"]) -> str:
    """Look a key up in the catalogue.

    Args:
        key: what to look up.
    """
    return f"{key}: in stock, aisle {len(key)}"


async def price(item: str, quantity: int) -> str:
    """The price of some items.

    Args:
        item: the item.
        quantity: how many.
    """
    return f"{quantity} x {item}: {quantity * 3} EUR"


async def one_round(engine: Engine, jobs: int, concurrency: int, tool_turns: int) -> tuple[float, list[float], list[str]]:
    """(wall s, each job's completion s, each job's messages with call ids blanked)."""
    runtime = AgentRuntime(engine)
    gate = asyncio.Semaphore(concurrency)
    jct: list[float] = [0.0] * jobs
    messages: list[str] = [""] * jobs

    async def job(index: int) -> None:
        async with gate:
            start = time.perf_counter()
            result = await runtime.job(f"jf-{index}", tools=[lookup, price]).run(
                f"Is {ITEMS[index % len(ITEMS)]} in stock, and what do {index % 4 + 2} cost?",
                max_turns=tool_turns + 1, tool_choice=["required"] * tool_turns + ["none"], max_tokens=48,
                # NOTE: one call a forced turn (the workload measured): "required" under parallel
                # calls may make several
                parallel_tool_calls=False,
            )
            jct[index] = time.perf_counter() - start
            messages[index] = re.sub(r"call_[0-9a-f]+", "call_", repr(result.messages))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(job(i) for i in range(jobs)))
    finally:
        await runtime.close()
    return time.perf_counter() - start, jct, messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--tool-turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.jobs} jobs a round, "
          f"{args.tool_turns} forced tool calls + an answer each; {args.rounds} rounds per setting (medians)")
    print(f"{'agents':>6} {'jump-forward':<13} {'mean JCT s':>10} {'wall s':>8} {'steps':>6} {'generated':>10} "
          f"{'jumped':>7} {'JCT off/on':>10}")
    all_same = True
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        rows: dict[str, dict[str, list[float]]] = {
            s: {"wall": [], "jct": [], "steps": [], "gen": [], "jumped": []} for s in SETTINGS
        }
        seen: dict[str, list[str]] = {}
        for r in range(args.rounds):
            for setting in SETTINGS if r % 2 == 0 else tuple(reversed(SETTINGS)):
                engine = Engine(model=loaded.name, loaded=loaded, num_kv_blocks=1024, jump_forward=setting == "on")
                wall, jct, messages = asyncio.run(one_round(engine, args.jobs, concurrency, args.tool_turns))
                stats = engine.stats()
                row = rows[setting]
                row["wall"].append(wall)
                row["jct"].append(statistics.mean(jct))
                row["steps"].append(len(engine.step_log))
                row["gen"].append(stats.engine_generated_tokens_total)
                row["jumped"].append(stats.engine_jump_forward_tokens_total)
                assert seen.setdefault(setting, messages) == messages, "a setting's jobs changed between rounds"
        all_same = all_same and seen["on"] == seen["off"]
        speedup = statistics.median(rows["off"]["jct"]) / statistics.median(rows["on"]["jct"])
        for setting in SETTINGS:
            row = rows[setting]
            print(f"{concurrency:>6} {setting:<13} {statistics.median(row['jct']):>10.2f} "
                  f"{statistics.median(row['wall']):>8.1f} {statistics.median(row['steps']):>6.0f} "
                  f"{statistics.median(row['gen']):>10.0f} {statistics.median(row['jumped']):>7.0f} "
                  f"{f'{speedup:.2f}x' if setting == 'on' else '':>10}")
    print(f"every job's messages the same with jump-forward on and off: {all_same}")
    if not all_same:
        raise SystemExit("jump-forward changed a job's messages")


if __name__ == "__main__":
    main()
