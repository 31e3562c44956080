"""Persistent block tables: each scheduled request's table kept as an int32 row between steps.

Every step hands the attention kernels one padded ``[sequences, width]`` int32 table. Built
from the requests' Python lists, every id of every sequence is converted every step: a
long-context batch holds tens of thousands of ids (16 sequences of 2,500 blocks: 1.6 ms on this
project's CPU, ``python scripts/bench_block_tables.py``), while a decode step changes at most
one entry per sequence. :class:`BlockTableRows` keeps each request's row and writes only the
entries that changed since the step before (vLLM v1 keeps its block table on the host the same
way); the step's table is then one memory copy per row.

What changes a request's list, and how the rows see it:

- a new list (installed at admission, emptied at preemption or release): the row is rebuilt
  (the row remembers which list object it copied);
- entries appended past the row's end: written from there;
- an entry changed in place (a hole or a reloaded block given its fresh block): the cache
  manager lowers ``Request.table_dirty_from`` to its index, and the row is rewritten from there.

:meth:`BlockTableRows.check_integrity` asserts that every row equals its list where it claims
to be current, so a mutation that forgets to mark the table fails the engine's integrity checks
(and every lossless test through them) instead of reading stale blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from asymcache_core.request import Request


@dataclass
class _Row:
    #: the request's list this row copies (identity, not value: a new list rebuilds the row)
    source: list[int]
    ids: np.ndarray
    #: entries ``[0, synced)`` equal the list's as of the last build
    synced: int
    last_used: int


class BlockTableRows:
    """The rows of the requests the last steps scheduled.

    Invariants (:meth:`check_integrity`): a row whose list is still the request's holds the
    list's entries below ``min(synced, request.table_dirty_from)``.

    Args:
        max_idle_steps: a row no step used for this many steps (its request finished, or
            waits) is dropped at the next step whose count is a multiple of it (the scan runs
            that often, not every step); it is rebuilt if the request runs again.
    """

    def __init__(self, max_idle_steps: int = 64) -> None:
        if max_idle_steps < 1:
            raise ValueError(f"max_idle_steps: must be >= 1, got {max_idle_steps!r}")
        self.max_idle_steps = max_idle_steps
        self.rows: dict[str, _Row] = {}
        self.num_steps = 0
        self.entries_written = 0  # ids converted from the lists, all steps (tests, benchmarks)

    def build(self, requests: Sequence[Request], width: int) -> np.ndarray:
        """The padded table of ``requests`` (one row each, in order), rows brought up to date.

        Args:
            requests: the step's sequences.
            width: the row length, at least every request's table length.

        Returns:
            ``[len(requests), width]`` int32, zero past each table's end.
        """
        self.num_steps += 1
        step = self.num_steps
        table = np.zeros((len(requests), width), dtype=np.int32)
        for out, request in zip(table, requests, strict=True):
            ids = request.block_ids
            n = len(ids)
            row = self.rows.get(request.request_id)
            if row is None or row.source is not ids:
                row = self.rows[request.request_id] = _Row(ids, np.empty(max(16, n), dtype=np.int32), 0, step)
            start = min(row.synced, request.table_dirty_from, n)
            if n > len(row.ids):
                grown = np.empty(max(n, 2 * len(row.ids)), dtype=np.int32)
                grown[:start] = row.ids[:start]
                row.ids = grown
            if start < n:
                row.ids[start:n] = ids[start:n]
                self.entries_written += n - start
            row.synced = n
            row.last_used = step
            request.table_dirty_from = n
            out[:n] = row.ids[:n]
        if step % self.max_idle_steps == 0:
            stale = [rid for rid, row in self.rows.items() if step - row.last_used >= self.max_idle_steps]
            for rid in stale:
                del self.rows[rid]
        return table

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Asserts that the row of every request in ``requests`` that has one is current where
        it claims to be."""
        for request in requests:
            row = self.rows.get(request.request_id)
            if row is None or row.source is not request.block_ids:
                continue
            n = min(row.synced, request.table_dirty_from, len(request.block_ids))
            assert row.ids[:n].tolist() == request.block_ids[:n], (
                f"{request.request_id}: block table row out of date below {n} (a change to "
                "block_ids in place must lower table_dirty_from)"
            )
