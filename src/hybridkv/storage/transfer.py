"""Transfer descriptors: the byte ranges holding a group's blocks, and copies driven by them.

A :class:`TransferDescriptor` lists ``(buffer_id, offset, length)`` ranges of flat ``uint8``
buffers.  The data of blocks ``block_ids`` is the concatenation of its ranges, the *stream*:
for each piece of the group's placement (see :class:`~hybridkv.storage.placement.Piece`), for
each block in ``block_ids`` order, that block's copy of the piece.  Consecutive stream entries
that touch in memory are coalesced into one range, so adjacent block ids of a cross-layer
layout become one range.  Padding (padded members, page tails, alignment gaps) is never part
of a piece and is never transferred.  State tensors split by alignment gaps are separate
pieces, hence separate ranges per slot.

Two descriptors *match* when they have the same ``piece_lengths``, the same number of blocks
and the same ``stream`` (what the bytes of a piece are: the storage's layout kind, page order
and the group's members and their segments' names, element types and per-block shapes, which
:meth:`KVCacheStorage.descriptor` records; fp16 is not bf16, and ``[8 tokens, 2 heads, 16]``
is not ``[16, 1, 16]`` though both are 512 bytes): their
streams then have the same length and meaning, and :func:`copy_blocks` can move one into the
other even if their ranges are cut differently (other block ids, other storage).  Between
storages of another layout kind or page order the bytes mean other things: move those with
:func:`hybridkv.storage.transfer_plan.plan_transfer`.
:func:`gather` packs a stream into one contiguous buffer (e.g. pinned host memory) and
:func:`scatter` unpacks it; both use nothing but the descriptor and flat buffers, so the
buffers may be another process's shared memory.

Example: a cross-layer group with 1 piece ``(offset 0, length 96, stride 128)`` (32 padding
bytes per block) and blocks ``[3, 4, 9]`` -> ranges ``(0, 384, 96), (0, 512, 96),
(0, 1152, 96)``: 4 does not touch 3 because of the padding.  Without padding
(``length 128``), ``[3, 4, 9]`` -> ``(0, 384, 256), (0, 1152, 128)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from hybridkv.plan import NULL_BLOCK_ID
from hybridkv.storage.errors import BlockRangeError, FreedBlockError, TransferError
from hybridkv.storage.placement import GroupPlacement

__all__ = [
    "BlockLiveness",
    "ByteRange",
    "TransferDescriptor",
    "build_descriptor",
    "check_no_overlap",
    "copy_blocks",
    "gather",
    "scatter",
    "spread",
]


@runtime_checkable
class BlockLiveness(Protocol):
    """Anything that knows whether a group's block is allocated (the cache manager's pools)."""

    def is_allocated(self, group_id: int, block_id: int) -> bool: ...


class ByteRange(NamedTuple):
    """``length`` bytes at ``offset`` of buffer ``buffer_id``."""

    buffer_id: int
    offset: int
    length: int


@dataclass(frozen=True, kw_only=True)
class TransferDescriptor:
    """The coalesced byte ranges of ``block_ids`` of group ``group_id`` (see module docs)."""

    group_id: int
    block_ids: tuple[int, ...]
    piece_lengths: tuple[int, ...]
    ranges: tuple[ByteRange, ...]
    #: What the stream's bytes are (layout kind, page order, members and segments; empty:
    #: not recorded, which matches only another descriptor that records none).
    stream: tuple[Any, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(r.length for r in self.ranges)

    def matches(self, other: TransferDescriptor) -> bool:
        """True when ``other``'s stream has the same length and meaning as this one."""
        return (
            self.piece_lengths == other.piece_lengths
            and len(self.block_ids) == len(other.block_ids)
            and self.stream == other.stream
        )


def build_descriptor(
    group: GroupPlacement,
    block_ids: Sequence[int],
    *,
    liveness: BlockLiveness | None = None,
    stream: tuple[Any, ...] = (),
) -> TransferDescriptor:
    """Descriptor of ``block_ids`` (in that order) of ``group`` (``stream``: what its bytes
    are, see :attr:`TransferDescriptor.stream`).  Pure.

    Raises :class:`BlockRangeError` for an id outside ``[1, num_blocks)`` (the null block 0
    holds no data), a repeated id, or a non-integer; :class:`FreedBlockError` when
    ``liveness`` says a block is not allocated to the group.
    """
    ids = tuple(block_ids)
    bad = [
        b
        for b in ids
        if isinstance(b, bool)
        or not isinstance(b, int | np.integer)
        or not NULL_BLOCK_ID < b < group.num_blocks
    ]
    if bad:
        raise BlockRangeError(
            f"block_ids: {bad[:8]} invalid for group {group.group_id}; valid ids are "
            f"[1, {group.num_blocks}) (block {NULL_BLOCK_ID} is the null block)"
        )
    ids = tuple(int(b) for b in ids)
    if len(set(ids)) != len(ids):
        dup = sorted({b for b in ids if ids.count(b) > 1})
        raise BlockRangeError(f"block_ids: group {group.group_id} ids repeat: {dup[:8]}")
    if liveness is not None:
        freed = [b for b in ids if not liveness.is_allocated(group.group_id, b)]
        if freed:
            raise FreedBlockError(
                f"block_ids: {freed[:8]} are not allocated to group {group.group_id}; "
                "descriptors are only made for live blocks"
            )
    blocks = np.asarray(ids, dtype=np.int64)
    starts = np.concatenate(
        [p.offset + blocks * p.block_stride for p in group.pieces] or [np.zeros(0, np.int64)]
    )
    lengths = np.repeat(np.asarray([p.length for p in group.pieces], dtype=np.int64), len(ids))
    ranges: tuple[ByteRange, ...] = ()
    if len(starts):
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
        heads = np.concatenate([[0], breaks])
        totals = np.add.reduceat(lengths, heads)
        buf = group.buffer_id
        ranges = tuple(
            ByteRange(buf, int(starts[h]), int(t))
            for h, t in zip(heads.tolist(), totals.tolist(), strict=True)
        )
    return TransferDescriptor(
        group_id=group.group_id,
        block_ids=ids,
        piece_lengths=tuple(p.length for p in group.pieces),
        ranges=ranges,
        stream=stream,
    )


def _flat(buffers: Sequence[torch.Tensor], desc: TransferDescriptor) -> list[torch.Tensor]:
    flats = []
    for i, buf in enumerate(buffers):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise TransferError(
                f"buffers[{i}]: need a flat contiguous uint8 tensor, got dtype {buf.dtype}, "
                f"shape {tuple(buf.shape)}"
            )
        flats.append(buf)
    for r in desc.ranges:
        if not 0 <= r.buffer_id < len(flats):
            raise TransferError(
                f"descriptor: range {r} names buffer {r.buffer_id}; {len(flats)} buffers given"
            )
        if r.offset < 0 or r.offset + r.length > flats[r.buffer_id].numel():
            raise TransferError(
                f"descriptor: range {r} leaves buffer {r.buffer_id} of "
                f"{flats[r.buffer_id].numel()} bytes"
            )
    return flats


#: On CUDA, a descriptor of at least this many ranges is moved as rows: two indexed copy
#: kernels per buffer, whatever the number of ranges (per-layer layouts give one range per
#: layer and block), instead of a view per range.
ROW_COPY_MIN_RANGES = 64
#: The smallest row (the gcd of every range's offset and length) worth indexing.
ROW_COPY_MIN_BYTES = 256
#: Ranges longer than this on average are packed by one concatenation instead (one pass over
#: device memory rather than two).  H100, ``benchmarks/bench_transfer.py --device cuda``:
#: per-layer blocks (32 KiB ranges) 0.18 -> 0.40 of one contiguous copy with rows; 1 MiB
#: cross-layer blocks 0.85 concatenated, 0.71 as rows.
ROW_COPY_MAX_MEAN_BYTES = 256 << 10
#: Devices that use row copies (tests add ``"cpu"`` to cover the path without a GPU).
ROW_COPY_DEVICES: tuple[str, ...] = ("cuda",)

RowPlan = tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]


def _row_plan(desc: TransferDescriptor, flats: Sequence[torch.Tensor]) -> RowPlan | None:
    """``(row bytes, [(buffer, source rows, packed rows)])`` for a row copy of ``desc``, or
    None where it does not apply (few ranges, another device, rows too small, or a buffer
    that is not a whole number of rows).  Rows of one buffer are listed in packed order."""
    ranges = desc.ranges
    if (
        len(ranges) < ROW_COPY_MIN_RANGES
        or flats[0].device.type not in ROW_COPY_DEVICES
        or desc.total_bytes > ROW_COPY_MAX_MEAN_BYTES * len(ranges)
    ):
        return None
    spec = np.array(ranges, dtype=np.int64).reshape(-1, 3)  # buffer, offset, length
    row = int(np.gcd.reduce(spec[:, 1:].ravel()))
    used = np.unique(spec[:, 0])
    if row < ROW_COPY_MIN_BYTES or any(flats[int(b)].numel() % row for b in used):
        return None
    counts = spec[:, 2] // row
    first = np.repeat(spec[:, 1] // row, counts)
    src = first + np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)
    buf = np.repeat(spec[:, 0], counts)
    order = np.argsort(buf, kind="stable")
    index = torch.from_numpy(np.stack([src[order], order])).to(flats[0].device)
    bounds = [0, *(np.flatnonzero(np.diff(buf[order])) + 1).tolist(), len(order)]
    segments = [
        (int(buf[order[a]]), index[0, a:e], index[1, a:e]) for a, e in itertools.pairwise(bounds)
    ]
    return row, segments


def gather(
    desc: TransferDescriptor,
    buffers: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    non_blocking: bool = False,
) -> torch.Tensor:
    """Pack the stream of ``desc`` from ``buffers`` into ``out`` and return it.

    ``out`` (flat ``uint8`` of at least ``desc.total_bytes``, any device, e.g. pinned host) is
    written from its start; by default a new tensor on the first buffer's device.  Mutates only
    ``out``.  One copy call per range; on CUDA, several ranges are packed on the device (one
    concatenation, or indexed row copies for many small ranges), then copied once.  With
    ``non_blocking`` a copy to pinned host memory is only queued: synchronize the stream
    before the host reads ``out``.  Raises :class:`TransferError` on mismatched buffers.
    """
    flats = _flat(buffers, desc)
    total = desc.total_bytes
    if out is None:
        device = flats[0].device if flats else torch.device("cpu")
        out = torch.empty(total, dtype=torch.uint8, device=device)
    _check_packed(out, total)
    plan = _row_plan(desc, flats)
    if plan is not None:
        row, segments = plan
        device = flats[0].device
        on_device = out.device == device
        rows = (
            out[:total].view(-1, row)
            if on_device
            else torch.empty(total // row, row, dtype=torch.uint8, device=device)
        )
        for b, src, dst in segments:
            rows.index_copy_(0, dst, flats[b].view(-1, row).index_select(0, src))
        if not on_device:
            out[:total].copy_(rows.view(-1), non_blocking=non_blocking)
        return out
    if len(desc.ranges) > 1 and flats[0].is_cuda:
        # One batched kernel packs the ranges on the device; then one copy (not one
        # synchronous device-to-host copy per range).
        slices = [flats[r.buffer_id][r.offset : r.offset + r.length] for r in desc.ranges]
        if out.device == flats[0].device:
            torch.cat(slices, out=out[:total])
        else:
            out[:total].copy_(torch.cat(slices), non_blocking=non_blocking)
        return out
    pos = 0
    for r in desc.ranges:
        out[pos : pos + r.length].copy_(
            flats[r.buffer_id][r.offset : r.offset + r.length], non_blocking=non_blocking
        )
        pos += r.length
    return out


def scatter(
    desc: TransferDescriptor,
    buffers: Sequence[torch.Tensor],
    packed: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> None:
    """Unpack ``packed`` (a stream matching ``desc``) into the ranges of ``desc``.

    Mutates only the bytes of ``buffers`` inside ``desc.ranges``.  On CUDA, several ranges
    are one copy to the device, then a multi-tensor copy (or indexed row copies).  With
    ``non_blocking`` the copies are queued on the current stream: keep ``packed`` unchanged
    until they ran.  Raises :class:`TransferError` when ``packed`` is shorter than
    ``desc.total_bytes`` or not flat.
    """
    flats = _flat(buffers, desc)
    _check_packed(packed, desc.total_bytes)
    plan = _row_plan(desc, flats)
    if plan is not None or (len(desc.ranges) > 1 and flats[0].is_cuda):
        # One copy to the device, then the ranges in batched kernels: indexed row copies, or
        # a multi-tensor copy.
        staged = packed[: desc.total_bytes].to(flats[0].device, non_blocking=non_blocking)
        if plan is None:
            dsts = [flats[r.buffer_id][r.offset : r.offset + r.length] for r in desc.ranges]
            spread(staged, dsts)
            return
        row, segments = plan
        rows = staged.view(-1, row)
        for b, src, dst in segments:
            flats[b].view(-1, row).index_copy_(0, src, rows.index_select(0, dst))
        return
    pos = 0
    for r in desc.ranges:
        flats[r.buffer_id][r.offset : r.offset + r.length].copy_(
            packed[pos : pos + r.length], non_blocking=non_blocking
        )
        pos += r.length


def spread(packed: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of flat ``packed`` (on the destinations' device) into ``dsts``,
    in order, with one multi-tensor copy (a few kernels on CUDA, not one copy per range)."""
    ends = itertools.accumulate(d.numel() for d in dsts)
    torch._foreach_copy_(list(dsts), [packed[a:b] for a, b in itertools.pairwise([0, *ends])])


def copy_blocks(
    src: TransferDescriptor,
    src_buffers: Sequence[torch.Tensor],
    dst: TransferDescriptor,
    dst_buffers: Sequence[torch.Tensor],
    *,
    non_blocking: bool = False,
) -> int:
    """Copy the stream of ``src`` into the ranges of ``dst``; return the bytes copied.

    The descriptors must :meth:`~TransferDescriptor.matches`; ranges are walked in step and cut
    where either side's range ends, so one copy call per overlap of a source and a destination
    range.  Mutates only ``dst``'s ranges.  Raises :class:`TransferError`, copying nothing, on
    a mismatch or when a destination range overlaps a source range in memory.
    """
    if not src.matches(dst):
        if src.stream[:2] != dst.stream[:2] and src.stream and dst.stream:
            raise TransferError(
                f"descriptors: the source's bytes are laid out {'/'.join(src.stream[:2])}, the "
                f"destination's {'/'.join(dst.stream[:2])}: a byte copy would scramble them "
                "(move them with plan_transfer)"
            )
        raise TransferError(
            f"descriptors: source (pieces {src.piece_lengths}, {len(src.block_ids)} blocks) and "
            f"destination (pieces {dst.piece_lengths}, {len(dst.block_ids)} blocks) differ"
            + ("" if src.stream == dst.stream else _stream_difference(src.stream, dst.stream))
        )
    s_flat, d_flat = _flat(src_buffers, src), _flat(dst_buffers, dst)
    # the copies: ranges walked in step, cut where either side's range ends
    copies: list[tuple[int, int, int, int, int]] = []  # src buffer, offset, dst buffer, offset, n
    i = j = 0
    s_pos = d_pos = 0
    while i < len(src.ranges) and j < len(dst.ranges):
        s, d = src.ranges[i], dst.ranges[j]
        n = min(s.length - s_pos, d.length - d_pos)
        copies.append((s.buffer_id, s.offset + s_pos, d.buffer_id, d.offset + d_pos, n))
        s_pos += n
        d_pos += n
        if s_pos == s.length:
            i, s_pos = i + 1, 0
        if d_pos == d.length:
            j, d_pos = j + 1, 0
    check_no_overlap(copies, s_flat, d_flat)
    copied = 0
    for sb, a, db, b, n in copies:
        d_flat[db][b : b + n].copy_(s_flat[sb][a : a + n], non_blocking=non_blocking)
        copied += n
    return copied


def _stream_difference(src: tuple[Any, ...], dst: tuple[Any, ...]) -> str:
    """What differs between two descriptors' streams, for an error message: the first member
    segment whose name, element type or per-block shape is not the other side's."""
    text = " in what their bytes are"
    if len(src) != 3 or len(dst) != 3:
        return text
    for a, b in zip(src[2], dst[2], strict=False):
        if a == b:
            continue
        where = f"layer {a[0]} slot {a[1]}" if a[:2] == b[:2] else f"members {a[:2]} / {b[:2]}"
        for x, y in zip(a[2:], b[2:], strict=False):
            if x != y:
                return (
                    f"{text}: {where} segment {x[0]!r} is {x[1]} {list(x[2])} on the source, "
                    f"{y[0]!r} {y[1]} {list(y[2])} on the destination (a byte copy would "
                    "make the destination read them as something else)"
                )
        return f"{text}: {where} holds other segments"
    return f"{text}: {len(src[2])} members on the source, {len(dst[2])} on the destination"


def check_no_overlap(
    copies: Sequence[tuple[int, int, int, int, int]],
    s_flat: Sequence[torch.Tensor],
    d_flat: Sequence[torch.Tensor],
    *,
    field: str = "descriptors",
    remedy: str = "copy through a staging buffer (gather, then scatter) or use "
    "KVCacheStorage.move_blocks",
) -> None:
    """Raise :class:`TransferError` when a copy ``(source buffer, offset, destination buffer,
    offset, length)`` writes bytes a copy of the same call reads (a copy onto itself aside):
    copied one after the other, a later copy would read what an earlier one wrote
    (:meth:`KVCacheStorage.move_blocks` orders such moves).  The message starts with
    ``field`` and ends with ``remedy``."""
    s_ptr = {t.untyped_storage().data_ptr() for t in s_flat}
    if not any(t.untyped_storage().data_ptr() in s_ptr for t in d_flat):
        return  # no memory in common: nothing can overlap
    marked = []
    for sb, a, db, b, n in copies:
        src_at, dst_at = s_flat[sb].data_ptr() + a, d_flat[db].data_ptr() + b
        if src_at != dst_at:
            marked += [(src_at, src_at + n, 0), (dst_at, dst_at + n, 1)]
    marked.sort()
    reach = [-1, -1]  # the furthest end so far of the reads, of the writes
    for start, end, side in marked:
        if start < reach[1 - side]:
            raise TransferError(
                f"{field}: source and destination ranges overlap in memory (a copy would "
                f"read bytes it already overwrote); {remedy}"
            )
        reach[side] = max(reach[side], end)


def _check_packed(packed: torch.Tensor, total: int) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous():
        raise TransferError(
            f"packed: need a flat contiguous uint8 tensor, got dtype {packed.dtype}, shape "
            f"{tuple(packed.shape)}"
        )
    if packed.numel() < total:
        raise TransferError(f"packed: {packed.numel()} bytes, the descriptor needs {total}")
