"""Placement: pieces, chunk extents, and no aliasing between groups (hypothesis)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import PlanError
from hybridkv.plan import ArenaPlan, MemoryLayout, Strategy
from hybridkv.storage import KVCacheStorage, LayoutKind, Piece, place
from test_storage_factories import (
    KINDS,
    SPECS,
    arena_layout,
    equal_slots,
    group,
    pools_layout,
    uniform_layout,
)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _groups() -> tuple:
    return (
        group(0, SPECS["full"], (0, 1)),
        group(1, SPECS["state"], (2,)),
        group(2, SPECS["mla"], (3, 4)),
        group(3, SPECS["kv_dims"], (5,)),
    )


def _arena() -> MemoryLayout:
    return arena_layout(equal_slots(_groups()), num_chunks=6, per=1)


def _bounded_arena() -> MemoryLayout:
    """Chunks no group's block divides: some block ids straddle two chunks."""
    gs = equal_slots(_groups())
    chunk = 2 * max(g.block_bytes for g in gs) + 64
    assert all(chunk % g.block_bytes for g in gs)
    return MemoryLayout(
        strategy=Strategy.ARENA, groups=gs, arena=ArenaPlan(chunk_bytes=chunk, num_chunks=6)
    )


def test_bounded_chunks_lend_only_the_blocks_inside_them() -> None:
    layout = _bounded_arena()
    size = layout.arena.chunk_bytes
    for kind in KINDS:
        placement = place(layout, kind)
        for gp, g in zip(placement.groups, layout.groups, strict=True):
            assert gp.num_blocks == layout.num_block_ids(g.group_id) == 6 * size // g.block_bytes
            lent = [b for c in range(6) for b in layout.chunk_blocks(g.group_id, c)]
            assert len(lent) == len(set(lent)) == 6 * layout.blocks_per_chunk(g.group_id)
            for c in range(6):
                for b in layout.chunk_blocks(g.group_id, c):
                    assert layout.chunk_of_block(g.group_id, b) == c
                    for off, length in gp.block_extents(b):
                        assert any(
                            s <= off and off + length <= s + n
                            for s, n in placement.chunk_extents(c)
                        ), (kind, g.group_id, c, b)


def test_bounded_chunk_ids_by_hand() -> None:
    # the layout docstring's example: 64 KiB and 96 KiB blocks in 320 KiB chunks
    gs = (
        group(0, SPECS["full"], (0,), page_bytes=64 << 10),
        group(1, SPECS["full"], (1,), page_bytes=96 << 10),
    )
    layout = MemoryLayout(
        strategy=Strategy.ARENA, groups=gs, arena=ArenaPlan(chunk_bytes=320 << 10, num_chunks=4)
    )
    assert [layout.blocks_per_chunk(g) for g in (0, 1)] == [5, 2]
    assert [list(layout.chunk_blocks(1, c)) for c in range(4)] == [[0, 1], [4, 5], [7, 8], [10, 11]]
    assert [layout.chunk_of_block(1, b) for b in (2, 3, 6, 9)] == [0, 0, 1, 2]  # never lent
    assert list(layout.chunk_blocks(0, 3)) == [15, 16, 17, 18, 19]
    with pytest.raises(PlanError, match=r"holds no whole block of group 1 in every chunk"):
        MemoryLayout(
            strategy=Strategy.ARENA, groups=gs, arena=ArenaPlan(chunk_bytes=160 << 10, num_chunks=4)
        )


def test_arena_block_addressing_follows_layout_contract() -> None:
    layout = _arena()
    placement = place(layout, LayoutKind.CROSS_LAYER)
    for gp, g in zip(placement.groups, layout.groups, strict=True):
        per = layout.blocks_per_chunk(g.group_id)
        assert gp.num_blocks == 6 * per
        for b in (1, per, 6 * per - 1):
            start = b * g.block_bytes
            for off, length in gp.block_extents(b):
                assert start <= off and off + length <= start + g.block_bytes
                assert off // layout.arena.chunk_bytes == b // per


def test_per_layer_arena_chunk_extents() -> None:
    layout = _arena()
    placement = place(layout, LayoutKind.PER_LAYER)
    slab = layout.total_bytes // 2
    c = layout.arena.chunk_bytes
    assert placement.chunk_extents(3) == [(3 * c // 2, c // 2), (slab + 3 * c // 2, c // 2)]
    assert place(layout).chunk_extents(3) == [(3 * c, c)]
    for gp in placement.groups:
        per = layout.blocks_per_chunk(gp.group_id)
        for b in range(per, 2 * per):  # chunk 1
            for off, length in gp.block_extents(b):
                assert any(
                    s <= off and off + length <= s + n for s, n in placement.chunk_extents(1)
                )


def test_pieces_exclude_padding() -> None:
    g = group(0, SPECS["full"], (0, 1), page_bytes=320, padded=1)  # 256 B data per page
    layout = pools_layout((g,), num_blocks=4)
    cross = place(layout).groups[0].pieces
    assert cross == (Piece(0, 256, 960), Piece(320, 256, 960))
    head = place(layout, LayoutKind.CROSS_LAYER_HEAD_MAJOR).groups[0].pieces
    # head page = 320 // 2 = 160 B, 128 B of data; 3 slots per head
    assert head == (
        Piece(0, 128, 960),
        Piece(160, 128, 960),
        Piece(480, 128, 960),
        Piece(640, 128, 960),
    )
    per_layer = place(layout, LayoutKind.PER_LAYER).groups[0].pieces
    # 3 slabs of 4 blocks x 320 B; single group -> K and V sub-slabs (128 B each)
    assert per_layer == (
        Piece(0, 128, 128),
        Piece(4 * 128, 128, 128),
        Piece(4 * 320, 128, 128),
        Piece(4 * 320 + 4 * 128, 128, 128),
    )


def test_uniform_per_layer_shares_slabs_across_groups() -> None:
    layout = uniform_layout((group(0, SPECS["full"], (0, 1)), group(1, SPECS["swa"], (2, 3))))
    placement = place(layout, LayoutKind.PER_LAYER)
    # same page profile (256 B pages, K then V): split slabs shared by slot index
    assert placement.groups[0].pieces == placement.groups[1].pieces
    mixed = uniform_layout((group(0, SPECS["full"], (0, 1)), group(1, SPECS["state"], (2,))))
    q = mixed.pools[0].block_bytes // 2
    assert place(mixed, LayoutKind.PER_LAYER).groups[1].pieces == (Piece(0, 176, q),)


# ----------------------------------------------------------------------- no aliasing


@st.composite
def _ownership(draw: st.DrawFn) -> tuple[str, LayoutKind, dict[int, list[int]]]:
    strategy = draw(st.sampled_from(["arena", "arena_bounded", "uniform"]))
    kind = draw(st.sampled_from(KINDS))
    live: dict[int, list[int]] = {g: [] for g in range(4)}
    if strategy != "uniform":
        layout = _layout(strategy)
        for chunk in range(1, 6):
            owner = draw(st.sampled_from([None, 0, 1, 2, 3]))
            if owner is None:
                continue
            ids = layout.chunk_blocks(owner, chunk)
            live[owner] += draw(st.lists(st.sampled_from(ids), unique=True, max_size=3))
    else:
        for b in range(1, 10):
            owner = draw(st.sampled_from([None, 0, 1, 2, 3]))
            if owner is not None:
                live[owner].append(b)
    return strategy, kind, live


def _layout(strategy: str) -> MemoryLayout:
    if strategy == "arena_bounded":
        return _bounded_arena()
    return _arena() if strategy == "arena" else uniform_layout(_groups(), num_blocks=10)


@given(_ownership())
def test_groups_never_alias_live_blocks(case: tuple[str, LayoutKind, dict[int, list[int]]]) -> None:
    strategy, kind, live = case
    storage = KVCacheStorage(_layout(strategy), kind=kind)
    placement = storage.placement
    spans = sorted(
        (off, off + n, gid, b)
        for gid, blocks in live.items()
        for b in blocks
        for off, n in placement.groups[gid].block_extents(b)
    )
    for (_, end, g1, b1), (start, _, g2, b2) in pairwise(spans):
        assert end <= start, f"group {g1} block {b1} overlaps group {g2} block {b2}"
    # write every live block with its group's byte, then read every one back intact
    for gid, blocks in live.items():
        for member in placement.groups[gid].members:
            for seg in member.segments:
                view = storage.segment_view(member.layer, member.slot, name=seg.segment.name)
                size = view.element_size()
                fill = int.from_bytes(bytes([gid + 1]) * size, "little")
                for b in blocks:
                    view[b].view(_BITS[size]).fill_(fill)
    for gid, blocks in live.items():
        for member in placement.groups[gid].members:
            for seg in member.segments:
                view = storage.segment_view(member.layer, member.slot, name=seg.segment.name)
                for b in blocks:
                    raw = view[b].contiguous().view(torch.uint8)
                    assert bool((raw == gid + 1).all())


@pytest.mark.parametrize("kind", KINDS)
def test_placement_invariants_hold(kind: LayoutKind) -> None:
    layouts = (
        _arena(),
        _bounded_arena(),
        uniform_layout(_groups()),
        pools_layout(_groups(), extra=8),
    )
    for layout in layouts:
        place(layout, kind).check_invariants()
