"""Prefill through the engine against the matmul peak (#28, item 4). GPU machine only.

``python scripts/gpu_prefill_step.py [--model dummy:llama-3.1-8b] [--repeats 5]`` prints:

* the bf16 matmul peak measured in the same run: ``torch.mm`` on the model's own GEMM shapes
  at 8,192 rows (the fastest of them, TFLOP/s);
* one table of median ``engine.step()`` wall times of 8,192-token steps (``--tokens``), each on
  fresh random prompts (no cache hit): one 8,192-token prompt, four 2,048-token prompts, and
  the last 8,192-token chunk of a 32,768-token prompt (24,576 tokens of context before it), for the
  library kernels and the batch-invariant mode (the CUDA default); the model FLOPs of a step
  (linear layers of every token, the LM head of the sampled rows, causal attention) per
  second, and their share of the matmul peak;
* the busiest kernels of one 8,192-token step of the default engine.

``--library-tiles`` times instead the library engine with and without its 128-key KV tiles for
deep prefill launches (``kernels.msa_config._WIDE_KV_MIN_KEYS``), and with them always split
(``_WIDE_KV_MIN_SPLITS``), in alternating rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from asymcache_core import Engine, SamplingParams
from asymcache_core.loaders import load_model
from kernels.bench import bench_ms, narrow_kv_tiles, split_wide_kv_tiles


def matmul_peak(shapes: list[tuple[int, int]], rows: int, dev: torch.device) -> tuple[float, str]:
    """Fastest bf16 ``x @ w.T`` over the weight shapes ``(out, in)`` at ``rows`` rows."""
    best, best_name = 0.0, ""
    for out_f, in_f in shapes:
        x = torch.randn(rows, in_f, device=dev, dtype=torch.bfloat16)
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16)
        ms = bench_ms(lambda x=x, w=w: torch.mm(x, w.t()))
        tflops = 2 * rows * in_f * out_f / ms / 1e9
        if tflops > best:
            best, best_name = tflops, f"{rows}x{in_f} @ {in_f}x{out_f}"
    return best, best_name


def step_flops(cfg: object, segments: list[tuple[int, int]], linear_params: int, head_params: int) -> float:
    """Model FLOPs of one step: ``segments`` are ``(context before, new tokens)``; one sampled
    row per segment (its prompt's last token) runs the LM head."""
    tokens = sum(n for _, n in segments)
    attn = 0
    for before, n in segments:
        # causal: new token i attends to before + i + 1 keys; QK^T and PV are 2 FLOPs a MAC each
        attn += n * before + n * (n + 1) // 2
    heads, head_dim, layers = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    return 2.0 * linear_params * tokens + 2.0 * head_params * len(segments) + 4.0 * heads * head_dim * layers * attn


def prefill_step_ms(engine: Engine, case: str, tokens: int, gen: torch.Generator, repeats: int) -> float:
    """Median wall time of the case's timed ``tokens``-token step over ``repeats`` fresh prompts."""
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(vocab // 10, vocab - vocab // 10, (n,), generator=gen).tolist()

    times = []
    for _ in range(repeats + 1):  # the first round warms up
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        if case == "one prompt":
            engine.add_request(prompt(tokens), params)
            skip = 0
        elif case == "four prompts":
            for _ in range(4):
                engine.add_request(prompt(tokens // 4), params)
            skip = 0
        else:  # the last of four chunks of one prompt
            engine.add_request(prompt(4 * tokens), params)
            skip = 3
        for _ in range(skip):
            engine.step()
        _sync()
        start = time.perf_counter()
        engine.step()
        _sync()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times[1:]) * 1e3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the timed step (the step budget)")
    ap.add_argument("--library-tiles", action="store_true",
                    help="the library engine with and without its 128-key tiles, alternating rounds")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of --library-tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    tokens = args.tokens
    loaded = load_model(args.model, dev, torch.bfloat16, seed=0)
    cfg = loaded.config
    linear_shapes: list[tuple[int, int]] = []
    linear_params = head_params = 0
    for name, param in loaded.model.named_parameters():
        if param.dim() != 2 or "embed" in name:
            continue
        if "lm_head" in name:
            head_params = param.numel()
            continue
        linear_params += param.numel()
        if name.startswith("layers.0.") or ".layers.0." in name:
            linear_shapes.append(tuple(param.shape))  # type: ignore[arg-type]
    if head_params == 0:  # tied embeddings: the head is the embedding matrix
        head_params = cfg.vocab_size * cfg.hidden_size
    peak, peak_shape = matmul_peak(linear_shapes, tokens, dev)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.model}: "
          f"{linear_params / 1e9:.2f} B linear parameters; bf16 matmul peak {peak:.0f} TFLOP/s ({peak_shape})")
    if args.library_tiles:
        library_tiles(args, loaded, cfg, linear_params, head_params, peak)
        return
    engines = {}
    for mode, invariant in (("library kernels", False), ("batch-invariant (default)", True)):
        start = time.perf_counter()
        engines[mode] = prefill_engine(args, loaded, invariant)
        print(f"engine ({mode}) ready in {time.perf_counter() - start:.1f} s")
    cases = {
        "one prompt": [(0, tokens)],
        "four prompts": [(0, tokens // 4)] * 4,
        "last chunk": [(3 * tokens, tokens)],
    }
    print("| step | mode | ms | TFLOP/s | of matmul peak |")
    print("|---|---|---:|---:|---:|")
    for case, segments in cases.items():
        flops = step_flops(cfg, segments, linear_params, head_params)
        for mode, engine in engines.items():
            ms = prefill_step_ms(engine, case, tokens, torch.Generator().manual_seed(11), args.repeats)
            tflops = flops / ms / 1e9
            print(f"| {step_name(case, tokens)} | {mode} | {ms:.1f} | {tflops:.0f} | {tflops / peak:.0%} |")
    engine = engines["batch-invariant (default)"]
    gen = torch.Generator().manual_seed(5)
    engine.add_request(torch.randint(cfg.vocab_size // 10, cfg.vocab_size - cfg.vocab_size // 10, (tokens,), generator=gen).tolist(),
                       SamplingParams(max_tokens=1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    print(f"default engine, one 1 x {tokens} step: {gpu_ms:.1f} ms of GPU time")
    print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


def prefill_engine(args: argparse.Namespace, loaded: object, invariant: bool) -> Engine:
    """An engine whose steps hold ``args.tokens`` tokens and whose pool holds a few prompts."""
    tokens = args.tokens
    return Engine(
        model=args.model, device="cuda", loaded=loaded, num_kv_blocks=(5 * tokens) // 16 + 64,
        max_num_batched_tokens=tokens, max_model_len=4 * tokens + 64, batch_invariant=invariant,
    )


def step_name(case: str, tokens: int) -> str:
    return {"one prompt": f"1 x {tokens}", "four prompts": f"4 x {tokens // 4}",
            "last chunk": f"last {tokens} of {4 * tokens}"}[case]


def library_tiles(args: argparse.Namespace, loaded: object, cfg: object, linear_params: int, head_params: int,
                  peak: float) -> None:
    """The library engine's prefill steps as the planner plans them, with its 128-key KV tiles
    always split in two or more (as before they ran on the split path at one split), and with
    64-key tiles only (the rule switched off), in ``args.rounds`` alternating rounds; medians."""
    tokens = args.tokens
    engine = prefill_engine(args, loaded, invariant=False)
    cases = {"one prompt": [(0, tokens)], "last chunk": [(3 * tokens, tokens)]}
    variants = {"planner": contextlib.nullcontext, "wide, >= 2 splits": split_wide_kv_tiles,
                "64-key tiles": narrow_kv_tiles}
    print("| step | " + " ms | ".join(variants) + " ms | planner vs 64-key | TFLOP/s (planner) | of matmul peak |")
    print("|---|" + "---:|" * (len(variants) + 3))
    for case, segments in cases.items():
        times: dict[str, list[float]] = {name: [] for name in variants}
        # NOTE: one generator for every call: a prompt drawn twice would hit the prefix cache
        gen = torch.Generator().manual_seed(11)
        for _ in range(args.rounds):
            for name, variant in variants.items():
                with variant():
                    times[name].append(prefill_step_ms(engine, case, tokens, gen, args.repeats))
        med = {name: statistics.median(t) for name, t in times.items()}
        tflops = step_flops(cfg, segments, linear_params, head_params) / med["planner"] / 1e9
        print(f"| {step_name(case, tokens)} | " + " | ".join(f"{ms:.1f}" for ms in med.values())
              + f" | {med['64-key tiles'] / med['planner']:.3f}x | {tflops:.0f} | {tflops / peak:.0%} |", flush=True)


if __name__ == "__main__":
    main()
