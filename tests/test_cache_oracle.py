"""Brute-force oracle: the fixed-point hit equals the longest aligned prefix every group serves.

For random layouts (1-4 groups of every kind, block sizes 2/4/8, every strategy) and random
request histories that fill and evict the cache, each hit ``get_computed_blocks`` returns is
compared with a naive search: for every candidate length, each group's rule is checked
directly (``spec.kept_tokens``) against the set of hashes its prefix cache holds.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.cache import KVCacheManager, Request
from test_cache_factories import (
    STRATEGIES,
    eviction_for,
    groups,
    layout_for,
    oracle,
    spec_items,
    tokens,
)


def _check(mgr: KVCacheManager, req: Request) -> int:
    before = mgr.stats.group_alone_hit_tokens
    got = mgr.get_computed_blocks(req)
    hit, alone, blocks = oracle(mgr, req)
    assert got.num_computed_tokens == hit
    assert [list(b) for b in got.blocks] == blocks
    if mgr.group_hit_stats:
        after = mgr.stats.group_alone_hit_tokens
        assert [a - b for a, b in zip(after, before, strict=True)] == alone
    else:  # windowed groups looked up only below the prefix-closed hit: no standalone count
        assert mgr.stats.group_alone_hit_tokens == ()
    kinds = [gp.spec.kind for gp in mgr.layout.groups]
    closed = [a for k, a in zip(kinds, alone, strict=True) if k in ("full_attention", "mla")]
    attention = [a for k, a in zip(kinds, alone, strict=True) if k != "state"]
    junction = min(closed) if closed else max(attention) if attention else hit
    assert got.junction_tokens == junction
    return hit


@given(
    strategy=hst.sampled_from(STRATEGIES),
    items=hst.lists(spec_items(), min_size=1, max_size=4),
    capacity=hst.integers(3, 14),
    group_stats=hst.booleans(),
    data=hst.data(),
)
def test_hits_match_the_brute_force_oracle(
    strategy: str, items: list, capacity: int, group_stats: bool, data: hst.DataObject
) -> None:
    mgr = KVCacheManager(
        layout_for(strategy, groups(*items), capacity),
        hasher="builtin",
        arena_eviction=eviction_for(strategy),
        group_hit_stats=group_stats,
    )
    base = tokens(40, start=10)
    for i in range(data.draw(hst.integers(1, 7), label="requests")):
        prefix = data.draw(hst.integers(0, 36), label="prefix")
        tail = data.draw(hst.lists(hst.integers(0, 2), min_size=1, max_size=10), label="tail")
        req = mgr.make_request(f"r{i}", base[:prefix] + tail)
        hit = _check(mgr, req)
        got = mgr.get_computed_blocks(req)
        first = data.draw(hst.integers(1, req.num_tokens - hit), label="first chunk")
        res = mgr.allocate_slots(req, first, num_new_computed_tokens=hit, new_computed_blocks=got)
        if res is None:
            continue
        req.num_computed_tokens = hit + first
        while req.num_computed_tokens < req.num_tokens:
            n = data.draw(hst.integers(1, req.num_tokens - req.num_computed_tokens), label="chunk")
            if mgr.allocate_slots(req, n) is None:
                break
            req.num_computed_tokens += n
        else:
            for t in data.draw(hst.lists(hst.integers(0, 2), max_size=4), label="decode"):
                req.append_token_ids([t])
                if mgr.allocate_slots(req, 1) is None:
                    break
                req.num_computed_tokens += 1
        mgr.free(req.request_id)
        mgr.check_invariants()
    for j in range(3):
        prefix = data.draw(hst.integers(0, 40), label="probe prefix")
        probe = mgr.make_request(f"p{j}", [*base[:prefix], 3])
        _check(mgr, probe)
