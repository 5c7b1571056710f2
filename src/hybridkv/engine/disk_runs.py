"""Runs of disk-tier stores and loads for :class:`~hybridkv.engine.tier_store.TierStore`.

Consecutive disk stores (loads) of blocks whose byte ranges are rows of one table
(:meth:`~hybridkv.engine.block_places.BlockPlaces.place`: every page-size group) move in
runs, as the host tier's do (:mod:`~hybridkv.engine.host_runs`), so per block the step pays
a few microseconds of Python, not a copy call, an event and a thread hand-off:

* stores on CUDA (:func:`store_staged`): a run is gathered into one staging buffer by one
  copy and queued with one ready event (:meth:`~hybridkv.engine.disk_tier.DiskTier.write_run`);
* stores of a cache in host memory (:func:`store_borrowed`): the writer reads the blocks'
  own byte ranges (:meth:`~hybridkv.engine.disk_tier.DiskTier.write_borrowed`; a staging
  copy would cost as much memory traffic as the write to the page cache);
* loads on CUDA (:func:`load_staged`): the checked staging tensors go to one device buffer
  (a copy each) and from there to their rows by one indexed scatter a run;
* loads of a cache in host memory (:func:`load_in_place`): the checked staging tensors go to
  their rows by one multi-tensor copy per table
  (:func:`~hybridkv.engine.host_runs.load_parts`).

Blocks whose ranges are not rows of one table go one by one (``alone``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.block_places import BlockPlaces
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.host_runs import FIRST_RUN_BYTES, RUN_BYTES, load_parts, load_rows, store_rows

__all__ = ["load_in_place", "load_staged", "store_borrowed", "store_staged"]


def store_staged(
    blocks: BlockPlaces,
    disk: DiskTier,
    run: Sequence[TierOp],
    ready: Callable[[], torch.cuda.Event | None],
    alone: Callable[[TierOp], None],
    non_blocking: bool,
) -> int:
    """Queue the disk stores ``run`` in runs of staging buffers (``ready``: the event each
    run's copy is done at); runs start at :data:`FIRST_RUN_BYTES` and double up to the
    tier's batch size, so the writer starts early.  Returns the blocks queued in runs."""
    place = blocks.place
    cap = min(FIRST_RUN_BYTES, disk.batch_bytes)
    ops: list[TierOp] = []
    sizes: list[int] = []
    rows: list[int] = []
    table = nbytes = queued = 0

    def flush() -> None:
        data = disk.buffer(1 << (nbytes - 1).bit_length())  # few sizes: spares reused
        store_rows(blocks.rows, table, rows, data[:nbytes], non_blocking)
        entries = [((o.group_id, o.block_hash), o.tag) for o in ops]
        disk.write_run(entries, sizes, data, ready())

    for op in run:
        size, t, block_rows = place(op.group_id, op.block)
        if ops and (t != table or nbytes + size > cap):
            flush()
            queued += len(ops)
            ops, sizes, rows, nbytes = [], [], [], 0
            cap = min(2 * cap, disk.batch_bytes)
        if t < 0:
            alone(op)
            continue
        ops.append(op)
        sizes.append(size)
        rows.extend(block_rows)
        table = t
        nbytes += size
    if ops:
        flush()
        queued += len(ops)
    return queued


def store_borrowed(blocks: BlockPlaces, disk: DiskTier, run: Sequence[TierOp]) -> int:
    """Queue the disk stores ``run`` of a cache in host memory as one job of the blocks' own
    byte ranges (one ``pwritev`` a block); the caller waits for them
    (:meth:`~hybridkv.engine.disk_tier.DiskTier.settle`) before anything writes the storage.
    Returns the blocks queued."""
    entries = [((op.group_id, op.block_hash), op.tag) for op in run]
    disk.write_borrowed(entries, [blocks.views(op.group_id, op.block)[0] for op in run])
    return len(entries)


def load_staged(
    blocks: BlockPlaces,
    device: torch.device,
    run: Sequence[TierOp],
    take: Callable[[TierOp], torch.Tensor],
    alone: Callable[[TierOp], None],
    loaded: list[torch.Tensor],
) -> int:
    """Copy the checked bytes of the disk loads ``run`` (``take``) to the device in runs of at
    most :data:`RUN_BYTES`; the staging tensors join ``loaded`` (given back once the copies
    ran).  Returns the blocks loaded in runs."""
    place = blocks.place
    staged: list[tuple[torch.Tensor, int]] = []
    rows: list[int] = []
    table = nbytes = done = 0

    def flush() -> None:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        at = 0
        for data, size in staged:
            dev[at : at + size].copy_(data, non_blocking=True)
            at += size
        load_rows(blocks.rows, table, rows, dev, True)

    for op in run:
        size, t, block_rows = place(op.group_id, op.block)
        if staged and (t != table or nbytes + size > RUN_BYTES):
            flush()
            staged, rows, nbytes = [], [], 0
        if t < 0:
            alone(op)
            continue
        data = take(op)
        loaded.append(data)
        staged.append((data, size))
        rows.extend(block_rows)
        table = t
        nbytes += size
        done += 1
    if staged:
        flush()
    return done


def load_in_place(
    blocks: BlockPlaces,
    run: Sequence[TierOp],
    take: Callable[[TierOp], torch.Tensor],
    scatter: Callable[[TierOp, torch.Tensor], None],
    loaded: list[torch.Tensor],
) -> int:
    """Copy the checked bytes of the disk loads ``run`` (``take``) into a cache in host
    memory: once every copy is taken, one multi-tensor copy per table, instead of a copy
    call (an indexed scatter for short rows) per block; ``scatter`` for the others.  The
    staging tensors join ``loaded``.  Returns the blocks loaded."""
    place = blocks.place
    parts: dict[int, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for op in run:
        _, table, block_rows = place(op.group_id, op.block)
        data = take(op)
        loaded.append(data)
        if table < 0:
            scatter(op, data)
        else:
            parts.setdefault(table, []).append((block_rows, data))
    for table, todo in parts.items():
        load_parts(blocks.rows, table, todo)
    return len(run)
