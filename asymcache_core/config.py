"""Engine configuration."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PRIORITIES = ("fcfs", "program", "adaptive")


@dataclass(frozen=True)
class CliFlag:
    """How the command line spells one :class:`EngineConfig` field (its ``"cli"`` metadata).

    Attributes:
        name: the option, vLLM's name where vLLM has one (``--max-model-len``); otherwise the
            field's name with dashes (``--num-kv-blocks``: vLLM's ``--num-gpu-blocks-override``
            overrides a profiled pool and is GPU-only, so it is only an alias).
        help: one line for ``--help``.
        aliases: other spellings that keep working (older names of this CLI, vLLM's).
    """

    name: str
    help: str
    aliases: tuple[str, ...] = ()


def _flag(name: str, help: str, *aliases: str) -> dict[str, Any]:
    return {"cli": CliFlag(name, help, aliases)}


def cli_flags() -> dict[str, CliFlag]:
    """The :class:`EngineConfig` fields the command line sets, with their options.

    ``eviction_policy``, ``priority`` and ``hole_reuse`` have none: a serving preset
    (``--policy``) or a bench suffix sets them.

    Returns:
        Field name -> option, in field order.
    """
    from dataclasses import fields

    return {f.name: f.metadata["cli"] for f in fields(EngineConfig) if "cli" in f.metadata}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Bad values raise ``ValueError`` naming the field.

    The command line's engine options are derived from these fields (:func:`cli_flags`), so a
    setting has one name from ``Engine(...)`` to ``asymcache serve --...``.

    Attributes:
        model: ``smollm2-135m`` (the packaged GGUF), a local HF folder, a ``.gguf`` path, or
            ``dummy:<config>`` (a shipped config name such as ``llama-3.1-8b``, or a path to a
            ``config.json``) with random weights.
        device: ``cpu``, ``cuda``, ``cuda:N``.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``float16``, ``bfloat16``.
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; ``None`` derives it from ``kv_memory_fraction``.
        kv_memory_fraction: share of the device's free memory (after weights) for the KV pool;
            on CPU, share of available RAM capped at 1 GiB.
        gpu_memory_utilization: vLLM's meaning: share of the device's memory the engine may use
            for weights, activations and the KV pool, which gets what is left
            (:func:`asymcache_core.memory_budget.plan_kv_pool`); overrides ``kv_memory_fraction``
            (``num_kv_blocks`` overrides both).
        device_memory_gib: the memory ``gpu_memory_utilization`` splits; ``None``: the CUDA
            device's total, on CPU the available RAM. A simulated engine needs it.
        max_num_batched_tokens: token budget of one step (fixed chunking).
        max_num_seqs: running requests at most.
        max_model_len: longest prompt + output; ``None`` takes the model's own limit (its
            ``max_position_embeddings``); the engine refuses a longer one.
        eviction_policy: a registered policy name (``lru``, ``vllm-apc``, ``pensieve``, ``asymcache``).
        hole_reuse: keep cache hits after a missing block (``None``: the policy's default).
        job_admission: job-level admission (:class:`~asymcache_core.job_admission.JobAdmission`):
            a request of an agent job (``job_id``) is admitted only while its job's context and
            those of every older job fit the pool, so whole jobs wait between turns instead of
            every job thrashing the pool; nothing is held back where the pool is not the
            bottleneck. ``None``: the eviction policy's default (on under ``asymcache``).
        implicit_jobs: a request that names no ``job_id`` joins the job of the conversation
            its prompt continues (the previous turn's prompt and reply), or starts one
            (:class:`~asymcache_core.implicit_jobs.ImplicitJobs`), so clients that never send
            job ids get job admission, pins and per-job reuse estimates too. ``None``: on in
            the agent runtime wherever job admission is (it ends a job whose reply calls no
            tool), off in a bare engine (:meth:`~asymcache_core.engine.Engine.use_implicit_jobs`).
        chunking: ``fixed`` (``max_num_batched_tokens``), ``fixed:N``, ``adaptive`` (every step
            meets ``tpot_slo_ms``) or ``adaptive:slack`` (every request's TPOT meets it: a step
            may spend half of what fast steps saved; :class:`~asymcache_core.budget.AdaptiveBudget`).
        tpot_slo_ms: time-per-output-token target the adaptive budget keeps.
        ttft_slo_ms: time-to-first-token target (``None``: none stated). Under ``priority=
            "adaptive"`` a waiting request ranks no earlier than its arrival less a slack that
            adapts to keep at most 1% of recent waits past the target
            (:class:`~asymcache_core.continuum.ttft_target.TTFTTarget`): program order, which
            finishes old jobs first, then delays a young job's turn only that far beyond arrival
            order. Other orders ignore it (``fcfs`` is arrival order; ``program`` is
            Continuum's, kept as published). Unset, program order is unbounded: it lowers job time and the job-time tail,
            and its time-to-first-token tail is several times arrival order's (BENCHMARKS.md,
            "A stated time-to-first-token target"). With a host tier, stating it also lets job
            admission count the tier's whole share at once rather than as far as jobs pause
            (:class:`~asymcache_core.job_admission.JobAdmission`): fewer turns held, for more
            job time.
        latency_profile: path of a JSON latency profile; ``None`` uses the analytic default.
        priority: admission order of waiting work: ``fcfs`` (by request), ``program`` (by job:
            Continuum's program order, running requests too) or ``adaptive`` (waiting requests
            by their job's start as far as the jobs seen so far show memory, Continuum's eta
            at its 95% lower bound:
            :meth:`~asymcache_core.continuum.controller.ContinuumController.adaptive_program_key`;
            running requests by arrival).
        attention_backend: ``auto``, ``torch``, ``naive`` or ``triton``.
        batch_invariant: each token's logits are the same bits whatever else shares its step,
            however its prompt was chunked and whether its history was cached or rebuilt as a
            hole: linear layers, norms and attention run with a fixed reduction order
            (:mod:`kernels.batch_invariant`, the MSA plan's fixed chunks, :func:`~kernels.msa_tiled.msa_tiled`).
            Greedy outputs are then exactly those of an unbounded pool under every policy, on
            the GPU too. ``None`` (the default): on for CUDA devices in bfloat16/float16, where
            it costs 1-7% of a step (H200, BENCHMARKS.md), off on the CPU, whose float32 steps
            kept greedy tokens in every test without it (log probabilities to the BLAS's rounding, which may
            follow a step's row count: up to 1.3e-5 when only a prompt's chunking changes, on
            an AMD EPYC with MKL, 2026-12-06), and off for float32 on a GPU (cost not
            measured); the resolved bool is what the field then holds.
        fused_kernels: with the Triton backend, the fused rotary + KV store, add + RMSNorm and
            SiLU-mul kernels (:mod:`kernels.fused`); ``False`` runs those steps as separate torch
            ops (an ablation; the benchmarks compare the two).
        max_step_log: most recent steps :attr:`Engine.step_log` keeps (``None``: every step;
            the benchmarks read them all, a long-running server keeps a window).
        enforce_eager: never capture CUDA graphs (vLLM's flag). Otherwise, on CUDA with the
            Triton backend, decode-only steps replay one CUDA graph and other steps of at most
            ``mixed_graph_max_tokens`` tokens replay piecewise graphs around the eager MSA
            (:mod:`~asymcache_core.piecewise_graphs`).
        jump_forward: once a request samples a token, the tokens its one logits processor
            keeps alone next (where a grammar allows a single token: parts of a forced tool
            call's fixed text) are appended at once and computed in the next step together, as
            the rest of a prompt is, instead of one decode step each (SGLang's jump-forward
            decoding, at the token level: the tokens are those sampling would pick, so outputs
            are unchanged). Not for rows with log probabilities. With async
            scheduling the step in flight sampled the position the first forced token takes;
            its token is dropped. ``None`` (the default) is on: on the CPU agent jobs with
            forced tool calls ran 1.15x faster with one in flight, 1.08x at 8; on an H100
            (dummy Llama-3.1-8B bf16, CUDA graphs, a fifth of the tokens forced) 1.17-1.20x at
            batch 1, 1.11-1.15x at 8, 1.07-1.08x at 32, though each jump makes its step a mixed
            one (BENCHMARKS.md, "Jump-forward"). The resolved bool is what the field then holds.
        async_scheduling: plan and launch each step while the one before it still runs on the
            device (vLLM's ``--async-scheduling``): the host's scheduling, packing and output
            work leave the device's critical path. A decode's input token is taken on the
            device from the step that sampled it; a request that ends in one step has already
            been planned into the next, whose token for it is dropped. Greedy tokens are the
            same as without it. A step whose rows sample on the host (penalties, logits
            processors, random sampling) is waited for before the next is planned. Needs the
            single-device model runner (not the simulator, not tensor parallelism). ``None``
            (the default): on for the model runner on one CUDA device, where it made decode
            steps 1.08-1.30x faster and an SWE run's mean JCT 6% lower (H200, BENCHMARKS.md);
            off on the CPU, whose steps leave the host nothing to overlap, in the simulator
            and with tensor parallelism.
        mixed_graph_max_tokens: largest step (tokens) captured piecewise; ``0`` runs every
            step with prefill or hole tokens eagerly. Above ~1,000 tokens a step is GPU-bound,
            so capturing it saves nothing.
        admit_full_prompt: admit a waiting request only when its whole prompt fits in the free
            and evictable blocks, not just its first chunk (vLLM's ``scheduler_reserve_full_isl``,
            on by default in vLLM 0.32). Chunked prefills admitted on their first chunk alone can
            outgrow the pool together and preempt each other. A request is still admitted on its
            first chunk when nothing else runs. Off by default here: in the simulator it costs
            the baselines' TTFT more queueing than the preemptions it saves (BENCHMARKS.md).
        least_work_first: schedule the requests with the fewest tokens left to compute first,
            cache hits excluded (decodes, then short or mostly cached prefills; shortest
            remaining prefill first, like SGLang's cache-aware orders); explicit request
            priorities still come first. Off: by arrival (or by job under ``program``), as
            vLLM. It keeps returning turns whose context is cached from waiting behind long
            prefills while their blocks are evicted; off by default because it lowers mean
            TTFT on the GPU workloads but not on the CPU demo workload (BENCHMARKS.md). A
            long prefill can wait while shorter ones keep arriving (higher TTFT p99);
            ``least_work_patience`` bounds that wait.
        least_work_patience: with ``least_work_first``, a waiting request lets later arrivals
            with less work go first only for this many times its own estimated prefill time
            (the latency model's; admission by ``arrival + patience x own work``), so a stream
            of short turns cannot starve a long cold prompt. ``None``: no bound (by work alone).
        cpu_offload_gb: host memory (GiB) for a second KV tier below the device pool
            (vLLM's name; :mod:`asymcache_core.host_tier`): evicted blocks live on there and
            come back by copy or by recomputation, whichever costs less; ``0``: no tier. Pinned
            memory on CUDA; on the CPU both tiers are host memory (same copies, same accounting).
        num_host_kv_blocks: host tier size in blocks (overrides ``cpu_offload_gb``).
        tensor_parallel_size: ranks the model is split over (:mod:`asymcache_core.parallel`):
            each holds a share of every layer's heads and of every KV block; the block pool,
            scheduler and eviction run once, in this process (rank 0), which sends each step's
            plan to the others. Ranks 1.. are worker processes on ``cuda:<rank>`` (NCCL) or
            on the CPU (gloo).
        host_eviction_policy: the host tier's eviction policy (``None``: the device pool's;
            ``vllm-apc``'s order is a plain LRU, what vLLM's CPU offload does).
        seed: seeds dummy weights and random sampling without a per-request seed.
        kv_events_config: vLLM's ``--kv-events-config`` JSON (``enable_kv_cache_events``,
            ``publisher``, ``endpoint``, ``replay_endpoint``, ``topic``, ...): the KV blocks the
            device pool and the host tier store and remove are published for KV-aware routers
            in vLLM's KV-events format (:mod:`asymcache_core.kv_events`, ``docs/kv-events.md``);
            ``None``: off. A dict of those keys is taken too (kept as its JSON).
        speculative_config: vLLM's ``--speculative-config`` JSON, ``ngram`` method: drafts from
            the request's context, the same tokens (:mod:`asymcache_core.speculative`); steps
            are synchronous (async scheduling resolves off); ``None``: off; a dict is kept as JSON.
    """

    model: str = field(default="smollm2-135m", metadata=_flag(
        "--model", "smollm2-135m, a local HF folder, a .gguf file or dummy:<config> (random weights)."))
    device: str = field(default="cpu", metadata=_flag("--device", "cpu, cuda or cuda:N."))
    dtype: str = field(default="auto", metadata=_flag(
        "--dtype", "auto (float32 on CPU, bfloat16 on CUDA), float32, float16 or bfloat16."))
    block_size: int = field(default=16, metadata=_flag("--block-size", "Tokens per KV block (a power of two)."))
    num_kv_blocks: int | None = field(default=None, metadata=_flag(
        "--num-kv-blocks", "KV pool size in blocks.",
        "--kv-blocks", "--num-gpu-blocks-override"))
    kv_memory_fraction: float = field(default=0.5, metadata=_flag(
        "--kv-memory-fraction", "Share of the device's free memory after the weights for the KV pool "
        "(CPU: of available RAM, at most 1 GiB) when --num-kv-blocks is not given."))
    gpu_memory_utilization: float | None = field(default=None, metadata=_flag(
        "--gpu-memory-utilization", "Share of the device's memory for the weights, the activations and the "
        "KV pool (vLLM's meaning): the pool gets what is left (default: --kv-memory-fraction of the free "
        "memory after the weights)."))
    device_memory_gib: float | None = field(default=None, metadata=_flag(
        "--device-memory-gib", "Device memory --gpu-memory-utilization splits (default: the CUDA device's; "
        "CPU: the available RAM; a simulated device needs it)."))
    max_num_batched_tokens: int = field(default=2048, metadata=_flag(
        "--max-num-batched-tokens", "Tokens per step (fixed chunking's budget; the cap of adaptive).",
        "--max-batched-tokens"))
    max_num_seqs: int = field(default=64, metadata=_flag("--max-num-seqs", "Running requests at most."))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "--max-model-len", "Longest prompt + output (default: the model's limit; past it is an error).",
        "--max-context"))
    eviction_policy: str = "asymcache"
    hole_reuse: bool | None = None
    job_admission: bool | None = None
    implicit_jobs: bool | None = field(default=None, metadata=_flag(
        "--implicit-jobs", "Requests that name no job_id join the job of the conversation they continue "
        "(default: on wherever job admission is)."))
    chunking: str = field(default="fixed", metadata=_flag(
        "--chunking", "fixed, fixed:N, adaptive (every step meets --tpot-slo-ms) or adaptive:slack "
        "(every request's TPOT meets it)."))
    tpot_slo_ms: float = field(default=50.0, metadata=_flag(
        "--tpot-slo-ms", "Adaptive chunking's time-per-output-token target (ms)."))
    ttft_slo_ms: float | None = field(default=None, metadata=_flag(
        "--ttft-slo-ms", "Time-to-first-token target (ms): program order (old jobs' turns first) moves a "
        "waiting request ahead of earlier arrivals only as far as the waits seen stay within it, and job "
        "admission counts a host KV tier's whole share from the start (default: no bound)."))
    latency_profile: str | None = field(default=None, metadata=_flag(
        "--latency-profile", "Latency profile JSON (asymcache profile) for the eviction cost and adaptive "
        "chunking (default: the analytic model)."))
    priority: str = "fcfs"
    attention_backend: str = field(default="auto", metadata=_flag(
        "--attention-backend", "auto, torch, naive or triton."))
    batch_invariant: bool | None = field(default=None, metadata=_flag(
        "--batch-invariant", "Fixed reduction order in every op: each token's logits are the same bits "
        "whatever shares its step, however its prompt was chunked, cached or rebuilt (default: on for "
        "CUDA devices in bfloat16/float16, off on the CPU)."))
    fused_kernels: bool = True
    max_step_log: int | None = field(default=None, metadata=_flag(
        "--max-step-log", "Most recent engine steps kept in the step log (default: all; serve keeps 10,000)."))
    enforce_eager: bool = field(default=False, metadata=_flag("--enforce-eager", "Never capture CUDA graphs."))
    async_scheduling: bool | None = field(default=None, metadata=_flag(
        "--async-scheduling", "Plan each step while the previous one runs on the device (vLLM's flag); "
        "greedy tokens are unchanged (default: on for one CUDA device, off on the CPU)."))
    jump_forward: bool | None = field(default=None, metadata=_flag(
        "--jump-forward", "Append the tokens a grammar forces (a forced tool call's fixed text) at once, "
        "computed together in the next step, instead of one decode step each; the tokens are unchanged "
        "(default: on)."))
    mixed_graph_max_tokens: int = field(default=1024, metadata=_flag(
        "--mixed-graph-max-tokens", "Largest step (tokens) replayed as piecewise CUDA graphs; 0 runs every "
        "step with prefill tokens eagerly."))
    admit_full_prompt: bool = field(default=False, metadata=_flag(
        "--admit-full-prompt", "Admit a request only when its whole prompt fits (vLLM 0.32's default), "
        "not its first chunk."))
    least_work_first: bool = field(default=False, metadata=_flag(
        "--least-work-first", "Run the requests with the fewest tokens left to compute first (default: "
        "by arrival)."))
    least_work_patience: float | None = field(default=None, metadata=_flag(
        "--least-work-patience", "With --least-work-first: a request lets later, smaller ones go first "
        "for at most this many times its own estimated prefill time (default: no bound)."))
    cpu_offload_gb: float = field(default=0.0, metadata=_flag(
        "--cpu-offload-gb", "Host memory (GiB) for a second KV tier: evicted blocks are kept there and "
        "copied back or recomputed, whichever is cheaper (0: no tier)."))
    num_host_kv_blocks: int | None = field(default=None, metadata=_flag(
        "--num-host-kv-blocks", "Host KV tier size in blocks (overrides --cpu-offload-gb)."))
    host_eviction_policy: str | None = None
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "--tensor-parallel-size", "Split the model over this many ranks (GPUs, or CPU processes): each "
        "holds a share of the heads and of every KV block.", "-tp"))
    seed: int = field(default=0, metadata=_flag(
        "--seed", "Seeds dummy weights and sampling without a per-request seed."))
    kv_events_config: str | None = field(default=None, metadata=_flag(
        "--kv-events-config", "vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
        "\"tcp://*:5557\"}': publish stored/removed KV blocks for KV-aware routers (docs/kv-events.md)."))
    speculative_config: str | None = field(default=None, metadata=_flag("--speculative-config", "vLLM's n-gram "
        "speculative decoding JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (same tokens)."))

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: must be a non-empty string")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: {self.device!r} is not a device; use cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: only cpu and cuda are supported, got {self.device!r}")
        if device.type == "cpu" and device.index not in (None, 0):
            raise ValueError(f"device: the CPU is one device ('cpu'), got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r} requested but CUDA is not available")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {sorted(DTYPES)}, got {self.dtype!r}")
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not _number(self.kv_memory_fraction) or not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction: must be a number in (0, 1], got {self.kv_memory_fraction!r}")
        if self.gpu_memory_utilization is not None and not (
            _number(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ValueError(f"gpu_memory_utilization: must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.device_memory_gib is not None and not (_number(self.device_memory_gib) and self.device_memory_gib > 0):
            raise ValueError(f"device_memory_gib: must be a positive number, got {self.device_memory_gib!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        from asymcache_core.eviction import registered_policies

        if self.eviction_policy not in registered_policies():
            raise ValueError(
                f"eviction_policy: unknown policy {self.eviction_policy!r}; "
                f"registered: {', '.join(registered_policies())}"
            )
        self.chunk_budget()  # validates `chunking`
        if not _number(self.tpot_slo_ms) or self.tpot_slo_ms <= 0:
            raise ValueError(f"tpot_slo_ms: must be a positive number of milliseconds, got {self.tpot_slo_ms!r}")
        if self.ttft_slo_ms is not None and not (
            isinstance(self.ttft_slo_ms, int | float) and not isinstance(self.ttft_slo_ms, bool)
            and math.isfinite(self.ttft_slo_ms) and self.ttft_slo_ms > 0
        ):
            raise ValueError(f"ttft_slo_ms: must be a positive number of milliseconds or None, got {self.ttft_slo_ms!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority: one of {PRIORITIES}, got {self.priority!r}")
        from kernels.dispatch import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: one of {BACKENDS}, got {self.attention_backend!r}")
        if self.max_step_log is not None and (
            isinstance(self.max_step_log, bool) or not isinstance(self.max_step_log, int) or self.max_step_log < 1
        ):
            raise ValueError(f"max_step_log: must be a positive integer or None, got {self.max_step_log!r}")
        if not isinstance(self.fused_kernels, bool):
            raise ValueError(f"fused_kernels: must be a bool, got {self.fused_kernels!r}")
        if self.jump_forward is None:
            # NOTE: resolved here, once, so every reader sees a bool. On for CUDA too: a jump
            # makes its step a mixed one (piecewise graphs, ~1.5x a decode graph at 8 decodes),
            # yet measured on an H100 forced runs finished 1.07-1.20x sooner at batch 1-32
            # (scripts/gpu_jump_forward.py; BENCHMARKS.md, "Jump-forward")
            object.__setattr__(self, "jump_forward", True)
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward: must be a bool or None, got {self.jump_forward!r}")
        if self.batch_invariant is None:
            # NOTE: resolved here, once, so every reader sees a bool: exact by default where the
            # library kernels are not (the GPU in 16-bit, where the cost was measured at 1-7% of
            # a step). float32 on a GPU keeps the library kernels unless asked: its fixed-order
            # GEMMs are IEEE Triton ones wherever cuBLAS's bits differ, a cost not measured.
            on = device.type == "cuda" and self.dtype in ("auto", "bfloat16", "float16")
            object.__setattr__(self, "batch_invariant", on and self.attention_backend != "naive")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant: must be a bool or None, got {self.batch_invariant!r}")
        if self.batch_invariant and self.attention_backend == "naive":
            raise ValueError("batch_invariant: the 'naive' attention backend has no batch-invariant mode")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling: must be a bool or None, got {self.async_scheduling!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: must be a bool, got {self.enforce_eager!r}")
        if (
            not isinstance(self.mixed_graph_max_tokens, int)
            or isinstance(self.mixed_graph_max_tokens, bool)
            or self.mixed_graph_max_tokens < 0
        ):
            raise ValueError(f"mixed_graph_max_tokens: must be an integer >= 0, got {self.mixed_graph_max_tokens!r}")
        if self.job_admission is not None and not isinstance(self.job_admission, bool):
            raise ValueError(f"job_admission: must be a bool or None, got {self.job_admission!r}")
        if self.implicit_jobs is not None and not isinstance(self.implicit_jobs, bool):
            raise ValueError(f"implicit_jobs: must be a bool or None, got {self.implicit_jobs!r}")
        for flag in ("admit_full_prompt", "least_work_first"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: must be a bool, got {getattr(self, flag)!r}")
        if self.least_work_patience is not None:
            value = self.least_work_patience
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"least_work_patience: must be a positive number or None, got {value!r}")
            if not self.least_work_first:
                raise ValueError("least_work_patience: needs least_work_first=True")
        value = self.cpu_offload_gb
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"cpu_offload_gb: must be a number >= 0, got {value!r}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks != 0:
            _positive_int("num_host_kv_blocks", self.num_host_kv_blocks)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling: not supported with tensor_parallel_size > 1")
        if self.host_eviction_policy is not None and self.host_eviction_policy not in registered_policies():
            raise ValueError(
                f"host_eviction_policy: unknown policy {self.host_eviction_policy!r}; "
                f"registered: {', '.join(registered_policies())}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed: must be an integer that fits 64 bits, got {self.seed!r}")
        if self.hole_reuse is not None and not isinstance(self.hole_reuse, bool):
            raise ValueError(f"hole_reuse: must be a bool or None, got {self.hole_reuse!r}")
        if self.latency_profile is not None and not isinstance(self.latency_profile, str | os.PathLike):
            raise ValueError(f"latency_profile: a path to a latency profile (JSON) or None, got {self.latency_profile!r}")
        if isinstance(self.kv_events_config, dict):
            # NOTE: vLLM's KVEventsConfig takes its fields in Python; here the dict becomes the
            # JSON the command line gives, so that every reader of the field sees one form.
            try:
                text = json.dumps(self.kv_events_config)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"kv_events_config: the dict is not JSON: {exc}") from None
            object.__setattr__(self, "kv_events_config", text)
        if self.kv_events_config is not None:
            from asymcache_core.kv_events import KVEventsConfig

            KVEventsConfig.from_json(self.kv_events_config)
        if isinstance(self.speculative_config, dict):
            try:
                object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"speculative_config: the dict is not JSON: {exc}") from None
        from asymcache_core.speculative import SpeculativeConfig

        if SpeculativeConfig.parse(self.speculative_config) is not None and self.async_scheduling:
            raise ValueError("speculative_config: not with async_scheduling (a draft follows the token before it)")

    def chunk_budget(self) -> int | None:
        """Fixed per-step token budget, or ``None`` when chunking is adaptive."""
        if not isinstance(self.chunking, str):
            raise ValueError(f"chunking: 'adaptive', 'adaptive:slack', 'fixed' or 'fixed:N', got {self.chunking!r}")
        if self.chunking in ("adaptive", "adaptive:slack"):
            return None
        if self.chunking == "fixed":
            return self.max_num_batched_tokens
        if self.chunking.startswith("fixed:"):
            digits = self.chunking.split(":", 1)[1]
            value = int(digits) if digits.isdigit() else 0
            if value >= 1:
                return value
        raise ValueError(
            f"chunking: 'adaptive', 'adaptive:slack', 'fixed' or 'fixed:N' (N >= 1), got {self.chunking!r}"
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = DTYPES[self.dtype]
        if dtype is None:
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return dtype


def _number(value: object) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")


def json_object_text(name: str, text: str) -> dict[str, Any]:
    """A JSON object given as text (a command-line flag's value, such as vLLM's
    ``--kv-events-config`` or ``--default-chat-template-kwargs``).

    Raises:
        ValueError: not JSON, or not an object (the message names ``name``).
    """
    value = json_text(name, text)
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    return value


def json_text(name: str, text: str) -> Any:
    """A JSON value given as text (a command-line flag's value).

    Raises:
        ValueError: not JSON (one line naming ``name``).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON ({e.msg} at character {e.pos})") from None
