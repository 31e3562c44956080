"""The MSA launches of representative steps, compiled for a GPU target on a machine without one.

``python -m kernels.offline_compile [--arch 90] [--json PATH]`` records the Triton launches
:func:`kernels.msa_triton.msa_triton` makes for a few steps of a Llama-3.1-8B-shaped layer (bf16,
32 query / 8 KV heads, head_dim 128, 16-token pages): decodes at small and large batch, a fresh
8k prefill and a deep prefill chunk, in the library and batch-invariant modes. It specializes
each launch's arguments the way Triton's runtime does (dtypes, 16-byte alignment and
divisibility, constexprs), compiles it for ``sm_<arch>`` with the Triton installed here, and
prints what decides a kernel's speed before it ever runs: registers per thread, bytes spilled to
local memory (and the local loads/stores in its SASS), shared memory, the software-pipelined
copies (``async_copy_global_to_local`` in the TTGIR), how many of them a wait leaves in flight,
and the tensor-core instructions.

Nothing is launched: no GPU is needed, only Triton's NVIDIA backend (its bundled ``ptxas`` and
``cuobjdump``). The device machine runs another Triton version than this one may, so the figures
are those of the local compiler: a guide for what to measure, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple
from unittest import mock

import torch

from kernels import msa_config, msa_plan
from kernels import msa_triton as msa_triton_module
from kernels.metadata import MSAMetadata, build_msa_metadata

# Llama-3.1-8B's attention shape, as kernels.bench uses it.
HQ, HKV, D, PAGE = 32, 8, 128, 16
_KERNELS = ("_msa_fwd_kernel", "_msa_reduce_kernel")


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel's name, the jitted function and its call arguments."""

    kernel: str
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Report:
    """What the compiler made of one launch.

    Attributes:
        step: the step's name.
        mode: ``library`` or ``batch-invariant``.
        kernel: the Triton kernel.
        config: its launch options (warps, stages) and tile constexprs.
        registers: registers per thread.
        spill_bytes: bytes of local memory per thread (``STACK``: spills and local arrays).
        local_ops: local loads and stores (``LDL`` / ``STL``) in the SASS.
        shared_bytes: shared memory per program.
        async_copies: pipelined global-to-shared copies in the TTGIR.
        copies_in_flight: the most copies a wait of the TTGIR leaves in flight
            (``async_wait {num = N}``): 0 when every wait drains the pipeline, so only the
            copies issued since the last wait overlap compute.
        tensor_core_ops: ``HGMMA`` (Hopper) or ``HMMA`` instructions in the SASS.
    """

    step: str
    mode: str
    kernel: str
    config: str
    registers: int
    spill_bytes: int
    local_ops: int
    shared_bytes: int
    async_copies: int
    copies_in_flight: int
    tensor_core_ops: int


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name: str, fn: Any, sink: list[Launch]) -> None:
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            self.sink.append(Launch(self.name, self.fn, args, dict(kwargs)))

        return call


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block, MSA launches are recorded instead of run (any device, CPU included)."""
    sink: list[Launch] = []
    with mock.patch.multiple(
        msa_triton_module, **{name: _Recorder(name, getattr(msa_triton_module, name), sink) for name in _KERNELS}
    ):
        yield sink


class StepInputs(NamedTuple):
    """CPU stand-ins of a step's MSA arguments (shapes, dtypes and strides as on a GPU)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: MSAMetadata


def step_inputs(segments: list[tuple[int, int]]) -> StepInputs:
    """A step of one segment per sequence, ``(context after the step, query tokens)`` each."""
    tables, segs, slots, start, next_block = [], [], [], 0, 0
    for seq, (ctx, q_len) in enumerate(segments):
        blocks = -(-ctx // PAGE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        segs.append((seq, start, q_len, ctx - q_len))
        slots += [tables[seq][p // PAGE] * PAGE + p % PAGE for p in range(ctx - q_len, ctx)]
        start += q_len
    meta = build_msa_metadata(tables, segs, slots, PAGE)
    q = torch.empty((start, HQ, D), dtype=torch.bfloat16)
    # NOTE: never read (nothing is launched): empty, so that the pages are not even touched
    k_cache = torch.empty((max(next_block, 1), PAGE, HKV, D), dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    return StepInputs(q, k_cache, v_cache, meta)


def record_step(segments: list[tuple[int, int]], invariant: bool, num_sms: int = 132) -> list[Launch]:
    """The launches :func:`~kernels.msa_triton.msa_triton` makes for one step, planned as on a
    GPU of ``num_sms`` SMs (the library or the batch-invariant mode)."""
    q, k_cache, v_cache, meta = step_inputs(segments)
    with mock.patch.object(msa_config, "_num_sms", lambda device: num_sms):
        plan = msa_plan.plan_msa(meta, HQ, HKV, D, q.device, dtype=q.dtype, invariant=invariant)
    with recording() as launches:
        msa_triton_module.msa_triton(q, k_cache, v_cache, dataclasses.replace(meta, plan=plan), D**-0.5)
    return launches


def compile_launch(launch: Launch, arch: int = 90) -> Any:
    """Compiles ``launch`` for ``sm_<arch>``, its arguments specialized as Triton's runtime
    specializes them. Returns Triton's compiled kernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _nvidia_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def analyse(compiled: Any) -> dict[str, int]:
    """Registers, local memory, shared memory, pipelined copies and tensor-core instructions of
    a compiled kernel (``cuobjdump`` on its cubin)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {
        "registers": int(fields.get("REG", 0)),
        "spill_bytes": int(fields.get("STACK", 0)),
        "local_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "shared_bytes": int(compiled.metadata.shared),
        "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local"),
        "copies_in_flight": max(
            (int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", compiled.asm["ttgir"])), default=0
        ),
        "tensor_core_ops": len(re.findall(r"\bH(?:G)?MMA\b", sass)),
    }


def _config(launch: Launch) -> str:
    kw = launch.kwargs
    tiles = " ".join(f"{k}={kw[k]}" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_S", "BLOCK_D") if k in kw)
    flags = " ".join(k for k in ("SPLIT", "CHUNK_MERGE", "PART_BY_ROW", "PREFETCH", "FUSED_MERGE") if kw.get(k))
    return f"w{kw.get('num_warps', 4)} s{kw.get('num_stages', '-')} {tiles} {flags}".strip()


#: ``(name, [(context after the step, query tokens)] per sequence)``: the steps compiled.
STEPS: tuple[tuple[str, list[tuple[int, int]]], ...] = (
    ("decode 1 x 8k", [(8192, 1)]),
    ("decode 32 x 2k", [(2048, 1)] * 32),
    ("prefill 8k", [(8192, 8192)]),
    ("8k chunk after 24k", [(32768, 8192)]),
)


def reports(arch: int = 90, steps: tuple[tuple[str, list[tuple[int, int]]], ...] = STEPS) -> list[Report]:
    """One :class:`Report` per distinct launch of ``steps`` in both modes."""
    out: list[Report] = []
    for name, segments in steps:
        for invariant in (False, True):
            seen: set[tuple[str, str]] = set()
            for launch in record_step(segments, invariant):
                config = _config(launch)
                if (launch.kernel, config) in seen:
                    continue
                seen.add((launch.kernel, config))
                figures = analyse(compile_launch(launch, arch))
                out.append(Report(name, "batch-invariant" if invariant else "library", launch.kernel, config, **figures))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=(80, 86, 89, 90),
                        help="compute capability x 10 (90: Hopper, 80: Ampere)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("kernels.offline_compile needs triton", file=sys.stderr)
        return 2
    if not os.path.exists(_nvidia_tool("cuobjdump")):
        print("kernels.offline_compile needs Triton's NVIDIA backend (cuobjdump not found)", file=sys.stderr)
        return 2
    rows = reports(args.arch)
    print(f"triton {triton.__version__}, sm_{args.arch}, bf16, {HQ} q / {HKV} KV heads, head_dim {D}")
    print("| step | mode | kernel | config | regs | spill B | LDL/STL | smem B | async copies | in flight | MMA |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.step} | {r.mode} | {r.kernel} | {r.config} | {r.registers} | {r.spill_bytes} | "
              f"{r.local_ops} | {r.shared_bytes} | {r.async_copies} | {r.copies_in_flight} | {r.tensor_core_ops} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
