"""Where hits land: the coarsest token grid that (nearly) every observed junction lies on.

A *junction* is where an admitted request leaves the prefix the cache already holds (the
prefix-closed groups' hit).  In chat traffic it falls anywhere (the previous turn's end,
aligned down), so nothing coarser than the schedule alignment describes it.  Where prompts are
assembled from fixed-size pieces (documents chunked for retrieval, a trace recorded in
512-token hash blocks such as Mooncake's), a later request shares an earlier one's prompt only
up to the last whole piece: its hits land on that piece grid, short of the earlier prompt's
end.  A windowed group keeps, under tail retention, the window before a prompt's end; on such
a workload it should also keep the window before the prompt's last grid point, or the next turn
finds the full-attention blocks but no window there.

:class:`HitGrid` learns the grid: per level ``alignment * 2**k`` the share of observed
junctions that are multiples of it; :meth:`HitGrid.grid` is the coarsest level holding at least
:data:`SHARE` of them (the alignment until :data:`MIN_JUNCTIONS` were seen).  Counts halve
every :data:`HALF_LIFE` junctions, so the grid follows the workload.

Example: junctions on a 512-token grid with 16-token alignment::

    >>> grid = HitGrid(16)
    >>> for j in range(1, 40):
    ...     grid.observe(512 * j)
    >>> grid.grid()
    512
"""

from __future__ import annotations

from typing import Final

__all__ = ["HALF_LIFE", "LEVELS", "MIN_JUNCTIONS", "SHARE", "HitGrid"]

#: Grid levels tried: the alignment times 1, 2, 4, ..., 2**(LEVELS - 1).
LEVELS: Final = 8
#: Share of junctions a level must hold to be the grid.
SHARE: Final = 0.9
#: Junctions observed before any level above the alignment is trusted.
MIN_JUNCTIONS: Final = 32
#: Junctions between two halvings of every count.
HALF_LIFE: Final = 1024


class HitGrid:
    """The learned hit grid of one coordinator (``alignment``: the schedule alignment)."""

    __slots__ = ("_grid", "alignment", "counts", "since_halving", "total")

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        #: Decayed count of junctions that are multiples of ``alignment << k``, per ``k``.
        self.counts = [0.0] * LEVELS
        self.total = 0.0
        self.since_halving = 0
        self._grid = alignment

    def observe(self, junction: int) -> None:
        """An admitted request left the cached prefix at ``junction`` tokens (0: it shared
        nothing, not counted)."""
        if junction <= 0 or junction % self.alignment:
            return
        q = junction // self.alignment
        counts = self.counts
        for k in range(LEVELS):
            if q % (1 << k):
                break
            counts[k] += 1.0
        self.total += 1.0
        self.since_halving += 1
        if self.since_halving >= HALF_LIFE:
            self.since_halving = 0
            self.total *= 0.5
            for k in range(LEVELS):
                counts[k] *= 0.5
        grid = self.alignment
        if self.total >= MIN_JUNCTIONS:
            for k in range(LEVELS - 1, 0, -1):
                if counts[k] >= SHARE * self.total:
                    grid = self.alignment << k
                    break
        self._grid = grid

    def grid(self) -> int:
        """The grid hits land on (a multiple of the alignment; the alignment when nothing
        coarser holds)."""
        return self._grid
