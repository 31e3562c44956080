"""Host time of a step's block tables: :func:`kernels.metadata.pad_block_tables` against
``torch.tensor`` of the zero-padded nested lists (what every step and graph replay did before).

``python scripts/bench_block_tables.py [--repeats 30]`` builds the padded int32 table of a
batch of ragged block tables (each sequence's ``block_ids``, a Python list, as the engine holds
them) both ways, checks they are equal, and prints the median time of each and their ratio for
decode batches from one short context to 128 long ones. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print("| sequences | blocks (longest) | nested lists ms | pad_block_tables ms | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for num, blocks in CASES:
        # ragged, as a batch's contexts are: the i-th sequence holds blocks - i ids
        tables = [list(range(i * blocks, (i + 1) * blocks - i)) for i in range(num)]
        assert torch.equal(nested_lists(tables, blocks), pad_block_tables(tables, blocks))
        before = median_ms(lambda t=tables, w=blocks: nested_lists(t, w), args.repeats)
        after = median_ms(lambda t=tables, w=blocks: pad_block_tables(t, w), args.repeats)
        print(f"| {num} | {blocks:,} | {before:.2f} | {after:.2f} | {before / after:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
