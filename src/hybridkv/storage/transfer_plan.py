"""Transfer plans: a request's cache bytes from one instance's layout to another's.

:func:`plan_transfer` takes two :class:`~hybridkv.storage.connector.Registration` s, the
request's block table per group on each side (a state group's table is the request's one
state slot) and the tokens to move, and returns a :class:`TransferPlan`: coalesced runs
``(source buffer, source offset, destination buffer, destination offset, length)``.

How: every array the destination stores (``(layer, slot, name)``) is matched with the
source's by name; its elements are enumerated as *units*, one per index of every axis but
the last (token, head; or a state tensor's leading axes), each unit the last axis's bytes,
which both sides store contiguously.  A unit's offset on each side comes from that side's
affine map, its block table (token ``t`` lives in block ``table[t // block_size]`` at row
``t % block_size``) and its tensor-parallel slice (only the global heads, or state rows, both
sides hold are planned: a destination rank of a wider split is filled by several source
ranks' plans, a narrower one takes its slice of one source rank).  Units are then sorted by
source offset and merged wherever both sides continue contiguously, so two cross-layer
layouts of the same page become one run per block (fewer where consecutive block ids touch
on both sides), while a cross-layer page landing in per-layer slabs becomes one run per
layer and segment.

A destination block that is the null block (a sliding window's recycled block) is skipped;
a source block that is null where the destination needs data raises
:class:`~hybridkv.storage.errors.TransferError`, as do arrays the source lacks, shapes or
element types that differ, global sizes that differ (an axis's ``shard_total`` on a split
side, its length on an unsplit one: 8 KV heads are not 4, whatever the ranks), block ids
outside a group, a destination block named twice and a null state slot on either side.  Runs
never overlap on the destination side; :meth:`TransferPlan.copy` refuses a plan whose source
and destination bytes overlap (one instance's blocks moved onto blocks the plan reads).

Executing a plan: :meth:`TransferPlan.copy` (both sides in one process),
:meth:`TransferPlan.pack` / :meth:`TransferPlan.unpack` (through one contiguous stream in run
order), or :mod:`hybridkv.storage.transport` between processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.errors import brief_repr
from hybridkv.storage.connector import Registration, SegmentRef
from hybridkv.storage.errors import TransferError
from hybridkv.storage.transfer import check_no_overlap

__all__ = ["TransferPlan", "plan_transfer"]


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Copy runs, sorted by source buffer and offset (int64 arrays of equal length)."""

    src_buffer: np.ndarray
    src_offset: np.ndarray
    dst_buffer: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def runs(self) -> list[tuple[int, int, int, int, int]]:
        """The runs as ``(src_buffer, src_offset, dst_buffer, dst_offset, length)`` tuples."""
        return list(
            zip(
                self.src_buffer.tolist(),
                self.src_offset.tolist(),
                self.dst_buffer.tolist(),
                self.dst_offset.tolist(),
                self.length.tolist(),
                strict=True,
            )
        )

    def check(self) -> None:
        """Raise :class:`TransferError` unless the plan's own arrays are well formed: five
        one-dimensional integer arrays of equal length, no negative buffer id, offset or
        length (a plan received from a peer is checked here before it touches a buffer)."""
        arrays = {
            "src_buffer": self.src_buffer,
            "src_offset": self.src_offset,
            "dst_buffer": self.dst_buffer,
            "dst_offset": self.dst_offset,
            "length": self.length,
        }
        size = None
        for name, a in arrays.items():
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
                got = f"{a.dtype}, shape {a.shape}" if isinstance(a, np.ndarray) else type(a)
                raise TransferError(f"plan.{name}: need a one-dimensional integer array, got {got}")
            if size is not None and a.size != size:
                raise TransferError(
                    f"plan.{name}: {a.size} entries, plan.src_buffer has {size}; "
                    "every array has one entry per run"
                )
            size = a.size
            if a.size and int(a.min()) < 0:
                raise TransferError(
                    f"plan.{name}: {int(a.min())} at run {int(a.argmin())}; must be >= 0"
                )

    def check_buffers(self, buffers: Sequence[torch.Tensor], side: str) -> None:
        """Raise :class:`TransferError`, before anything is copied, unless the plan is well
        formed (:meth:`check`) and ``buffers`` can serve every run of ``side`` (``source``
        or ``destination``): each buffer a run names present, a flat contiguous uint8 tensor
        holding the run."""
        self.check()
        ids = self.src_buffer if side == "source" else self.dst_buffer
        offs = self.src_offset if side == "source" else self.dst_offset
        if not ids.size:
            return
        ends = offs + self.length
        for b in np.unique(ids).tolist():
            if not 0 <= b < len(buffers):
                raise TransferError(
                    f"{side} buffers: the plan uses buffer {b}, {len(buffers)} buffers given"
                )
            buf = buffers[b]
            got = _not_flat_bytes(buf)
            if got:
                raise TransferError(
                    f"{side} buffers[{b}]: need a flat contiguous uint8 tensor, got {got}"
                )
            need = int(ends[ids == b].max())
            if buf.numel() < need:
                raise TransferError(
                    f"{side} buffers[{b}]: {buf.numel()} bytes, the plan's runs reach byte {need}"
                )

    def copy(self, src_buffers: Sequence[torch.Tensor], dst_buffers: Sequence[torch.Tensor]) -> int:
        """Copy every run from ``src_buffers`` into ``dst_buffers`` (flat uint8 tensors);
        returns the bytes copied.  Buffers that cannot serve the runs, and source and
        destination runs that overlap in memory (a plan from an instance to itself moving
        blocks onto blocks it reads, which copied run by run would read bytes an earlier run
        wrote), raise :class:`TransferError` before anything is copied."""
        self.check_buffers(src_buffers, "source")
        self.check_buffers(dst_buffers, "destination")
        runs = self.runs()
        check_no_overlap(runs, src_buffers, dst_buffers, field="plan", remedy=_STAGE)
        for sb, so, db, do, n in runs:
            dst_buffers[db][do : do + n].copy_(src_buffers[sb][so : so + n])
        return self.total_bytes

    def pack(
        self, src_buffers: Sequence[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The runs' source bytes, concatenated in run order, into ``out`` (or a new tensor
        on the first buffer's device).  An ``out`` sharing bytes with a source run raises
        :class:`TransferError` before anything is written."""
        self.check_buffers(src_buffers, "source")
        total = self.total_bytes
        runs = self.runs()
        if out is None:
            device = src_buffers[0].device if len(src_buffers) else "cpu"
            out = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            _check_stream(out, total)
            packed = [
                (sb, so, 0, pos, n)
                for (sb, so, _, _, n), pos in zip(runs, self._positions(), strict=True)
            ]
            check_no_overlap(packed, src_buffers, [out], field="out", remedy=_FRESH)
        pos = 0
        for sb, so, _, _, n in runs:
            out[pos : pos + n].copy_(src_buffers[sb][so : so + n])
            pos += n
        return out

    def _positions(self) -> list[int]:
        """Where each run starts in a :meth:`pack` stream."""
        starts: list[int] = (np.cumsum(self.length) - self.length).tolist()
        return starts

    def unpack(self, packed: torch.Tensor, dst_buffers: Sequence[torch.Tensor]) -> None:
        """Write a stream from :meth:`pack` into the runs' destinations.  A ``packed``
        sharing bytes with a destination run raises :class:`TransferError` before anything
        is written."""
        _check_stream(packed, self.total_bytes)
        self.check_buffers(dst_buffers, "destination")
        runs = self.runs()
        streamed = [
            (0, pos, db, do, n)
            for (_, _, db, do, n), pos in zip(runs, self._positions(), strict=True)
        ]
        check_no_overlap(streamed, [packed], dst_buffers, field="packed", remedy=_FRESH)
        pos = 0
        for _, _, db, do, n in runs:
            dst_buffers[db][do : do + n].copy_(packed[pos : pos + n])
            pos += n


_STAGE = "copy through a staging buffer (pack, then unpack) or plan into other blocks"
_FRESH = "use a stream that shares no memory with the cache buffers"


def _not_flat_bytes(t: object) -> str:
    """What ``t`` is when it is not a flat contiguous uint8 tensor ("" when it is)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        return f"dtype {t.dtype}, shape {tuple(t.shape)}"
    return ""


def _check_stream(packed: torch.Tensor, total: int) -> None:
    got = _not_flat_bytes(packed)
    if got:
        raise TransferError(f"packed: need a flat contiguous uint8 tensor, got {got}")
    if packed.numel() < total:
        raise TransferError(f"packed: {packed.numel()} bytes, the plan moves {total}")


def plan_transfer(
    src: Registration,
    src_tables: Mapping[int, Sequence[int]],
    dst: Registration,
    dst_tables: Mapping[int, Sequence[int]],
    *,
    tokens: tuple[int, int] | tuple[np.ndarray, np.ndarray],
    state: bool = True,
    unsplit: bool = True,
    skip: Mapping[int, Sequence[tuple[int, int]]] | None = None,
) -> TransferPlan:
    """The runs moving tokens ``[tokens[0], tokens[1])`` of every token-indexed array (and,
    with ``state``, every state slot) from ``src`` to ``dst`` (see the module doc).
    ``*_tables[g]``: group ``g``'s block table on that side.  ``tokens`` may instead map
    positions: ``(destination positions, source positions)``, two equal-length arrays
    (a context-parallel rank's local tokens and their places in the whole request,
    :mod:`hybridkv.storage.cp`).  ``unsplit=False`` leaves out the arrays the source holds
    whole (MLA latents, unsplit states): every tensor-parallel rank has them, so a
    destination filled from several source ranks takes them from the first only.
    ``skip[g]``: ranges ``[start, end)`` of source positions whose tokens are left out of
    the destination group ``g``'s arrays (the source released them; the destination never
    publishes the blocks they fall in: :meth:`~hybridkv.cache.KVCacheManager.drop_unread`).
    Pure.

    Raises :class:`TransferError` for an array the source lacks, shapes, element types or
    global sizes (``shard_total``) that differ, a table too short for the tokens (a
    ``(start, end)`` range is checked against the tables before its positions are made),
    block ids that are not integers of the group's range, a destination block twice, a null
    source block where the destination needs data, or a null state slot.
    """
    _check_tokens(tokens)
    checked: dict[tuple[str, int], np.ndarray] = {}
    todo: list[tuple[SegmentRef, np.ndarray, SegmentRef, np.ndarray]] = []
    for d in dst.segments:
        s = src.segment(d.key)
        if s is None:
            raise TransferError(
                f"layer {d.layer} slot {d.slot} {d.name!r}: the source instance "
                f"{src.instance!r} stores no such array"
            )
        if (d.token_axis is None and not state) or (not unsplit and s.shard_axis is None):
            continue
        s_tab = _table(src_tables, s, "source", checked)
        d_tab = _table(dst_tables, d, "destination", checked)
        todo.append((s, s_tab, d, d_tab))
    _check_token_range(
        tokens, [(d, d_tab) for _, _, d, d_tab in todo if not (skip and skip.get(d.group_id))]
    )
    pair = _token_pairs(tokens)
    pairs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    parts: list[tuple[np.ndarray, ...]] = []
    for s, s_tab, d, d_tab in todo:
        own = pair
        if skip and d.token_axis is not None and skip.get(d.group_id):
            got = pairs.get(d.group_id)
            if got is None:
                got = pairs[d.group_id] = _skipping(pair, skip[d.group_id], d.group_id)
            own = got
        part = _segment_units(s, s_tab, d, d_tab, own)
        if part is not None:
            parts.append(part)
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return TransferPlan(empty, empty, empty, empty, empty)
    sb, so, db, do, n = (np.concatenate(x) for x in zip(*parts, strict=True))
    return _coalesce(sb, so, db, do, n)


def _skipping(
    pair: tuple[np.ndarray, np.ndarray], ranges: Sequence[tuple[int, int]], g: int
) -> tuple[np.ndarray, np.ndarray]:
    """``pair`` without the tokens whose source position lies in one of ``ranges``."""
    td, ts = pair
    out = np.zeros(len(ts), dtype=bool)
    for r in ranges:
        ok = isinstance(r, tuple | list) and len(r) == 2
        if not ok or not all(isinstance(x, int | np.integer) for x in r):
            raise TransferError(f"skip[{g}]: need (start, end) token ranges, got {brief_repr(r)}")
        a, b = r
        out |= (ts >= a) & (ts < b)
    return td[~out], ts[~out]


def _table(
    tables: Mapping[int, Sequence[int]],
    seg: SegmentRef,
    side: str,
    checked: dict[tuple[str, int], np.ndarray],
) -> np.ndarray:
    """Group ``seg.group_id``'s table on ``side`` as int64, checked once: integers in
    ``[0, num_blocks)``; on the destination no block twice (but the null block 0)."""
    g = seg.group_id
    done = checked.get((side, g))
    if done is not None:
        return done
    table = tables.get(g)
    if table is None:
        raise TransferError(f"{side} tables: no block table for group {g}")
    arr = np.asarray(table)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TransferError(
            f"{side} tables[{g}]: need a 1-D sequence of integer block ids, got {brief_repr(table)}"
        )
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= seg.num_blocks)]
    if bad.size:
        raise TransferError(
            f"{side} tables[{g}]: block id {int(bad[0])} is not a block of group {g}; valid: "
            f"0 .. {seg.num_blocks - 1}"
        )
    if side == "destination":
        used = arr[arr != 0]
        ids, counts = np.unique(used, return_counts=True)
        if np.any(counts > 1):
            raise TransferError(
                f"destination tables[{g}]: block {int(ids[counts > 1][0])} appears twice (the "
                "runs would overwrite each other)"
            )
    checked[side, g] = arr
    return arr


def _segment_units(
    s: SegmentRef,
    s_tab: np.ndarray,
    d: SegmentRef,
    d_tab: np.ndarray,
    pair: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, ...] | None:
    where = f"layer {d.layer} slot {d.slot} {d.name!r}"
    if s.dtype != d.dtype:
        raise TransferError(
            f"{where}: the source stores {s.dtype}, the destination {d.dtype} (the bytes of "
            "one are not the other's)"
        )
    if s.itemsize != d.itemsize or len(s.shape) != len(d.shape) or s.token_axis != d.token_axis:
        raise TransferError(
            f"{where}: the source stores {s.shape} x {s.itemsize} B, the destination "
            f"{d.shape} x {d.itemsize} B"
        )
    if s.shard_axis is not None and d.shard_axis is not None and s.shard_axis != d.shard_axis:
        raise TransferError(f"{where}: the two sides split it over ranks along other axes")
    ndim = len(d.shape)
    for axis in range(ndim):
        if axis == d.token_axis:
            continue
        s_all, d_all = _global_size(s, axis), _global_size(d, axis)
        if s_all != d_all:
            raise TransferError(
                f"{where}: axis {axis} has {s_all} entries in all on the source "
                f"({_extent(s, axis)}), {d_all} on the destination ({_extent(d, axis)}); "
                "both sides must hold one array of the same size before any tensor-parallel "
                "split (a split cuts it, never resizes it); check that both instances run one "
                "model and register their split with the right kv_heads / state_rows"
            )
    # Per axis: the global index range both sides hold (token axis handled apart).
    ranges: list[tuple[int, int]] = []
    for axis in range(ndim):
        if axis == d.token_axis:
            ranges.append((0, 0))
            continue
        s_first = s.shard_first if axis == s.shard_axis else 0
        d_first = d.shard_first if axis == d.shard_axis else 0
        lo = max(s_first, d_first)
        hi = min(s_first + s.shape[axis], d_first + d.shape[axis])
        if hi <= lo:
            return None  # no slice in common (another source rank holds it)
        ranges.append((lo, hi))
    src = np.array([s.offset], dtype=np.int64)
    dst = np.array([d.offset], dtype=np.int64)
    if d.token_axis is None:  # a state slot
        if not len(s_tab) or not len(d_tab):
            raise TransferError(f"{where}: a state group needs its slot in both tables")
        if not s_tab[0] or not d_tab[0]:
            side = "source" if not s_tab[0] else "destination"
            raise TransferError(
                f"{where}: the {side}'s state slot is the null block 0 (it holds no state and "
                "is never written)"
            )
        src += int(s_tab[0]) * s.block_stride
        dst += int(d_tab[0]) * d.block_stride
    last = ndim - 1
    for axis in range(last):
        if axis == d.token_axis:
            td, ts = pair
            need = int(td.max()) // d.block_size + 1 if len(td) else 0
            if len(d_tab) < need:
                raise TransferError(f"{where}: the destination table covers too few tokens")
            d_blocks = d_tab[td // d.block_size]
            keep = d_blocks != 0
            td, ts, d_blocks = td[keep], ts[keep], d_blocks[keep]
            if len(ts) and int(ts.max()) // s.block_size >= len(s_tab):
                raise TransferError(f"{where}: the source table covers too few tokens")
            s_blocks = s_tab[ts // s.block_size]
            if np.any(s_blocks == 0):
                miss = int(ts[np.flatnonzero(s_blocks == 0)[0]])
                raise TransferError(f"{where}: the source holds no data for token {miss}")
            cs = s_blocks * s.block_stride + (ts % s.block_size) * s.strides[axis]
            cd = d_blocks * d.block_stride + (td % d.block_size) * d.strides[axis]
        else:
            lo, hi = ranges[axis]
            g = np.arange(lo, hi, dtype=np.int64)
            s_first = s.shard_first if axis == s.shard_axis else 0
            d_first = d.shard_first if axis == d.shard_axis else 0
            cs = (g - s_first) * s.strides[axis]
            cd = (g - d_first) * d.strides[axis]
        src = (src[:, None] + cs[None, :]).ravel()
        dst = (dst[:, None] + cd[None, :]).ravel()
    lo, hi = ranges[last]
    if last == d.token_axis:  # a 1-axis token array: one element per token
        raise TransferError(f"{where}: a token array needs a feature axis")
    s_first = s.shard_first if last == s.shard_axis else 0
    d_first = d.shard_first if last == d.shard_axis else 0
    if s.strides[last] == s.itemsize and d.strides[last] == d.itemsize:
        src = src + (lo - s_first) * s.itemsize
        dst = dst + (lo - d_first) * d.itemsize
        n = np.full(src.shape, (hi - lo) * s.itemsize, dtype=np.int64)
    else:  # a strided last axis: one unit per element
        g = np.arange(lo, hi, dtype=np.int64)
        src = (src[:, None] + ((g - s_first) * s.strides[last])[None, :]).ravel()
        dst = (dst[:, None] + ((g - d_first) * d.strides[last])[None, :]).ravel()
        n = np.full(src.shape, s.itemsize, dtype=np.int64)
    sb = np.full(src.shape, s.buffer_id, dtype=np.int64)
    db = np.full(dst.shape, d.buffer_id, dtype=np.int64)
    return sb, src, db, dst, n


def _global_size(seg: SegmentRef, axis: int) -> int:
    """How many entries axis ``axis`` of ``seg``'s array has before any tensor-parallel
    split: ``shard_total`` along the split axis, the shape elsewhere."""
    return seg.shard_total if axis == seg.shard_axis else seg.shape[axis]


def _extent(seg: SegmentRef, axis: int) -> str:
    """What ``seg`` holds of axis ``axis``, for an error message."""
    if axis != seg.shard_axis:
        return f"shape {seg.shape}, not split"
    first, count = seg.shard_first, seg.shape[axis]
    return f"entries {first}..{first + count - 1} of shard_total {seg.shard_total}"


def _check_tokens(tokens: object) -> None:
    """Raise :class:`TransferError` unless ``tokens`` is a pair (a range or a token map)."""
    if not isinstance(tokens, tuple | list) or len(tokens) != 2:
        raise TransferError(
            f"tokens: need (start, end) or (destination positions, source positions), got "
            f"{brief_repr(tokens)}"
        )


def _check_token_range(
    tokens: tuple[int, int] | tuple[np.ndarray, np.ndarray],
    token_arrays: Sequence[tuple[SegmentRef, np.ndarray]],
) -> None:
    """For a ``(start, end)`` range, raise :class:`TransferError` when ``end`` lies past what a
    destination table of a token array covers, before the range's positions are made (a
    group with ``skip`` ranges is checked per token later)."""
    a, b = tokens
    if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in (a, b)):
        return  # a token map, or a bad range _token_pairs names
    end = int(b)
    for d, d_tab in token_arrays:
        if d.token_axis is None or end <= int(a):
            continue
        covered = len(d_tab) * d.block_size
        if end > covered:
            raise TransferError(
                f"tokens: end {end} lies past what the destination table of group "
                f"{d.group_id} covers ({len(d_tab)} blocks of {d.block_size} tokens = "
                f"{covered}); valid: end <= {covered} (layer {d.layer} slot {d.slot} "
                f"{d.name!r}: the destination table covers too few tokens)"
            )


def _token_pairs(
    tokens: tuple[int, int] | tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """``(destination positions, source positions)`` of the tokens to move."""
    a, b = tokens
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        na, nb = np.asarray(a), np.asarray(b)
        if (na.size and na.dtype.kind not in "iu") or (nb.size and nb.dtype.kind not in "iu"):
            raise TransferError("tokens: a token map's positions must be integers")
        td, ts = na.astype(np.int64), nb.astype(np.int64)
        if td.shape != ts.shape or td.ndim != 1 or (td.size and min(td.min(), ts.min()) < 0):
            raise TransferError(
                "tokens: a token map needs two equal-length 1-D arrays of positions >= 0"
            )
        if np.unique(td).size != td.size:
            raise TransferError("tokens: a token map names a destination position twice")
        return td, ts
    if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in (a, b)):
        raise TransferError(f"tokens: need two integers (start, end), got {brief_repr(tokens)}")
    start, end = int(a), int(b)
    if not 0 <= start <= end:
        raise TransferError(f"tokens: need 0 <= start <= end, got {tokens}")
    t = np.arange(start, end, dtype=np.int64)
    return t, t


def _coalesce(
    sb: np.ndarray, so: np.ndarray, db: np.ndarray, do: np.ndarray, n: np.ndarray
) -> TransferPlan:
    order = np.lexsort((so, sb))
    sb, so, db, do, n = sb[order], so[order], db[order], do[order], n[order]
    if len(n) > 1:
        joins = (
            (sb[1:] == sb[:-1])
            & (db[1:] == db[:-1])
            & (so[1:] == so[:-1] + n[:-1])
            & (do[1:] == do[:-1] + n[:-1])
        )
        heads = np.concatenate([[0], np.flatnonzero(~joins) + 1])
    else:
        heads = np.arange(len(n))
    lengths = np.add.reduceat(n, heads) if len(n) else n
    return TransferPlan(sb[heads], so[heads], db[heads], do[heads], lengths)
