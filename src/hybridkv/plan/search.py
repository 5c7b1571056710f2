"""Bisection over integers for the planner's monotone questions (how many requests fit, the
least budget or block count that holds one).  Standard library only."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["first_true"]


def first_true(holds: Callable[[int], bool], bad: int, good: int, tolerance: int = 1) -> int:
    """The least ``n`` in ``(bad, good]`` with ``holds(n)``, for ``holds`` false at ``bad``,
    true at ``good`` and (assumed) monotone in between; stops once the bracket is at most
    ``tolerance`` wide, so the result is always a value where ``holds`` was true."""
    while good - bad > max(1, tolerance):
        mid = (bad + good) // 2
        if holds(mid):
            good = mid
        else:
            bad = mid
    return good
