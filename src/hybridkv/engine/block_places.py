"""Where each device block of an engine's storage lies, for the copies of the cache tiers.

:class:`BlockPlaces` answers, once per ``(group, block)`` and cached after that, how
:class:`~hybridkv.engine.tier_store.TierStore` copies a block out of or into the storage:

* as rows of one table of :class:`~hybridkv.engine.host_runs.BlockRows` (every range of the
  block of one length and phase in one buffer: a cross-layer page-size block is one row, a
  per-layer block's K/V pages are rows of one stride), which the host and disk runs merge
  into one indexed copy a run;
* else through the block's :class:`~hybridkv.storage.transfer.TransferDescriptor` (one copy
  per coalesced byte range);
* and, for a cache in host memory, as views of the storage's own bytes that a disk writer
  reads without a staging copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.host_runs import BlockRows, load_rows, store_rows
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.transfer import TransferDescriptor, gather, scatter

__all__ = ["BlockPlaces", "Place"]

#: ``(bytes, table id, rows)`` of a device block (:meth:`BlockPlaces.place`).
Place = tuple[int, int, tuple[int, ...]]


class BlockPlaces:
    """The byte places of ``storage``'s blocks.  ``non_blocking``: copies queue on the
    current CUDA stream instead of completing before they return."""

    def __init__(self, storage: KVCacheStorage, non_blocking: bool) -> None:
        self.storage = storage
        self.non_blocking = non_blocking
        #: The storage's blocks as rows of its buffers.
        self.rows = BlockRows(storage.buffers)
        #: ``(bytes, table id, rows)`` of each ``(group, block)``; table id -1 for a block
        #: of several byte ranges that are not rows of one table.
        self._places: dict[tuple[int, int], Place] = {}
        #: One-block transfer descriptors.
        self._descs: dict[tuple[int, int], TransferDescriptor] = {}
        #: The storage buffers' bytes, and each ``(group, block)``'s ranges of them.
        self._flat: list[memoryview] | None = None
        self._views: dict[tuple[int, int], tuple[tuple[memoryview, ...], int]] = {}

    def places(self, ops: Sequence[TierOp]) -> list[Place]:
        """:meth:`place` of each operation's ``(group_id, block)``, in one pass."""
        get, place = self._places.get, self.place
        return [get((op.group_id, op.block)) or place(op.group_id, op.block) for op in ops]

    def place(self, group_id: int, block: int) -> Place:
        """``(bytes, table id, rows)`` of device block ``block`` of ``group_id``: its byte
        ranges as rows of one table of :attr:`rows` when they are all of one length and
        phase in one buffer, else table id -1 and no rows."""
        key = (group_id, block)
        found = self._places.get(key)
        if found is None:
            desc = self.descriptor(group_id, block)
            at = [self.rows.place(r.buffer_id, r.offset, r.length) for r in desc.ranges]
            table, rows = at[0][0], tuple(row for _, row in at)
            if any(t != table for t, _ in at):
                table, rows = -1, ()
            found = self._places[key] = (desc.total_bytes, table, rows)
        return found

    def descriptor(self, group_id: int, block: int) -> TransferDescriptor:
        """The storage's transfer descriptor of the one block."""
        desc = self._descs.get((group_id, block))
        if desc is None:
            desc = self._descs[group_id, block] = self.storage.descriptor(group_id, [block])
        return desc

    def views(self, group_id: int, block: int) -> tuple[tuple[memoryview, ...], int]:
        """The block's byte ranges as views of the storage buffers (which must live in host
        memory), in packed order, and their total bytes."""
        key = (group_id, block)
        found = self._views.get(key)
        if found is None:
            if self._flat is None:
                self._flat = [b.numpy().data for b in self.storage.buffers]
            flat = self._flat
            ranges = self.descriptor(group_id, block).ranges
            views = tuple(flat[r.buffer_id][r.offset : r.offset + r.length] for r in ranges)
            found = self._views[key] = (views, sum(r.length for r in ranges))
        return found

    def gather(self, group_id: int, block: int, out: torch.Tensor) -> None:
        """Copy the block into ``out`` (packed): one copy for rows of one table, else one
        per byte range."""
        _, table, rows = self.place(group_id, block)
        if table >= 0:
            store_rows(self.rows, table, rows, out, self.non_blocking)
        else:
            desc = self.descriptor(group_id, block)
            gather(desc, self.storage.buffers, out, non_blocking=self.non_blocking)

    def scatter(self, group_id: int, block: int, packed: torch.Tensor) -> None:
        """Copy ``packed`` into the block."""
        _, table, rows = self.place(group_id, block)
        if table >= 0:
            load_rows(self.rows, table, rows, packed, self.non_blocking)
        else:
            desc = self.descriptor(group_id, block)
            scatter(desc, self.storage.buffers, packed, non_blocking=self.non_blocking)
