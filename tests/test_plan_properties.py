"""Invariants of every plan on random small models and budgets (hypothesis)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import PlanError
from hybridkv.plan import Plan, Strategy, blocks_for_request, make_plan
from hybridkv.specs import CacheSpec, ModelSpec
from test_plan_factories import chunked, full, mla, model, sliding, state


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


specs = st.one_of(
    st.builds(full, kv=st.integers(1, 2), hd=st.sampled_from([2, 4]), dtype=st.just("bf16")),
    st.builds(sliding, st.integers(1, 24), sinks=st.integers(0, 3)),
    st.builds(chunked, st.integers(1, 24)),
    st.builds(mla, st.integers(1, 8), st.integers(1, 4)),
    st.builds(state, st.tuples(st.integers(1, 40))),
    st.builds(state, st.tuples(st.integers(1, 6), st.integers(1, 6)), st.tuples(st.integers(1, 9))),
)


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    palette: list[CacheSpec] = draw(st.lists(specs, min_size=1, max_size=3))
    picks = draw(st.lists(st.integers(0, len(palette)), min_size=1, max_size=8))
    if all(p == len(palette) for p in picks):
        picks[0] = 0
    return model([palette[p] if p < len(palette) else None for p in picks])


def _fits(plan: Plan, requests: int) -> bool:
    """Independent capacity rule: whole chunks per group (arena) or blocks per pool."""
    layout = plan.layout
    need = [blocks_for_request(g, plan.max_model_len) for g in layout.groups]
    if layout.arena is not None:
        size = layout.arena.chunk_bytes
        # a chunk lends every whole block, less one when the block does not divide it
        lent = [size // g.block_bytes - (size % g.block_bytes > 0) for g in layout.groups]
        assert min(lent) >= 1
        # the null host's ids of chunk 0 and the tail host's past the last chunk hold
        # blocks too
        loans = [0] * len(layout.groups)
        for host in (layout.null_host, layout.tail_host):
            if host is not None:
                loans[host.group_id] += host.end - host.first
        chunks = sum(
            _cdiv(max(0, requests * n - loan), k)
            for k, n, loan in zip(lent, need, loans, strict=True)
        )
        return chunks <= layout.arena.num_chunks - 1
    return all(
        requests * sum(need[g] for g in pool.group_ids) <= pool.num_blocks - 1
        for pool in layout.pools
    )


def _check(plan: Plan, m: ModelSpec) -> None:
    layout = plan.layout
    members = sorted(mem for g in layout.groups for mem in g.members)
    assert members == sorted((e.layer, e.slot) for e in m.entries())
    for g in layout.groups:
        for layer, slot in g.members:
            assert m.layers[layer].caches[slot] == g.spec
    n = plan.capacity.max_concurrent_requests
    assert n >= 1
    assert _fits(plan, n)
    assert not _fits(plan, n + 1)
    assert plan.capacity.max_resident_tokens == n * plan.max_model_len
    w = plan.waste
    assert min(w.padded_layers, w.padded_pages, w.chunk_tails, w.reserved) >= 0
    assert plan.free_bytes >= 0
    assert plan.allocated_bytes + w.total + plan.free_bytes == plan.memory_bytes
    assert layout.total_bytes <= plan.memory_bytes
    assert plan.physical_need.total <= plan.allocated_bytes
    assert plan.physical_need.total == n * m.resident_bytes(plan.max_model_len)
    assert 0 < plan.utilisation <= 1
    assert Plan.from_json(plan.to_json()) == plan


@given(
    m=models(),
    memory=st.integers(1, 1 << 16),
    seq_len=st.integers(1, 100),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    state_block_size=st.none() | st.integers(1, 64),
    alignment=st.sampled_from([32, 64, 256, 1024]),
    strategy=st.sampled_from(list(Strategy)),
)
def test_random_plans_hold_their_invariants(
    m: ModelSpec,
    memory: int,
    seq_len: int,
    block_size: int,
    state_block_size: int | None,
    alignment: int,
    strategy: Strategy,
) -> None:
    def plan_with(budget: int) -> Plan:
        return make_plan(
            m,
            memory_bytes=budget,
            max_model_len=seq_len,
            strategy=strategy,
            block_size=block_size,
            state_block_size=state_block_size,
            chunk_alignment=alignment,
        )

    try:
        plan = plan_with(memory)
    except PlanError as exc:
        found = re.search(
            r"(?:one request needs|this split needs at least) (?:\S+ \S+ \((\d+) B\)|(\d+) B)",
            str(exc),
        )
        assert found is not None, str(exc)
        least = int(found.group(1) or found.group(2))
        assert least > memory
        # The budget the message names is enough for one request.
        _check(plan_with(least), m)
        return
    _check(plan, m)


def test_too_small_error_names_a_budget_that_holds_one_request() -> None:
    # Found by the property above: at 1 B the search saw a padded-page candidate needing
    # 480 B, but at 480 B it kept the exact pages (chunks of 192 B) and needed 576 B.  Since
    # the blocks chunk 0 lends its host count, two 192-byte chunks hold one request.
    m = model([state((5,)), state((36,))])

    def plan_with(budget: int) -> Plan:
        return make_plan(
            m,
            memory_bytes=budget,
            max_model_len=1,
            strategy=Strategy.ARENA,
            block_size=1,
            chunk_alignment=32,
        )

    for budget in (1, 383):
        with pytest.raises(PlanError, match=r"one request needs 384 B including"):
            plan_with(budget)
    assert plan_with(384).capacity.max_concurrent_requests == 1
