"""Prefix-cache statistics: queries, hits in tokens, per group and per group alone."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PrefixCacheStats", "StatsCollector"]


class PrefixCacheStats(NamedTuple):
    """Counters over an interval (or since start).

    ``queries``: ``get_computed_blocks`` calls; ``query_tokens``: the requests' token counts
    summed; ``hit_tokens``: tokens of the hits returned (every group serves the whole hit).
    ``group_alone_hit_tokens[g]``: tokens group ``g`` could have served by its own rule if the
    other groups did not constrain the hit (its standalone longest hit, aligned to the
    schedule alignment); empty unless the manager was built with ``group_hit_stats=True``.
    ``preemptions``: requests preempted.  ``reset``: the prefix cache was
    reset during the interval.  ``compactions``: :meth:`KVCacheManager.compact` calls that
    moved blocks; ``moved_blocks``: the blocks they moved.
    """

    queries: int
    query_tokens: int
    hit_tokens: int
    group_alone_hit_tokens: tuple[int, ...]
    preemptions: int
    reset: bool
    compactions: int = 0
    moved_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0.0 without queries)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class StatsCollector:
    """Mutable counters behind :class:`PrefixCacheStats`: cumulative and since the last take."""

    __slots__ = (
        "_alone",
        "_counts",
        "_ever_reset",
        "_num_groups",
        "_reset",
        "_total_alone",
        "_total_counts",
    )

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self._counts = [0] * 6  # queries, query/hit tokens, preemptions, compactions, moves
        self._alone = [0] * num_groups
        self._reset = False
        self._ever_reset = False
        self._total_counts = [0] * 6
        self._total_alone = [0] * num_groups

    def record_query(self, query_tokens: int, hit_tokens: int, alone: list[int] | None) -> None:
        c = self._counts
        c[0] += 1
        c[1] += query_tokens
        c[2] += hit_tokens
        if alone is not None:
            a = self._alone
            for g, n in enumerate(alone):
                a[g] += n

    def record_preemption(self) -> None:
        self._counts[3] += 1

    def record_compaction(self, moved: int) -> None:
        self._counts[4] += 1
        self._counts[5] += moved

    def record_reset(self) -> None:
        self._reset = True
        self._ever_reset = True

    def _fold(self) -> None:
        for i, n in enumerate(self._counts):
            self._total_counts[i] += n
        for g, n in enumerate(self._alone):
            self._total_alone[g] += n

    def total(self) -> PrefixCacheStats:
        """Counters since the manager was built; ``reset`` tells whether one ever happened."""
        c = [t + n for t, n in zip(self._total_counts, self._counts, strict=True)]
        alone = tuple(t + n for t, n in zip(self._total_alone, self._alone, strict=True))
        return PrefixCacheStats(c[0], c[1], c[2], alone, c[3], self._ever_reset, c[4], c[5])

    def take(self) -> PrefixCacheStats:
        """Counters since the previous take; starts a new interval."""
        c = self._counts
        out = PrefixCacheStats(c[0], c[1], c[2], tuple(self._alone), c[3], self._reset, c[4], c[5])
        self._fold()
        self._counts = [0] * 6
        self._alone = [0] * self._num_groups
        self._reset = False
        return out
