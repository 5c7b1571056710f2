"""Where every byte of every member page lives: the layout kinds.  No torch.

:class:`hybridkv.plan.MemoryLayout` fixes which *region* a block id owns (see
``plan/layout.py``): pool ``p``'s block ``b`` owns ``[b * B_p, (b + 1) * B_p)`` of buffer ``p``
(``B_p`` = ``PoolPlan.block_bytes``); arena group ``g``'s block ``b`` owns
``[b * B_g, (b + 1) * B_g)`` of buffer 0 (``B_g`` = ``GroupPlan.block_bytes``), inside chunk
``b // blocks_per_chunk(g)``.  This module decides how the member pages are arranged, per
:class:`LayoutKind`.  Notation: ``S`` = slots of the group (members + padded members), ``P`` =
``page_bytes``, ``N`` = block ids of the group, ``H`` = KV heads.

``CROSS_LAYER`` (default): ``(blocks, slots, page)``.  Block ``b``'s region holds member ``m``'s
page at ``b * B + m * P``; one block of a group is one contiguous byte range for transfer.

``CROSS_LAYER_HEAD_MAJOR``: ``(blocks, heads, slots, head page)`` for attention groups: head
``h`` of member ``m`` sits at ``b * B + (h * S + m) * Ph`` with ``Ph = P // H`` (rounded down to
the element size); a head page is ``K_h [block_size, head_dim]`` then ``V_h [block_size,
v_dim]`` (``page_order`` does not apply), so one tensor-parallel rank's heads of a block are
one contiguous range too.  MLA and state groups have no heads: they cannot share the head-major
arrangement and fall back to the ``CROSS_LAYER`` arrangement inside their own blocks.

Layers are grouped by page size before any of this: a group's members share one spec and one
``page_bytes``, so the per-block region of a group is the cross-layer region of every layer
with that page; under ``uniform`` all groups share one page size and one pool (vLLM's single
cross-layer tensor); groups whose pages differ get regions of their own (their own pool, or
their own chunks of the arena).

``PER_LAYER``: slot ``m`` owns a *slab*, its own ``[N, page]`` region, as if every layer had its
own tensor (vLLM's per-layer KV tensors; slot ``m`` of every group in a pool shares slab ``m``).
Pools: ``slots = max S`` over the pool's groups, slab ``m`` starts at ``m * N * q`` with block
stride ``q = B_p // slots`` (rounded down to the element size).  When every group of the pool
has the same page profile, each slab is further split into one sub-slab per segment
(``[2, N, block_size, H, D]``-style: slab ``m``'s K of block ``b`` at ``m*N*q + b*|K|``, its V at
``m*N*q + N*off_V + b*|V|``) so that K (and V) of consecutive blocks are adjacent, which is what
flat kernel-block views need.  Arena: every group must have the same slot count ``S``; slab
``m`` is ``[m * T / S, (m + 1) * T / S)`` (``T`` = arena bytes) and member ``m`` of block ``b``
sits at ``m * T / S + b * P``, so chunk ``c`` owns the ``S`` pieces
``[m*T/S + c*C/S, m*T/S + (c+1)*C/S)``.

Inside a page (all kinds but head-major): segments in page order (see
:mod:`hybridkv.storage.segments`), each starting at a multiple of :data:`SEGMENT_ALIGN` when the
whole page still fits ``page_bytes`` with that alignment, else packed back to back.  Attention
segments are ``[block_size, H, D]`` for :attr:`PageOrder.NHD` pages and ``[H, block_size, D]``
for :attr:`PageOrder.HND` pages.

Worked example (cross-layer, NHD): one full-attention group, 2 members, block_size 2, 1 head,
head_dim 4, fp16: ``|K| = |V| = 2*1*4*2 = 16`` B, ``P = 32``, ``B = 64``.  Member 1's V of
block 3 starts at ``3*64 + 1*32 + 16 = 240``; its element ``[t=1, h=0, d=2]`` is at
``240 + 1*8 + 0*8 + 2*2 = 252``: strides ``(block 64, token 8, head 8, dim 2)`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise, product
from typing import NamedTuple, TypeVar

from hybridkv.errors import InvariantError
from hybridkv.plan import GroupPlan, MemoryLayout, Strategy
from hybridkv.storage.errors import LayoutUnsupportedError, UnknownLayerError, ViewKindError
from hybridkv.storage.segments import HEADED_KINDS, Segment, max_itemsize, page_segments

__all__ = [
    "SEGMENT_ALIGN",
    "GroupPlacement",
    "LayoutKind",
    "MemberPlacement",
    "PageOrder",
    "Piece",
    "SegmentPlacement",
    "StoragePlacement",
    "place",
]

_E = TypeVar("_E", bound=StrEnum)

#: Preferred byte alignment of a segment inside a page (used only when the page has room).
SEGMENT_ALIGN = 64


class LayoutKind(StrEnum):
    """How member pages are arranged in the backing buffers (see the module docstring)."""

    CROSS_LAYER = "cross_layer"
    CROSS_LAYER_HEAD_MAJOR = "cross_layer_head_major"
    PER_LAYER = "per_layer"


class PageOrder(StrEnum):
    """Axis order of attention segments inside a page: tokens-major or heads-major."""

    NHD = "nhd"
    HND = "hnd"


@dataclass(frozen=True, kw_only=True)
class SegmentPlacement:
    """Where one segment of one member lives: an affine map from ``(block, *index)`` to bytes.

    Element ``index`` of block ``b`` starts at byte
    ``offset + b * block_stride + sum(i * s for i, s in zip(index, strides))`` of buffer
    ``buffer_id``.  ``strides`` are in bytes, one per axis of ``segment.shape``.
    """

    segment: Segment
    buffer_id: int
    offset: int
    block_stride: int
    strides: tuple[int, ...]

    def byte_offset(self, block: int, index: tuple[int, ...]) -> int:
        """Byte offset of element ``index`` of block ``block`` (no range checks)."""
        return (
            self.offset
            + block * self.block_stride
            + sum(i * s for i, s in zip(index, self.strides, strict=True))
        )

    @property
    def aligned(self) -> bool:
        """True when every offset and stride is a multiple of the element size (viewable)."""
        size = self.segment.dtype.itemsize
        return all(v % size == 0 for v in (self.offset, self.block_stride, *self.strides))

    def extents(self) -> list[tuple[int, int]]:
        """Contiguous ``(offset, length)`` byte runs of block 0, sorted by offset."""
        run = self.segment.dtype.itemsize
        outer: list[tuple[int, int]] = []
        for stride, size in sorted(
            (st, sz) for st, sz in zip(self.strides, self.segment.shape, strict=True) if sz > 1
        ):
            if stride == run and not outer:
                run *= size
            else:
                outer.append((stride, size))
        starts = [
            self.offset + sum(i * st for i, (st, _) in zip(idx, outer, strict=True))
            for idx in product(*(range(sz) for _, sz in outer))
        ]
        return sorted((s, run) for s in starts)


@dataclass(frozen=True, kw_only=True)
class MemberPlacement:
    """The segments of member ``(layer, slot)`` of a group, in page order."""

    layer: int
    slot: int
    segments: tuple[SegmentPlacement, ...]

    def segment(self, name: str) -> SegmentPlacement:
        """The segment called ``name``; raises :class:`ViewKindError` naming the valid ones."""
        for seg in self.segments:
            if seg.segment.name == name:
                return seg
        valid = ", ".join(s.segment.name for s in self.segments)
        raise ViewKindError(
            f"segment: layer {self.layer} slot {self.slot} has no segment {name!r}; valid: {valid}"
        )


class Piece(NamedTuple):
    """A run of data bytes repeated per block: block ``b``'s copy is at ``offset + b*stride``."""

    offset: int
    length: int
    block_stride: int


@dataclass(frozen=True, kw_only=True)
class GroupPlacement:
    """Placement of one group: its members' segments and its data *pieces*.

    ``pieces`` cover exactly the data bytes of one block (padding excluded), merged where
    adjacent, sorted by offset; transfer descriptors are built from them.
    """

    group_id: int
    buffer_id: int
    num_blocks: int
    members: tuple[MemberPlacement, ...]
    pieces: tuple[Piece, ...]

    @property
    def data_bytes_per_block(self) -> int:
        return sum(p.length for p in self.pieces)

    def block_extents(self, block: int) -> list[tuple[int, int]]:
        """``(offset, length)`` byte runs holding block ``block``'s data (no range check)."""
        return [(p.offset + block * p.block_stride, p.length) for p in self.pieces]


@dataclass(frozen=True, kw_only=True)
class StoragePlacement:
    """Placement of a whole layout: buffer sizes and one :class:`GroupPlacement` per group."""

    layout: MemoryLayout
    kind: LayoutKind
    page_order: PageOrder
    buffer_bytes: tuple[int, ...]
    groups: tuple[GroupPlacement, ...]

    def member(self, layer: int, slot: int = 0) -> tuple[GroupPlacement, MemberPlacement]:
        """The group and member placement of ``(layer, slot)``.

        Raises :class:`UnknownLayerError` naming the layer and the ``(layer, slot)`` pairs the
        plan stores.
        """
        for group in self.groups:
            for member in group.members:
                if member.layer == layer and member.slot == slot:
                    return group, member
        valid = sorted((m.layer, m.slot) for g in self.groups for m in g.members)
        raise UnknownLayerError(
            f"layer: ({layer}, slot {slot}) is not stored by this plan; valid (layer, slot) "
            f"pairs: {valid}"
        )

    def chunk_extents(self, chunk: int) -> list[tuple[int, int]]:
        """Arena only: the ``(offset, length)`` byte ranges chunk ``chunk`` owns in buffer 0."""
        arena = self.layout.arena
        if arena is None:
            raise LayoutUnsupportedError("chunk_extents: only the arena strategy has chunks")
        size = arena.chunk_bytes
        length = arena.tail_bytes if chunk == arena.num_chunks else size  # the tail: shorter
        if self.kind is not LayoutKind.PER_LAYER:
            return [(chunk * size, length)]
        slots = _arena_slots(self.layout)
        slab = arena.total_bytes // slots
        return [(m * slab + chunk * size // slots, length // slots) for m in range(slots)]

    def check_invariants(self) -> None:
        """Pieces fit their buffer, do not overlap inside a block, nor between two blocks."""
        for g in self.groups:
            size = self.buffer_bytes[g.buffer_id]
            spans = sorted(g.block_extents(0))
            for (a, la), (b, _) in pairwise(spans):
                if a + la > b:
                    raise InvariantError(f"group {g.group_id}: pieces overlap at byte {b}")
            for p in g.pieces:
                if p.length > p.block_stride and g.num_blocks > 1:
                    raise InvariantError(f"group {g.group_id}: piece {p} overlaps the next block")
                if p.offset < 0 or p.offset + (g.num_blocks - 1) * p.block_stride + p.length > size:
                    raise InvariantError(f"group {g.group_id}: piece {p} leaves buffer {size} B")


# --------------------------------------------------------------------------- page layout


def _contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out: list[int] = []
    acc = itemsize
    for dim in reversed(shape):
        out.append(acc)
        acc *= dim
    return tuple(reversed(out))


def _segment_strides(group: GroupPlan, seg: Segment, order: PageOrder) -> tuple[int, ...]:
    size = seg.dtype.itemsize
    if group.spec.kind in HEADED_KINDS and order is PageOrder.HND:
        tokens, _, dim = seg.shape
        return (dim * size, tokens * dim * size, size)
    return _contiguous_strides(seg.shape, size)


def _page_offsets(segments: tuple[Segment, ...], page_bytes: int) -> list[int]:
    """Offsets of ``segments`` inside a page: :data:`SEGMENT_ALIGN`-aligned if that fits."""
    for align in (SEGMENT_ALIGN, 1):
        offsets: list[int] = []
        end = 0
        for seg in segments:
            start = -(-end // align) * align
            offsets.append(start)
            end = start + seg.nbytes
        if end <= page_bytes:
            return offsets
    raise InvariantError(f"segments need more than page_bytes {page_bytes}")  # plan validated


def _page_profile(group: GroupPlan) -> tuple[tuple[int, int], ...]:
    segs = page_segments(group.spec, group.block_size)
    return tuple(zip(_page_offsets(segs, group.page_bytes), (s.nbytes for s in segs), strict=True))


# --------------------------------------------------------------------------- regions


class _Region(NamedTuple):
    """Where a group's blocks live: ``block_stride`` between block regions of one buffer."""

    buffer_id: int
    num_blocks: int
    block_stride: int
    buffer_bytes: int


def _region(layout: MemoryLayout, group: GroupPlan) -> _Region:
    if layout.arena is not None:  # one stride over the whole region (see plan.layout)
        num_ids = layout.num_block_ids(group.group_id)
        return _Region(0, num_ids, group.block_bytes, layout.total_bytes)
    pool = layout.pool_of(group.group_id)
    return _Region(pool.pool_id, pool.num_blocks, pool.block_bytes, pool.total_bytes)


def _slots(group: GroupPlan) -> int:
    return group.num_members + group.padded_members


def _arena_slots(layout: MemoryLayout) -> int:
    counts = {g.group_id: _slots(g) for g in layout.groups}
    if len(set(counts.values())) != 1:
        raise LayoutUnsupportedError(
            f"kind: per_layer on the arena strategy needs every group to have the same number "
            f"of slots (members + padded_members), got {counts}; use cross_layer or "
            "cross_layer_head_major, or pad the groups"
        )
    slots = next(iter(counts.values()))
    chunk = layout.arena.chunk_bytes if layout.arena is not None else 0
    tail = layout.arena.tail_bytes if layout.arena is not None else 0
    if chunk % slots or tail % slots:
        raise LayoutUnsupportedError(
            f"kind: per_layer on the arena strategy needs chunk_bytes ({chunk}) and tail_bytes "
            f"({tail}) to split into {slots} equal slab pieces; use cross_layer or "
            "cross_layer_head_major"
        )
    return slots


# --------------------------------------------------------------------------- arrangers

_Arranger = Callable[[MemoryLayout, GroupPlan, PageOrder], list[list[SegmentPlacement]]]


def _cross_layer(
    layout: MemoryLayout, group: GroupPlan, order: PageOrder
) -> list[list[SegmentPlacement]]:
    reg = _region(layout, group)
    segs = page_segments(group.spec, group.block_size)
    offsets = _page_offsets(segs, group.page_bytes)
    return [
        [
            SegmentPlacement(
                segment=seg,
                buffer_id=reg.buffer_id,
                offset=m * group.page_bytes + off,
                block_stride=reg.block_stride,
                strides=_segment_strides(group, seg, order),
            )
            for seg, off in zip(segs, offsets, strict=True)
        ]
        for m in range(group.num_members)
    ]


def _head_major(
    layout: MemoryLayout, group: GroupPlan, order: PageOrder
) -> list[list[SegmentPlacement]]:
    if group.spec.kind not in HEADED_KINDS:
        return _cross_layer(layout, group, order)
    reg = _region(layout, group)
    k_seg, v_seg = page_segments(group.spec, group.block_size)
    tokens, heads, k_dim = k_seg.shape
    size = k_seg.dtype.itemsize
    head_page = group.page_bytes // heads // size * size
    head_stride = _slots(group) * head_page
    out: list[list[SegmentPlacement]] = []
    for m in range(group.num_members):
        k = SegmentPlacement(
            segment=k_seg,
            buffer_id=reg.buffer_id,
            offset=m * head_page,
            block_stride=reg.block_stride,
            strides=(k_dim * size, head_stride, size),
        )
        v = SegmentPlacement(
            segment=v_seg,
            buffer_id=reg.buffer_id,
            offset=m * head_page + tokens * k_dim * size,
            block_stride=reg.block_stride,
            strides=(v_seg.shape[2] * size, head_stride, size),
        )
        out.append([k, v])
    return out


def _per_layer(
    layout: MemoryLayout, group: GroupPlan, order: PageOrder
) -> list[list[SegmentPlacement]]:
    reg = _region(layout, group)
    segs = page_segments(group.spec, group.block_size)
    offsets = _page_offsets(segs, group.page_bytes)
    strides = [_segment_strides(group, s, order) for s in segs]
    if layout.arena is not None:
        slab = layout.total_bytes // _arena_slots(layout)
        return [
            [
                SegmentPlacement(
                    segment=seg,
                    buffer_id=0,
                    offset=m * slab + off,
                    block_stride=group.page_bytes,
                    strides=st,
                )
                for seg, off, st in zip(segs, offsets, strides, strict=True)
            ]
            for m in range(group.num_members)
        ]
    pool = layout.pool_of(group.group_id)
    mates = [layout.groups[g] for g in pool.group_ids]
    slots = max(_slots(g) for g in mates)
    align = max(max_itemsize(page_segments(g.spec, g.block_size)) for g in mates)
    q = reg.block_stride // slots // align * align
    if q < group.page_bytes:
        raise LayoutUnsupportedError(
            f"kind: per_layer cannot fit group {group.group_id}'s {group.page_bytes} B pages in "
            f"pool {pool.pool_id}: {slots} slabs leave {q} B per block; use cross_layer"
        )
    split = len({_page_profile(g) for g in mates}) == 1
    slab = reg.num_blocks * q
    return [
        [
            SegmentPlacement(
                segment=seg,
                buffer_id=reg.buffer_id,
                offset=m * slab + (reg.num_blocks * off if split else off),
                block_stride=seg.nbytes if split else q,
                strides=st,
            )
            for seg, off, st in zip(segs, offsets, strides, strict=True)
        ]
        for m in range(group.num_members)
    ]


_ARRANGERS: dict[LayoutKind, _Arranger] = {
    LayoutKind.CROSS_LAYER: _cross_layer,
    LayoutKind.CROSS_LAYER_HEAD_MAJOR: _head_major,
    LayoutKind.PER_LAYER: _per_layer,
}


def _pieces(segments: list[SegmentPlacement]) -> tuple[Piece, ...]:
    """Merge every segment's block-0 extents into pieces (adjacent runs of one stride join)."""
    raw = sorted(
        (off, seg.block_stride, length) for seg in segments for off, length in seg.extents()
    )
    merged: list[Piece] = []
    for off, stride, length in sorted(raw, key=lambda r: (r[1], r[0])):
        last = merged[-1] if merged else None
        if last is not None and last.block_stride == stride and last.offset + last.length == off:
            merged[-1] = Piece(last.offset, last.length + length, stride)
        else:
            merged.append(Piece(off, length, stride))
    return tuple(sorted(merged))


def place(
    layout: MemoryLayout,
    kind: LayoutKind | str = LayoutKind.CROSS_LAYER,
    page_order: PageOrder | str = PageOrder.NHD,
) -> StoragePlacement:
    """Place every member page of ``layout`` with layout ``kind``.  Pure; does not allocate.

    Raises :class:`LayoutUnsupportedError` when ``kind`` cannot place ``layout`` (named in the
    message), or :class:`hybridkv.errors.StorageError` for an unknown kind or page order.
    """
    kind = _parse(LayoutKind, kind, "kind")
    page_order = _parse(PageOrder, page_order, "page_order")
    arrange = _ARRANGERS[kind]
    groups: list[GroupPlacement] = []
    for group in layout.groups:
        reg = _region(layout, group)
        members = arrange(layout, group, page_order)
        groups.append(
            GroupPlacement(
                group_id=group.group_id,
                buffer_id=reg.buffer_id,
                num_blocks=reg.num_blocks,
                members=tuple(
                    MemberPlacement(layer=layer, slot=slot, segments=tuple(segs))
                    for (layer, slot), segs in zip(group.members, members, strict=True)
                ),
                pieces=_pieces([s for segs in members for s in segs]),
            )
        )
    if layout.strategy is Strategy.ARENA:
        buffer_bytes: tuple[int, ...] = (layout.total_bytes,)
    else:
        buffer_bytes = tuple(p.total_bytes for p in layout.pools)
    return StoragePlacement(
        layout=layout,
        kind=kind,
        page_order=page_order,
        buffer_bytes=buffer_bytes,
        groups=tuple(groups),
    )


def _parse(enum: type[_E], value: _E | str, field: str) -> _E:
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(e.value for e in enum)
        raise LayoutUnsupportedError(f"{field}: unknown value {value!r}; valid: {valid}") from None
