"""Runs of block copies between a cache storage and the host tier's buffer.

A host-tier ``store`` copies one device block into a slot of the host buffer, a ``load``
copies a slot back into a device block.  One copy per block costs the host a few
microseconds of Python and the copy engine a gap between copies, which for blocks under
~1 MiB is as long as the copy itself.  So the stores (loads) of blocks whose byte ranges are
all of one length and phase in one buffer (a cross-layer layout's page-size groups: one range
a block; a per-layer layout's: a range per layer and K/V; a state whose pieces are equal) are
merged into runs: blocks whose host slots are adjacent, of one such table, up to
:data:`RUN_BYTES`.  A run moves as rows of a 2-D view of the storage buffer
(:class:`BlockRows`), a block's ranges in its descriptor's order:

* on CUDA, a store is one indexed gather kernel into a device staging tensor plus one
  device-to-host copy, a load one host-to-device copy plus one indexed scatter kernel, both
  over 8-byte words (each block's index list travels to the device from pinned memory,
  queued like the copies);
* on the CPU, a store is one indexed gather straight into the host slots (a row copy each,
  on all of torch's threads), over 8-byte words for rows under :data:`CPU_BYTE_GATHER`
  (over bytes those ran at half the speed).  A load of rows of :data:`CPU_WIDE_ROW` or more
  is one multi-tensor copy, a row each; of narrower rows, one multi-tensor copy into the
  run's stretches of rows in arithmetic progression (a per-layer block's ranges are one
  such stretch: one strided copy, on all threads), or, where the stretches average under
  :data:`CPU_WIDE_SPAN` bytes, one indexed scatter over 8-byte words (single-threaded, but
  without a copy call per stretch).  A disk load run of blocks each checked in a staging
  tensor of its own goes to the rows by one multi-tensor copy for the whole run
  (:func:`load_parts`).

The tier store walks a stream of stores (loads) in batches that start small and grow
(:data:`FIRST_RUN_BYTES` doubling to :data:`RUN_BYTES`) and issues each batch's runs before
walking the next, so the first copies overlap the host's walk over the rest.  Within a batch
the blocks are sorted by host offset before they merge (:func:`merge_runs`): slots that a
free list hands back in any order still go as one copy per adjacent stretch.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

__all__ = [
    "CPU_BYTE_GATHER",
    "CPU_SERIAL_ELEMENTS",
    "CPU_SHARED_MIN",
    "CPU_WIDE_ROW",
    "CPU_WIDE_SPAN",
    "FIRST_RUN_BYTES",
    "RUN_BYTES",
    "BlockRows",
    "copy_all",
    "load_parts",
    "load_rows",
    "merge_runs",
    "spans",
    "store_rows",
]

#: Bytes the first batch of a stream of host stores (loads) carries at most; each later batch
#: may carry twice its predecessor's, up to :data:`RUN_BYTES`, and a run never more than its
#: batch.  A smaller first batch starts the copies after fewer blocks of the host's walk;
#: larger runs pay the per-run cost (on CUDA an index upload, a kernel and a copy: the index
#: upload alone, a pinned tensor made per list, took 43 us of host time on an H200 machine,
#: 2026-11-27) fewer times.  Measured on an
#: H200 (2026-11-27, 1, 2, 4 and 8 MiB, two interleaved rounds, blocks of 128 KiB to 1 MiB,
#: 128 and 1,024 of them, both layouts): 8 MiB gave the best round trip in 13 of 16 rows
#: (128 blocks of 128 KiB, cross-layer: 0.41-0.46 of one contiguous copy with 1 MiB, 0.58-0.66
#: with 8; 256 KiB 0.77-0.78 -> 0.82; 1 MiB 0.87 -> 0.90).
FIRST_RUN_BYTES = 8 << 20
#: Bytes one run carries at most (and so the staging tensor on CUDA).
RUN_BYTES = 16 << 20
#: On the CPU, loads of rows of at least this many bytes copy each row on its own (one
#: multi-tensor copy): a row is one long copy already, and two of them as one strided view
#: copied slower (2-core VM, 256 KiB rows: 9.4-9.8 vs 6.5-7.4 GB/s).
CPU_WIDE_ROW = 128 << 10
#: On the CPU, a load of narrower rows whose stretches of rows (rows in arithmetic progression, see
#: :func:`spans`) average at least this many bytes copies each stretch as one strided view
#: (torch spreads a copy of 256 KiB or more over its threads); below it, one indexed
#: scatter over 8-byte words (one thread).  2-core VM, 64 MiB scattered: stretches of
#: 1 MiB 13.4 vs 8.0 GB/s, of 256 KiB 6.0 vs 7.2, of 64 KiB 5.0 vs 7.6.
CPU_WIDE_SPAN = 512 << 10
#: On the CPU, a store gathers rows under this many bytes over 8-byte words, longer rows
#: over bytes (2-core VM, 128 MiB of rows: 32 KiB 11.5 vs 6.6 GB/s, 128 KiB 13.9 vs 9.4,
#: 256 KiB 7.9 vs 10.0, 2 MiB 13.2 vs 12.3; a plain copy 11-16).
CPU_BYTE_GATHER = 256 << 10
#: On the CPU, torch copies a tensor of at most this many elements on one thread (its
#: ``GRAIN_SIZE``), so one multi-tensor copy of such tensors runs on one core; :func:`copy_all`
#: splits it into a share per torch thread, copied at once.  Larger tensors torch already
#: spreads over its threads, and shares of them would compete for the cores.  2-core VM,
#: 128 MiB of copies, one ``_foreach_copy_`` -> two shares (ms): rows of 32 KiB as 8-byte words
#: (4,096 elements) 32.5 -> 19.9, of 128 KiB 27.0-29.9 -> 17.9-18.3, of 256 KiB 25.1 -> 16.6
#: (32,768), of 512 KiB 17.8-21.1 -> 18.8-20.9 (65,536); rows of 64 KiB as bytes (65,536
#: elements) 27.4 -> 37.4; a contiguous copy of the 128 MiB 16-22.  So copies go over
#: 8-byte words where the bytes allow it (fewer elements, a row of up to 256 KiB on one
#: thread) and are shared.
CPU_SERIAL_ELEMENTS = 32768
#: ... and carries at least this many bytes in all (below it a thread hand-off costs more
#: than it saves).
CPU_SHARED_MIN = 4 << 20


class BlockRows:
    """Byte ranges of the storage's blocks as rows of 2-D views of its buffers.

    A range of ``length`` bytes at byte ``offset`` of buffer ``b`` is row
    ``offset // length`` of the table ``(b, length, offset % length)``: a view of the
    buffer from byte ``offset % length`` on, ``length`` bytes a row.  ``wide[t]`` views
    table ``t`` as 8-byte words where its rows allow it (None otherwise).
    """

    def __init__(self, buffers: tuple[torch.Tensor, ...]) -> None:
        self.buffers = buffers
        self.tables: list[torch.Tensor] = []
        self.wide: list[torch.Tensor | None] = []
        self._ids: dict[tuple[int, int, int], int] = {}
        self._views: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._stretches: dict[
            tuple[int, tuple[int, ...], bool], tuple[tuple[int, int, torch.Tensor], ...]
        ] = {}

    def view(self, table: int, row: int, wide: bool = False) -> torch.Tensor:
        """Row ``row`` of table ``table``, over 8-byte words when ``wide`` (the table must
        allow it), else over bytes (a view made once: making one costs microseconds)."""
        key = (table, row, wide)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = self.whole(table, wide)[row]
        return found

    def whole(self, table: int, wide: bool) -> torch.Tensor:
        """Table ``table`` over 8-byte words when ``wide`` (the table must allow it), else
        over bytes."""
        found = self.wide[table] if wide else self.tables[table]
        assert found is not None
        return found

    def stretches(
        self, table: int, picked: tuple[int, ...], wide: bool
    ) -> tuple[tuple[int, int, torch.Tensor], ...]:
        """Rows ``picked`` of table ``table`` as ``(index of the first, rows, view)`` per
        stretch of rows in arithmetic progression (:func:`spans`), each one strided 2-D view
        of the table (over 8-byte words when ``wide``, else over bytes), made once per
        block's rows: building them costs a block tens of microseconds of Python."""
        key = (table, picked, wide)
        found = self._stretches.get(key)
        if found is None:
            found = self._stretches[key] = tuple(
                _stretch_views(self.whole(table, wide), spans(picked))
            )
        return found

    def place(self, buffer_id: int, offset: int, length: int) -> tuple[int, int]:
        """``(table id, row)`` of the range of ``length`` bytes at ``offset``."""
        base = offset % length
        key = (buffer_id, length, base)
        tid = self._ids.get(key)
        if tid is None:
            buf = self.buffers[buffer_id]
            rows = (buf.numel() - base) // length
            table = buf[base : base + rows * length].view(rows, length)
            wide = None
            if length % 8 == 0 and (buf.data_ptr() + base) % 8 == 0:
                wide = table.view(torch.int64)
            tid = self._ids[key] = len(self.tables)
            self.tables.append(table)
            self.wide.append(wide)
        return tid, offset // length


def merge_runs(
    items: list[tuple[int, int, tuple[int, ...], int]], cap: int
) -> list[tuple[int, int, list[int]]]:
    """Blocks ``(host offset, table, rows, bytes)`` as runs ``(first host offset, table, rows
    in host order)``: sorted by host offset (a batch's slots come from a free list in any
    order), a block joins the run before it when it starts where that run ends, is of its
    table and the run stays within ``cap`` bytes (two loads of one entry: two runs)."""
    items.sort()
    out: list[tuple[int, int, list[int]]] = []
    rows: list[int] = []
    lo = hi = 0
    table = -1
    for offset, t, block, nbytes in items:
        if offset == hi and t == table and hi - lo + nbytes <= cap:
            rows += block
            hi += nbytes
            continue
        if rows:
            out.append((lo, table, rows))
        rows = list(block)
        lo, hi, table = offset, offset + nbytes, t
    if rows:
        out.append((lo, table, rows))
    return out


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an index tensor on ``device`` (through pinned memory, queued on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64)
    staged = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
    return staged.to(device, non_blocking=True)


def spans(picked: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``picked`` cut into stretches ``(index of its first entry, entries, first row, step)``
    of rows in arithmetic progression with a positive step, each as long as it can be
    (greedily, from the start): a per-layer block's rows (its ranges, layer after layer, at
    one stride through the buffer) are one stretch."""
    out: list[tuple[int, int, int, int]] = []
    n = len(picked)
    i = 0
    while i < n:
        first = picked[i]
        if i + 1 == n or (step := picked[i + 1] - first) <= 0:
            out.append((i, 1, first, 1))
            i += 1
            continue
        j, last = i + 2, picked[i + 1]
        while j < n and picked[j] - last == step:
            last = picked[j]
            j += 1
        out.append((i, j - i, first, step))
        i = j
    return out


def _views(
    rows: BlockRows, table_id: int, n: int, host: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table ``table_id`` and ``host`` (``n`` rows of it) as matching 2-D views: over 8-byte
    words where both allow it, else over bytes."""
    wide = rows.wide[table_id]
    if wide is not None and host.data_ptr() % 8 == 0:
        return wide, host.view(torch.int64).view(n, -1)
    return rows.tables[table_id], host.view(n, -1)


def store_rows(
    rows: BlockRows, table_id: int, picked: Sequence[int], host: torch.Tensor, non_blocking: bool
) -> None:
    """Copy rows ``picked`` of table ``table_id``, in order, into ``host`` (flat bytes)."""
    table = rows.tables[table_id]
    n = len(picked)
    if n == 1:
        host.copy_(rows.view(table_id, picked[0]), non_blocking=non_blocking)
        return
    index = _index(picked, table.device)
    cpu = table.device.type != "cuda"
    if cpu and table.shape[1] >= CPU_BYTE_GATHER:
        src, dst = table, host.view(n, -1)
    else:
        src, dst = _views(rows, table_id, n, host)
    if cpu:  # one row copy each, straight into the host bytes
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(torch.index_select(src, 0, index), non_blocking=non_blocking)


def load_rows(
    rows: BlockRows, table_id: int, picked: Sequence[int], host: torch.Tensor, non_blocking: bool
) -> None:
    """Copy ``host`` (flat bytes, rows in order) into rows ``picked`` of table ``table_id``."""
    table = rows.tables[table_id]
    n, width = len(picked), table.shape[1]
    if n == 1:
        rows.view(table_id, picked[0]).copy_(host, non_blocking=non_blocking)
        return
    dst, src = _views(rows, table_id, n, host)
    if table.device.type != "cuda":
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        if width >= CPU_WIDE_ROW:  # a row each
            dsts.extend(rows.view(table_id, r) for r in picked)
            srcs.extend(host.view(n, width).unbind(0))
        else:  # a strided view per stretch, or one indexed scatter for short stretches
            found = spans(picked)
            if dst.dtype == torch.int64 and n * width < CPU_WIDE_SPAN * len(found):
                dst.index_put_((_index(picked, table.device),), src)
                return
            for at, count, view in _stretch_views(dst, found):
                dsts.append(view)
                srcs.append(src[at : at + count])
        torch._foreach_copy_(dsts, srcs)  # one multi-tensor copy (runs: up to 16 MiB)
        return
    index = _index(picked, table.device)
    dst.index_copy_(0, index, src.to(table.device, non_blocking=non_blocking))


def _stretch_views(
    table: torch.Tensor, found: Sequence[tuple[int, int, int, int]]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(index of the first, rows, view)`` of each stretch ``found`` (:func:`spans`): the
    stretch's rows of 2-D ``table`` as one strided view."""
    words = table.shape[1]  # a row in the table's elements (8-byte words or bytes)
    base = table.storage_offset()
    for at, count, first, step in found:
        yield at, count, table.as_strided((count, words), (step * words, 1), base + first * words)


def load_parts(
    rows: BlockRows, table_id: int, parts: Sequence[tuple[tuple[int, ...], torch.Tensor]]
) -> None:
    """On the CPU, copy each ``(picked, host)`` of ``parts`` (``host``: flat bytes, its rows
    in order) into rows ``picked`` of table ``table_id``, all of them by one multi-tensor
    copy (:func:`copy_all`): a row each for rows of :data:`CPU_WIDE_ROW` or more, else one
    strided view per stretch of rows in arithmetic progression (:meth:`BlockRows.stretches`,
    made once per block; a per-layer block's ranges are one).  For many blocks whose bytes
    sit in tensors of their own (a disk load run, each block checked in its own staging
    tensor): no index tensor and no copy call per block."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    width = rows.tables[table_id].shape[1]
    can_widen = rows.wide[table_id] is not None
    for picked, host in parts:
        n = len(picked)
        wide = can_widen and host.data_ptr() % 8 == 0
        flat = host.view(torch.int64) if wide else host
        words = flat.numel() // n
        if n == 1 or width >= CPU_WIDE_ROW:
            dsts.extend(rows.view(table_id, r, wide) for r in picked)
            srcs.extend(flat.view(n, words).unbind(0))
            continue
        matrix = flat.view(n, words)
        for at, count, view in rows.stretches(table_id, picked, wide):
            dsts.append(view)
            srcs.append(matrix if count == n else matrix[at : at + count])
    copy_all(dsts, srcs)


_pool: tuple[ThreadPoolExecutor, int, int] | None = None
_pool_lock = threading.Lock()


def _forked() -> None:
    """In a forked child: forget the parent's pool and take a fresh lock (a parent thread may
    have held it at the fork, and no thread of the child would ever release that copy)."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def _shares() -> tuple[ThreadPoolExecutor, int] | None:
    """The threads :func:`copy_all` hands shares to and their number (torch's thread count
    less one, made on first use, and again in a forked child, which has none of its
    parent's threads), or None on one thread."""
    global _pool
    pid = os.getpid()
    if _pool is None or _pool[2] != pid:
        with _pool_lock:
            if _pool is None or _pool[2] != pid:
                helpers = torch.get_num_threads() - 1
                _pool = None
                if helpers > 0:
                    pool = ThreadPoolExecutor(helpers, thread_name_prefix="hybridkv-copy")
                    _pool = (pool, helpers, pid)
    return None if _pool is None else _pool[:2]


def _copy_share(dsts: list[torch.Tensor], srcs: list[torch.Tensor], inference: bool) -> None:
    """One share of :func:`copy_all` on a helper thread, in the caller's inference mode (a
    cache made under ``torch.inference_mode()`` holds inference tensors, which only that mode
    may write in place)."""
    with torch.inference_mode(inference):
        torch._foreach_copy_(dsts, srcs)


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` on the CPU, as one multi-tensor copy, or,
    where the tensors average at most :data:`CPU_SERIAL_ELEMENTS` elements and carry
    :data:`CPU_SHARED_MIN` bytes or more in all, as one per torch thread over equal shares of
    the list, at once (the copies release the GIL)."""
    n = len(dsts)
    if not n:
        return
    elements = sum(d.numel() for d in dsts)
    small = elements <= CPU_SERIAL_ELEMENTS * n
    big = sum(d.nbytes for d in dsts) >= CPU_SHARED_MIN
    shared = _shares() if small and big else None
    if shared is None:
        torch._foreach_copy_(dsts, srcs)
        return
    pool, helpers = shared
    k = min(helpers + 1, n)
    cuts = [n * i // k for i in range(k + 1)]
    inference = torch.is_inference_mode_enabled()  # thread-local: the shares run as the caller
    jobs = [
        pool.submit(_copy_share, dsts[a:b], srcs[a:b], inference)
        for a, b in itertools.pairwise(cuts[1:])
    ]
    try:
        torch._foreach_copy_(dsts[: cuts[1]], srcs[: cuts[1]])
    finally:  # no share may still be writing when this returns or raises
        wait(jobs)
    for job in jobs:
        job.result()
