"""The engine's disk tier: :class:`~hybridkv.storage.disk_slots.DiskSlots` behind worker
threads, so the step neither writes nor reads the disk.

* **Writes** (a block the tier above evicted, or one the device evicted straight to disk)
  are copied into a host tensor in the step, then written, checksummed, by one writer
  thread in the order they were asked for, drops and clears in the same queue; a step's
  operations go to the writer in jobs of ``batch_bytes`` (the writer starts while the step
  still copies the rest) and one at the end (:meth:`DiskTier.commit`).  The writer shares
  each run of writes with a helper thread
  (:meth:`~hybridkv.storage.disk_slots.DiskSlots.write_many`: each takes the next entry,
  checksums it and writes it with its header).  At most
  ``max_pending_bytes`` wait for it; a step that would queue more first waits for the oldest
  (back-pressure, never an unbounded queue).  All changes to the slots happen on that thread.
* **Reads** run on reader threads before a request is admitted: the disk blocks its hit
  loads are split over the readers (:meth:`DiskTier.prefetch`), each read into a host
  staging tensor and checked (:meth:`DiskTier.read_state`); the
  step's ``load`` then copies the checked bytes to the device.  A key with a write still
  queued is read only after the write is done.  A result that raced a drop or a rewrite of
  its key (a newer generation) is thrown away and read again.

Host memory stays bounded by the work in flight, not by the keys ever written: a key's
generation is kept only while a read of it is in flight, a bad read nobody asks about is
forgotten after as many ticks as a checked copy, and a copy leaves its reader job's result
once staged or given back (:meth:`DiskTier.check_invariants` checks these structures).

A cache in host memory needs no staging copy: :meth:`DiskTier.write_borrowed` queues the
blocks' own bytes, which the writer and the helper thread then checksum and write between
them, and :meth:`DiskTier.settle` waits for them before the caller changes that memory.

Reads and writes both release the GIL (``pread``/``pwrite`` and the XXH3 checksums of large
buffers), so they overlap each other and the model's step.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from hybridkv.engine.disk_batches import Item, Key, run_batch
from hybridkv.engine.disk_tier_check import check_disk_tier
from hybridkv.storage.disk_slots import DiskCacheError, DiskSlots

__all__ = ["DiskTier"]

#: A reader job's result: each key it read, with its checked copy or None (bad).
_Result = dict[Key, torch.Tensor | None]


def _malformed(entries: Sequence[tuple[Key, int]]) -> int:
    """How many of ``entries`` are not ``((group, hash), tag)``."""
    return sum(1 for e in entries if not (len(e) == 2 and len(e[0]) == 2))


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
        batch_bytes: int = 8 << 20,
    ) -> None:
        self.slots = slots
        #: Queued writes go to the writer in jobs of about this many bytes (or at commit).
        self.batch_bytes = batch_bytes
        self.pin = pin
        self.max_pending_bytes = max_pending_bytes
        #: The process whose threads these are: a forked child has none of them.
        self._pid = os.getpid()
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-disk-write")
        #: Shares each run of writes with the writer (checksums and writes).
        self._helper = cf.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-disk-help")
        self._readers = (
            cf.ThreadPoolExecutor(readers, thread_name_prefix="hybridkv-disk-read")
            if readers
            else None
        )
        #: Queued writer jobs, oldest first, with the bytes each holds and the keys it writes
        #: or drops (their :attr:`_writing` entries go with it once it is done).
        self._queue: deque[tuple[cf.Future[object], int, list[Key]]] = deque()
        self._queued_bytes = 0
        #: The newest write of each key still queued (only keys of jobs in ``_queue``).
        self._writing: dict[Key, cf.Future[object]] = {}
        #: Advanced by every write and drop; a read records it when asked.
        self._clock = 0
        #: Keys whose read in flight a later write or drop made stale (never staged), with the
        #: clock of that write or drop (> the read's); an entry goes with its read.
        self._gen: dict[Key, int] = {}
        #: Reads in flight, or done and not yet seen: the clock when asked, and the job reading
        #: it (a copy leaves the job's result once staged or given back).
        self._reads: dict[Key, tuple[int, cf.Future[_Result]]] = {}
        #: Finished reads of a bad copy (or that raised) not yet asked about, with the
        #: :meth:`tick` that saw them, oldest first (forgotten, like staged copies, by age).
        self._bad_at: dict[Key, int] = {}
        #: Checked bytes waiting for their load.
        self.staged: dict[Key, torch.Tensor] = {}
        #: The :meth:`tick` each staged copy was last asked for, oldest first.
        self._staged_at: dict[Key, int] = {}
        self._ticks = 0
        #: A staged copy nobody asked for (:meth:`read_state`, :meth:`take`) in this many
        #: ticks is given back: its request was admitted without the hit, aborted or moved
        #: on, and the copy would otherwise hold host memory outside every budget until its
        #: entry left the disk.  A later ask reads it again.
        self.max_staged_ticks = 8
        #: Staged copies given back unused (by age).
        self.expired = 0
        #: Bad reads forgotten unasked by age (not in :attr:`bad_reads`: nothing discarded).
        self.expired_bad = 0
        self._closed = False
        #: Reads that found a copy missing, torn or corrupt.
        self.bad_reads = 0
        #: Runs of writes the writer could not make (raised: logged, their entries missing),
        #: and entries the slots refused (a size no slot holds; the rest of their run is written).
        self.failed_runs = 0
        self.readers = readers
        #: Writes (with the CUDA event their bytes are ready at, if any), drops (no data) and
        #: clears (None) not yet handed to the writer.
        self._batch: list[Item | None] = []
        self._batch_bytes = 0
        self._pending_keys: list[Key] = []
        #: A clear in the batch not yet handed over, and the writer job running one.
        self._clear_queued = False
        self._clearing: cf.Future[object] | None = None
        #: Host tensors free for reuse, by size: steady-state reads and writes allocate none.
        #: At most ``max_spare_bytes`` are kept (runs come in several sizes, each of which
        #: would otherwise keep its own peak: pinned memory on CUDA); the rest are freed.
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._spare_bytes = 0
        self._spare_lock = threading.Lock()
        #: Borrowed payloads queued and maybe not yet written (:meth:`settle` waits).
        self._borrowed = False
        self.max_spare_bytes = max_pending_bytes + 2 * batch_bytes

    def buffer(self, size: int) -> torch.Tensor:
        """A host uint8 tensor of ``size`` bytes to fill (hand it to :meth:`write`, or back
        with :meth:`give`)."""
        with self._spare_lock:
            spare = self._spare.get(size)
            if spare:
                self._spare_bytes -= size
                return spare.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, data: torch.Tensor) -> None:
        """Return a tensor from :meth:`buffer` or :meth:`take` once its bytes are used (kept
        for reuse while the spares stay within ``max_spare_bytes``, else freed)."""
        size = data.numel()
        with self._spare_lock:
            if self._spare_bytes + size <= self.max_spare_bytes:
                self._spare.setdefault(size, []).append(data)
                self._spare_bytes += size

    @property
    def spare_bytes(self) -> int:
        """Bytes of the tensors kept for reuse."""
        return self._spare_bytes

    # -- writer queue ---------------------------------------------------------------------------
    def write(
        self, key: Key, tag: int, data: torch.Tensor, ready: torch.cuda.Event | None = None
    ) -> None:
        """Queue ``data`` (a CPU uint8 tensor the tier now owns, and reuses once written) as
        entry ``key``; it goes to the writer with the rest of the batch at :meth:`commit`.
        ``ready``: a CUDA event recorded after the (asynchronous) copy that fills ``data``; the
        threads wait for it before they read the bytes.  A write that fails stores nothing:
        the entry then reads as bad (a rewrite that finds no slot keeps the old copy)."""
        self.write_run([(key, tag)], [data.numel()], data, ready)

    def write_run(
        self,
        entries: Sequence[tuple[Key, int]],
        sizes: Sequence[int],
        data: torch.Tensor,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue consecutive byte ranges of ``data`` (a CPU uint8 tensor from :meth:`buffer`,
        owned by the tier now: reused once every range is written) as entries: the ``i``-th
        ``(key, tag)`` of ``entries`` gets the next ``sizes[i]`` bytes.  One wait for ``ready``
        serves the whole run, so many small blocks cost the step little more than one.  Each
        entry is written, committed or failed on its own, as by :meth:`write`."""
        self._own()
        bad = _malformed(entries)
        if bad or len(entries) != len(sizes) or any(n < 0 for n in sizes):
            raise ValueError(
                f"disk write run: entries must be ((group, hash), tag) with one size >= 0 "
                f"each; got {len(entries)} entries ({bad} malformed) and sizes "
                f"{list(sizes)[:8]}"
            )
        if sum(sizes) > data.numel():
            raise ValueError(f"disk write run: {sum(sizes)} bytes of a {data.numel()}-byte buffer")
        if not entries:
            self.give(data)
            return
        last, start = len(sizes) - 1, 0
        for i, ((key, tag), size) in enumerate(zip(entries, sizes, strict=True)):
            part = data[start : start + size]
            start += size
            self._batch.append((key, tag, part, ready, data if i == last else None))
            self._touch(key)
        self._batch_bytes += data.numel()
        if self._batch_bytes >= self.batch_bytes:  # let the writer start on what is ready
            self.commit()

    def write_borrowed(
        self, entries: Sequence[tuple[Key, int]], payloads: Sequence[Sequence[memoryview]]
    ) -> None:
        """Queue a run of entries whose bytes the writer reads from the caller's memory: the
        ``i``-th ``(key, tag)`` of ``entries`` gets the concatenation of ``payloads[i]``
        (checksummed as one payload, written with its header by one ``pwritev``), with no
        staging copy.  The caller must leave that memory unchanged until :meth:`settle`
        returns.  For a cache that lives in host memory, where the staging copy would cost as
        much memory traffic as the write itself.  They go to the writer at :meth:`commit`
        (or :meth:`settle`) as one job, not in jobs of ``batch_bytes``: they hold no staging
        memory, the caller waits for them anyway, and each job ends with one of its two
        threads idle while the other finishes its last entry (measured: 128 blocks of 1 MiB
        in jobs of 8 took 8-14% longer than as one)."""
        self._own()
        bad = _malformed(entries)
        if bad or len(entries) != len(payloads):
            raise ValueError(
                f"disk borrowed run: entries must be ((group, hash), tag) with one payload "
                f"each; got {len(entries)} entries ({bad} malformed) and "
                f"{len(payloads)} payloads"
            )
        for (key, tag), pieces in zip(entries, payloads, strict=True):
            part = tuple(pieces)
            self._batch.append((key, tag, part, None, None))
            self._batch_bytes += sum(v.nbytes for v in part)
            self._touch(key)
        self._borrowed = self._borrowed or bool(entries)

    def settle(self) -> None:
        """Wait until every borrowed payload (:meth:`write_borrowed`) is written, so the
        caller may change that memory again (nothing to wait for when none is queued)."""
        if self._borrowed:
            self.flush()

    def drop(self, key: Key) -> None:
        """Queue the removal of entry ``key`` (nothing when it is not stored)."""
        self._own()
        self._batch.append((key, 0, None, None, None))
        self._touch(key)

    def clear(self) -> None:
        """Queue the removal of every entry; forget staged and in-flight reads (no read
        starts until the removal is done)."""
        self._own()
        self._batch.append(None)
        self._clear_queued = True
        for key in list(self._reads):
            job = self._pop_read(key)
            if not job.cancel():  # running or done: its copy goes back once it is
                job.add_done_callback(functools.partial(self._release, key))
        self._give_back_staged()

    def _touch(self, key: Key) -> None:
        self._clock += 1
        if key in self._reads:  # its read in flight is stale now
            self._gen[key] = self._clock
            self._bad_at.pop(key, None)
        stale = self._unstage(key)
        if stale is not None:
            self.give(stale)
        self._pending_keys.append(key)

    def commit(self) -> None:
        """Hand the queued writes, drops and clears to the writer thread as one job (first
        waiting for older jobs while more than ``max_pending_bytes`` would be queued)."""
        if not self._batch:
            return
        self._own()
        nbytes = self._batch_bytes
        while self._queue and self._queued_bytes + nbytes > self.max_pending_bytes:
            self._pop_job().result()
        job = self._writer.submit(self._run_batch, self._batch)
        keys = self._pending_keys
        for key in keys:
            self._writing[key] = job
        self._queue.append((job, nbytes, keys))
        self._queued_bytes += nbytes
        if self._clear_queued:
            self._clearing, self._clear_queued = job, False
        self._batch, self._batch_bytes, self._pending_keys = [], 0, []
        self._pop_done_jobs()

    def _pop_job(self) -> cf.Future[object]:
        """Take the oldest job off the queue, with its bytes and :attr:`_writing` entries."""
        job, nbytes, keys = self._queue.popleft()
        self._queued_bytes -= nbytes
        for key in keys:
            if self._writing.get(key) is job:
                del self._writing[key]
        return job

    def _pop_done_jobs(self) -> None:
        """Take the finished jobs off the queue (one writer: they are the oldest)."""
        while self._queue and self._queue[0][0].done():
            self._pop_job()

    def _cleared(self) -> bool:
        """Whether no queued clear is still to run (reads wait for it)."""
        if self._clear_queued:
            self.commit()
        job = self._clearing
        if job is None:
            return True
        if not job.done():
            return False
        self._clearing = None
        return True

    def _run_batch(self, batch: list[Item | None]) -> object:
        """The writer's job (:func:`~hybridkv.engine.disk_batches.run_batch`)."""
        self.failed_runs += run_batch(self.slots, self._helper, batch, self.give)
        return None

    def flush(self) -> None:
        """Wait until every queued write, drop and clear is done."""
        self.commit()
        while self._queue:
            self._pop_job().result()
        self._borrowed = False
        self._writing.clear()
        self._clearing = None

    # -- reads ----------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[Key]) -> None:
        """Start reading and checking ``keys`` (those not staged, read or being written),
        split over the reader threads."""
        self._own()
        self.commit()
        if not self._cleared():
            return
        writing = self._writing_now()
        todo = [
            k
            for k in dict.fromkeys(keys)
            if k not in self.staged and k not in writing and self._stale(k)
        ]
        if not todo or self._readers is None:
            return
        n = self.readers
        for part in (todo[i::n] for i in range(n)):
            if part:
                job = self._readers.submit(self._read_many, part)
                for k in part:
                    if k in self._reads:
                        self._abandon(k)  # a stale read
                    self._reads[k] = (self._clock, job)

    def _own(self) -> None:
        """Refuse work once closed, and in a forked child: the writer, helper and reader
        threads stayed in the parent, so a job handed to them would never run and its
        caller would wait forever."""
        if self._closed:
            raise DiskCacheError(f"disk tier of {self.slots.directory}: used after close()")
        if os.getpid() != self._pid:
            raise DiskCacheError(
                f"disk tier of {self.slots.directory}: used in a forked child (pid {os.getpid()}, "
                f"opened by {self._pid}); its threads stayed in the parent, open the "
                "directory in this process instead"
            )

    def _writing_now(self) -> dict[Key, cf.Future[object]]:
        """The keys with a write still queued (finished jobs taken off first)."""
        self._pop_done_jobs()
        return self._writing

    def _stale(self, key: Key) -> bool:
        """Whether ``key`` has no read in flight, or one a later write or drop made stale."""
        read = self._reads.get(key)
        return read is None or self._gen.get(key, 0) > read[0]

    def _pop_read(self, key: Key) -> cf.Future[_Result]:
        """Forget ``key``'s read (and its generation and bad mark); returns its job."""
        self._gen.pop(key, None)
        self._bad_at.pop(key, None)
        return self._reads.pop(key)[1]

    def _abandon(self, key: Key) -> None:
        """Forget ``key``'s read; its copy goes back to the spares once its job is done."""
        self._pop_read(key).add_done_callback(functools.partial(self._release, key))

    def _release(self, key: Key, job: cf.Future[_Result]) -> None:
        """Give back ``key``'s copy from finished ``job`` (it may run on a reader thread)."""
        if job.cancelled() or job.exception() is not None:
            return
        data = job.result().pop(key, None)
        if data is not None:
            self.give(data)

    def read_state(self, key: Key) -> bool | None:
        """True: ``key``'s copy is read and checked (in :attr:`staged`); False: it is missing,
        torn or corrupt; None: its read (or the write before it) is still in flight."""
        self._own()
        if key in self.staged:
            self._stage(key, self.staged[key])  # asked for: young again
            return True
        self.commit()
        if not self._cleared():
            return None
        writing = self._writing.get(key)
        if writing is not None:
            if not writing.done():
                return None
            del self._writing[key]
        if self._stale(key):
            if self._readers is None:
                return self._settle(key, self._read(key))
            if key in self._reads:
                self._abandon(key)
            self.prefetch([key])
            return None
        job = self._reads[key][1]
        if not job.done():
            return None
        self._pop_read(key)
        return self._settle(key, job.result().pop(key))  # (raises the reader's error)

    def _settle(self, key: Key, data: torch.Tensor | None) -> bool:
        if data is None:
            self.bad_reads += 1
            return False
        self._stage(key, data)
        return True

    def _stage(self, key: Key, data: torch.Tensor) -> None:
        """Stage ``data`` as ``key``'s checked copy, youngest (asked for at this tick)."""
        self.staged[key] = data
        self._staged_at.pop(key, None)
        self._staged_at[key] = self._ticks

    def _give_back_staged(self) -> None:
        for data in self.staged.values():
            self.give(data)
        self.staged.clear()
        self._staged_at.clear()

    def _unstage(self, key: Key) -> torch.Tensor | None:
        self._staged_at.pop(key, None)
        return self.staged.pop(key, None)

    def tick(self) -> int:
        """Advance the staging clock by one (the tier store does at the end of each
        :meth:`~hybridkv.engine.tier_store.TierStore.apply`) and give back the staged copies
        not asked for in :attr:`max_staged_ticks` ticks (finished reads nobody asked for yet
        are staged first, so their copies age too); returns how many.  Finished bad reads age
        the same way (:attr:`expired_bad`); stale reads are forgotten at once."""
        self._ticks += 1
        self._pop_done_jobs()
        for key, (_, job) in list(self._reads.items()):
            if key in self._gen:
                self._abandon(key)  # written or dropped since it was asked: a stale copy
            elif not job.done() or key in self._bad_at:
                continue
            elif job.cancelled() or job.exception() is not None or job.result()[key] is None:
                self._bad_at[key] = self._ticks  # read_state reports it if asked in time
            else:
                self._pop_read(key)
                data = job.result().pop(key)
                assert data is not None
                self._stage(key, data)
        for key, at in list(self._bad_at.items()):  # oldest first
            if self._ticks - at <= self.max_staged_ticks:
                break
            self._pop_read(key)
            self.expired_bad += 1
        old = 0
        for at in self._staged_at.values():  # oldest first: stop at the first young one
            if self._ticks - at <= self.max_staged_ticks:
                break
            old += 1
        for key in list(itertools.islice(self._staged_at, old)):
            del self._staged_at[key]
            self.give(self.staged.pop(key))
        self.expired += old
        return old

    def _read_many(self, keys: list[Key]) -> _Result:
        return {k: self._read(k) for k in keys}

    def _read(self, key: Key) -> torch.Tensor | None:
        entry = self.slots.entries.get(key)
        if entry is None:
            return None
        out = self.buffer(entry.size)
        if self.slots.read(key, out.numpy().data):
            return out
        self.give(out)
        return None

    def take(self, key: Key) -> torch.Tensor | None:
        """The checked bytes of ``key`` for its load (:meth:`give` them back after): staged
        ones, those of its finished prefetch, or (when no check ran before the admission)
        read and checked now, after its queued write; None when bad."""
        self._own()
        data = self._unstage(key)
        if data is not None:
            return data
        self.commit()
        if self._clearing is not None:
            self._clearing.result()
            self._clearing = None
        writing = self._writing.pop(key, None)
        if writing is not None:
            writing.result()
        data = self._done_copy(key)  # (found by review: a finished prefetch was read again)
        if data is not None:
            return data
        if key in self._reads:  # read here: that copy would only wait, staged and unasked
            self._abandon(key)
        data = self._read(key)
        if data is None:
            self.bad_reads += 1
        return data

    def _done_copy(self, key: Key) -> torch.Tensor | None:
        """``key``'s checked copy from its read, taken off it, when that read is current (no
        write or drop since it was asked), finished and good; else None (the read stays)."""
        read = self._reads.get(key)
        if read is None or key in self._gen or not read[1].done():
            return None
        job = read[1]
        if job.cancelled() or job.exception() is not None or job.result().get(key) is None:
            return None
        self._pop_read(key)
        return job.result().pop(key)

    def reading(self) -> bool:
        """Whether reads (or writes a read waits for) are in flight."""
        return (
            any(not f.done() for _, f in self._reads.values())
            or any(not f.done() for f in self._writing.values())
            or (self._clearing is not None and not self._clearing.done())
        )

    def wait(self) -> None:
        """Block until at least one in-flight read or write is done."""
        pending: list[cf.Future[Any]] = [f for _, f in self._reads.values() if not f.done()]
        pending += [f for f in self._writing.values() if not f.done()]
        if self._clearing is not None and not self._clearing.done():
            pending.append(self._clearing)
        if pending:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)

    def check_invariants(self) -> None:
        """Check what the tier keeps redundant (raises :class:`~hybridkv.errors.InvariantError`
        naming the first broken invariant): staged copies against their ages and disk entries,
        the batch and queue byte counts against their contents and ``max_pending_bytes``, the
        spares against ``max_spare_bytes`` (and never holding a tensor still in use), and the
        generations and bad marks against the reads in flight; and, when no write is queued
        or running, the slots' own bookkeeping (:meth:`DiskSlots.check_invariants`, which
        the writer thread changes).  O(entries held); no I/O."""
        check_disk_tier(self)
        if not self._batch and all(job.done() for job, _, _ in self._queue):
            self.slots.check_invariants()

    def close(self) -> None:
        """Finish every queued write and in-flight read, then close the directory (threads
        and files are given back even when finishing raised)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._give_back_staged()
            self._writer.shutdown(wait=True)
            self._helper.shutdown(wait=True)
            if self._readers is not None:
                self._readers.shutdown(wait=True)
            self.slots.close()
