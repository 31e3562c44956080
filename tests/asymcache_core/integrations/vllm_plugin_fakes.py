"""A stand-in for the few vLLM 0.32 modules the plugin's ``scheduler.py`` imports (no vLLM needed).

:func:`load_scheduler_module` installs fake ``vllm.*`` modules in ``sys.modules`` (through
pytest's ``monkeypatch``, so they vanish after the test) and imports a fresh copy of
``asymcache_core.integrations.vllm.scheduler`` over them. The fake ``Scheduler`` base does what
vLLM's does around the mixin's hooks: ``add_request``, ``schedule`` (admits every waiting
request, prefix hits first, as ``KVCacheManager.allocate_slots`` would), ``finish_requests``
(``_free_request``, tail first) and a ``BlockPool`` with vLLM's cache bookkeeping methods
(``cache_full_blocks``, ``_insert_block_hash``, ``_remove_cached_block_hashes``,
``evict_blocks``, ``reset_prefix_cache``).
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import pytest

SCHEDULER_MODULE = "asymcache_core.integrations.vllm.scheduler"
FAKE_NAME = "_asymcache_vllm_scheduler_over_fakes"


class RequestStatus(enum.IntEnum):
    """vLLM's statuses (the subset the plugin reads, same order)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None
    is_null: bool = False
    prev_free_block: Any = None
    next_free_block: Any = None


class ListQueue:
    """vLLM's LRU free queue, reduced to what the plugin reads before replacing it."""

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = list(blocks)

    def get_all_free_blocks(self) -> list[Block]:
        return list(self.blocks)


class BlockPool:
    """vLLM's ``BlockPool`` bookkeeping, one hash per block, one KV group."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_gpu_blocks = num_blocks
        self.enable_caching = True
        self.hash_block_size = 4
        self.free_block_queue: Any = ListQueue(self.blocks)
        self.cached: dict[Hashable, Block] = {}

    def get_new_blocks(self, n: int) -> list[Block]:
        out = self.free_block_queue.popleft_n(n)
        for block in out:
            self._remove_cached_block_hashes(block)
            block.ref_cnt += 1
        return out

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: list[Block]) -> None:
        first, last = [], []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def cache_full_blocks(
        self, request: Any, blocks: list[Block], num_cached_blocks: int, num_full_blocks: int,
        block_size: int, kv_cache_group_id: int,
    ) -> None:
        for i in range(num_cached_blocks, num_full_blocks):
            key = request.block_hashes[i]
            self._insert_block_hash(key, blocks[i], block_size)

    def _insert_block_hash(self, key: Hashable, block: Block, num_tokens: int | None) -> None:
        if block.block_hash == key or key in self.cached:
            return
        block.block_hash = key
        self.cached[key] = block

    def _remove_cached_block_hashes(self, block: Block) -> list[Hashable]:
        key = block.block_hash
        if key is None:
            return []
        if self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash = None
        return [key]

    def evict_blocks(self, block_ids: set[int]) -> None:
        for block_id in block_ids:
            self._remove_cached_block_hashes(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self.blocks):
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True


@dataclass
class Request:
    """vLLM's ``Request``: a prompt of whole blocks, keys ``key_i`` naming their prefix."""

    request_id: str
    keys: list[str]
    extra_args: dict[str, Any] | None = None
    session_id: str | None = None
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    sampling_params: Any = None
    num_computed_tokens: int = 0
    block_size: int = 4
    all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampling_params = types.SimpleNamespace(extra_args=self.extra_args)
        self.all_token_ids = [hash(k) % 1000 for k in self.keys for _ in range(self.block_size)]

    @property
    def block_hashes(self) -> list[str]:
        return self.keys

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def fan_out(
    request_id: str, prompt: list[str], outputs: list[list[str]], extra_args: dict[str, Any] | None = None,
    session_id: str | None = None,
) -> list[Request]:
    """The child requests vLLM 0.32 makes of a request with ``n = len(outputs)`` choices
    (``LLMEngine.add_request`` / ``AsyncLLM.add_request`` with
    ``vllm/v1/engine/parallel_sampling.py``'s ``ParentRequest.get_child_info``): the i-th child's
    id is ``f"{i}_{request_id}"`` and it carries the parent's prompt, session id and
    ``extra_args`` (a shallow copy of the sampling params: the same dict). Each child's blocks are
    the prompt's followed by its own choice's (``outputs[i]``, the keys of its generated blocks).
    """
    return [
        Request(f"{i}_{request_id}", prompt + out, extra_args=extra_args, session_id=session_id)
        for i, out in enumerate(outputs)
    ]


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.block_pool = pool
        self.tables: dict[str, list[Block]] = {}

    def get_blocks(self, request_id: str) -> Any:
        return types.SimpleNamespace(blocks=(list(self.tables.get(request_id, [])),))

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return True


class Scheduler:
    """vLLM's ``Scheduler`` around the hooks the mixin overrides."""

    def __init__(self, vllm_config: Any, num_blocks: int = 32, block_size: int = 4) -> None:
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.kv_cache_manager = KVCacheManager(BlockPool(num_blocks))
        self.requests: dict[str, Request] = {}
        self.policy = SchedulingPolicy.FCFS
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.max_num_running_reqs = 64
        # NOTE: vLLM's switch of its stats (``--disable-log-stats`` sets it False)
        self.log_stats = False

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> Any:
        pool = self.kv_cache_manager.block_pool
        new = []
        while self.waiting:
            request = self.waiting.popleft()
            hits: list[Block] = []
            for key in request.keys:
                block = pool.cached.get(key)
                if block is None:
                    break
                hits.append(block)
            pool.touch(hits)
            table = hits + pool.get_new_blocks(len(request.keys) - len(hits))
            pool.cache_full_blocks(request, table, len(hits), len(table), self.block_size, 0)
            self.kv_cache_manager.tables[request.request_id] = table
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new.append(types.SimpleNamespace(req_id=request.request_id))
        return types.SimpleNamespace(scheduled_new_reqs=new)

    def finish_requests(self, request_id: str, status: RequestStatus) -> None:
        request = self.requests[request_id]
        request.status = status
        if request in self.running:
            self.running.remove(request)
        self._free_request(request)

    def _free_request(self, request: Request) -> None:
        table = self.kv_cache_manager.tables.pop(request.request_id, [])
        self.kv_cache_manager.block_pool.free_blocks(list(reversed(table)))
        del self.requests[request.request_id]


class AsyncScheduler(Scheduler):
    pass


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def load_scheduler_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Imports a fresh ``scheduler.py`` over fake vLLM modules (undone by ``monkeypatch``).

    Args:
        monkeypatch: the test's monkeypatch fixture.

    Returns:
        The scheduler module.
    """
    fakes = {
        "vllm": _module("vllm"),
        # NOTE: vLLM's environment settings the scheduler reads (its stats log's interval)
        "vllm.envs": _module("vllm.envs", VLLM_LOG_STATS_INTERVAL=10.0),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.core": _module("vllm.v1.core"),
        "vllm.v1.core.sched": _module("vllm.v1.core.sched"),
        "vllm.v1.core.kv_cache_utils": _module(
            "vllm.v1.core.kv_cache_utils",
            make_block_hash_with_group_id=lambda h, g: h,
            resolve_block_hashes=lambda hashes, hash_size, size: hashes,
        ),
        "vllm.v1.core.sched.async_scheduler": _module(
            "vllm.v1.core.sched.async_scheduler", AsyncScheduler=AsyncScheduler),
        "vllm.v1.core.sched.request_queue": _module(
            "vllm.v1.core.sched.request_queue", SchedulingPolicy=SchedulingPolicy),
        "vllm.v1.core.sched.scheduler": _module("vllm.v1.core.sched.scheduler", Scheduler=Scheduler),
        "vllm.v1.request": _module("vllm.v1.request", RequestStatus=RequestStatus),
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    # NOTE: a private copy under its own name: the real module (imported over real vLLM, or
    # not at all) stays as it was, and monkeypatch drops the copy after the test.
    spec = importlib.util.find_spec(SCHEDULER_MODULE)
    assert spec is not None and spec.origin is not None
    copy_spec = importlib.util.spec_from_file_location(FAKE_NAME, spec.origin)
    assert copy_spec is not None and copy_spec.loader is not None
    module = importlib.util.module_from_spec(copy_spec)
    monkeypatch.setitem(sys.modules, FAKE_NAME, module)
    copy_spec.loader.exec_module(module)
    return module


def vllm_config(options: dict[str, Any] | None = None) -> Any:
    """A ``VllmConfig`` with ``additional_config["asymcache"] = options``; the model is
    unknown to the analytic latency model (the default one is used)."""
    extra = {} if options is None else {"asymcache": options}
    return types.SimpleNamespace(additional_config=extra, model_config=types.SimpleNamespace(hf_config=None))


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_scheduler(sched_mod: types.ModuleType, options: dict[str, Any] | None = None, num_blocks: int = 32) -> Any:
    """The plugin's synchronous scheduler on the fake vLLM, its clocks one :class:`Clock`
    (implicit jobs off unless ``options`` turn them on)."""
    opts = {"implicit_jobs": False, **(options or {})}
    sched = sched_mod.AsymCacheScheduler(vllm_config(opts), num_blocks=num_blocks)
    clock = Clock()
    sched.asymcache_clock = clock
    sched.asymcache_controller.clock = clock
    sched.asymcache_queue.clock = clock
    return sched
