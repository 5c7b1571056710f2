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
tensor of its own.  A disk tier is not stored by the engine yet (the manager and simulator
model it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.errors import EngineError
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.transfer import TransferDescriptor, gather, scatter

__all__ = ["TierStore"]


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
    """Tier entries ``(group, hash) -> packed block bytes`` over one engine's storage, in a
    host buffer of ``host_bytes`` (0: a tensor per entry)."""

    def __init__(self, storage: KVCacheStorage, host_bytes: int = 0) -> None:
        self.storage = storage
        self.entries: dict[str, dict[tuple[int, int], torch.Tensor]] = {"host": {}}
        self._pin = storage.device.type == "cuda"
        self._slots = _Slots(host_bytes, self._pin) if host_bytes else None
        #: Buffer offset of each entry held in the slots.
        self._offsets: dict[tuple[int, int], int] = {}
        #: One-block transfer descriptors, built once per ``(group, block)``.
        self._descs: dict[tuple[int, int], TransferDescriptor] = {}
        #: Blocks copied device -> tier and tier -> device so far.
        self.stored = self.loaded = 0

    def apply(self, ops: Iterable[TierOp]) -> None:
        """Run ``ops`` in order.  Raises :class:`EngineError` for a tier the engine does not
        store or an entry it does not hold (a bookkeeping bug: nothing is read)."""
        storage = self.storage
        for op in ops:
            if op.op == "clear":
                for entries in self.entries.values():
                    entries.clear()
                self._offsets.clear()
                if self._slots is not None:
                    self._slots.reset()
                continue
            entries = self._tier(op.tier)
            key = (op.group_id, op.block_hash)
            if op.op == "store":
                desc = self._desc(op.group_id, op.block)
                out = self._room(key, desc.total_bytes)
                if len(desc.ranges) == 1:  # a cross-layer page-size block: one copy
                    r = desc.ranges[0]
                    out.copy_(storage.buffers[r.buffer_id][r.offset : r.offset + r.length])
                else:
                    gather(desc, storage.buffers, out)
                entries[key] = out
                self.stored += 1
            elif op.op == "load":
                packed = self._entry(entries, key, op)
                desc = self._desc(op.group_id, op.block)
                if len(desc.ranges) == 1:
                    r = desc.ranges[0]
                    storage.buffers[r.buffer_id][r.offset : r.offset + r.length].copy_(packed)
                else:
                    scatter(desc, storage.buffers, packed.to(storage.device))
                self.loaded += 1
            elif op.op == "drop":
                self._entry(entries, key, op)
                self._release(key, entries.pop(key))
            elif op.op == "move":
                self._tier(op.dest)[key] = entries.pop(key)
            else:
                raise EngineError(f"tier store: unknown operation {op.op!r}")

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
                f"{', '.join(self.entries)})"
            )
        return entries

    def _entry(
        self, entries: dict[tuple[int, int], torch.Tensor], key: tuple[int, int], op: TierOp
    ) -> torch.Tensor:
        found = entries.get(key)
        if found is None:
            raise EngineError(
                f"tier store: {op.op} of group {op.group_id} hash {op.block_hash:#x}, which the "
                f"{op.tier} tier does not hold"
            )
        return found

    def num_bytes(self) -> int:
        """Bytes the entries hold."""
        return sum(t.numel() for entries in self.entries.values() for t in entries.values())
