"""The cache lookup against a block-by-block walk: every mix of device hits, host copies and
misses, with and without hole reuse (hypothesis)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.kv_cache_manager import RELOAD, CacheHit, KVCacheManager
from asymcache_core.request import HOLE, Request
from asymcache_core.sampling_params import SamplingParams

BS = 4


def walk_block_by_block(manager: KVCacheManager, request: Request) -> CacheHit:
    """The lookup as one Python turn per block (the oracle), runs of host copies priced as
    one Python turn per block too."""
    hashes = manager.ensure_hashes(request)
    max_blocks = min(len(hashes), (request.num_tokens - 1) // BS)
    on_device = manager.pool.cached.get
    on_host = manager.tier.pool.cached.get if manager.tier is not None else None
    table: list[int] = []
    host_slots: dict[int, int] = {}
    skipped = 0
    for i in range(max_blocks):
        block_id = on_device(hashes[i])
        if block_id is None and on_host is not None:
            slot = on_host(hashes[i])
            if slot is not None:
                host_slots[i] = slot
                table.append(RELOAD)
                continue
        if block_id is None:
            if not manager.hole_reuse:
                skipped = sum(on_device(h) is not None for h in hashes[i + 1 : max_blocks])
                break
            table.append(HOLE)
        else:
            table.append(block_id)
    recomputed = 0
    if host_slots and manager.reload_by_cost:
        recomputed = recompute_cheap_runs(manager, request, table)
    while table and table[-1] == HOLE:
        table.pop()
    leading = next((i for i, b in enumerate(table) if b == HOLE), len(table))
    hits = sum(b != HOLE for b in table)
    return CacheHit(
        block_table=table,
        leading_tokens=leading * BS,
        hit_tokens=hits * BS,
        hole_tokens=(len(table) - hits) * BS,
        skipped_hit_tokens=skipped * BS,
        reloads={i: host_slots[i] for i, b in enumerate(table) if b == RELOAD},
        host_recomputed_tokens=recomputed * BS,
    )


def recompute_cheap_runs(manager: KVCacheManager, request: Request, table: list[int]) -> int:
    """Each run of ``RELOAD`` entries found by walking the table, turned into holes where its
    rebuild prices below its copy."""
    tier = manager.tier
    present = sum(b != HOLE for b in table)
    fixed, slope = tier.latency.block_rebuild_line(BS, max(request.num_tokens - present * BS, tier.latency.knee_tokens))
    turned = 0
    i = 0
    while i < len(table):
        if table[i] != RELOAD:
            i += 1
            continue
        j = i
        while j < len(table) and table[j] == RELOAD:
            j += 1
        n = j - i
        if n * fixed + slope * (i + j - 1) * n / 2 < tier.reload_seconds(n):
            table[i:j] = [HOLE] * n
            turned += n
        i = j
    return turned


def host_tier(host: dict[int, int], copy_s: float) -> SimpleNamespace:
    """A host tier of ``host`` (hash -> slot) whose prices favour copies of long runs late in
    the context: a rebuild costs 1 s a block plus a quarter second a position, a copy ``copy_s``
    a block plus 1 s."""
    return SimpleNamespace(
        pool=SimpleNamespace(cached=host),
        latency=SimpleNamespace(block_rebuild_line=lambda bs, base: (1.0, 0.25), knee_tokens=0),
        reload_seconds=lambda n: 1.0 + copy_s * n,
    )


@settings(max_examples=300, deadline=None)
@given(
    where=st.lists(st.sampled_from(["device", "host", "both", "none"]), min_size=0, max_size=24),
    extra=st.integers(0, BS),
    hole_reuse=st.booleans(),
    with_tier=st.booleans(),
    by_cost=st.booleans(),
    copy_s=st.sampled_from([0.5, 2.0, 3.5, 9.0]),
)
def test_lookup_matches_the_block_by_block_walk(
    where: list[str], extra: int, hole_reuse: bool, with_tier: bool, by_cost: bool, copy_s: float
) -> None:
    tokens = list(range(1, len(where) * BS + extra + 1)) or [1]
    request = Request("r", tokens, SamplingParams(), 0.0)
    device: dict[int, int] = {}
    host: dict[int, int] = {}
    tier = host_tier(host, copy_s)
    manager = KVCacheManager(
        SimpleNamespace(cached=device),  # type: ignore[arg-type]
        BS,
        hole_reuse,
        tier if with_tier else None,  # type: ignore[arg-type]
        reload_by_cost=by_cost,
    )
    for i, (h, place) in enumerate(zip(manager.ensure_hashes(request), where, strict=False)):
        if place in ("device", "both"):
            device[h] = 100 + i
        if place in ("host", "both"):
            host[h] = 500 + i
    expected = walk_block_by_block(manager, request)
    assert manager.lookup(request) == expected
    assert manager.lookup(request).block_table == expected.block_table, "a second lookup finds the same"


def test_runs_of_host_copies_are_priced() -> None:
    """Two blocks on the host before four on the device: rebuilt when a copy costs 9 s a block,
    reloaded at 0.5 s (the oracle test's prices)."""
    for copy_s, reloaded in ((9.0, 0), (0.5, 2)):
        tokens = list(range(1, 6 * BS + 2))
        request = Request("r", tokens, SamplingParams(), 0.0)
        device: dict[int, int] = {}
        host: dict[int, int] = {}
        manager = KVCacheManager(SimpleNamespace(cached=device), BS, True, host_tier(host, copy_s))  # type: ignore[arg-type]
        for i, h in enumerate(manager.ensure_hashes(request)):
            (host if i < 2 else device)[h] = i
        hit = manager.lookup(request)
        assert len(hit.reloads) == reloaded
        assert hit.host_recomputed_tokens == (2 - reloaded) * BS
        assert hit.hit_tokens == (4 + reloaded) * BS
        assert hit.leading_tokens == (6 if reloaded else 0) * BS, "rebuilt copies are holes before the hits"


def test_a_recomputed_run_is_priced_in_a_step_past_its_knee() -> None:
    """A request whose own new tokens are few still rebuilds its host hits in a step that
    others fill: the run is priced at the model's knee or above, where every token costs the
    per-token rate, not under it, where tokens are almost free."""
    from asymcache_core.latency_model import LatencyModel

    model = LatencyModel(floor_s=5e-3, per_token_s=1e-4, per_attn_s=1e-9, knee_tokens=512)
    tokens = list(range(1, 6 * BS + 2))  # two blocks on the host, four on the device, 1 new token
    request = Request("r", tokens, SamplingParams(), 0.0)

    def rebuild_s(base: int) -> float:
        fixed, slope = model.block_rebuild_line(BS, base)
        return 2 * fixed + slope * (0 + 2 - 1) * 2 / 2  # the run of blocks 0 and 1

    alone, full = rebuild_s(1), rebuild_s(model.knee_tokens)
    assert full > 10 * alone  # under the knee a rebuild is almost free, past it it is not
    # a copy dearer than the lone rebuild but cheaper than the rebuild in a full step is
    # chosen; one dearer than both is not
    for copy_s, reloaded in (((alone + full) / 2, 2), (2 * full, 0)):
        device: dict[int, int] = {}
        host: dict[int, int] = {}
        tier = SimpleNamespace(pool=SimpleNamespace(cached=host), latency=model, reload_seconds=lambda n, c=copy_s: c)
        manager = KVCacheManager(SimpleNamespace(cached=device), BS, True, tier)  # type: ignore[arg-type]
        for i, h in enumerate(manager.ensure_hashes(request)):
            (host if i < 2 else device)[h] = i
        hit = manager.lookup(request)
        assert len(hit.reloads) == reloaded and hit.host_recomputed_tokens == (2 - reloaded) * BS
