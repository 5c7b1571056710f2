"""Context-parallel slot mapping, and moving a cp-sharded cache into an unsharded one by
exact bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import StorageError
from hybridkv.storage import LayoutKind
from hybridkv.storage.connector import register
from hybridkv.storage.cp import CPSlotMapper
from hybridkv.storage.transfer_plan import plan_transfer
from test_storage_factories import owned_ids
from test_storage_transfer_plan import filled, groups, make, raw, specs


def test_the_docstring_example() -> None:
    m = CPSlotMapper(10, 2, mode="round_robin", interleave=2)
    assert m.global_tokens(0).tolist() == [0, 1, 4, 5, 8, 9]
    assert m.global_tokens(1).tolist() == [2, 3, 6, 7]
    assert m.slot_mapping(1, [7, 3], 4).tolist() == [28, 29, 30, 31]
    ranks, local = m.locate([0, 3, 9])
    assert (ranks.tolist(), local.tolist()) == ([0, 1, 0], [0, 1, 5])
    c = CPSlotMapper(10, 3, mode="contiguous")
    assert [c.global_tokens(r).tolist() for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert c.slot_mapping(2, [5], 4).tolist() == [20, 21]


@given(
    n=st.integers(0, 200),
    cp=st.integers(1, 8),
    mode=st.sampled_from(["contiguous", "round_robin"]),
    k=st.integers(1, 16),
)
def test_every_token_lives_on_exactly_one_rank_in_order(n: int, cp: int, mode: str, k: int) -> None:
    m = CPSlotMapper(n, cp, mode=mode, interleave=k)
    held = np.concatenate([m.global_tokens(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(n))
    for r in range(cp):
        g = m.global_tokens(r)
        assert (np.diff(g) > 0).all()  # local order is global order
        ranks, local = m.locate(g)
        assert (ranks == r).all() and local.tolist() == list(range(g.size))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(StorageError, match="mode: unknown sharding 'zigzag'"):
        CPSlotMapper(4, 2, mode="zigzag")
    with pytest.raises(StorageError, match="cp_size / interleave"):
        CPSlotMapper(4, 0)
    m = CPSlotMapper(9, 2)
    with pytest.raises(StorageError, match="rank: 2 is not a rank"):
        m.global_tokens(2)
    with pytest.raises(StorageError, match="the table has 1"):
        m.slot_mapping(0, [3], 4)  # 5 tokens need 2 blocks
    with pytest.raises(StorageError, match=r"positions must lie in \[0, 9\)"):
        m.locate([9])


@pytest.mark.parametrize("mode", ["contiguous", "round_robin"])
def test_a_cp_sharded_cache_moves_into_an_unsharded_one_exactly(mode: str) -> None:
    n, cp = 30, 3
    mapper = CPSlotMapper(n, cp, mode=mode, interleave=4)
    sp = specs(1, state=False)
    whole_layout = make("pools", groups(sp, 4))
    truth = filled(whole_layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    whole_table = {g.group_id: list(range(1, 9)) for g in whole_layout.groups}
    rank_layout = make("arena", groups(sp, 8))
    rank_tables = {
        g.group_id: owned_ids(rank_layout, g.group_id, 0)[:2] for g in rank_layout.groups
    }
    t_reg = register(truth.placement)
    # Each rank's cache holds its local tokens (filled from the truth through the map).
    ranks = []
    for r in range(cp):
        store = filled(rank_layout, LayoutKind.PER_LAYER, "hnd", 10 + r)
        reg = register(store.placement)
        plan_transfer(
            t_reg, whole_table, reg, rank_tables, tokens=mapper.token_map(r, to_global=False)
        ).copy(truth.buffers, store.buffers)
        # the slot mapping says where: local token i of rank r is global token g
        view = store.segment_view(0, name="k").flatten(0, 1)  # [slots, H, D]
        whole = truth.segment_view(0, name="k")
        slots = mapper.slot_mapping(r, rank_tables[0], 8)
        for i, g in enumerate(mapper.global_tokens(r).tolist()):
            assert torch.equal(raw(view[slots[i]]), raw(whole[whole_table[0][g // 4], g % 4]))
        ranks.append((store, reg))
    # ... and back: every rank into one fresh unsharded cache rebuilds the request exactly.
    out = filled(whole_layout, LayoutKind.CROSS_LAYER, "nhd", 99)
    o_reg = register(out.placement)
    for r, (store, reg) in enumerate(ranks):
        plan_transfer(reg, rank_tables, o_reg, whole_table, tokens=mapper.token_map(r)).copy(
            store.buffers, out.buffers
        )
    for gp in whole_layout.groups:
        for layer, slot in gp.members:
            for seg in out.placement.member(layer, slot)[1].segments:
                a = truth.segment_view(layer, slot, name=seg.segment.name)
                b = out.segment_view(layer, slot, name=seg.segment.name)
                for t in range(n):
                    blk = whole_table[gp.group_id][t // 4]
                    assert torch.equal(raw(a[blk, t % 4]), raw(b[blk, t % 4]))
