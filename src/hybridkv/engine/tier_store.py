"""The bytes of the lower cache tiers for :class:`~hybridkv.engine.llm_engine.LLMEngine`.

The manager decides (:mod:`hybridkv.cache.tiers`); :class:`TierStore` carries out its
:class:`~hybridkv.cache.tiers.TierOp` stream, in order, before each step's model pass:

* ``store``: the device evicted a cached block to reuse it; its bytes are still intact (no
  step has written the block since), so they are gathered through the storage's transfer
  descriptor (:func:`hybridkv.storage.transfer.gather`: one copy per coalesced byte range,
  one for a cross-layer page-size group) into a host tensor;
* ``load``: a hit reads an entry back: scattered into the fresh device block the manager
  allocated for it, before the step reads that block;
* ``move`` / ``drop`` / ``clear``: a tier evicted an entry down, or out.

Host entries live in one CPU buffer of the tier's capacity (pinned when the cache lives on
CUDA; on CPU its pages are only touched when first written), carved into slots of each
group's packed block size and reused through per-size free lists, so steady-state copies
allocate nothing.  An entry that finds no room there (the sizes fragmented the buffer) gets a
tensor of its own.

A disk tier's entries live in a :class:`~hybridkv.storage.disk_slots.DiskSlots` directory
(checksummed slots in a preallocated file, kept across processes).  A disk copy is checked
before it is used: :meth:`TierStore.check_hit` runs before a waiting request is admitted
(the scheduler's ``hit_check``), reads the request's disk blocks into host staging tensors on
a worker thread and checks their CRCs; a copy that fails (a write that failed, a truncated
file, a flipped byte, a slot a killed process left half written) is discarded from the
manager, whose next lookup misses it, and a request whose reads are in flight waits while
the others run.  The ``load`` later copies the checked staging bytes to the device.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache import ComputedBlocks, KVCacheManager, Request
from hybridkv.cache.tiers import TierOp, TierSpec
from hybridkv.engine.errors import EngineError
from hybridkv.plan.layout import MemoryLayout
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.disk_slots import FORMAT_VERSION, DiskSlots
from hybridkv.storage.transfer import TransferDescriptor, gather, scatter

__all__ = ["TierStore", "fingerprint", "open_tiers", "tier_specs"]


def tier_specs(host_bytes: int | None, disk_bytes: int | None) -> tuple[TierSpec, ...]:
    """The lower tiers for a host size and a disk size (None or 0: no such tier)."""
    specs = []
    if host_bytes:
        specs.append(TierSpec("host", host_bytes))
    if disk_bytes:
        specs.append(TierSpec("disk", disk_bytes))
    return tuple(specs)


def open_tiers(
    storage: KVCacheStorage,
    manager: KVCacheManager,
    *,
    host_bytes: int | None,
    disk_dir: str | Path | None,
    disk_bytes: int | None,
    fingerprint: Mapping[str, Any],
) -> TierStore | None:
    """The tier storage for ``manager`` (built with :func:`tier_specs` of the same sizes), or
    None without tiers.  A disk directory an earlier process left is reopened and its entries
    adopted by the manager, oldest first (those that find no room are freed).  Raises
    :class:`~hybridkv.storage.disk_slots.DiskCacheError` for a directory that cannot be used
    (see :class:`~hybridkv.storage.disk_slots.DiskSlots`)."""
    if not host_bytes and not disk_bytes:
        return None
    disk = None
    if disk_dir is not None and disk_bytes:
        sizes = [g.block_bytes for g in storage.layout.groups]
        disk = DiskSlots(disk_dir, disk_bytes, fingerprint, sizes)
        found = disk.recovered
        if found:
            taken = manager.adopt_tier_entries(
                "disk", [(e.group_id, e.block_hash, e.tag) for e in found]
            )
            disk.keep_only((found[i].group_id, found[i].block_hash) for i in taken)
    return TierStore(storage, host_bytes or 0, disk)


def fingerprint(
    model: str, dtype: torch.dtype, layout: MemoryLayout, hasher: str, **extra: Any
) -> dict[str, Any]:
    """What a disk cache's bytes depend on: the model (name, dtype, ``extra`` such as the
    seed of a built-in model or the attention sinks), the layout's groups and packing, the
    block hasher and the file format.  A directory made with another one is refused."""
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "layout": layout.to_dict(),
        "hasher": hasher,
        "format": FORMAT_VERSION,
        **extra,
    }


class _Slots:
    """Byte slots of one buffer: bump allocation plus a free list per slot size."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.top = 0
        self.free: dict[int, list[int]] = {}

    def take(self, size: int) -> int | None:
        spare = self.free.get(size)
        if spare:
            return spare.pop()
        if self.top + size > self.buffer.numel():
            return None
        self.top += size
        return self.top - size

    def give(self, offset: int, size: int) -> None:
        self.free.setdefault(size, []).append(offset)

    def reset(self) -> None:
        self.top = 0
        self.free.clear()


class TierStore:
    """Tier entries ``(group, hash) -> packed block bytes`` over one engine's storage: host
    entries in a buffer of ``host_bytes`` (0: a tensor per entry), disk entries in ``disk``.
    ``async_reads``: read and check disk copies on a worker thread (False: inline)."""

    def __init__(
        self,
        storage: KVCacheStorage,
        host_bytes: int = 0,
        disk: DiskSlots | None = None,
        *,
        async_reads: bool = True,
    ) -> None:
        self.storage = storage
        self.entries: dict[str, dict[tuple[int, int], torch.Tensor]] = {"host": {}}
        self.disk = disk
        self._pin = storage.device.type == "cuda"
        self._slots = _Slots(host_bytes, self._pin) if host_bytes else None
        #: Buffer offset of each entry held in the slots.
        self._offsets: dict[tuple[int, int], int] = {}
        #: One-block transfer descriptors, built once per ``(group, block)``.
        self._descs: dict[tuple[int, int], TransferDescriptor] = {}
        #: Disk copies read and checked, waiting for their load.
        self._staged: dict[tuple[int, int], torch.Tensor] = {}
        #: Disk reads in flight: the entry's write generation when it was asked for.
        self._reads: dict[tuple[int, int], tuple[int, cf.Future[torch.Tensor | None]]] = {}
        self._gen: dict[tuple[int, int], int] = {}
        self._pool = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-disk")
            if disk is not None and async_reads
            else None
        )
        #: Blocks copied device -> tier and tier -> device so far; disk copies found unusable.
        self.stored = self.loaded = self.bad_reads = 0

    # -- checking a hit before its admission ---------------------------------------------------
    def check_hit(
        self, manager: KVCacheManager, request: Request, hit: ComputedBlocks
    ) -> ComputedBlocks | None:
        """The hit to admit ``request`` with: every disk block it loads read and checked
        (discarding bad copies from ``manager`` and looking up again), or None while reads
        are in flight."""
        if self.disk is None:
            return hit
        while True:
            keys = [(g, h) for g, h, t in manager.tier_blocks(request, hit) if t == "disk"]
            bad: list[tuple[int, int]] = []
            waiting = False
            for key in keys:
                if key in self._staged:
                    continue
                state = self._read_state(key)
                if state is None:
                    waiting = True
                elif state is False:
                    bad.append(key)
            if not bad:
                return None if waiting else hit
            for g, h in bad:
                self.bad_reads += 1
                manager.discard_tier_block(g, h)
            hit = manager.get_computed_blocks(request)

    def _read_state(self, key: tuple[int, int]) -> bool | None:
        """True: ``key`` is staged; False: its copy is bad; None: its read is in flight."""
        gen = self._gen.get(key, 0)
        job = self._reads.get(key)
        if job is not None and job[0] != gen:  # rewritten since: read again
            job = None
        if job is None:
            if self._pool is None:
                data = self._read(key)
                return self._staged_or_bad(key, data)
            self._reads[key] = (gen, self._pool.submit(self._read, key))
            return None
        if not job[1].done():
            return None
        del self._reads[key]
        return self._staged_or_bad(key, job[1].result())

    def _staged_or_bad(self, key: tuple[int, int], data: torch.Tensor | None) -> bool:
        if data is None:
            return False
        self._staged[key] = data
        return True

    def _read(self, key: tuple[int, int]) -> torch.Tensor | None:
        disk = self.disk
        assert disk is not None
        entry = disk.entries.get(key)
        if entry is None:
            return None
        out = torch.empty(entry.size, dtype=torch.uint8, pin_memory=self._pin)
        return out if disk.read(key, out.numpy().data) else None

    def reading(self) -> bool:
        """Whether disk reads are in flight."""
        return any(not f.done() for _, f in self._reads.values())

    def wait(self) -> None:
        """Block until at least one in-flight disk read is done."""
        pending = [f for _, f in self._reads.values() if not f.done()]
        if pending:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)

    # -- the manager's operations ---------------------------------------------------------------
    def apply(self, ops: Iterable[TierOp]) -> None:
        """Run ``ops`` in order.  Raises :class:`EngineError` for a tier the engine does not
        store or an entry it does not hold (a bookkeeping bug: nothing is read)."""
        for op in ops:
            if op.op == "clear":
                self._clear()
            elif op.tier == "disk" or op.dest == "disk":
                self._disk_op(op)
            elif op.op == "store":
                out = self._room((op.group_id, op.block_hash), self._desc_of(op).total_bytes)
                self._gather(op, out)
                self.entries["host"][op.group_id, op.block_hash] = out
                self.stored += 1
            elif op.op == "load":
                self._scatter(op, self._entry(self._tier(op.tier), op))
                self.loaded += 1
            elif op.op == "drop":
                entries = self._tier(op.tier)
                self._entry(entries, op)
                key = (op.group_id, op.block_hash)
                self._release(key, entries.pop(key))
            else:
                raise EngineError(f"tier store: unknown operation {op.op!r} on {op.tier!r}")

    def _disk_op(self, op: TierOp) -> None:
        disk = self.disk
        if disk is None:
            raise EngineError(f"tier store: the engine stores no disk tier ({op.op} asked)")
        key = (op.group_id, op.block_hash)
        if op.op in ("store", "move"):
            if op.op == "store":
                data = torch.empty(self._desc_of(op).total_bytes, dtype=torch.uint8)
                self._gather(op, data)
            else:
                host = self._tier(op.tier)
                data = self._entry(host, op)
                del host[key]
            self._gen[key] = self._gen.get(key, 0) + 1
            self._staged.pop(key, None)
            # A failed write stores nothing: the entry reads as bad, and check_hit discards it.
            disk.write(key, op.tag, data.cpu().numpy().data)
            if op.op == "move":
                self._release(key, data)
            self.stored += 1
        elif op.op == "load":
            staged = self._staged.pop(key, None)
            if staged is None:  # admitted without check_hit (no hit check installed)
                staged = self._read(key)
                if staged is None:
                    raise EngineError(
                        f"tier store: the disk copy of group {op.group_id} block "
                        f"{op.block_hash:#x} failed its check after the request was admitted"
                    )
            self._scatter(op, staged)
            self.loaded += 1
        elif op.op == "drop":
            self._gen[key] = self._gen.get(key, 0) + 1
            self._staged.pop(key, None)
            disk.drop(key)  # a copy whose write failed is not there: nothing to drop
        else:
            raise EngineError(f"tier store: unknown operation {op.op!r} on the disk tier")

    def _clear(self) -> None:
        for entries in self.entries.values():
            entries.clear()
        self._offsets.clear()
        if self._slots is not None:
            self._slots.reset()
        if self.disk is not None:
            self.disk.clear()
        self._staged.clear()
        self._reads.clear()
        self._gen.clear()

    def _desc_of(self, op: TierOp) -> TransferDescriptor:
        return self._desc(op.group_id, op.block)

    def _gather(self, op: TierOp, out: torch.Tensor) -> None:
        """Copy device block ``op.block`` into ``out`` (packed)."""
        desc = self._desc_of(op)
        buffers = self.storage.buffers
        if len(desc.ranges) == 1:  # a cross-layer page-size block: one copy
            r = desc.ranges[0]
            out.copy_(buffers[r.buffer_id][r.offset : r.offset + r.length])
        else:
            gather(desc, buffers, out)

    def _scatter(self, op: TierOp, packed: torch.Tensor) -> None:
        """Copy ``packed`` into device block ``op.block``."""
        desc = self._desc_of(op)
        buffers = self.storage.buffers
        if len(desc.ranges) == 1:
            r = desc.ranges[0]
            buffers[r.buffer_id][r.offset : r.offset + r.length].copy_(packed)
        else:
            scatter(desc, buffers, packed.to(self.storage.device))

    def _desc(self, group_id: int, block: int) -> TransferDescriptor:
        desc = self._descs.get((group_id, block))
        if desc is None:
            desc = self._descs[group_id, block] = self.storage.descriptor(group_id, [block])
        return desc

    def _room(self, key: tuple[int, int], size: int) -> torch.Tensor:
        """Where the entry ``key`` of ``size`` bytes goes: a slot, or a tensor of its own."""
        slots = self._slots
        offset = None if slots is None else slots.take(size)
        if slots is None or offset is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        self._offsets[key] = offset
        return slots.buffer[offset : offset + size]

    def _release(self, key: tuple[int, int], data: torch.Tensor) -> None:
        offset = self._offsets.pop(key, None)
        if offset is not None and self._slots is not None:
            self._slots.give(offset, data.numel())

    def _tier(self, name: str) -> dict[tuple[int, int], torch.Tensor]:
        entries = self.entries.get(name)
        if entries is None:
            raise EngineError(
                f"tier store: the engine stores no {name!r} tier (it has: "
                f"{', '.join(self.entries)}{', disk' if self.disk is not None else ''})"
            )
        return entries

    def _entry(self, entries: Mapping[tuple[int, int], torch.Tensor], op: TierOp) -> torch.Tensor:
        found = entries.get((op.group_id, op.block_hash))
        if found is None:
            raise EngineError(
                f"tier store: {op.op} of group {op.group_id} hash {op.block_hash:#x}, which the "
                f"{op.tier} tier does not hold"
            )
        return found

    def num_bytes(self) -> int:
        """Bytes the host entries hold (staged disk copies included)."""
        held = sum(t.numel() for entries in self.entries.values() for t in entries.values())
        return held + sum(t.numel() for t in self._staged.values())

    def close(self) -> None:
        """Finish in-flight reads and close the disk directory (releasing its lock)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.disk is not None:
            self.disk.close()
