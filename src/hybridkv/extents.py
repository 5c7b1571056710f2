"""Free space of a byte range that holds slots of several sizes: the host tier's buffer and
the disk tier's file.  No torch.

Slots are carved from the front (a bump mark, :attr:`FreeExtents.top`).  A freed slot joins
its free neighbours into one extent, so space freed by small slots serves large ones later
(free lists per exact size never did: once small entries had filled a disk and left, a
larger size found no room while the file was nearly empty).  A request takes, in order: a
free extent of exactly its size, the smallest free extent that leaves a usable remainder (at
least ``min_rest`` bytes), split in two, then room at the bump mark: freed space is used
before the carved space grows.
"""

from __future__ import annotations

from hybridkv.errors import InvariantError

__all__ = ["FreeExtents"]


class FreeExtents:
    """Free extents of ``[0, limit)`` (see the module doc).

    ``min_rest``: the smallest extent a split may leave (the disk's slot header and a byte);
    ``lower_top``: a freed extent that ends at the bump mark lowers the mark instead (the
    host buffer; the disk keeps what it carved, as its recovery walk reads it).
    """

    def __init__(self, limit: int, *, min_rest: int = 1, lower_top: bool = True) -> None:
        self.limit = limit
        self.min_rest = max(1, min_rest)
        self.lower_top = lower_top
        #: Bytes carved from the front so far.
        self.top = 0
        self._at: dict[int, int] = {}  # start -> length
        self._end: dict[int, int] = {}  # end -> start
        self._by_len: dict[int, dict[int, None]] = {}  # length -> starts, newest last

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents (below the bump mark)."""
        return sum(self._at.values())

    def extents(self) -> list[tuple[int, int]]:
        """The free extents ``(start, length)``, by start."""
        return sorted(self._at.items())

    def take(self, n: int) -> tuple[int, tuple[int, int] | None] | None:
        """``(start, rest)`` of ``n`` bytes taken, or None when nothing has room.  ``rest``
        is ``(start, length)`` of the free extent a split left after them (None when
        nothing was split): a caller that marks free space in the bytes themselves (the
        disk's headers) marks it there."""
        same = self._by_len.get(n)
        if same:
            start = next(reversed(same))
            self._remove(start)
            return start, None
        fits = [k for k in self._by_len if k - n >= self.min_rest]
        if fits:
            length = min(fits)
            start = next(reversed(self._by_len[length]))
            self._remove(start)
            self._add(start + n, length - n)
            return start, (start + n, length - n)
        if self.top + n <= self.limit:
            self.top += n
            return self.top - n, None
        return None

    def give(self, start: int, n: int) -> tuple[int, int]:
        """Free ``n`` bytes at ``start``, joined with the free extents next to them; returns
        the extent they are now part of (``(top, 0)`` when it lowered the bump mark)."""
        after = self._at.get(start + n)
        if after is not None:
            self._remove(start + n)
            n += after
        before = self._end.get(start)
        if before is not None:
            self._remove(before)
            n += start - before
            start = before
        if self.lower_top and start + n == self.top:
            self.top = start
            return self.top, 0
        self._add(start, n)
        return start, n

    def reset(self) -> None:
        """Everything free again, nothing carved."""
        self.top = 0
        self._at.clear()
        self._end.clear()
        self._by_len.clear()

    def check(self, used: list[tuple[int, int, str]]) -> None:
        """Raise :class:`InvariantError` unless the slots in ``used`` (``(start, bytes,
        what)``) and the free extents lie under the bump mark, within ``limit``, with no two
        overlapping, and no two free extents touching (they would have been joined)."""
        spans = [*used, *((s, n, f"free extent of {n} B") for s, n in self._at.items())]
        end, last = 0, "the start"
        for start, n, what in sorted(spans):
            if start < end:
                raise InvariantError(f"extents: {what} at {start} overlaps {last}")
            end, last = start + n, what
        if end > self.top or self.top > self.limit:
            raise InvariantError(
                f"extents: slots reach byte {end}, bump mark {self.top}, limit {self.limit}"
            )
        for start, n in self._at.items():
            if start + n in self._at:
                raise InvariantError(f"extents: free extents at {start} and {start + n} touch")
            if self._end.get(start + n) != start or start not in self._by_len.get(n, {}):
                raise InvariantError(f"extents: the indexes disagree on the extent at {start}")
        if len(self._end) != len(self._at) or sum(map(len, self._by_len.values())) != len(self._at):
            raise InvariantError("extents: the indexes hold other extents than the free ones")

    def _add(self, start: int, n: int) -> None:
        self._at[start] = n
        self._end[start + n] = start
        self._by_len.setdefault(n, {})[start] = None

    def _remove(self, start: int) -> None:
        n = self._at.pop(start)
        del self._end[start + n]
        starts = self._by_len[n]
        del starts[start]
        if not starts:
            del self._by_len[n]
