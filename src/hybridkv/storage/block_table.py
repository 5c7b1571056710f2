"""Kernel block tables: manager block ids and the kernel block ids they split into.  No torch.

A group's manager block of ``block_size`` tokens is ``ratio = block_size // kernel_block_size``
kernel blocks; manager block ``m`` is kernel blocks ``m * ratio + j`` for ``j in range(ratio)``.
A :class:`BlockTable` keeps one request's manager ids and the matching kernel ids (``int32``)
side by side, and every mutation updates both.

Invariant (checked by :meth:`BlockTable.check_invariants`)::

    len(kernel_ids) == len(manager_ids) * ratio
    kernel_ids[i * ratio + j] == manager_ids[i] * ratio + j      for every i, j
    0 <= manager_ids[i] < num_blocks                             (when num_blocks is known)
    0 <= kernel_ids[k] <= INT32_MAX                              (ids below 2**31 // ratio)

The null block (manager id 0) maps to kernel ids ``0 .. ratio-1``, the null block's own kernel
blocks, so a null entry stays null at kernel granularity.

Example: ratio 4, manager ids ``[7, 0, 2]`` -> kernel ids
``[28, 29, 30, 31, 0, 1, 2, 3, 8, 9, 10, 11]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.errors import InvariantError
from hybridkv.plan import NULL_BLOCK_ID, GroupPlan
from hybridkv.storage.errors import BlockRangeError, KernelBlockSizeError

__all__ = ["BlockTable", "batch_kernel_table", "kernel_ratio"]

_I32_MAX = int(np.iinfo(np.int32).max)


def _id_limit(ratio: int) -> int:
    """One past the largest manager id whose kernel ids (``id * ratio + ratio - 1`` the last)
    fit in ``int32``."""
    return (_I32_MAX + 1) // ratio


def _is_count(x: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def kernel_ratio(group: GroupPlan, kernel_block_size: int | None = None) -> int:
    """Kernel blocks per manager block of ``group``.

    ``kernel_block_size`` overrides ``group.kernel_block_size``; an override that is not a
    positive divisor of ``group.block_size`` raises :class:`KernelBlockSizeError` naming both.
    """
    size = group.kernel_block_size if kernel_block_size is None else kernel_block_size
    if not _is_count(size) or size <= 0 or group.block_size % int(size):
        raise KernelBlockSizeError(
            f"kernel_block_size: {size!r} does not divide group {group.group_id}'s block_size "
            f"{group.block_size}; use a positive divisor of {group.block_size}"
        )
    return group.block_size // int(size)


class BlockTable:
    """One request's block table at manager and kernel granularity.

    ``ratio`` is kernel blocks per manager block; ``num_blocks`` (optional) bounds manager ids
    to ``[0, num_blocks)``.  Every mutator validates first and raises :class:`BlockRangeError`
    (an id or position out of range) before touching any state, so a failed call leaves the
    table unchanged.  Arrays returned by
    :attr:`manager_ids` and :attr:`kernel_ids` are read-only views valid until the next
    mutation.
    """

    __slots__ = ("_kernel", "_len", "_manager", "_offsets", "num_blocks", "ratio")

    def __init__(
        self, ratio: int, *, num_blocks: int | None = None, block_ids: Iterable[int] = ()
    ) -> None:
        if not _is_count(ratio) or ratio <= 0:
            raise KernelBlockSizeError(f"ratio: must be a positive integer, got {ratio!r}")
        limit = _id_limit(int(ratio))
        if num_blocks is not None and not (_is_count(num_blocks) and 0 < num_blocks <= limit):
            raise BlockRangeError(
                f"num_blocks: must be in [1, {limit}] for ratio {ratio}, got {num_blocks}"
            )
        self.ratio = int(ratio)
        self.num_blocks = None if num_blocks is None else int(num_blocks)
        self._offsets = np.arange(ratio, dtype=np.int32)
        self._manager = np.zeros(8, dtype=np.int32)
        self._kernel = np.zeros(8 * ratio, dtype=np.int32)
        self._len = 0
        self.extend(block_ids)

    @classmethod
    def for_group(
        cls,
        group: GroupPlan,
        *,
        num_blocks: int | None = None,
        kernel_block_size: int | None = None,
    ) -> BlockTable:
        """An empty table for ``group`` (see :func:`kernel_ratio` for the override)."""
        return cls(kernel_ratio(group, kernel_block_size), num_blocks=num_blocks)

    # ------------------------------------------------------------------ reads

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> int:
        return int(self._manager[self._position(index)])

    @property
    def manager_ids(self) -> npt.NDArray[np.int32]:
        out = self._manager[: self._len]
        out.flags.writeable = False
        return out

    @property
    def kernel_ids(self) -> npt.NDArray[np.int32]:
        out = self._kernel[: self._len * self.ratio]
        out.flags.writeable = False
        return out

    def __repr__(self) -> str:
        return f"BlockTable(ratio={self.ratio}, manager_ids={self.manager_ids.tolist()})"

    # ------------------------------------------------------------------ mutations

    def append(self, block_id: int) -> None:
        """Add ``block_id`` at the end.  Raises :class:`BlockRangeError` for a bad id."""
        self.extend((block_id,))

    def extend(self, block_ids: Iterable[int]) -> None:
        """Add ``block_ids`` at the end, all or none."""
        ids = self._checked(block_ids)
        self._reserve(self._len + len(ids))
        self._write(self._len, ids)
        self._len += len(ids)

    def pop(self) -> int:
        """Remove and return the last manager id.  Raises :class:`BlockRangeError` when empty."""
        if not self._len:
            raise BlockRangeError("pop: the block table is empty")
        self._len -= 1
        return int(self._manager[self._len])

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries (``0 <= length <= len``)."""
        if not _is_count(length) or not 0 <= length <= self._len:
            raise BlockRangeError(f"truncate: length must be in [0, {self._len}], got {length!r}")
        self._len = length

    def resize(self, length: int, fill: int = NULL_BLOCK_ID) -> None:
        """Truncate to ``length``, or grow to it by appending ``fill`` (the null block)."""
        if not _is_count(length) or length < 0:
            raise BlockRangeError(f"resize: length must be an integer >= 0, got {length!r}")
        if length <= self._len:
            self._len = length
        else:
            self.extend([fill] * (length - self._len))

    def set(self, index: int, block_id: int) -> None:
        """Replace entry ``index`` with ``block_id``; its kernel entries follow."""
        pos = self._position(index)
        self._write(pos, self._checked((block_id,)))

    def set_null(self, index: int) -> None:
        """Replace entry ``index`` with the null block (kernel entries become its kernel ids)."""
        self.set(index, NULL_BLOCK_ID)

    def swap(self, i: int, j: int) -> None:
        """Exchange entries ``i`` and ``j`` (and their kernel runs)."""
        pi, pj = self._position(i), self._position(j)
        a, b = int(self._manager[pi]), int(self._manager[pj])
        self._write(pi, np.array([b], dtype=np.int32))
        self._write(pj, np.array([a], dtype=np.int32))

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` if manager and kernel ids disagree or leave range."""
        manager, kernel = self.manager_ids, self.kernel_ids
        if len(kernel) != len(manager) * self.ratio:
            raise InvariantError(f"{len(kernel)} kernel ids for {len(manager)} manager ids")
        expected = (manager[:, None] * self.ratio + self._offsets[None, :]).reshape(-1)
        if not np.array_equal(kernel, expected):
            bad = int(np.argmax(kernel != expected))
            raise InvariantError(
                f"kernel id at {bad} is {int(kernel[bad])}, expected {int(expected[bad])}"
            )
        upper = _id_limit(self.ratio) if self.num_blocks is None else self.num_blocks
        if len(manager) and (manager.min() < 0 or manager.max() >= upper):
            raise InvariantError(f"manager ids out of range [0, {upper}): {manager.tolist()}")

    # ------------------------------------------------------------------ internals

    def _position(self, index: int) -> int:
        if not _is_count(index) or not -self._len <= index < self._len:
            raise BlockRangeError(
                f"index: {index!r} is out of range for a block table of {self._len} entries"
            )
        return int(index) % self._len

    def _checked(self, block_ids: Iterable[int]) -> npt.NDArray[np.int32]:
        try:
            ids = list(block_ids)
        except TypeError:
            raise BlockRangeError(
                f"block_ids: need an iterable of block ids, got {type(block_ids).__name__}"
            ) from None
        upper = _id_limit(self.ratio) if self.num_blocks is None else self.num_blocks
        bad = [
            b
            for b in ids
            if isinstance(b, bool) or not isinstance(b, int | np.integer) or not 0 <= b < upper
        ]
        if bad:
            raise BlockRangeError(
                f"block_id: {bad[:8]} out of range; valid manager ids are [0, {upper})"
            )
        return np.asarray(ids, dtype=np.int32)

    def _reserve(self, length: int) -> None:
        if length <= len(self._manager):
            return
        cap = max(length, 2 * len(self._manager))
        manager = np.zeros(cap, dtype=np.int32)
        kernel = np.zeros(cap * self.ratio, dtype=np.int32)
        manager[: self._len] = self._manager[: self._len]
        kernel[: self._len * self.ratio] = self._kernel[: self._len * self.ratio]
        self._manager, self._kernel = manager, kernel

    def _write(self, pos: int, ids: npt.NDArray[np.int32]) -> None:
        n = len(ids)
        self._manager[pos : pos + n] = ids
        runs = ids[:, None] * self.ratio + self._offsets[None, :]
        self._kernel[pos * self.ratio : (pos + n) * self.ratio] = runs.reshape(-1)


def batch_kernel_table(
    tables: Sequence[BlockTable], *, width: int | None = None, pad: int = NULL_BLOCK_ID
) -> npt.NDArray[np.int32]:
    """A ``[len(tables), width]`` ``int32`` array, row ``r`` = ``tables[r].kernel_ids``.

    ``width`` defaults to the longest kernel row; shorter rows are padded with ``pad`` (the null
    kernel block 0 by default).  Every table must share one ratio.  Raises
    :class:`BlockRangeError` when a row is longer than ``width`` or the ratios differ.
    """
    if not _is_count(pad) or not 0 <= pad <= _I32_MAX:
        raise BlockRangeError(f"pad: must be a kernel block id in [0, {_I32_MAX}], got {pad!r}")
    ratios = {t.ratio for t in tables}
    if len(ratios) > 1:
        raise BlockRangeError(f"tables: all tables need one ratio, got {sorted(ratios)}")
    longest = max((len(t.kernel_ids) for t in tables), default=0)
    width = longest if width is None else width
    if longest > width:
        raise BlockRangeError(f"width: {width} is shorter than the longest row ({longest})")
    out = np.full((len(tables), width), pad, dtype=np.int32)
    for row, table in enumerate(tables):
        ids = table.kernel_ids
        out[row, : len(ids)] = ids
    return out
