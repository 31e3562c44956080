"""The least-work order's tracked prefix hits on a real vLLM 0.32 (``prefix_hits.py``).

First on a real ``KVCacheManager`` (its ``BlockPool``, coordinator and ``Request`` hashes; no
model): allocations that evict, a connector's ``evict_blocks``, output tokens that grow a
chain, a prefix-cache reset; then inside an in-process engine (``order_hits_scenario.py``)
through hundreds of real scheduling steps with evictions and preemptions. Each time, every
tracked hit must be ``coordinator.find_longest_cache_hit``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from real_vllm import HERE, ROOT
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from asymcache_core.integrations.vllm.prefix_hits import track_prefix_hits

BLOCK = 16


def make_manager(num_blocks: int, *, sliding_group: bool = False, **kwargs: Any) -> KVCacheManager:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["full"], full)]
    if sliding_group:
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=64
        )
        groups.append(KVCacheGroupSpec(["window"], window))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, **kwargs
    )


class Requests:
    """Real ``Request`` objects whose block hashes vLLM's hasher computes."""

    def __init__(self) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.count = 0

    def __call__(self, prompt: list[int]) -> Request:
        self.count += 1
        return Request(
            f"r{self.count}", prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher
        )


def tokens(base: int, n: int) -> list[int]:
    return [base + i % 997 for i in range(n)]


def run_request(manager: KVCacheManager, request: Request) -> None:
    """Admits ``request`` as vLLM's scheduler does (its hit first) and computes its prompt."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens


def test_tracked_hits_equal_the_lookup_on_a_real_pool() -> None:
    manager = make_manager(40)
    hits, why = track_prefix_hits(manager)
    assert hits is not None and why is None
    pool = manager.block_pool
    make = Requests()
    shared = tokens(100, 160)  # 10 blocks
    waiting = [make(shared + tokens(1000 * i, 40 + 24 * i)) for i in range(6)] + [
        make(tokens(9000, 300))
    ]
    checked = {"events": 0, "nonzero": 0}

    def check() -> None:
        for request in waiting:
            _, full, _ = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1
            )
            assert (
                hits.hit_tokens(request.request_id, request.block_hashes, request.num_tokens)
                == full
            )
            checked["nonzero"] += full > 0
        checked["events"] += 1

    check()
    first = make(shared + tokens(7000, 50))
    run_request(manager, first)  # caches the shared prefix
    check()
    manager.free(first)
    check()
    for request in list(waiting[:3]):  # admitted one by one; the 40 blocks cannot hold them all
        waiting.remove(request)
        run_request(manager, request)
        check()
        request.append_output_token_ids(tokens(50, 20))  # decoding grows its chain
        manager.free(request)
        check()
    # preempted back to the waiting queue with its output tokens: a longer chain
    waiting.append(request)
    check()
    pool.evict_blocks(
        {b.block_id for b in pool.blocks[1:] if b.block_hash is not None and b.block_id % 3 == 0}
    )
    check()
    big = make(tokens(20000, 36 * BLOCK))  # its allocation evicts most of what is cached
    run_request(manager, big)
    check()
    manager.free(big)
    assert pool.reset_prefix_cache()
    check()
    run_request(manager, (again := make(shared + tokens(1000, 40))))
    check()
    manager.free(again)
    check()
    assert checked["nonzero"] >= 10  # the comparisons saw real hits, not only zeros
    hits.retain({r.request_id for r in waiting})
    assert len(hits) == len(waiting)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"enable_caching": False}, "prefix caching is off"),
        ({"use_eagle": True}, "EAGLE"),
        ({"sliding_group": True}, "not a single KV cache group"),
    ],
)
def test_the_full_lookup_stays_where_tracking_would_not_be_exact(
    kwargs: dict[str, Any], reason: str
) -> None:
    hits, why = track_prefix_hits(make_manager(40, **kwargs))
    assert hits is None and why is not None and reason in why


@pytest.mark.parametrize("eviction", ["asymcache", "lru"])
def test_tracked_hits_equal_the_lookup_through_real_scheduling_steps(
    tiny_model: Path, eviction: str
) -> None:
    options = json.dumps({"order": "least-work", "eviction": eviction})
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        ASYMCACHE_VLLM_OPTIONS=options,
    )
    # NOTE: this tree's code in the subprocess too (the venv's editable install may be another
    # checkout's: a worktree's)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(HERE / "order_hits_scenario.py"), str(tiny_model)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(lines[-1])
    assert report["options"]["eviction"] == eviction and report["tracking"]
    assert report["mismatches"] == []
    # the comparisons covered real hits, evictions and preempted requests with output tokens
    assert report["steps"] >= 100 and report["checks"] >= 500 and report["nonzero_hits"] >= 100
    assert report["evictions"] >= 20 and report["preempted_checks"] >= 1
    assert report["reset"] is True
    assert report["outputs_repeat"]  # the reset and the order changed no output
