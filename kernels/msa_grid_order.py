"""The order of an MSA launch's grid: tile first or KV head first (host side).

The GPU starts a grid's programs in order along its first axis. :mod:`kernels.msa_plan`
sorts a launch's tiles heaviest first; with the grid ``(tile, KV head, split)`` that order
holds within one KV head only, and with ``(KV head, tile, split)`` across heads
(``MSAPlan.heads_first``). :func:`heads_first_pays` models both orders' makespans and says
which one a launch of prefill tiles should take.
"""

from __future__ import annotations

import torch

# A launch's grid goes KV head first when the modelled makespan by tile first is at least this
# many times the one by head first (the tile's fixed work counted as this many keys).
# NOTE: measured on the H200 (scripts/gpu_msa_grid_order.py, library prefill launches of 256-row
# tiles, one program per SM): the GPU starts programs along the grid's first axis, so by tile
# first the last KV head's deepest tiles start when most of the launch is done and run on
# alone; by head first, every head of the deepest tile starts first. Head first was 4-14%
# faster on the 9 layouts with holes at many depths, 1-4% slower where every tile is about
# equally deep (a chunk deep in one prompt): there the tile-first order's programs in flight
# share one KV head's keys in L2. The model (a list schedule of the costs in either order) put
# the first at 1.11-1.24x, the second at 1.00-1.05x.
HEADS_FIRST_MIN_GAIN = 1.08
# Rows of the tiles (one program per SM) whose launches the model orders; decode tiles, many
# programs to an SM, keep the tile first (either order ran within 1.2% of the other).
HEADS_FIRST_ROWS = 128
TILE_FIXED_KEYS = 2000
# Head first puts the tiles on the grid's second axis, at most this many programs long.
_MAX_GRID_Y = 65_535


def heads_first_pays(tile_keys: list[int], num_kv_heads: int, chunk: int, num_sms: int) -> bool:
    """Whether a launch of tiles seeing ``tile_keys`` keys (heaviest first), each walked by
    ``num_kv_heads`` programs per ``chunk`` of keys, one program per SM at a time, finishes
    :data:`HEADS_FIRST_MIN_GAIN` times sooner by KV head first than by tile first.

    Each order's makespan is modelled as a list schedule: a program starts once the programs
    before it in the grid's order have spread their work over the SMs, and the launch ends
    when the last one to finish does (or when the work alone would end, if later).
    """
    if num_kv_heads < 2 or len(tile_keys) > _MAX_GRID_Y:
        return False  # nothing to order; or too many tiles for the grid's second axis
    if len(tile_keys) * num_kv_heads <= num_sms:
        return False  # every program starts at once, in either order
    # NOTE: one tensor expression over [splits, tiles] (a deep launch has ~30 splits of ~250
    # tiles: a Python loop over them took ~4 ms of the step's host time; this takes ~0.1 ms).
    # A tile with no keys in a split costs nothing there, and its terms never exceed the
    # work up to that split, which bounds both makespans anyway.
    keys = torch.tensor(tile_keys, dtype=torch.float64)
    starts = torch.arange(-(-int(keys.max()) // chunk), dtype=torch.float64)[:, None] * chunk
    costs = torch.where(keys > starts, (keys - starts).clamp(max=chunk) + TILE_FIXED_KEYS, 0.0)
    head_work = costs.sum(1, keepdim=True)  # [splits, 1]: one KV head's work in each split
    done = num_kv_heads * (head_work.cumsum(0) - head_work)  # all heads' work of earlier splits
    before = costs.cumsum(1) - costs  # one head's work of heavier tiles in the same split
    by_tile = ((done + (num_kv_heads - 1) * head_work + before) / num_sms + costs).max().item()
    by_head = ((done + num_kv_heads * before + (num_kv_heads - 1) * costs) / num_sms + costs).max().item()
    work = num_kv_heads * head_work.sum().item() / num_sms
    return max(by_tile, work) >= HEADS_FIRST_MIN_GAIN * max(by_head, work)
