"""Tensor-parallel execution: rank 0 runs the engine, ranks 1.. run its model shards.

The block pool, scheduler and eviction run once, in the engine's process (rank 0). Each step
rank 0 packs the plan into a :class:`~asymcache_core.model_runner.StepInputs` (plain lists),
sends it to every worker over a pipe, and all ranks run the forward of their shard together;
the row-parallel partial sums and the vocab-parallel logits meet in ``torch.distributed``
collectives (NCCL on CUDA, gloo on the CPU). Only rank 0 samples. The host tier's copies are
sent the same way, so every rank moves its share of each block.

NOTE: the process groups are built from a private ``TCPStore`` rather than
``init_process_group``: torch's default group is process-wide state, and one process may hold
several engines (tests, a bench comparing presets).

A rank that dies is noticed before the next step is sent (its process has exited) or inside a
collective (its peers' sockets close); the engine then raises :class:`EngineDeadError` on
every step, and the server answers 503.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import select
import subprocess
import sys
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from asymcache_core.config import EngineConfig
from asymcache_core.errors import EngineDeadError
from asymcache_core.host_tier import KVTransfers
from asymcache_core.model_runner import ModelRunner, pack_step
from asymcache_core.parallel import TensorParallelGroup, TensorShard, plan_tensor_shards
from asymcache_core.scheduler import SchedulerOutput

logger = logging.getLogger("asymcache_core.tensor_parallel")

#: seconds a collective may wait for a peer before it fails (a hung, not dead, rank)
COLLECTIVE_TIMEOUT_S = 120.0
#: seconds a worker may take to load its shard and report ready
STARTUP_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a worker needs to build its shard and runner (picklable).

    Attributes:
        rank: the worker's rank (>= 1).
        size: ranks in all.
        shard: its share of the model.
        store_port: rank 0's ``TCPStore`` port on 127.0.0.1.
        model: the model spec.
        device: ``cpu`` or ``cuda`` (the worker takes ``cuda:<rank>``).
        dtype: the weights' and cache's dtype.
        seed: the engine seed (dummy weights).
        max_model_len: longest context (``None``: the model's).
        attention_backend: the backend name the engine asked for.
        batch_invariant: the batch-invariant mode (fixed-order reductions across ranks too).
        fused_kernels: the Triton backend's fused elementwise kernels.
        num_threads: torch threads of the worker (CPU ranks share the host's cores).
    """

    rank: int
    size: int
    shard: TensorShard
    store_port: int
    model: str
    device: str
    dtype: torch.dtype
    seed: int
    max_model_len: int | None
    attention_backend: str
    batch_invariant: bool
    fused_kernels: bool
    num_threads: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<rank>`` (wrapping over the visible GPUs), or the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def new_process_group(store: Any, rank: int, size: int, device: torch.device) -> Any:
    """A process group of the model's ranks over ``store``, not registered as torch's default.

    Returns:
        A ``ProcessGroupNCCL`` on CUDA, a ``ProcessGroupGloo`` on the CPU (a c10d backend: its
        collectives are called directly, see :class:`~asymcache_core.parallel.TensorParallelGroup`).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    prefix = dist.PrefixStore("asymcache-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, options)
    return dist.ProcessGroupGloo(prefix, rank, size, timeout)


def _worker_main(conn: Connection) -> None:
    """A worker rank: receives its :class:`RankSpec`, builds its shard, then runs every step
    rank 0 sends until told to stop.

    NOTE: any failure ends the process: its sockets close and rank 0's collectives fail, so
    the engine fails loudly instead of waiting on a rank that will never answer.
    """
    import torch.distributed as dist

    from asymcache_core.loaders import load_model
    from kernels.dispatch import select_attention_backend

    try:
        spec: RankSpec = conn.recv()
        torch.set_num_threads(spec.num_threads)
        device = rank_device(torch.device(spec.device), spec.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(
            "127.0.0.1", spec.store_port, spec.size, is_master=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        group = new_process_group(store, spec.rank, spec.size, device)
        tp = TensorParallelGroup(spec.shard, group, deterministic=spec.batch_invariant)
        loaded = load_model(spec.model, device, spec.dtype, spec.seed, spec.max_model_len, tp)
        backend = select_attention_backend(
            device, spec.attention_backend, spec.dtype, spec.batch_invariant, fused=spec.fused_kernels
        )
        # NOTE: the pool size comes after the load: rank 0 sizes it from its own shard's memory.
        kind, runner_kwargs = conn.recv()
        assert kind == "runner", kind
        runner = ModelRunner(loaded, device=device, dtype=spec.dtype, backend=backend, **runner_kwargs)
        conn.send(("ready", None))
        while True:
            kind, payload = conn.recv()
            if kind == "step":
                inputs, landed = payload
                for ticket in landed:
                    runner.wait_transfers(ticket)
                runner.forward(inputs)
            elif kind == "transfer":
                runner.transfer_kv(payload)
            elif kind == "wait":
                runner.wait_transfers(payload)
            elif kind == "stop":
                break
    except EOFError:
        return  # rank 0 is gone
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the process ends
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None


class TensorParallelWorkers:
    """The worker ranks 1..N-1 of one engine, and rank 0's end of their collectives.

    Args:
        size: ranks in all (>= 2).
        model: the model spec.
        device: rank 0's device.
        dtype: weights and cache.
        seed: the engine seed.
        max_model_len: longest context (``None``: the model's).
        attention_backend: the backend name asked for.
        batch_invariant: fixed-order reductions.
        fused_kernels: the Triton backend's fused elementwise kernels.
        shards: every rank's share (:func:`~asymcache_core.parallel.plan_tensor_shards`).
    """

    def __init__(
        self,
        size: int,
        model: str,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        max_model_len: int | None,
        attention_backend: str,
        batch_invariant: bool,
        fused_kernels: bool,
        shards: list[TensorShard],
    ) -> None:
        import torch.distributed as dist

        self.size = size
        self._spec = dict(
            size=size, model=model, device=device.type, dtype=dtype, seed=seed, max_model_len=max_model_len,
            attention_backend=attention_backend, batch_invariant=batch_invariant, fused_kernels=fused_kernels,
            num_threads=max(1, torch.get_num_threads() // size),
        )
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
        )
        self.device = rank_device(device, 0)
        self.shards = shards
        self.batch_invariant = batch_invariant
        #: the worker processes, rank 1 first
        self.processes: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self.dead: str | None = None
        self.group: TensorParallelGroup | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self) -> TensorParallelGroup:
        """Starts the workers, joins rank 0 to their process group, and returns rank 0's
        collectives. Their shards load while rank 0 loads its own; :meth:`configure` then
        builds their runners.

        NOTE: workers are fresh interpreters (``python -m asymcache_core.tensor_parallel``),
        not ``multiprocessing`` children: a spawned child re-imports the parent's main
        script, which would start another engine in a script without a ``__main__`` guard.
        """
        authkey = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, port = listener.address
            env = dict(os.environ, ASYMCACHE_TP_AUTHKEY=authkey.hex())
            # NOTE: stops the workers even if this object is never closed (a crashed caller).
            self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self._conns)
            for rank in range(1, self.size):
                process = subprocess.Popen(
                    [sys.executable, "-m", "asymcache_core.tensor_parallel", f"{host}:{port}"],
                    env=env, stdin=subprocess.DEVNULL,
                )
                self.processes.append(process)
                conn = _accept(listener, process, rank)
                conn.send(RankSpec(rank=rank, shard=self.shards[rank], store_port=self.store.port, **self._spec))
                self._conns.append(conn)
        group = new_process_group(self.store, 0, self.size, self.device)
        self.group = TensorParallelGroup(self.shards[0], group, deterministic=self.batch_invariant)
        return self.group

    def configure(self, runner_kwargs: dict[str, Any]) -> None:
        """Builds every worker's runner (the pool size is known once rank 0 has loaded) and
        waits until they are ready.

        Args:
            runner_kwargs: :class:`~asymcache_core.model_runner.ModelRunner`'s keyword arguments
                other than the model, device, dtype and backend (the same on every rank).

        Raises:
            EngineDeadError: a worker failed to start (its error in the message).
        """
        self.send("runner", runner_kwargs)
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(STARTUP_TIMEOUT_S):
                self._fail(f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            try:
                kind, payload = conn.recv()
            except EOFError:
                self._fail(f"tensor-parallel rank {rank} exited while starting")
            if kind != "ready":
                self._fail(f"tensor-parallel rank {rank} failed to start:\n{payload}")

    def send(self, kind: str, payload: Any) -> None:
        """Sends one message to every worker.

        Raises:
            EngineDeadError: a worker has died (now or before).
        """
        self.check_alive()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send((kind, payload))
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone")

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` if any worker has exited (or failed before)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        for rank, (process, conn) in enumerate(zip(self.processes, self._conns, strict=True), start=1):
            if process.poll() is not None:
                detail = ""
                try:
                    if conn.poll():
                        kind, payload = conn.recv()
                        detail = f": {payload}" if kind == "error" else ""
                except (EOFError, OSError):
                    pass
                self._fail(f"tensor-parallel rank {rank} died (exit code {process.returncode}){detail}")

    def step_failed(self, exc: BaseException) -> EngineDeadError:
        """The error to raise when rank 0's part of a step failed: names the dead rank if one is."""
        try:
            self.check_alive()
        except EngineDeadError as dead:
            return dead
        self.dead = f"tensor-parallel step failed on rank 0: {exc}"
        return EngineDeadError(self.dead)

    def _fail(self, why: str) -> None:
        self.dead = why
        raise EngineDeadError(why)

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


def start_workers(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> TensorParallelWorkers:
    """Starts ranks 1.. of a tensor-parallel engine (they load their shards meanwhile).

    Raises:
        ValueError: the model's heads cannot be split over ``tensor_parallel_size`` ranks, or
            there are fewer GPUs than ranks.
    """
    from asymcache_core.loaders import resolve_hf_config
    from asymcache_core.models import ModelConfig

    size = config.tensor_parallel_size
    shards = plan_tensor_shards(ModelConfig.from_hf(resolve_hf_config(config.model)[0]), size)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs; {torch.cuda.device_count()} visible")
    workers = TensorParallelWorkers(
        size, config.model, device, dtype, config.seed, config.max_model_len,
        config.attention_backend, config.batch_invariant, config.fused_kernels, shards,
    )
    workers.start()
    return workers


def _accept(listener: Listener, process: subprocess.Popen[bytes], rank: int) -> Connection:
    """The control connection of the worker just started (it connects back to ``listener``).

    Raises:
        EngineDeadError: it exited, or did not connect within :data:`STARTUP_TIMEOUT_S`.
    """
    # NOTE: ``Listener.accept`` has no timeout: wait on its socket, watching the process.
    sock = listener._listener._socket  # type: ignore[attr-defined]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        if ready:
            return listener.accept()
        if process.poll() is not None:
            raise EngineDeadError(f"tensor-parallel rank {rank} exited while starting (exit code {process.returncode})")
        if time.monotonic() > deadline:
            raise EngineDeadError(f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")


def _stop_workers(processes: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(("stop", None))
        except OSError:
            pass
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    for conn in conns:
        conn.close()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every forward and every block copy also runs on the workers.

    Args:
        workers: the started workers (:meth:`TensorParallelWorkers.start` done).
        loaded: rank 0's shard of the model.
        device, dtype, backend: rank 0's.
        **runner_kwargs: the rest of :class:`~asymcache_core.model_runner.ModelRunner`'s
            arguments, the same on every rank (the workers build theirs with them).
    """

    def __init__(
        self,
        workers: TensorParallelWorkers,
        loaded: Any,
        device: torch.device,
        dtype: torch.dtype,
        backend: Any,
        **runner_kwargs: Any,
    ) -> None:
        workers.configure(runner_kwargs)
        super().__init__(loaded, device=device, dtype=dtype, backend=backend, **runner_kwargs)
        self.workers = workers
        # NOTE: reloads rank 0 has seen land: the workers order their next forward after their
        # own copies of those tickets (each rank copies its share of every block).
        self._landed: set[int] = set()

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        inputs = pack_step(plan, self.block_size)
        landed, self._landed = sorted(self._landed), set()
        self.workers.send("step", (inputs, landed))
        try:
            out = self.forward(inputs)
        except RuntimeError as exc:
            # NOTE: no fault isolation across ranks: the others are inside this step's
            # collectives, so the group is out of step whatever failed here.
            raise self.workers.step_failed(exc) from exc
        return self.finish_forward(plan, inputs, out)

    def transfer_kv(self, transfers: KVTransfers) -> None:
        self.workers.send("transfer", transfers)
        super().transfer_kv(transfers)

    def transfer_complete(self, ticket: int) -> bool:
        done = super().transfer_complete(ticket)
        if done:
            self._landed.add(ticket)
        return done

    def wait_transfers(self, ticket: int | None = None) -> None:
        self.workers.send("wait", ticket)
        super().wait_transfers(ticket)


def main(argv: list[str]) -> None:
    """A worker's entry point: ``python -m asymcache_core.tensor_parallel HOST:PORT`` (the
    authentication key in ``ASYMCACHE_TP_AUTHKEY``)."""
    host, port = argv[0].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop("ASYMCACHE_TP_AUTHKEY"))
    conn = Client((host, int(port)), authkey=authkey)
    _worker_main(conn)


if __name__ == "__main__":
    main(sys.argv[1:])
