"""Host time of a step's block tables, three ways: ``torch.tensor`` of the zero-padded nested
lists (what every step and graph replay did before 2026-12-03), :func:`kernels.metadata.pad_block_tables`
(numpy, row by row, from the whole lists), and the persistent rows of
:class:`asymcache_core.block_tables.BlockTableRows` (the default since 2026-12-03: only what
changed is converted).

``python scripts/bench_block_tables.py [--repeats 30]`` builds the padded int32 table of a
batch of ragged block tables (each sequence's ``block_ids``, a Python list, as the engine holds
them) every way, checks they are equal, and prints the median time of each for decode batches
from one short context to 128 long ones. The persistent rows are timed in steady decode: each
step, one sequence in 16 appends a block (16-token blocks, one token a step). CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from asymcache_core.block_tables import BlockTableRows
from asymcache_core.request import Request
from asymcache_core.sampling_params import SamplingParams
from kernels.metadata import pad_block_tables

# (sequences, blocks of the longest): 16-token blocks, so 1,875 blocks are a 30k-token context
CASES = ((1, 128), (8, 1_560), (16, 2_500), (32, 1_875), (128, 1_000))


def nested_lists(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class _DecodeStep:
    """One steady decode step of the persistent rows: one sequence in 16 appends a block."""

    def __init__(self, rows: BlockTableRows, requests: list[Request], width: int) -> None:
        self.rows, self.requests, self.width, self.turn = rows, requests, width, 0

    def __call__(self) -> np.ndarray:
        self.turn += 1
        for request in self.requests[self.turn % 16 :: 16]:
            request.block_ids.append(self.turn)
        return self.rows.build(self.requests, self.width)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print("| sequences | blocks (longest) | nested lists ms | pad_block_tables ms | persistent rows ms | rows vs pad |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num, blocks in CASES:
        # ragged, as a batch's contexts are: the i-th sequence holds blocks - i ids
        tables = [list(range(i * blocks, (i + 1) * blocks - i)) for i in range(num)]
        assert torch.equal(nested_lists(tables, blocks), pad_block_tables(tables, blocks))
        before = median_ms(lambda t=tables, w=blocks: nested_lists(t, w), args.repeats)
        after = median_ms(lambda t=tables, w=blocks: pad_block_tables(t, w), args.repeats)
        requests = []
        for i, table in enumerate(tables):
            request = Request(f"r{i}", [0], SamplingParams(max_tokens=1), 0.0)
            request.block_ids = list(table)
            requests.append(request)
        rows = BlockTableRows()
        width = blocks + 16
        rows.build(requests, width)  # the prompt's step: every row written once
        step = _DecodeStep(rows, requests, width)
        persistent = median_ms(step, args.repeats)
        assert (step() == pad_block_tables([r.block_ids for r in requests], width).numpy()).all()
        print(
            f"| {num} | {blocks:,} | {before:.2f} | {after:.2f} | {persistent:.3f} | {after / persistent:.0f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
