"""The disk slots' file as the recovery walk reads it (:mod:`hybridkv.storage.disk_slots`):
the walk at open (:func:`walk`), the empty marks a run's splits put in the file so that a
walk after a kill finds every whole slot (:class:`SplitMarks`), and the check that the
entries and free extents tile the carved part of the file (:func:`check_tiling`).

The walk at open goes from header to header: each header, committed or empty, says where the
next one is (its slot's stride).  Between runs every entry's header and every free extent's
start lie on that chain.  A run (:meth:`DiskSlots.write_many`) carves all its slots first and
then two threads write them in any order, so a kill can leave any of them unwritten while
others are whole.  A slot split from a free extent starts where the extent's old empty mark
is, which steps over the whole extent: left unwritten, it would hide the whole slots the run
carved after it from the same extent.  Such a slot gets an empty mark of its own length
before the run's writes (found by review: until then the walk lost those entries).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from hybridkv.errors import InvariantError
from hybridkv.extents import FreeExtents
from hybridkv.storage.disk_format import (
    COMMITTED,
    EMPTY,
    HEADER_BYTES,
    HEADER_READ,
    SLOT_ALIGN,
    checksum,
    pack_header,
    parse_header,
    slot_stride,
)

__all__ = ["SlotEntry", "SplitMarks", "check_tiling", "empty_header", "room_in_place", "walk"]

#: Writes a header at an offset of the file.
_Pwrite = Callable[[bytes, int], None]


class SlotEntry(NamedTuple):
    """A committed slot: its entry ``(group, block hash)``, admission ``tag``, payload
    ``size``, file ``offset`` of its header and ``stamp`` (store order)."""

    group_id: int
    block_hash: int
    tag: int
    size: int
    offset: int
    stamp: int


def empty_header(length: int) -> bytes:
    """The header marking ``length`` bytes of slots (header included) free."""
    return pack_header(0, 0, 0, length - HEADER_BYTES, 0, 0, EMPTY)


class SplitMarks:
    """The empty headers one run must write before any of its slots: for a slot split from a
    free extent, one at the rest (the committed slot's header leads there) and, once a later
    slot of the run is carved right after it, one of the slot's own length at its start (an
    unwritten slot then hides nothing).  Slots carved in a row from one extent share them:
    ``k`` such slots write ``k + 1`` headers (a lone split, the rest's alone), where marking
    each slot and its rest as it is taken would write ``2 k``.

    A drop during the run (a key the run writes again) marks its slot and the free space
    it joins empty at once (:meth:`freed`); when that joins a rest of the run, the slot
    before the rest gets its own mark too (the extent's old mark would reach the dropped
    copy's header, which still reads committed).  :meth:`write` puts the marks out highest
    offset first, so every header it writes points at one already written or at a point the
    walk already reaches (the end of the extent): a kill at any moment leaves a walkable
    chain.  A run that splits nothing writes none."""

    def __init__(self) -> None:
        #: Offset -> length of the empty mark to write there.
        self.marks: dict[int, int] = {}
        self._after: dict[int, int] = {}  # a rest's start -> the slot split before it

    def __bool__(self) -> bool:
        return bool(self.marks or self._after)

    def taken(self, offset: int, rest: tuple[int, int] | None) -> None:
        """A slot at ``offset`` was carved, leaving ``rest`` (``(start, length)``, None when
        nothing was split)."""
        before = self._after.pop(offset, None)
        if before is not None:  # the run's slot before this one needs its own mark now
            self.marks[before] = offset - before
        if rest is not None:
            self.marks[rest[0]] = rest[1]
            self._after[rest[0]] = offset

    def freed(self, start: int, length: int) -> None:
        """Free space ``[start, start + length)`` was just marked empty by one header at its
        start (a drop during the run): the marks planned inside it are superseded.  When it
        grew a rest of this run (a slot of the run ends at ``start``), the slot before needs
        its own mark: its old header reaches the end of the extent it was split from, now
        inside this free space, where the dropped entry's header still reads committed."""
        for at in [a for a in self.marks if start <= a < start + length]:
            del self.marks[at]
        before = self._after.get(start)
        if before is not None:
            self.marks[before] = start - before

    def write(self, pwrite: _Pwrite) -> None:
        """Write the marks by ``pwrite(header, offset)``, highest offset first, and forget
        them (also when a write raises: its :class:`OSError` propagates)."""
        try:
            for at in sorted(self.marks, reverse=True):
                pwrite(empty_header(self.marks[at]), at)
        finally:
            self.marks.clear()
            self._after.clear()


def room_in_place(space: FreeExtents, entry: SlotEntry, size: int) -> bool:
    """Whether ``space`` has a slot for a ``size``-byte payload once ``entry``'s slot is
    freed (tried on a copy, nothing changes): a rewrite that finds none keeps its old copy."""
    trial = copy.deepcopy(space)
    trial.give(entry.offset, slot_stride(entry.size))
    return trial.take(slot_stride(size)) is not None


def check_tiling(space: FreeExtents, used: Iterable[tuple[int, int, str]], where: str) -> None:
    """Raise :class:`InvariantError` (its message starting with ``where``) unless the slots
    ``used`` (``(offset, stride, what)``) and the free extents of ``space`` tile the carved
    part of the file, ``[0, space.top)``: no overlap, no gap, every span aligned to
    :data:`SLOT_ALIGN`, every free extent at least a header and a byte (``space.min_rest``),
    and ``space``'s own indexes in agreement (:meth:`FreeExtents.check`)."""
    used = list(used)
    try:
        space.check(used)
    except InvariantError as exc:
        raise InvariantError(f"{where}: {exc}") from exc
    free = [(s, n, f"free extent of {n} B") for s, n in space.extents()]
    at = 0
    for start, n, what in sorted([*used, *free]):
        if start % SLOT_ALIGN or n % SLOT_ALIGN or n < space.min_rest:
            raise InvariantError(f"{where}: {what} at {start} is not a whole aligned slot")
        if start != at:  # overlaps were found above
            raise InvariantError(
                f"{where}: a gap of {start - at} B at {at} (before {what}) is neither an "
                "entry nor free space"
            )
        at = start + n
    if at != space.top:
        raise InvariantError(
            f"{where}: entries and free space end at {at}, the carved part at {space.top}"
        )


def walk(
    fd: int, sizes: Sequence[int], file_bytes: int, space: FreeExtents, pwrite: _Pwrite
) -> tuple[dict[tuple[int, int], SlotEntry], list[SlotEntry], int]:
    """Walk the carved slots of ``fd`` (for payloads of up to ``sizes[-1]`` bytes, in a file
    of ``file_bytes``) from the front: committed ones become entries, empty ones free slots
    (given to ``space``, whose bump mark ends where the walk does); everything from the first
    header that does not check out (never carved, or torn) is free space.  A run that two
    threads wrote (:meth:`DiskSlots.write_many`) and a kill cut short may leave a carved slot
    unwritten before a whole one: a split slot's own empty mark (:class:`SplitMarks`) steps
    over it; for a slot carved at the end of the file the walk tries the header a slot of
    each block size would end at, goes on from the first that checks out (the hole becomes
    free space, marked so in the file by ``pwrite``) and ends only where none does.  A
    header found so may be older than the hole (an earlier life's, inside the slot the run
    carved over it), so a committed one counts only when its payload checksum holds
    (:func:`_whole`): one whose payload a later slot overwrote led the walk along the old
    slots, past the whole entry after the hole (found by review).  Any entry's payload
    checksum is checked at every read, too.  Returns the entries by key, the same oldest
    first, and the stamp the next write takes."""
    entries: dict[tuple[int, int], SlotEntry] = {}
    found: list[SlotEntry] = []
    next_stamp = 0
    offset = 0
    size_now = os.fstat(fd).st_size
    strides = [slot_stride(s) for s in sizes]
    while offset + HEADER_BYTES <= size_now:
        parsed = _header(fd, offset, size_now, sizes[-1], file_bytes)
        if parsed is None:
            for stride in strides:  # a hole of one slot of this size?
                parsed = _header(fd, offset + stride, size_now, sizes[-1], file_bytes)
                if parsed is not None and _whole(fd, offset + stride, parsed):
                    # marked free, so the next walk strides over it
                    with contextlib.suppress(OSError):
                        pwrite(empty_header(stride), offset)
                    space.give(offset, stride)
                    offset += stride
                    break
            else:
                break
        group, size, state, tag, stamp, h, _ = parsed
        end = offset + slot_stride(size)
        if state == COMMITTED and (group, h) not in entries:
            entry = SlotEntry(group, h, tag, size, offset, stamp)
            entries[group, h] = entry
            found.append(entry)
            next_stamp = max(next_stamp, stamp + 1)
        else:
            if state == COMMITTED:  # a second copy of an entry: the slot is free
                with contextlib.suppress(OSError):
                    pwrite(pack_header(group, h, tag, size, 0, 0, EMPTY), offset)
            space.give(offset, end - offset)  # joined in memory; headers stay
        offset = end
    space.top = offset
    found.sort(key=lambda e: e.stamp)
    return entries, found, next_stamp


def _whole(fd: int, offset: int, parsed: tuple[int, int, int, int, int, int, int]) -> bool:
    """Whether the slot at ``offset`` with header ``parsed`` is empty or its payload matches
    its checksum (read: the walk calls this only past a hole)."""
    _, size, state, _, _, _, crc = parsed
    if state != COMMITTED:
        return True
    try:
        data = os.pread(fd, size, offset + HEADER_BYTES)
    except OSError:
        return False
    return len(data) == size and checksum(memoryview(data)) == crc


def _header(
    fd: int, offset: int, size_now: int, largest: int, file_bytes: int
) -> tuple[int, int, int, int, int, int, int] | None:
    """The header at ``offset`` if it checks out and its slot lies within the file (a
    committed one of at most ``largest`` payload bytes; an empty one may span joined free
    slots), else None."""
    if offset + HEADER_BYTES > size_now:
        return None
    try:
        raw = os.pread(fd, HEADER_READ, offset)
    except OSError:
        return None
    parsed = parse_header(raw)
    if parsed is None:
        return None
    size = parsed[1]
    limit = largest if parsed[2] else file_bytes
    if not 0 < size <= limit or offset + slot_stride(size) > file_bytes:
        return None
    return parsed
