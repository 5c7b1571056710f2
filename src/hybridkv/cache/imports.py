"""Requests whose prompt another instance computed (a disaggregated prefill's handover):
:func:`drop_unread`, behind :meth:`KVCacheManager.drop_unread`.

After the import's allocation, windowed groups (sliding window, local chunks) free the
blocks no query after the prompt reads, as a prefix hit of the prompt would not have held
them.  The exporting side may have released more than this side drops: its window blocks
can be smaller, so this side's first kept block starts before the first token it still
has.  Those tokens (``missing``) are never written here; each block holding one is
withheld from the prefix cache for good, so no later hit reads them.  Tokens a query after
the prompt reads must be written: an import lacking one is refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.cache.arguments import check_count, check_group_id, check_request_id
from hybridkv.cache.coordinator import HybridCoordinator
from hybridkv.cache.errors import RequestLengthError, UnknownRequestError, UnwrittenTokensError
from hybridkv.errors import brief_repr

__all__ = ["drop_unread"]

Ranges = Mapping[int, Sequence[tuple[int, int]]]


def drop_unread(
    coord: HybridCoordinator, request_id: str, num_tokens: int, missing: Ranges | None
) -> int:
    """See :meth:`hybridkv.cache.manager.KVCacheManager.drop_unread`."""
    check_request_id("drop_unread", request_id)
    rs = coord.requests.get(request_id)
    if rs is None:
        raise UnknownRequestError(f"drop_unread: request {request_id!r} holds no blocks")
    n = check_count("drop_unread: num_tokens", num_tokens)
    start = rs.request.num_computed_tokens
    if not start <= n <= rs.num_slots:
        raise RequestLengthError(
            f"drop_unread: num_tokens {n} outside [{start}, {rs.num_slots}] (computed tokens, "
            f"allocated slots) of {request_id!r}"
        )
    managers = coord.managers
    gaps = _check_missing(missing, len(managers))
    for g, ranges in gaps.items():
        bad = managers[g].unwritable(rs.groups[g], start, n, ranges)
        if bad is not None:
            raise UnwrittenTokensError(
                f"drop_unread: missing[{g}]: token {bad[0]} of {request_id!r} is not written "
                f"by the import, but {bad[1]}; only tokens no query after the prompt reads "
                "may be missing"
            )
    return sum(
        len(m.drop_unread(st, n, gaps.get(g, ()), start))
        for g, (m, st) in enumerate(zip(managers, rs.groups, strict=True))
    )


def _check_missing(missing: object, num_groups: int) -> dict[int, list[tuple[int, int]]]:
    """``missing`` as ``{group: [(start, end), ...]}`` (sorted), or a
    :class:`RequestLengthError` naming what is wrong."""
    if missing is None:
        return {}
    where = "drop_unread: missing"
    if not isinstance(missing, Mapping):
        raise RequestLengthError(
            f"{where}: need a mapping of group id to token ranges [(start, end), ...], got "
            f"{brief_repr(missing)}"
        )
    out: dict[int, list[tuple[int, int]]] = {}
    for key, ranges in missing.items():
        g = check_group_id(where, key, num_groups)
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence):
            raise RequestLengthError(
                f"{where}[{g}]: need a sequence of (start, end) token ranges, got "
                f"{brief_repr(ranges)}"
            )
        got: list[tuple[int, int]] = []
        for r in ranges:
            ok = isinstance(r, (tuple, list)) and len(r) == 2
            a, b = (check_count(f"{where}[{g}]", x) for x in r) if ok else (0, -1)
            if not a < b:
                raise RequestLengthError(
                    f"{where}[{g}]: need token ranges (start, end) with 0 <= start < end, "
                    f"got {brief_repr(r)}"
                )
            got.append((a, b))
        out[g] = sorted(got)
    return out
