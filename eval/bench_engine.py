"""Engine speed against transformers' ``generate`` on the same model, side by side.

``python -m eval.bench_engine`` (or ``asymcache bench-engine``) prints prefill and decode tokens/s
of this engine and of HF ``generate`` at batch 1 and 16, measured in one run on one machine.

Prefill is timed as the first step of a batch (all prompts, one token sampled), the median of
``prefill_samples`` fresh ones per measurement (a single step of a few hundred milliseconds
swings by 20% on a shared machine); decode is the rest of a ``max_tokens`` generation divided
by its generated tokens. Both engines run greedy (``sampling="random"``: temperature 0.7 and
top-p 0.9, top-k off, in both), float32, with EOS ignored so that every row generates exactly ``new_tokens`` tokens. Each
measurement is repeated, the two engines alternating, and the table shows medians and the
range of the paired ratios: on a shared 2-core machine one run's figures swing by 10% or more.
"""

from __future__ import annotations

import contextlib
import io
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SpeedRow:
    """One measurement: engine, batch, prefill tok/s, decode tok/s."""

    engine: str
    batch: int
    prefill_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class SpeedSummary:
    """An engine's repeated measurements at one batch size.

    Attributes:
        engine: ``asymcache`` or ``transformers``.
        batch: prompts per batch.
        runs: the measurements, in order (the engines alternate between them).
    """

    engine: str
    batch: int
    runs: tuple[SpeedRow, ...]

    @property
    def prefill_tok_s(self) -> float:
        return statistics.median(r.prefill_tok_s for r in self.runs)

    @property
    def decode_tok_s(self) -> float:
        return statistics.median(r.decode_tok_s for r in self.runs)


#: the settings of ``sampling="random"`` (both engines)
RANDOM = {"temperature": 0.7, "top_p": 0.9}
SAMPLINGS = ("greedy", "random")


def _ours_params(sampling: str, max_tokens: int) -> Any:
    from asymcache_core import SamplingParams

    extra = RANDOM if sampling == "random" else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def _hf_kwargs(sampling: str) -> dict[str, Any]:
    return {"do_sample": True, "top_k": 0, **RANDOM} if sampling == "random" else {"do_sample": False}


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def bench_ours(
    loaded, batch: int, prompt_len: int, new_tokens: int, seed: int, prefill_samples: int = 3, sampling: str = "greedy"
) -> SpeedRow:
    from asymcache_core import Engine

    prompts = _prompts(batch, prompt_len, loaded.config.vocab_size, seed)
    blocks = batch * (-(-(prompt_len + new_tokens) // 16) + 1) + 16
    engine = Engine(model=loaded.name, loaded=loaded, num_kv_blocks=blocks, max_num_batched_tokens=max(2048, batch * prompt_len))
    engine.generate(prompts[:1], _ours_params(sampling, 2))  # warm-up
    prefills = []
    for _ in range(prefill_samples):
        engine.reset_prefix_cache()  # every timed prefill computes its prompts afresh
        for p in prompts:
            engine.add_request(p, _ours_params(sampling, 1))
        start = time.perf_counter()
        engine.step()  # the whole batch's prefill (the budget covers it) and its one token
        prefills.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    engine.reset_prefix_cache()
    params = _ours_params(sampling, new_tokens)
    for p in prompts:
        engine.add_request(p, params)
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    total = time.perf_counter() - start
    prefill = statistics.median(prefills)
    return SpeedRow("asymcache", batch, batch * prompt_len / prefill, batch * (new_tokens - 1) / (total - first))


def bench_hf(
    hf_model, batch: int, prompt_len: int, new_tokens: int, seed: int, vocab: int, prefill_samples: int = 3,
    sampling: str = "greedy",
) -> SpeedRow:
    prompts = torch.tensor(_prompts(batch, prompt_len, vocab, seed))
    mask = torch.ones_like(prompts)
    how = _hf_kwargs(sampling)
    with torch.no_grad():
        hf_model.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=2, min_new_tokens=2, **how)
        prefills = []
        for _ in range(prefill_samples):
            start = time.perf_counter()
            hf_model.generate(prompts, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **how)
            prefills.append(time.perf_counter() - start)
        start = time.perf_counter()
        hf_model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **how)
        total = time.perf_counter() - start
    prefill = statistics.median(prefills)
    return SpeedRow("transformers", batch, batch * prompt_len / prefill, batch * (new_tokens - 1) / max(total - prefill, 1e-9))


def run(
    batches: tuple[int, ...] = (1, 16), prompt_len: int = 128, new_tokens: int = 64, seed: int = 0,
    progress: Any = None, repeats: int = 3, sampling: str = "greedy",
) -> list[SpeedSummary]:
    """Measures both engines, ``repeats`` times each, alternating; returns the summaries (also
    printed as a table).

    Args:
        progress: optional ``rich.progress.Progress``-like object (``add_task``/``update``):
            one task over the model loads and the measurements.
        repeats: measurements per engine and batch size.
        sampling: ``greedy``, or ``random`` (temperature 0.7, top-p 0.9 in both engines).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from asymcache_core.loaders import load_model, packaged_smollm2_path

    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling: must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    task = progress.add_task("bench-engine", total=2 + 2 * len(batches) * repeats) if progress is not None else None
    completed = 0

    def done() -> None:
        nonlocal completed
        completed += 1
        if progress is not None:
            progress.update(task, completed=completed)

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed)
    done()
    path = packaged_smollm2_path()
    # NOTE: transformers draws its own bars while it reads the GGUF file (one of them a bare
    # tqdm that no flag turns off); the command shows its progress itself, one line per task
    # in a log, so in a log they are left out
    quiet = not sys.stderr.isatty()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    done()
    summaries: list[SpeedSummary] = []
    for batch in batches:
        ours: list[SpeedRow] = []
        theirs: list[SpeedRow] = []
        for _ in range(repeats):
            ours.append(bench_ours(loaded, batch, prompt_len, new_tokens, seed, sampling=sampling))
            done()
            theirs.append(bench_hf(hf_model, batch, prompt_len, new_tokens, seed, loaded.config.vocab_size, sampling=sampling))
            done()
        summaries += [SpeedSummary("asymcache", batch, tuple(ours)), SpeedSummary("transformers", batch, tuple(theirs))]
    print_table(summaries, prompt_len, new_tokens, sampling)
    return summaries


def _ratio_range(ours: SpeedSummary, hf: SpeedSummary, key: str) -> str:
    """``min-max`` of the paired runs' ratios (run ``i`` of each engine ran back to back)."""
    ratios = [getattr(a, key) / getattr(b, key) for a, b in zip(ours.runs, hf.runs, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def print_table(rows: list[SpeedSummary], prompt_len: int, new_tokens: int, sampling: str = "greedy") -> None:
    repeats = max((len(r.runs) for r in rows), default=0)
    how = "greedy" if sampling == "greedy" else "random (temperature 0.7, top-p 0.9)"
    from kernels.cpu_linear import few_row_forms

    # NOTE: the engine's linear op is the form its probe kept for this machine (kernels/cpu_linear.py)
    forms = "/".join(dict.fromkeys(few_row_forms(torch.get_num_threads())))
    print(f"# SmolLM2-135M fp32, prompt {prompt_len}, {new_tokens} new tokens, {how}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"CPU linear {forms}, median of {repeats} alternating runs (ratio range over the paired runs)")
    print(f"{'engine':<14}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'prefill x':>11}{'decode x':>10}"
          f"{'prefill range':>15}{'decode range':>14}")
    by_batch: dict[int, dict[str, SpeedSummary]] = {}
    for row in rows:
        by_batch.setdefault(row.batch, {})[row.engine] = row
    for batch, pair in by_batch.items():
        hf = pair.get("transformers")
        for row in pair.values():
            px = row.prefill_tok_s / hf.prefill_tok_s if hf else float("nan")
            dx = row.decode_tok_s / hf.decode_tok_s if hf else float("nan")
            ranges = ("", "")
            if hf is not None and row is not hf:
                ranges = (_ratio_range(row, hf, "prefill_tok_s"), _ratio_range(row, hf, "decode_tok_s"))
            print(f"{row.engine:<14}{batch:>6}{row.prefill_tok_s:>15.1f}{row.decode_tok_s:>14.1f}{px:>10.2f}x{dx:>9.2f}x"
                  f"{ranges[0]:>15}{ranges[1]:>14}")


if __name__ == "__main__":
    run()
