"""Engine step time on the GPU: eager vs CUDA-graph decode, and a mixed step. GPU machine only.

``python scripts/gpu_profile_step.py [--model dummy:llama-3.1-8b]`` prints one table: the
median ``engine.step()`` wall time of decode-only steps at several batch sizes, eager and with
CUDA graphs, each with and without the fused elementwise kernels (``fused_kernels``), the
weight-read floor and the weights + KV floor (bytes / measured copy bandwidth) beside them, and
an eager mixed step (decodes plus a prefill chunk); then the busiest ops of an eager decode step.
With ``--modes``, one table instead: CUDA-graph fused decode steps with the library kernels
against the batch-invariant mode (the CUDA default), beside the same floors.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model


def step_times(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 5 / (time.perf_counter() - start)


def load_with_floor(model: str) -> tuple[object, int, float, float]:
    """``(loaded model, weight bytes, copy bandwidth B/s, weight-read floor ms)`` on the GPU."""
    dev = torch.device("cuda")
    loaded = load_model(model, dev, torch.bfloat16, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = copy_bandwidth(dev)
    return loaded, weight_bytes, bandwidth, weight_bytes / bandwidth * 1e3


def decode_ms(engine: Engine, batch: int, context: int, gen: torch.Generator) -> float:
    """Median decode-only step of ``batch`` sequences at ``context`` tokens."""
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(1000, vocab - 1000, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    step_times(engine, 3)
    ms = statistics.median(step_times(engine, 20)) * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


# (batch, context) of the decode rows
DECODE_CASES = ((1, 2048), (1, 16384), (8, 2048), (32, 2048), (64, 1024))


def shared_engines(model: str, loaded: object, variants: dict[object, dict[str, object]]) -> dict[object, Engine]:
    """One engine per variant (its ``Engine`` keyword arguments), all sharing ``loaded``'s weights.

    NOTE: 8,192 blocks each hold the largest row (64 x 1,024).
    """
    engines = {}
    for key, kwargs in variants.items():
        start = time.perf_counter()
        engines[key] = Engine(
            model=model, device="cuda", loaded=loaded, num_kv_blocks=8192, max_num_batched_tokens=8192,
            max_model_len=32768, **kwargs,
        )
        print(f"engine ({', '.join(f'{k}={v}' for k, v in kwargs.items())}) ready in {time.perf_counter() - start:.1f} s")
    return engines


def decode_rows(engines: dict[object, Engine], loaded: object, weight_bytes: int, bandwidth: float):  # type: ignore[no-untyped-def]
    """Per case of :data:`DECODE_CASES`: ``(batch, context, ms by engine key, weights+KV floor ms)``."""
    cfg = loaded.config  # type: ignore[attr-defined]
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    for batch, context in DECODE_CASES:
        ms = {key: decode_ms(engine, batch, context, torch.Generator().manual_seed(batch)) for key, engine in engines.items()}
        yield batch, context, ms, (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth * 1e3


def compare_modes(model: str, loaded: object, weight_bytes: int, bandwidth: float, floor_ms: float) -> None:
    """Decode steps (CUDA graphs, fused kernels) with the library kernels and in the
    batch-invariant mode, the CUDA default, against the same floors."""
    engines = shared_engines(model, loaded, {inv: {"batch_invariant": inv} for inv in (False, True)})
    print("| batch | context | library ms | batch-invariant ms | invariant / library "
          "| invariant / weight floor | invariant / weights+KV floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, ms, kv_floor in decode_rows(engines, loaded, weight_bytes, bandwidth):
        print(f"| {batch} | {context} | {ms[False]:.2f} | {ms[True]:.2f} | {ms[True] / ms[False]:.2f}x "
              f"| {ms[True] / floor_ms:.2f}x | {ms[True] / kv_floor:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--modes", action="store_true",
                    help="instead: CUDA-graph fused decode steps, library kernels against the batch-invariant mode")
    args = ap.parse_args()
    loaded, weight_bytes, bandwidth, floor_ms = load_with_floor(args.model)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.model}: "
          f"{weight_bytes / 1e9:.1f} GB of weights, copy {bandwidth / 1e12:.2f} TB/s, weight-read floor {floor_ms:.2f} ms")
    if args.modes:
        compare_modes(args.model, loaded, weight_bytes, bandwidth, floor_ms)
        return
    variants = {(eager, fused): {"enforce_eager": eager, "fused_kernels": fused}
                for eager in (True, False) for fused in (False, True)}
    engines = shared_engines(args.model, loaded, variants)  # type: ignore[arg-type]
    print("| step | batch | context | eager ms | eager fused ms | graph ms | graph fused ms | fused speed-up (graph) "
          "| graph fused / weight floor | graph fused / weights+KV floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, ms, kv_floor in decode_rows(engines, loaded, weight_bytes, bandwidth):
        print(f"| decode | {batch} | {context} | {ms[True, False]:.2f} | {ms[True, True]:.2f} | {ms[False, False]:.2f} "
              f"| {ms[False, True]:.2f} | {ms[False, False] / ms[False, True]:.2f}x | {ms[False, True] / floor_ms:.2f}x "
              f"| {ms[False, True] / kv_floor:.2f}x |")
    engine = engines[True, True]
    gen = torch.Generator().manual_seed(7)
    vocab = engine.model_config.vocab_size
    for _ in range(16):
        engine.add_request(torch.randint(1000, vocab - 1000, (1024,), generator=gen).tolist(),
                           SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()
    times = []
    for _ in range(6):
        engine.add_request(torch.randint(1000, vocab - 1000, (512,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        times += step_times(engine, 1)
        engine.step()
    print(f"| mixed (16 decodes + 512 prefill) | 17 | 1024 | {statistics.median(times) * 1e3:.2f} | - | - | - |")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    # NOTE: kernels only; op rows (aten::mm) repeat their kernels' device time
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    print(f"eager decode step x16: {launches} kernel launches, {gpu_ms:.2f} ms of GPU time")
    print(events.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()
