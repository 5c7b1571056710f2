"""The bytes of the lower cache tiers for :class:`~hybridkv.engine.llm_engine.LLMEngine`.

The manager decides (:mod:`hybridkv.cache.tiers`); :class:`TierStore` carries out its
:class:`~hybridkv.cache.tiers.TierOp` stream, in order, before each step's model pass:

* ``store``: the device evicted a cached block to reuse it; its bytes are still intact (no
  step has written the block since), so they are gathered through the storage's transfer
  descriptor (:func:`hybridkv.storage.transfer.gather`: one copy per coalesced byte range,
  one for a cross-layer page-size group) into a host tensor;
* ``load``: a hit reads an entry back: scattered into the fresh device block the manager
  allocated for it, before the step reads that block;
* ``move`` / ``drop`` / ``clear``: a tier evicted an entry down, or out;
* ``relocate``: compaction moved a device block (consecutive ones copied as one batch,
  :meth:`~hybridkv.storage.storage.KVCacheStorage.move_blocks`), in its place in the stream:
  after the stores that read what it overwrites and the loads into what it moves.

Host entries live in one CPU buffer of the tier's capacity (pinned when the cache lives on
CUDA; on CPU its pages are only touched when first written), carved into slots of each
group's packed block size; a freed slot joins its free neighbours, which later slots of any
size reuse (:class:`~hybridkv.engine.host_slots.HostSlots`), so steady-state copies allocate
nothing.  The manager counts the tier's bytes, not where they lie, so an entry can still find
no room there (free space left in pieces too small): it gets a tensor of its own.  Those
tensors are bounded: once they hold more than :data:`OVERFLOW_SHARE` of the tier's capacity
(and more than one entry), :meth:`TierStore.sync` drops the oldest of them from the
manager's host tier until they do not (a copy on disk stays; the drop runs in the same sync),
so host memory stays within the capacity and that share, or one entry more.  Before
2026-11-28 they were not bounded.  On the Mooncake trace's first 2,000 requests (16 GiB
device, 128 GiB host) 104-118 of 1.3-1.4 million host stores of Nemotron-H-8B, Jamba-v0.1
and Qwen3-Next-80B-A3B, whose state checkpoints are 16-98 times an attention block, found no
room, and their tensors peaked at 262 MiB-1.3 GiB (none of gpt-oss-20b's blocks, all of one
size): under the 2 GiB share.
Discarding every such entry at once instead lost a protected conversation's hit in
``tests/test_engine_sessions.py``; compacting the buffer instead (sliding entries down from
its start until a gap fits) moved terabytes on that trace.

A disk tier's entries live in a :class:`~hybridkv.storage.disk_slots.DiskSlots` directory
(checksummed slots in a preallocated file, kept across processes).  A disk copy is checked
before it is used: :meth:`TierStore.check_hit` runs before a waiting request is admitted
(the scheduler's ``hit_check``), reads the request's disk blocks into host staging tensors on
reader threads and checks them (:mod:`hybridkv.engine.disk_tier`, which also writes on a
thread of its own); a copy that fails (a write that failed, a truncated file, a flipped
byte, a slot a killed process left half written) is discarded from the
manager, whose next lookup misses it, and a request whose reads are in flight waits while
the others run.  The ``load`` later copies the checked staging bytes to the device.

Consecutive disk stores and loads of blocks whose ranges are rows of one table (every
page-size group) move in runs (:mod:`~hybridkv.engine.disk_runs`): per block the step pays a
few microseconds of Python, not a copy call, an event and a thread hand-off.  A cache in host
memory stages nothing on the way out: its disk stores hand the writer the blocks' own byte
ranges, and :meth:`TierStore.apply` waits for those writes before a load writes the storage
and before it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

import torch

from hybridkv.cache import ComputedBlocks, KVCacheManager, Request
from hybridkv.cache.tiers import TierOp
from hybridkv.engine import host_runs
from hybridkv.engine.block_places import BlockPlaces, Place
from hybridkv.engine.disk_runs import load_in_place, load_staged, store_borrowed, store_staged
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.errors import EngineError
from hybridkv.engine.host_runs import BlockRows, load_rows, merge_runs, store_rows
from hybridkv.engine.host_slots import HostSlots
from hybridkv.errors import InvariantError, StorageError
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.disk_slots import DiskSlots

__all__ = ["OVERFLOW_SHARE", "TierStore"]

#: The share of the host tier's capacity that entries finding no room in its buffer may hold
#: in tensors of their own (see the module doc).
OVERFLOW_SHARE = 1 / 64


def _run_end(todo: list[TierOp], start: int, kind: str, tier: str) -> int:
    """The index past the operations from ``start`` on that are ``kind`` on ``tier`` (no
    destination): the rest of a run the operation before ``start`` opened."""
    j, n = start, len(todo)
    while j < n and (nxt := todo[j]).op == kind and nxt.tier == tier and not nxt.dest:
        j += 1
    return j


def _host_copy(op: TierOp) -> bool:
    """Whether ``op`` copies a block between the device and the host tier."""
    return op.tier == "host" and op.op in ("store", "load") and not op.dest


class TierStore:
    """Tier entries ``(group, hash) -> packed block bytes`` over one engine's storage: host
    entries in slots of a buffer of ``host_bytes`` (0, or no room: a tensor per entry), disk
    entries in ``disk``.  ``readers``: threads that read and check disk copies (0: inline)."""

    def __init__(
        self,
        storage: KVCacheStorage,
        host_bytes: int = 0,
        disk: DiskSlots | None = None,
        *,
        readers: int = 2,
    ) -> None:
        self.storage = storage
        #: Host entries: ``(slot offset, bytes)`` in the host buffer, offset -1 for an entry
        #: in a tensor of its own (in ``_own``).  No tensor is made per slot entry.
        self._host: dict[tuple[int, int], tuple[int, int]] = {}
        self._own: dict[tuple[int, int], torch.Tensor] = {}
        self._pin = storage.device.type == "cuda"
        #: On CUDA the copies are queued on the current stream (the step's kernels follow
        #: them in order) and the host does not wait; it synchronizes only before reading
        #: host bytes itself (a move to disk) and before reusing a disk staging tensor.
        self._async = self._pin
        #: Host stores / loads of blocks in adjacent slots merged into runs
        #: (:mod:`hybridkv.engine.host_runs`); False: one copy per block.
        self._coalesce = True
        #: Device-to-host copies queued since the host last waited for the stream.
        self._unsynced = False
        #: Disk staging tensors whose host-to-device copies are queued, with the event
        #: recorded after them: given back to the disk tier once it completed.
        self._held: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        self._closed = False
        self.disk = None if disk is None else DiskTier(disk, readers=readers, pin=self._pin)
        self._slots = HostSlots(host_bytes, self._pin) if host_bytes else None
        #: Each device block's byte places (rows, descriptor, views), built once.
        self._blocks = BlockPlaces(storage, self._async)
        self._rows = self._blocks.rows
        #: Disk stores of a cache in host memory are written from the storage itself
        #: (:func:`~hybridkv.engine.disk_runs.store_borrowed`); False: through staging
        #: copies, as on CUDA.
        self._borrow = storage.device.type == "cpu"
        #: Blocks copied device -> tier and tier -> device so far, and device blocks
        #: compaction moved (``relocate``).
        self.stored = self.loaded = self.relocated = 0
        #: Bytes the host entries that find no room in the buffer may hold in tensors of
        #: their own (:meth:`overflow`), and how many :meth:`sync` discarded past them.
        self.overflow_limit = int(host_bytes * OVERFLOW_SHARE)
        self.overflowed = 0

    @property
    def bad_reads(self) -> int:
        """Disk copies found missing, torn or corrupt (each one discarded: a miss)."""
        return 0 if self.disk is None else self.disk.bad_reads

    # -- checking a hit before its admission ---------------------------------------------------
    def check_hit(
        self, manager: KVCacheManager, request: Request, hit: ComputedBlocks
    ) -> ComputedBlocks | None:
        """The hit to admit ``request`` with: every disk block it loads read and checked
        (discarding bad copies from ``manager`` and looking up again), or None while reads
        are in flight.

        ``manager``'s pending operations run first (:meth:`apply`, without aging the staged
        copies): an admission earlier in the same schedule may have moved an entry this hit
        reads down to disk, and its copy is on disk only once that ``move`` ran (found by
        review: such a copy was read before it was written, counted bad and discarded, a lost
        hit)."""
        self._open("check_hit")
        disk = self.disk
        if disk is None:
            return hit
        pending = manager.take_tier_ops()
        if pending:  # (an empty apply would still wait for borrowed disk writes)
            self.apply(pending, tick=False)
        while True:
            bad: list[tuple[int, int]] = []
            waiting = False
            keys = [(g, h) for g, h, tier in manager.tier_blocks(request, hit) if tier == "disk"]
            disk.prefetch(keys)
            for key in keys:
                state = disk.read_state(key)
                if state is None:
                    waiting = True
                elif state is False:
                    bad.append(key)
            if not bad:
                return None if waiting else hit
            for g, h in bad:
                manager.discard_tier_block(g, h)
            hit = manager.get_computed_blocks(request)

    def reading(self) -> bool:
        """Whether disk reads are in flight."""
        return self.disk is not None and self.disk.reading()

    def wait(self) -> None:
        """Block until at least one in-flight disk read is done."""
        if self.disk is not None:
            self.disk.wait()

    # -- the manager's operations ---------------------------------------------------------------
    def sync(self, manager: KVCacheManager) -> None:
        """Run ``manager``'s pending tier operations (:meth:`apply`), then drop from its host
        tier the entries in tensors of their own past the bound (:meth:`overflow`; a copy of
        the same block on disk stays) and run the ``drop`` operations that records, so the
        manager and this store agree when it returns (found by review: the entries were
        discarded from every tier, a good disk copy too, and dropped here a sync later)."""
        self.apply(manager.take_tier_ops())
        over = [key for key in self.overflow() if manager.drop_tier_copy("host", *key)]
        if over:
            self.overflowed += len(over)
            self.apply(manager.take_tier_ops(), tick=False)

    def overflow(self) -> list[tuple[int, int]]:
        """The oldest host entries in tensors of their own (no room in the buffer) whose
        discarding leaves the others within :attr:`overflow_limit` bytes, or one entry."""
        held = sum(t.numel() for t in self._own.values())
        out: list[tuple[int, int]] = []
        left = len(self._own)
        for key, data in self._own.items():  # oldest first
            if held <= self.overflow_limit or left == 1:
                break
            out.append(key)
            held -= data.numel()
            left -= 1
        return out

    def apply(self, ops: Iterable[TierOp], *, tick: bool = True) -> None:
        """Run ``ops`` in order, then (``tick``) age the disk tier's staged copies, once per
        step.  Raises :class:`EngineError` for a tier the engine does not store or an entry it
        does not hold (a bookkeeping bug: nothing is read)."""
        self._open("apply")
        self._give_back_staging()
        loaded_from_disk: list[torch.Tensor] = []
        todo = list(ops)
        i, n = 0, len(todo)
        while i < n:
            op = todo[i]
            i += 1
            if _host_copy(op):  # with the host copies of the same kind right after it
                j = _run_end(todo, i, op.op, "host")
                run, i = todo[i - 1 : j], j
                if op.op == "store":
                    self._store_run(run)
                else:
                    self._settle()
                    self._load_run(run)
            elif op.op == "relocate":  # compaction's moves, with those right after it
                j = _run_end(todo, i, "relocate", "device")
                run, i = todo[i - 1 : j], j
                self._settle()  # a borrowed disk write may still read a destination
                try:
                    self.storage.move_blocks((o.group_id, o.from_block, o.block) for o in run)
                except StorageError as exc:  # nothing of the run was copied
                    raise EngineError(f"tier store: relocate: {exc}") from exc
                self.relocated += len(run)
            elif op.op == "clear":
                self._clear()
            elif op.op == "store" and op.tier == "disk" and not op.dest:
                j = _run_end(todo, i, "store", "disk")
                run, i = todo[i - 1 : j], j
                self._disk_store_run(run)
            elif op.op == "load" and op.tier == "disk":
                j = _run_end(todo, i, "load", "disk")
                run, i = todo[i - 1 : j], j
                self._disk_load_run(run, loaded_from_disk)
            elif op.tier == "disk" or op.dest == "disk":
                if op.op == "load":
                    self._settle()
                self._disk_op(op, loaded_from_disk)
            elif op.op == "load":
                self._tier(op.tier)  # not a tier this store keeps: raises
            elif op.op == "drop":
                self._tier(op.tier)
                self._entry(op)
                self._release((op.group_id, op.block_hash))
            else:
                raise EngineError(f"tier store: unknown operation {op.op!r} on {op.tier!r}")
        if loaded_from_disk:
            if self._async:
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(torch.cuda.current_stream(self.storage.device))
                self._held.append((done, loaded_from_disk))
            else:
                self._give_back(loaded_from_disk)
        if self.disk is not None:
            self.disk.commit()
            self._settle()
            if tick:
                self.disk.tick()  # staged copies no admission asked for lately are given back

    def _settle(self) -> None:
        """Wait for the disk writes that read the storage itself (a cache in host memory:
        :func:`~hybridkv.engine.disk_runs.store_borrowed`) before anything changes it."""
        if self.disk is not None:
            self.disk.settle()

    def _batches(self, run: list[TierOp]) -> Iterator[tuple[int, int, list[Place], int]]:
        """``run`` cut into batches ``(start, end, places, cap)`` of growing bytes
        (:data:`~hybridkv.engine.host_runs.FIRST_RUN_BYTES` doubling up to
        :data:`~hybridkv.engine.host_runs.RUN_BYTES`, counted in blocks of the batch's first):
        each batch's copies are queued before the host walks the next, so the first start
        after a few blocks.  ``cap``: bytes a run may carry (0 without merging)."""
        cap, n = host_runs.FIRST_RUN_BYTES, len(run)
        places = self._blocks.places
        start = 0
        while start < n:
            first = run[start]
            size = self._blocks.place(first.group_id, first.block)[0]
            end = min(n, start + max(1, cap // size))
            yield start, end, places(run[start:end]), cap if self._coalesce else 0
            start = end
            cap = min(2 * cap, host_runs.RUN_BYTES)

    def _store_run(self, run: list[TierOp]) -> None:
        """Host stores, a batch at a time (:meth:`_batches`): blocks bound for adjacent host
        slots go as one run (:func:`~hybridkv.engine.host_runs.merge_runs`,
        :func:`~hybridkv.engine.host_runs.store_rows`), the others one by one."""
        host, slots = self._host, self._slots
        new: set[tuple[int, int]] = set()
        for op in run:  # before any change: a second store of a key would lose its slot
            key = (op.group_id, op.block_hash)
            if key in host or key in new:
                raise EngineError(
                    f"tier store: store of group {op.group_id} hash {op.block_hash:#x}, which "
                    "the host tier already holds (a drop must come first)"
                )
            new.add(key)
        emit = self._emitter(store_rows)
        for start, end, found, cap in self._batches(run):
            batch = run[start:end]
            size = found[0][0]
            if slots is None:
                offsets = [-1] * len(batch)
            elif all(f[0] == size for f in found):
                offsets = slots.take_many(size, len(batch))
            else:
                offsets = [slots.take(f[0]) for f in found]
            keys = [(op.group_id, op.block_hash) for op in batch]
            sizes = [(o, f[0]) for o, f in zip(offsets, found, strict=True)]
            host.update(zip(keys, sizes, strict=True))
            items = [
                (o, f[1], f[2], f[0])
                for o, f in zip(offsets, found, strict=True)
                if o >= 0 and f[1] >= 0
            ]
            if len(items) < len(batch):  # no room in the buffer, or several byte ranges
                for op, key, o, f in zip(batch, keys, offsets, found, strict=True):
                    if o < 0:  # a tensor of its own
                        data = torch.empty(f[0], dtype=torch.uint8, pin_memory=self._pin)
                        self._own[key] = data
                        self._gather(op, data)
                    elif f[1] < 0:
                        self._gather(op, self._bytes(key))
            for lo, table, rows in merge_runs(items, cap):
                emit(lo, table, rows)
        self.stored += len(run)
        self._unsynced = self._async

    def _load_run(self, run: list[TierOp]) -> None:
        """Host loads, a batch at a time (:meth:`_batches`): adjacent host slots go to their
        blocks as one run (:func:`~hybridkv.engine.host_runs.load_rows`), the others one by
        one.  Every entry is checked present before any copy."""
        get = self._host.get
        entries = [get((op.group_id, op.block_hash)) for op in run]
        for op, entry in zip(run, entries, strict=True):
            if entry is None:
                self._entry(op)  # raises
        emit = self._emitter(load_rows)
        for start, end, found, cap in self._batches(run):
            held = entries[start:end]
            items = [
                (e[0], f[1], f[2], f[0])
                for e, f in zip(held, found, strict=True)
                if e is not None and e[0] >= 0 and f[1] >= 0
            ]
            if len(items) < end - start:  # a tensor of its own, or several byte ranges
                for op, e, f in zip(run[start:end], held, found, strict=True):
                    if e is not None and (e[0] < 0 or f[1] < 0):
                        self._scatter(op, self._bytes((op.group_id, op.block_hash)))
            for lo, table, rows in merge_runs(items, cap):
                emit(lo, table, rows)
        self.loaded += len(run)

    def _emitter(
        self, copy: Callable[[BlockRows, int, list[int], torch.Tensor, bool], None]
    ) -> Callable[[int, int, list[int]], None]:
        """A function that has ``copy`` (:func:`store_rows` or :func:`load_rows`) move a run's
        rows to or from their range of the host buffer."""
        buffer = None if self._slots is None else self._slots.buffer
        tables, nb = self._rows.tables, self._async

        def emit(start: int, table: int, rows: list[int]) -> None:
            assert buffer is not None
            size = len(rows) * tables[table].shape[1]
            copy(self._rows, table, rows, buffer[start : start + size], nb)

        return emit

    def _give_back_staging(self, wait: bool = False) -> None:
        """Give the disk tier back the staging tensors whose loads completed (all: ``wait``)."""
        while self._held:
            done, tensors = self._held[0]
            if not wait and not done.query():  # type: ignore[no-untyped-call]
                return
            done.synchronize()
            self._held.pop(0)
            self._give_back(tensors)

    def _give_back(self, tensors: list[torch.Tensor]) -> None:
        if self.disk is not None:
            for t in tensors:
                self.disk.give(t)

    def _host_ready(self) -> None:
        """Wait for the queued device-to-host copies before the host reads their bytes."""
        if self._unsynced:
            torch.cuda.current_stream(self.storage.device).synchronize()
            self._unsynced = False

    def _ready_event(self) -> torch.cuda.Event | None:
        """An event after the copies queued so far (None where copies are synchronous)."""
        if not self._async:
            return None
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.storage.device))
        return ready

    def _disk_op(self, op: TierOp, loaded: list[torch.Tensor]) -> None:
        disk = self.disk
        if disk is None:
            raise EngineError(f"tier store: the engine stores no disk tier ({op.op} asked)")
        key = (op.group_id, op.block_hash)
        if op.op == "store":
            data = disk.buffer(self._blocks.place(op.group_id, op.block)[0])
            self._gather(op, data)
            disk.write(key, op.tag, data, self._ready_event())
            self.stored += 1
        elif op.op == "move":
            self._tier(op.tier)
            self._entry(op)
            self._host_ready()  # the host copies the slot, or the threads read the tensor
            held = self._own.get(key)
            if held is None:  # a slot of the host buffer, reused at once: a copy
                held = disk.buffer(self._host[key][1])
                held.copy_(self._bytes(key))
            self._release(key)
            disk.write(key, op.tag, held)
        elif op.op == "load":
            staged = self._take_checked(op)
            self._scatter(op, staged)
            loaded.append(staged)  # given back once the copy ran
            self.loaded += 1
        elif op.op == "drop":
            disk.drop(key)  # a copy whose write failed is not there: nothing to drop
        else:
            raise EngineError(f"tier store: unknown operation {op.op!r} on the disk tier")

    def _disk_store_run(self, run: list[TierOp]) -> None:
        """Disk stores, in runs (:mod:`hybridkv.engine.disk_runs`)."""
        disk = self.disk
        if disk is None:
            raise EngineError("tier store: the engine stores no disk tier (store asked)")
        if self._borrow:
            self.stored += store_borrowed(self._blocks, disk, run)
            return
        alone = functools.partial(self._disk_op, loaded=[])
        queued = store_staged(self._blocks, disk, run, self._ready_event, alone, self._async)
        self.stored += queued
        if queued:
            self._unsynced = self._async

    def _disk_load_run(self, run: list[TierOp], loaded: list[torch.Tensor]) -> None:
        """Disk loads, in runs (:mod:`hybridkv.engine.disk_runs`)."""
        if self.disk is None:
            raise EngineError("tier store: the engine stores no disk tier (load asked)")
        take = self._take_checked
        if self._async:
            alone = functools.partial(self._disk_op, loaded=loaded)
            self.loaded += load_staged(self._blocks, self.storage.device, run, take, alone, loaded)
        else:
            self._settle()
            self.loaded += load_in_place(self._blocks, run, take, self._scatter, loaded)

    def _take_checked(self, op: TierOp) -> torch.Tensor:
        """The disk tier's checked bytes for ``op``'s load (raises when its check failed)."""
        assert self.disk is not None
        staged = self.disk.take((op.group_id, op.block_hash))
        if staged is None:
            raise EngineError(
                f"tier store: the disk copy of group {op.group_id} block "
                f"{op.block_hash:#x} failed its check after the request was admitted"
            )
        return staged

    def _clear(self) -> None:
        self._host_ready()  # no queued copy still writes a slot the clear frees
        self._host.clear()
        self._own.clear()
        if self._slots is not None:
            self._slots.reset()
        if self.disk is not None:
            self.disk.clear()

    def _gather(self, op: TierOp, out: torch.Tensor) -> None:
        """Copy device block ``op.block`` into ``out`` (packed)."""
        self._blocks.gather(op.group_id, op.block, out)
        self._unsynced = self._async

    def _scatter(self, op: TierOp, packed: torch.Tensor) -> None:
        """Copy ``packed`` into device block ``op.block``."""
        self._blocks.scatter(op.group_id, op.block, packed)

    def host_keys(self) -> set[tuple[int, int]]:
        """The ``(group, hash)`` of every host entry."""
        return set(self._host)

    def _bytes(self, key: tuple[int, int]) -> torch.Tensor:
        """Host entry ``key``'s bytes (a view of its slot, or its own tensor)."""
        offset, size = self._host[key]
        if offset < 0:
            return self._own[key]
        assert self._slots is not None
        return self._slots.buffer[offset : offset + size]

    def _release(self, key: tuple[int, int]) -> None:
        """Forget host entry ``key``, giving its slot back."""
        offset, size = self._host.pop(key)
        if offset < 0:
            del self._own[key]
        elif self._slots is not None:
            self._slots.give(offset, size)

    def _tier(self, name: str) -> None:
        """Raise unless ``name`` is the host tier (the one tier whose bytes this store keeps
        in memory)."""
        if name != "host":
            raise EngineError(
                f"tier store: the engine stores no {name!r} tier (it has: host"
                f"{', disk' if self.disk is not None else ''})"
            )

    def _entry(self, op: TierOp) -> None:
        """Raise unless the host tier holds ``op``'s entry."""
        if (op.group_id, op.block_hash) not in self._host:
            raise EngineError(
                f"tier store: {op.op} of group {op.group_id} hash {op.block_hash:#x}, which the "
                f"{op.tier} tier does not hold"
            )

    def check_invariants(self) -> None:
        """Host slots and entries agree (raises :class:`~hybridkv.errors.InvariantError`):
        every entry in the buffer and every free slot lies under the bump mark, no two
        overlap, and every entry outside the buffer has a tensor of its size; and the disk
        tier's own structures (:meth:`~hybridkv.engine.disk_tier.DiskTier.check_invariants`)."""
        if self.disk is not None:
            self.disk.check_invariants()
        slots = self._slots
        spans: list[tuple[int, int, str]] = []
        for key, (offset, size) in self._host.items():
            if offset < 0:
                own = self._own.get(key)
                if own is None or own.numel() != size:
                    raise InvariantError(f"tier store: host entry {key} has no tensor of {size} B")
            else:
                spans.append((offset, size, f"entry {key}"))
        if set(self._own) - {k for k, (o, _) in self._host.items() if o < 0}:
            raise InvariantError("tier store: a tensor of its own outlives its host entry")
        if slots is None:
            if spans:
                raise InvariantError("tier store: slot entries without a host buffer")
            return
        slots.check(spans)

    def num_bytes(self) -> int:
        """Bytes the host entries hold (staged disk copies included)."""
        held = sum(size for _, size in self._host.values())
        return held + (
            0 if self.disk is None else sum(t.numel() for t in self.disk.staged.values())
        )

    def close(self) -> None:
        """Finish queued disk writes and in-flight reads and close the disk directory
        (releasing its lock); a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._host_ready()
            self._give_back_staging(wait=True)
        finally:
            if self.disk is not None:
                self.disk.close()

    def _open(self, what: str) -> None:
        if self._closed:
            raise EngineError(f"tier store: {what} after close()")
