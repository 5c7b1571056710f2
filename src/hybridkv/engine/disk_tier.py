"""The engine's disk tier: :class:`~hybridkv.storage.disk_slots.DiskSlots` behind worker
threads, so the step neither writes nor reads the disk.

* **Writes** (a block the tier above evicted, or one the device evicted straight to disk)
  are copied into a host tensor in the step, then written, checksummed, by one writer
  thread in the order they were asked for, drops and clears in the same queue.  At most
  ``max_pending_bytes`` wait for it; a step that would queue more first waits for the oldest
  (back-pressure, never an unbounded queue).  All changes to the slots happen on that thread.
* **Reads** run on reader threads before a request is admitted: each disk block its hit
  loads is read into a host staging tensor and checked (:meth:`DiskTier.read_state`); the
  step's ``load`` then copies the checked bytes to the device.  A key with a write still
  queued is read only after the write is done.  A result that raced a drop or a rewrite of
  its key (a newer generation) is thrown away and read again.

Reads and writes both release the GIL (``pread``/``pwrite`` and zlib's CRC-32 on large
buffers), so they overlap each other and the model's step.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.storage.disk_slots import DiskSlots

__all__ = ["DiskTier"]

Key = tuple[int, int]


class DiskTier:
    """``slots`` with asynchronous writes and checked reads (see the module doc).
    ``readers``: reader threads (0: read inline, in the caller); ``pin``: staging tensors in
    pinned memory (the cache lives on CUDA)."""

    def __init__(
        self,
        slots: DiskSlots,
        *,
        readers: int = 2,
        pin: bool = False,
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        self.slots = slots
        self.pin = pin
        self.max_pending_bytes = max_pending_bytes
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-disk-write")
        self._readers = (
            cf.ThreadPoolExecutor(readers, thread_name_prefix="hybridkv-disk-read")
            if readers
            else None
        )
        #: Queued writer jobs, oldest first, with the bytes each holds.
        self._queue: deque[tuple[cf.Future[object], int]] = deque()
        self._queued_bytes = 0
        #: The newest write of each key still queued.
        self._writing: dict[Key, cf.Future[object]] = {}
        #: Per key, bumped by every write and drop: a read of an older generation is stale.
        self._gen: dict[Key, int] = {}
        self._reads: dict[Key, tuple[int, cf.Future[torch.Tensor | None]]] = {}
        #: Checked bytes waiting for their load.
        self.staged: dict[Key, torch.Tensor] = {}
        #: Reads that found a copy missing, torn or corrupt.
        self.bad_reads = 0

    # -- writer queue ---------------------------------------------------------------------------
    def _submit(
        self, key: Key | None, nbytes: int, fn: Callable[..., object], *args: object
    ) -> None:
        while self._queue and self._queued_bytes + nbytes > self.max_pending_bytes:
            done, size = self._queue.popleft()
            done.result()
            self._queued_bytes -= size
        job = self._writer.submit(fn, *args)
        self._queue.append((job, nbytes))
        self._queued_bytes += nbytes
        while self._queue and self._queue[0][0].done():
            self._queued_bytes -= self._queue.popleft()[1]
        if key is not None:
            self._writing[key] = job
            self._gen[key] = self._gen.get(key, 0) + 1
            self.staged.pop(key, None)

    def write(self, key: Key, tag: int, data: torch.Tensor) -> None:
        """Queue ``data`` (a CPU uint8 tensor the tier now owns) as entry ``key``.  A write
        that fails stores nothing: the entry then reads as bad."""
        self._submit(key, data.numel(), self._write, key, tag, data)

    def _write(self, key: Key, tag: int, data: torch.Tensor) -> None:
        self.slots.write(key, tag, data.numpy().data)

    def drop(self, key: Key) -> None:
        """Queue the removal of entry ``key`` (nothing when it is not stored)."""
        self._submit(key, 0, self.slots.drop, key)

    def clear(self) -> None:
        """Queue the removal of every entry; forget staged and in-flight reads."""
        self._submit(None, 0, self.slots.clear)
        self.staged.clear()
        self._reads.clear()
        for key in self._gen:
            self._gen[key] += 1

    def flush(self) -> None:
        """Wait until every queued write, drop and clear is done."""
        while self._queue:
            self._queue.popleft()[0].result()
        self._queued_bytes = 0
        self._writing.clear()

    # -- reads ----------------------------------------------------------------------------------
    def read_state(self, key: Key) -> bool | None:
        """True: ``key``'s copy is read and checked (in :attr:`staged`); False: it is missing,
        torn or corrupt; None: its read (or the write before it) is still in flight."""
        if key in self.staged:
            return True
        writing = self._writing.get(key)
        if writing is not None:
            if not writing.done():
                return None
            del self._writing[key]
        gen = self._gen.get(key, 0)
        job = self._reads.get(key)
        if job is not None and job[0] != gen:
            job = None  # raced a drop or a rewrite: read again
        if job is None:
            if self._readers is None:
                return self._settle(key, self._read(key))
            self._reads[key] = (gen, self._readers.submit(self._read, key))
            return None
        if not job[1].done():
            return None
        del self._reads[key]
        return self._settle(key, job[1].result())

    def _settle(self, key: Key, data: torch.Tensor | None) -> bool:
        if data is None:
            self.bad_reads += 1
            return False
        self.staged[key] = data
        return True

    def _read(self, key: Key) -> torch.Tensor | None:
        entry = self.slots.entries.get(key)
        if entry is None:
            return None
        out = torch.empty(entry.size, dtype=torch.uint8, pin_memory=self.pin)
        return out if self.slots.read(key, out.numpy().data) else None

    def take(self, key: Key) -> torch.Tensor | None:
        """The checked bytes of ``key`` for its load: staged ones, or (when no check ran
        before the admission) read and checked now, after its queued write; None when bad."""
        data = self.staged.pop(key, None)
        if data is not None:
            return data
        writing = self._writing.pop(key, None)
        if writing is not None:
            writing.result()
        data = self._read(key)
        if data is None:
            self.bad_reads += 1
        return data

    def reading(self) -> bool:
        """Whether reads (or writes a read waits for) are in flight."""
        return any(not f.done() for _, f in self._reads.values()) or any(
            not f.done() for f in self._writing.values()
        )

    def wait(self) -> None:
        """Block until at least one in-flight read or write is done."""
        pending: list[cf.Future[Any]] = [f for _, f in self._reads.values() if not f.done()]
        pending += [f for f in self._writing.values() if not f.done()]
        if pending:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)

    def close(self) -> None:
        """Finish every queued write and in-flight read, then close the directory."""
        self.flush()
        self._writer.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self.slots.close()
