"""A disk tier's bytes: one preallocated file of checksummed slots that outlives the process.

The directory holds three files:

* ``manifest.json``: the format version, the capacity, and the *fingerprint* of whoever made
  it (model, dtype, layout, hasher: the engine's :func:`hybridkv.engine.tier_setup.fingerprint`).
  A directory made by a different fingerprint or capacity is refused
  (:class:`DiskCacheError`), never read as this model's data.
* ``blocks.bin``: the slots, preallocated (``posix_fallocate``) to the capacity plus one header
  per possible slot, so a full disk is found when the cache opens, not in the middle of a
  write.  Slots are carved from the front in the order they are first needed; a freed slot
  joins its free neighbours into one extent, marked empty by one header at its start, which
  later slots of any size reuse (:class:`hybridkv.extents.FreeExtents`).
* ``lock``: an exclusive ``flock`` while a process has the directory open (a second process
  on the same directory is refused; the lock dies with its process).

Each slot is a 128-byte header and the payload (:mod:`hybridkv.storage.disk_format`: the
entry's name and tag, payload size, store counter, payload checksum and the header's own
CRC-32).  A write computes the checksum first and puts header and payload out in
one ``pwritev`` (a separate header write cost a quarter of the disk tier's write throughput:
a syscall per entry, and on two threads a wait for the GIL after each); a slot is reused
only after its drop marked it empty.  A process killed in the middle of a write so leaves
an empty or never-written header (no entry), a torn one (its CRC fails), or a whole header
over a payload cut short or still the old one (the payload checksum fails).  A slot split
from a free extent is marked before the run's writes (:class:`SplitMarks`): its rest empty
and, when a later slot of the run follows it, the slot itself empty at its own length, so
the walk at open steps over any slot a kill left unwritten onto the next.  Entries are
content-addressed (a hash names the same bytes for the same fingerprint), so any slot whose
checksums hold is a correct entry.  Every read checks the header (name, size, state, header
CRC) and the payload checksum before the bytes are used: a write that failed, a truncated
file, a flipped byte, a torn write all read as *missing*, never as data.

Positioned reads and writes (``pread``/``pwrite``), not ``mmap``: an I/O error, a full disk
or a file truncated by someone else then surfaces as an :class:`OSError` that becomes a
miss; through a mapping it is a ``SIGBUS`` that kills the process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from hybridkv.errors import InvariantError, brief_repr
from hybridkv.extents import FreeExtents
from hybridkv.storage.disk_format import (
    COMMITTED,
    HEADER_BYTES,
    HEADER_READ,
    SLOT_ALIGN,
    checksum,
    pack_header,
    parse_header,
    payload_bytes,
    slot_stride,
)
from hybridkv.storage.disk_io import pwrite_all, pwritev_all
from hybridkv.storage.disk_manifest import DiskCacheError, check_manifest
from hybridkv.storage.disk_space import (
    SlotEntry,
    SplitMarks,
    check_tiling,
    empty_header,
    room_in_place,
    walk,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "DiskCacheError",
    "DiskSlots",
    "SlotEntry",
    "checksum",
]

logger = logging.getLogger(__name__)

#: Bumped whenever the file format changes; a manifest of another version is refused.
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_DATA = "blocks.bin"
_LOCK = "lock"
#: The lock files this process holds (device, inode) -> pid, so that a second open of a
#: directory in the same process is told apart from another process holding it.
_HELD_HERE: dict[tuple[int, int], int] = {}


#: ``(key, tag, payload)`` items :meth:`DiskSlots.write_many` stores.
_Items = Sequence[tuple[tuple[int, int], int, memoryview | Sequence[memoryview]]]


def _file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class DiskSlots:
    """The slots of one disk-cache directory, for entries of at most the payload ``sizes``
    given (one per group), within ``capacity_bytes`` of payload.

    Opening creates the directory and its files, or reopens those an earlier process left
    (same ``fingerprint`` and capacity) and finds their committed entries
    (:attr:`recovered`, oldest first).  Raises :class:`DiskCacheError` for a path that is a
    file or not writable, a directory with other content, another fingerprint or capacity,
    a directory locked by a live process, or a disk without room for the file.
    """

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        fingerprint: Mapping[str, Any],
        sizes: Sequence[int],
    ) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.sizes = sorted({int(s) for s in sizes if s > 0})
        if not self.sizes:
            raise DiskCacheError("disk cache: no group has a positive block size")
        self.max_slots = capacity_bytes // self.sizes[0] + 1
        self.file_bytes = capacity_bytes + self.max_slots * (HEADER_BYTES + SLOT_ALIGN)
        self._fd = -1
        self._lock_fd = -1
        self._lock_id = (-1, -1)
        self._open(dict(fingerprint))
        #: Committed entries by ``(group, hash)``.
        self.entries: dict[tuple[int, int], SlotEntry] = {}
        #: The file's free space: slots carved from the front; a freed slot joins its free
        #: neighbours, and a split leaves room for a header and a byte.
        self._space = FreeExtents(self.file_bytes, min_rest=slot_stride(1), lower_top=False)
        #: The empty marks the run being carved must write before its slots.
        self._marks = SplitMarks()
        self._stamp = 0
        #: Entries found committed when the directory was opened, oldest first.
        self.recovered: list[SlotEntry] = self._recover()
        #: Writes that failed (I/O error, no room left in the file) and entries dropped.
        self.write_errors = 0
        self.no_room = 0

    # -- opening ------------------------------------------------------------------------------
    def _open(self, fingerprint: dict[str, Any]) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise DiskCacheError(f"disk cache: {d} is a file, not a directory")
        made = not d.exists()  # the directory this call makes (removed if it fails)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskCacheError(
                f"disk cache: cannot create directory {d}: {exc.strerror}"
            ) from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise DiskCacheError(f"disk cache: directory {d} is not writable")
        manifest = d / _MANIFEST
        want = {"format": FORMAT_VERSION, "capacity_bytes": self.capacity_bytes, **fingerprint}
        try:  # as the manifest will hold it (tuples become lists), so a reopen compares equal
            want = json.loads(json.dumps(want, sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise DiskCacheError(
                f"disk cache: the fingerprint must be JSON data (str, int, float, bool, None, "
                f"lists and dicts of them): {exc}"
            ) from None
        ours = {_MANIFEST, _DATA, _LOCK, _MANIFEST + ".tmp"}
        known = manifest.exists()
        if known:
            check_manifest(manifest, want)
        else:
            others = sorted(p.name for p in d.iterdir() if p.name not in ours)
            if others:
                raise DiskCacheError(
                    f"disk cache: {d} holds files that are not a hybridkv cache "
                    f"({', '.join(others[:3])}); use an empty directory"
                )
        self._lock_fd = os.open(d / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        lock_id = _file_id(self._lock_fd)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = -1
            if _HELD_HERE.get(lock_id) == os.getpid():
                raise DiskCacheError(
                    f"disk cache: {d} is already open in this process (another engine or disk "
                    "tier on the same directory); close() that one first or use another "
                    "directory"
                ) from exc
            raise DiskCacheError(f"disk cache: {d} is in use by another process") from exc
        _HELD_HERE[lock_id] = os.getpid()
        self._lock_id = lock_id
        try:
            self._fd = os.open(d / _DATA, os.O_RDWR | os.O_CREAT, 0o644)
            if not known and os.fstat(self._fd).st_size:
                # No manifest says which model, layout and hasher wrote these slots (one was
                # removed, or a process died before writing it): checksums that hold prove
                # nothing about that, so nothing in the file is read.
                logger.warning("disk cache: %s has no %s; its %s is discarded", d, _MANIFEST, _DATA)
                os.ftruncate(self._fd, 0)
            size_now = os.fstat(self._fd).st_size
        except OSError as exc:
            self.close()
            raise DiskCacheError(
                f"disk cache: cannot open {d / _DATA}: {exc.strerror or exc}; use an empty "
                "directory"
            ) from None
        more = self.file_bytes - size_now
        free = shutil.disk_usage(d).free
        if more > free:
            self._unmake(known, made)
            raise DiskCacheError(
                f"disk cache: cannot reserve {self.file_bytes} bytes in {d}: {free} bytes free "
                "(free space, or a smaller --disk-memory)"
            )
        try:
            os.posix_fallocate(self._fd, 0, self.file_bytes)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: sparse
                if os.fstat(self._fd).st_size < self.file_bytes:
                    os.ftruncate(self._fd, self.file_bytes)
            else:
                self._unmake(known, made)
                raise DiskCacheError(
                    f"disk cache: cannot reserve {self.file_bytes} bytes in {d}: "
                    f"{exc.strerror} (free space, or a smaller --disk-memory)"
                ) from exc
        if not known:
            tmp = d / (_MANIFEST + ".tmp")
            tmp.write_text(json.dumps(want, sort_keys=True))
            os.replace(tmp, manifest)

    def _unmake(self, known: bool, made: bool) -> None:
        """Close the files after a failed reservation and, for a cache this call began (no
        manifest yet), remove what it made: its data and lock files, and the directory when
        it made that too.  An existing cache is left as it was."""
        self.close()
        if known:
            return
        for name in (_DATA, _LOCK):
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
        if made:
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def _recover(self) -> list[SlotEntry]:
        """Walk the carved slots from the front (:func:`~hybridkv.storage.disk_space.walk`):
        committed ones become :attr:`entries`, empty ones and the holes a kill left free
        space; the entries found, oldest first."""
        self.entries, found, self._stamp = walk(
            self._fd, self.sizes, self.file_bytes, self._space, self._pwrite
        )
        return found

    # -- entries ------------------------------------------------------------------------------
    def keep_only(self, keys: Iterable[tuple[int, int]]) -> None:
        """Free every entry but ``keys`` (those an earlier process left that the cache did
        not adopt)."""
        keep = set(keys)
        for key in [k for k in self.entries if k not in keep]:
            self.drop(key)
        self.recovered = [e for e in self.recovered if (e.group_id, e.block_hash) in keep]

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def write(
        self, key: tuple[int, int], tag: int, data: memoryview | Sequence[memoryview]
    ) -> bool:
        """Store ``data`` (contiguous bytes, or pieces whose concatenation is the payload) as
        entry ``key`` with admission ``tag``: its checksum, then header and payload by one
        ``pwritev`` (:meth:`write_many` of the one item).  Returns False, storing nothing,
        when no slot is left for its size (a stored ``key`` keeps its old copy: found by
        review, it was dropped first) or the write fails (the entry then reads as missing: a
        rewrite that has room frees the old copy's slot first, so a full file rewrites in
        place; the engine learns of a failed write only by that miss, at the entry's next
        check, and its manager never asks to rewrite a key its tier holds).  Raises
        :class:`DiskCacheError`, storing nothing, for a key, tag or payload size the slots
        cannot hold (:meth:`_check_item`) or a closed cache."""
        return self.write_many([(key, tag, data)])[0]

    def write_many(
        self,
        items: _Items,
        helper: Executor | None = None,
    ) -> list[bool]:
        """Store ``items`` (``(key, tag, data)``, as :meth:`write` takes them) as writing them
        one by one in order would (entries, offsets, stamps, failures; a failed write uses up
        its stamp), with ``helper`` (a one-thread executor; None: this thread alone) sharing
        the work: slots and stamps are taken in order, then this thread and the helper each
        take the next entry when done with their last, checksum it and write it (its bytes
        are in cache for the write).  Keys repeated in ``items`` are written one by one.

        Measured on a 2-core machine against one plain write of the same 128 MiB (a loop of
        the same calls, 128 blocks of 1 MiB): 0.93 for this with blocks in 32 pieces, against
        0.70 with each header written after its payload by a call of its own and 0.48 with
        one thread writing while the other checksums ahead; contiguous blocks 1.08 against
        0.83 for the latter.  The payloads are read from the callers' memory, which stays
        unchanged until this returns."""
        if self._fd < 0:
            raise DiskCacheError(f"disk cache: {self.directory} is closed; open it again")
        keys = [key for key, _, _ in items]
        if len(set(keys)) != len(keys):
            return [self.write(key, tag, data) for key, tag, data in items]
        # what the header cannot hold or no slot fits raises before any change
        sizes = [payload_bytes(data) for _, _, data in items]
        for (key, tag, _), size in zip(items, sizes, strict=True):
            self._check_item(key, tag, size)
        places: list[tuple[int, int] | None] = []
        for (key, _, _), size in zip(items, sizes, strict=True):
            old = self.entries.get(key)
            if old is not None and room_in_place(self._space, old, size):
                self.drop(key)
            offset = None if key in self.entries else self._take(size)
            if offset is None:
                self.no_room += 1
                places.append(None)
            else:
                places.append((offset, self._stamp))
                self._stamp += 1
        if not self._write_marks(sizes, places):
            return [False] * len(items)
        errors = self._put_shared(items, places, helper)
        done = []
        for (key, tag, _), size, place, error in zip(items, sizes, places, errors, strict=True):
            if place is None:
                done.append(False)
                continue
            offset, stamp = place
            if error is not None:
                self._failed(key, tag, size, offset, error)
                done.append(False)
            else:
                self.entries[key] = SlotEntry(key[0], key[1], tag, size, offset, stamp)
                done.append(True)
        return done

    def _check_item(self, key: tuple[int, int], tag: int, size: int) -> None:
        """Raise :class:`DiskCacheError` for an entry the slots cannot store: a key that is
        not ``(group, block hash)`` with ``0 <= group < 2**32`` and a hash of at most 33
        signed bytes, a tag that is not a 64-bit integer, or an empty payload or one larger
        than the largest of the ``sizes`` the cache was opened for (its slot would end the
        recovery walk of a later process)."""
        ok_key = (
            isinstance(key, tuple)
            and len(key) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in key)
            and 0 <= key[0] < 1 << 32
            and -(1 << 263) <= key[1] < 1 << 263
        )
        if not ok_key:
            raise DiskCacheError(
                f"disk cache: key {key!r} is not (group, block hash): two integers, "
                "the group in [0, 2**32), the hash of at most 33 signed bytes"
            )
        if not isinstance(tag, int) or isinstance(tag, bool) or not -(1 << 63) <= tag < 1 << 63:
            raise DiskCacheError(f"disk cache: tag {brief_repr(tag)} is not a 64-bit integer")
        if not 0 < size <= self.sizes[-1]:
            raise DiskCacheError(
                f"disk cache: a {size}-byte payload for key {key}; this cache stores payloads "
                f"of 1 to {self.sizes[-1]} bytes"
            )

    def _put_shared(
        self,
        items: _Items,
        places: Sequence[tuple[int, int] | None],
        helper: Executor | None,
    ) -> list[Exception | None]:
        """Write the items that have a slot, this thread and ``helper`` each taking the next
        one when done with its last; per item the error its write raised, else None."""
        out: list[Exception | None] = [None] * len(items)
        todo = iter([i for i, place in enumerate(places) if place is not None])
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(todo, -1)
                if i < 0:
                    return
                key, tag, data = items[i]
                place = places[i]
                assert place is not None
                out[i] = self._put(key, tag, data, *place)

        shared = helper.submit(work) if helper is not None and len(items) > 1 else None
        work()
        if shared is not None:
            shared.result()
        return out

    def _put(
        self,
        key: tuple[int, int],
        tag: int,
        data: memoryview | Sequence[memoryview],
        offset: int,
        stamp: int,
    ) -> Exception | None:
        """Checksum ``data`` and write it with its committed header into the slot at
        ``offset`` (one ``pwritev``); the error the checksum or the write raised, if any: an
        I/O error, or anything else (a payload released under it), which fails this entry
        alone, never the rest of a batch or the slots' bookkeeping.  Touches no bookkeeping
        (threads share :meth:`write_many`)."""
        try:
            head = pack_header(
                key[0], key[1], tag, payload_bytes(data), stamp, checksum(data), COMMITTED
            )
            pieces: list[bytes | memoryview] = [head]
            if isinstance(data, memoryview):
                pieces.append(data)
            else:
                pieces.extend(data)
            self._pwritev(pieces, offset)
        except Exception as exc:  # a failed entry reads as missing
            return exc
        return None

    def _failed(
        self, key: tuple[int, int], tag: int, size: int, offset: int, exc: Exception
    ) -> None:
        """A write of ``key`` into the slot at ``offset`` failed: mark it empty and free it."""
        g, h = key
        logger.warning(
            "disk cache: writing group %d block %#x failed: %s",
            g,
            h,
            exc,
            exc_info=None if isinstance(exc, OSError) else exc,  # not an I/O error: a bug
        )
        self.write_errors += 1
        self._give(offset, size)

    def read(self, key: tuple[int, int], out: memoryview) -> bool:
        """Read entry ``key`` into ``out`` (its size) and check it: the header must name
        ``key``, be committed and intact, and the payload must match its checksum.  Returns False
        (``out`` then holds garbage) for a missing, torn, truncated or corrupt entry."""
        if self._fd < 0:
            raise DiskCacheError(f"disk cache: {self.directory} is closed; open it again")
        entry = self.entries.get(key)
        if entry is None or out.nbytes != entry.size:
            return False
        try:
            head = bytearray(HEADER_BYTES)
            got = os.preadv(self._fd, [head, out], entry.offset)  # header and payload at once
        except OSError as exc:
            logger.warning("disk cache: reading group %d block %#x failed: %s", *key, exc)
            return False
        parsed = parse_header(bytes(head[:HEADER_READ]))
        if parsed is None or got != HEADER_BYTES + entry.size:
            return False
        group, size, state, _, _, h, crc = parsed
        return (
            state == COMMITTED and (group, h) == key and size == entry.size and checksum(out) == crc
        )

    def drop(self, key: tuple[int, int]) -> bool:
        """Forget entry ``key`` and mark its slot empty (reused by a later write of its size);
        False when no such entry."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self._give(entry.offset, entry.size)
        return True

    def clear(self) -> None:
        """Drop every entry."""
        for key in list(self.entries):
            self.drop(key)

    def used_bytes(self) -> int:
        """Payload bytes of the committed entries."""
        return sum(e.size for e in self.entries.values())

    def check_invariants(self) -> None:
        """Raise :class:`~hybridkv.errors.InvariantError` unless the bookkeeping agrees with
        itself (a broken one is a bug in hybridkv; the file is not read, so damage to it,
        which reads as missing, is not one): each entry is filed under its own key, with a
        payload of 1 to ``sizes[-1]`` bytes and a stamp below the next one to be given; the
        entries' slots (their stride from their size) and the free extents tile the carved
        part of the file, ``[0, top)``, without overlap or gap, aligned, within the file
        (:func:`~hybridkv.storage.disk_space.check_tiling`); no run's planned empty marks
        are left unwritten; ``recovered`` is in store order; the failure counters are not
        negative.  O(entries log entries), no I/O; call it between operations, not while a
        :meth:`write_many` runs on another thread."""
        where = f"disk slots in {self.directory}"
        if self._space.limit != self.file_bytes:
            raise InvariantError(
                f"{where}: free space spans {self._space.limit} B, the file {self.file_bytes}"
            )
        used = []
        for key, e in self.entries.items():
            if key != (e.group_id, e.block_hash):
                raise InvariantError(f"{where}: entry {e} is filed under key {key}")
            if not 0 < e.size <= self.sizes[-1]:
                raise InvariantError(
                    f"{where}: entry {key} holds {e.size} B; slots hold 1 to {self.sizes[-1]}"
                )
            if not 0 <= e.stamp < self._stamp:
                raise InvariantError(
                    f"{where}: entry {key} has stamp {e.stamp}, the next stamp is {self._stamp}"
                )
            used.append((e.offset, slot_stride(e.size), f"entry {key} ({e.size} B)"))
        if self._marks:
            raise InvariantError(f"{where}: empty marks {self._marks.marks} were never written")
        check_tiling(self._space, used, where)
        stamps = [e.stamp for e in self.recovered]
        if stamps != sorted(stamps):
            raise InvariantError(f"{where}: recovered entries are not in store order: {stamps}")
        if min(self.write_errors, self.no_room) < 0:
            raise InvariantError(
                f"{where}: write_errors {self.write_errors}, no_room {self.no_room}"
            )

    def close(self) -> None:
        """Close the files and release the directory's lock."""
        if self._lock_fd >= 0 and _HELD_HERE.get(self._lock_id) == os.getpid():
            del _HELD_HERE[self._lock_id]
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._lock_fd = -1

    def __del__(self) -> None:
        self.close()

    # -- slots --------------------------------------------------------------------------------
    def _take(self, size: int) -> int | None:
        """The offset of a slot for a ``size``-byte payload, or None when no free space
        has room.  A slot split from a larger free extent plans the empty marks that
        :meth:`_write_marks` puts in the file before the run's writes (:class:`SplitMarks`:
        the rest's, and the slot's own once a later slot of the run follows it), so a walk
        after a kill finds every whole slot, whichever of the run's writes happened."""
        got = self._space.take(slot_stride(size))
        if got is None:
            return None
        offset, rest = got
        self._marks.taken(offset, rest)
        return offset

    def _write_marks(self, sizes: Sequence[int], places: Sequence[tuple[int, int] | None]) -> bool:
        """Write the empty marks the run's splits planned (one header each, highest offset
        first); True when they are out.  When one fails (an I/O error) every slot of the run
        (``places``, for payloads of ``sizes``) is freed again, highest first, each marked
        empty with its free neighbours (:meth:`_give`): the run stores nothing, and the
        walk's chain of headers stays whole at every step."""
        try:
            self._marks.write(self._pwrite)
        except OSError as exc:
            logger.warning("disk cache: marking free space failed: %s", exc)
            taken = sorted(
                ((p[0], size) for p, size in zip(places, sizes, strict=True) if p is not None),
                reverse=True,
            )
            for offset, size in taken:
                self._give(offset, size)
            self.write_errors += len(taken)
            return False
        return True

    def _give(self, offset: int, size: int) -> None:
        """Free the slot at ``offset`` (a ``size``-byte payload): it joins its free
        neighbours, and one header at the joined extent's start marks the whole of it empty
        (a slot whose mark fails stays committed in the file: a later process adopts its
        entry, whose bytes are still right).  Marks a run being carved planned inside the
        joined extent are dropped: this header supersedes them."""
        start, length = self._space.give(offset, slot_stride(size))
        self._marks.freed(start, length)
        with contextlib.suppress(OSError):
            self._pwrite(empty_header(length), start)

    def _pwrite(self, data: bytes, offset: int) -> None:
        """Write a header (a drop's or a failed write's empty mark)."""
        pwrite_all(self._fd, data, offset)

    def _pwritev(self, pieces: Sequence[bytes | memoryview], offset: int) -> None:
        """Write an entry's header and payload pieces back to back from ``offset``."""
        pwritev_all(self._fd, pieces, offset)
