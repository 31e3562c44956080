"""How an :class:`~asymcache_core.engine.Engine` builds its parts from its configuration.

The model (one rank, or tensor-parallel workers), the KV pool's size (from
``gpu_memory_utilization`` or a share of free memory) and the model runner with its attention
backend. The engine calls these once, in its constructor; none of them keeps state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from asymcache_core.budget import AdaptiveBudget, FixedBudget
from asymcache_core.config import EngineConfig
from asymcache_core.memory_budget import GIB, KVPoolPlan, check_device_pool_fits, plan_for_device
from asymcache_core.scheduler import Scheduler, fcfs_key
from asymcache_core.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from asymcache_core.kv_stack import KVStack
    from asymcache_core.latency_model import LatencyFeedback, LatencyModel
    from asymcache_core.request import Request
    from asymcache_core.scheduler import SchedulerOutput
    from asymcache_core.tensor_parallel import TensorParallelWorkers

# NOTE: the engine's own logger: `serve` prints its startup line from the record `log_ready` writes
logger = logging.getLogger("asymcache_core.engine")


class Runner(Protocol):
    """Runs a planned step and returns ``request_id -> sampled token`` for finished contexts."""

    def execute(self, plan: SchedulerOutput) -> dict[str, int]: ...


def resolve_config(config: EngineConfig | str | None, overrides: dict[str, Any]) -> EngineConfig:
    """The engine's configuration from what its constructor was given.

    Args:
        config: an :class:`EngineConfig`, a model spec, or ``None`` (the defaults).
        overrides: fields of :class:`EngineConfig` applied on top.

    Raises:
        ValueError: the model is given twice, or ``config`` is of another type.
    """
    if isinstance(config, str):
        if "model" in overrides:
            raise ValueError("model: given both as the first argument and as model=")
        return EngineConfig(model=config, **overrides)
    if config is None:
        return EngineConfig(**overrides)
    if not isinstance(config, EngineConfig):
        raise ValueError(f"config: expected an EngineConfig or a model name, not {type(config).__name__}")
    return dataclasses.replace(config, **overrides) if overrides else config


class ModelAndLength(Protocol):
    """What :func:`check_max_model_len` reads of a configuration (an :class:`EngineConfig`, or
    the bench's, which cuts its jobs to ``max_model_len``)."""

    @property
    def model(self) -> str: ...

    @property
    def max_model_len(self) -> int | None: ...


def check_max_model_len(config: ModelAndLength, model_config: Any) -> None:
    """Refuses a ``max_model_len`` past the model's positions (vLLM's rule).

    NOTE: the engine runs at most the model's ``max_position_embeddings``: a longer limit was
    once kept silently in ``engine.config`` while the engine used the model's. The bench checks
    its own ``max_model_len`` here too, so that every entry point says it in the same words.

    Args:
        config: the engine configuration (``max_model_len`` ``None``: the model's).
        model_config: the model's :class:`~asymcache_core.models.ModelConfig`.

    Raises:
        ValueError: naming ``max_model_len`` and the model's limit.
    """
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len: {config.max_model_len} is past {config.model}'s limit of "
            f"{limit} tokens (its max_position_embeddings); give at most {limit} or leave it "
            "unset for the model's own"
        )


def load_engine_model(config: EngineConfig, loaded: Any) -> tuple[Any, TensorParallelWorkers | None]:
    """The engine's model, and its tensor-parallel workers when it is split.

    Args:
        config: the engine configuration.
        loaded: an already loaded model to share (``None``: load ``config.model``).

    Returns:
        ``(loaded model, workers or None)``.

    Raises:
        ValueError: the shared model is another model, or would have to be split;
            ``max_model_len`` past the model's positions (:func:`check_max_model_len`).
    """
    from asymcache_core.loaders import load_model, resolve_hf_config
    from asymcache_core.models import ModelConfig

    device, dtype = config.torch_device, config.torch_dtype
    if loaded is not None:
        if loaded.name != config.model:
            raise ValueError(f"model: the shared model is {loaded.name!r}, not {config.model!r}")
        check_max_model_len(config, loaded.config)
        if config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: a shared, already loaded model cannot be split")
        return loaded, None
    if config.max_model_len is not None:
        # NOTE: from the config alone, before any weight is read or worker started
        check_max_model_len(config, ModelConfig.from_hf(resolve_hf_config(config.model)[0]))
    if config.tensor_parallel_size > 1:
        from asymcache_core.tensor_parallel import start_workers

        workers = start_workers(config, device, dtype)
        return load_model(config.model, device, dtype, config.seed, config.max_model_len, workers.group), workers
    return load_model(config.model, device, dtype, config.seed, config.max_model_len), None


def rank_model_config(model_config: Any, tp_workers: TensorParallelWorkers | None) -> Any:
    """The model as rank 0 holds it: its share of the KV heads sizes its share of a block.

    NOTE: rank 0 holds the largest share, so a pool that fits rank 0 fits every rank.
    """
    if tp_workers is None:
        return model_config
    return dataclasses.replace(model_config, num_key_value_heads=tp_workers.shards[0].num_kv_heads)


def check_pool_fits(
    config: EngineConfig, model_config: Any, tp_workers: TensorParallelWorkers | None, num_blocks: int,
    dtype_bytes: int,
) -> None:
    """Raises ``ValueError`` naming ``num_kv_blocks`` when a pool of ``num_blocks`` cannot fit
    one rank's device at all (:func:`~asymcache_core.memory_budget.check_device_pool_fits`)."""
    per_block = rank_model_config(model_config, tp_workers).kv_bytes_per_token(dtype_bytes) * config.block_size
    check_device_pool_fits(num_blocks * per_block, config.torch_device)


def pool_blocks(
    config: EngineConfig, model_config: Any, tp_workers: TensorParallelWorkers | None, weights: Any, dtype_bytes: int
) -> tuple[int, KVPoolPlan | None]:
    """KV blocks of the device pool when ``num_kv_blocks`` is not set.

    ``gpu_memory_utilization`` sizes the pool as vLLM does
    (:func:`~asymcache_core.memory_budget.plan_for_device`); without it, ``kv_memory_fraction``
    of the free device memory (of the available host memory on the CPU, at most 1 GiB).

    Args:
        config: the engine configuration.
        model_config: the whole model's shape.
        tp_workers: the tensor-parallel workers (``None``: one rank).
        weights: the loaded model's module, whose bytes the memory plan counts (``None``: simulated).
        dtype_bytes: bytes of one KV element.

    Returns:
        ``(blocks, the memory plan or None)``.
    """
    rank_config = rank_model_config(model_config, tp_workers)
    if config.gpu_memory_utilization is not None:
        plan = plan_for_device(
            rank_config, gpu_memory_utilization=config.gpu_memory_utilization, device=config.torch_device,
            block_size=config.block_size, dtype_bytes=dtype_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            weights=weights,
            device_memory_bytes=None if config.device_memory_gib is None else int(config.device_memory_gib * GIB),
            batch_invariant=bool(config.batch_invariant),
        )
        return plan.num_blocks, plan
    per_block = rank_config.kv_bytes_per_token(dtype_bytes) * config.block_size
    device = config.torch_device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.kv_memory_fraction
    else:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(avail * config.kv_memory_fraction, 1 << 30)
    return max(16, int(budget // per_block)), None


def build_model_runner(
    config: EngineConfig,
    loaded: Any,
    tp_workers: TensorParallelWorkers | None,
    *,
    num_blocks: int,
    max_model_len: int,
    num_host_blocks: int,
) -> tuple[Runner, str]:
    """The runner of a loaded model: one rank's :class:`~asymcache_core.model_runner.ModelRunner`
    or the tensor-parallel runner over ``tp_workers``.

    Returns:
        ``(runner, attention backend name)``.
    """
    from asymcache_core.model_runner import ModelRunner
    from kernels.dispatch import select_attention_backend

    device, dtype = config.torch_device, config.torch_dtype
    backend = select_attention_backend(
        device, config.attention_backend, dtype, batch_invariant=config.batch_invariant, fused=config.fused_kernels,
    )
    if config.batch_invariant and device.type == "cpu" and tp_workers is None:
        from kernels.cpu_linear import check_invariant_linears

        # NOTE: which product each weight shape runs is checked now (a few seconds, once a
        # machine: kept in the cache folder), not in the first step a request waits on.
        check_invariant_linears(loaded.model, torch.get_num_threads())
    runner_kwargs: dict[str, Any] = dict(
        num_blocks=num_blocks, block_size=config.block_size, seed=config.seed,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        # NOTE: tensor-parallel steps run eagerly: a captured graph would have to hold
        # the collectives of every rank in lockstep.
        cuda_graphs=not config.enforce_eager and device.type == "cuda" and backend.name == "triton"
        and tp_workers is None,
        mixed_graph_tokens=config.mixed_graph_max_tokens,
        num_host_blocks=num_host_blocks,
        # NOTE: a step's rows: its chunk budget plus a token per running decode.
        max_num_batched_tokens=max(config.max_num_batched_tokens, config.chunk_budget() or 0)
        + config.max_num_seqs,
    )
    if tp_workers is None:
        return ModelRunner(loaded, device=device, dtype=dtype, backend=backend, **runner_kwargs), backend.name
    from asymcache_core.tensor_parallel import TensorParallelRunner

    try:
        runner = TensorParallelRunner(tp_workers, loaded, device, dtype, backend, **runner_kwargs)
    except BaseException:
        tp_workers.close()
        raise
    return runner, backend.name


def eos_token_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids, with the tokenizer's own."""
    eos = set(model_config.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return frozenset(eos)


def build_scheduler(
    config: EngineConfig,
    stack: KVStack,
    latency: LatencyModel,
    feedback: LatencyFeedback,
    clock: Callable[[], float],
    *,
    on_finish: Callable[[Request, float], None],
    eos_token_ids: frozenset[int],
    max_model_len: int,
    async_output: bool,
) -> Scheduler:
    """The scheduler over the KV stack, with its chunk budget (``config.chunking``: fixed, or
    adaptive on ``latency`` as ``feedback`` corrects it) and the program order ``config.priority``
    names."""
    fixed = config.chunk_budget()
    budget: FixedBudget | AdaptiveBudget = (
        FixedBudget(fixed)
        if fixed is not None
        else AdaptiveBudget(
            latency, config.tpot_slo_ms / 1e3, config.block_size, config.max_num_batched_tokens,
            feedback=feedback, clock=clock, slack=config.chunking == "adaptive:slack",
        )
    )
    continuum = stack.continuum
    return Scheduler(
        stack.kv,
        config.block_size,
        config.max_num_seqs,
        budget,
        continuum.program_key if config.priority == "program" else fcfs_key,
        admission_key=continuum.adaptive_program_key if config.priority == "adaptive" else None,
        reclaim=stack.pins.release_for_pressure,
        on_admit=continuum.on_admit,
        on_finish=on_finish,
        eos_token_ids=eos_token_ids,
        max_model_len=max_model_len,
        clock=clock,
        align_chunks=fixed is None,
        admit_full_prompt=config.admit_full_prompt,
        least_work_first=config.least_work_first,
        least_work_patience=config.least_work_patience,
        work_seconds=latency.prefill_latency,
        job_admission=stack.job_admission,
        async_output=async_output,
        jump_forward=config.jump_forward,
        speculative=SpeculativeConfig.parse(config.speculative_config),
    )


def log_ready(config: EngineConfig, num_blocks: int, block_bytes: int) -> None:
    """Logs the loaded engine's model, device and pool (structured: ``engine_ready``)."""
    ready = {
        "model": config.model, "dtype": str(config.torch_dtype).removeprefix("torch."),
        "device": str(config.torch_device), "eviction_policy": config.eviction_policy, "kv_blocks": num_blocks,
        "kv_gib": num_blocks * block_bytes / GIB,
    }
    logger.info("engine ready: %s", ready, extra={"engine_ready": ready})


__all__ = [
    "Runner",
    "build_model_runner",
    "build_scheduler",
    "eos_token_ids",
    "load_engine_model",
    "log_ready",
    "pool_blocks",
    "rank_model_config",
    "resolve_config",
]
