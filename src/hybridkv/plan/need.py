"""How many blocks one request holds per group: the unit of every capacity figure.

:func:`blocks_for_request` is the single source of truth; the planner sizes pools with it and
a cache manager can use it for admission.  The figure is the *peak* number of blocks a request
holds at any point while it grows to ``seq_len`` tokens (blocks, not tokens or bytes):

* full attention, MLA: every token is kept, ``cdiv(seq_len, block_size)``.
* sliding window ``W`` (plus ``S`` sink tokens): the most blocks the visible span of any query
  at position ``< seq_len`` touches (a ``W``-token span that starts on the last token of a
  block touches one block more than an aligned one), **plus one**: the block being filled
  while the block that left the window has not been released yet.  Never more than
  ``cdiv(seq_len, block_size)``.
* chunked local attention (chunk ``C``): the most blocks the current chunk's span touches
  (chunks need not be aligned to blocks), plus one for the same reason, capped likewise.
* state kinds: 1, the running state slot.  Checkpoints saved for prefix caching are cache
  contents that can be evicted, not need.

Example: ``W = 128``, block 16, ``seq_len = 131072``: a 128-token span touches at most 9
blocks, so the need is 10 blocks (full attention needs 8192).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import cast

from hybridkv.errors import PlanError, brief_repr
from hybridkv.plan.layout import GroupPlan
from hybridkv.specs import CacheKind, CacheSpec, ChunkedLocalSpec, SlidingWindowSpec

__all__ = ["blocks_for_request", "blocks_touched", "spec_blocks_for_request"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_touched(spans: tuple[range, ...], block_size: int) -> int:
    """Number of distinct blocks of ``block_size`` tokens that the token ``spans`` touch."""
    intervals = sorted((r.start // block_size, (r.stop - 1) // block_size) for r in spans if r)
    count = 0
    end = -1
    for lo, hi in intervals:
        lo = max(lo, end + 1)
        if hi >= lo:
            count += hi - lo + 1
            end = hi
    return count


def _full(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    return _cdiv(seq_len, block_size)


def _state(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    return 1


def _sliding(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    sw = cast(SlidingWindowSpec, spec)
    window, sinks = sw.window, sw.sink_tokens
    # While the window start q-W+1 is <= S the visible span is 0..q: it grows with q.
    peak = (min(seq_len - 1, window - 1 + sinks)) // block_size + 1
    # Beyond that, the count depends on the window start s only through s % block_size and
    # through its overlap with the sink blocks, which ends before s = S + block_size; the next
    # block_size starts cover every residue, so 2 * block_size starts are enough (exact).
    for start in range(sinks + 1, min(seq_len - window, sinks + 2 * block_size) + 1):
        spans = sw.visible_tokens(start + window - 1)
        peak = max(peak, blocks_touched(spans, block_size))
    return min(_cdiv(seq_len, block_size), peak + 1)


def _chunked(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    chunk = cast(ChunkedLocalSpec, spec).chunk_size
    peak = 0
    # A full chunk starting at c touches blocks c // bs .. (c + C - 1) // bs.  Chunk starts
    # k * C repeat their offset within a block every bs / gcd(C, bs) <= bs chunks.
    for k in range(min(seq_len // chunk, block_size)):
        start = k * chunk
        peak = max(peak, (start + chunk - 1) // block_size - start // block_size + 1)
    last = (seq_len - 1) // chunk * chunk  # the chunk holding the last token (maybe partial)
    peak = max(peak, (seq_len - 1) // block_size - last // block_size + 1)
    return min(_cdiv(seq_len, block_size), peak + 1)


_NEED: dict[CacheKind, Callable[[CacheSpec, int, int], int]] = {
    CacheKind.FULL: _full,
    CacheKind.MLA: _full,
    CacheKind.SLIDING: _sliding,
    CacheKind.CHUNKED: _chunked,
    CacheKind.STATE: _state,
}


def spec_blocks_for_request(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    """Peak blocks one request of ``seq_len`` tokens holds for one group (see module doc).

    ``seq_len == 0`` needs 0 blocks.  Raises :class:`PlanError` for a ``spec`` that is not a
    :class:`CacheSpec`, a negative length, a non-positive block size or a spec that stores
    nothing.  Pure (memoised).
    """
    if not isinstance(spec, CacheSpec):
        raise PlanError(
            f"spec: expected a CacheSpec (e.g. a layer's caches[0]), got {brief_repr(spec)}"
        )
    if not isinstance(block_size, int) or block_size <= 0:
        raise PlanError(f"block_size: must be a positive integer, got {block_size!r}")
    if not isinstance(seq_len, int) or seq_len < 0:
        raise PlanError(f"seq_len: must be an integer >= 0, got {seq_len!r}")
    return _spec_blocks(spec, block_size, seq_len)


@lru_cache(maxsize=4096)
def _spec_blocks(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    """:func:`spec_blocks_for_request` of checked arguments, memoised."""
    rule = _NEED.get(spec.kind)
    if rule is None:
        valid = ", ".join(k.value for k in _NEED)
        raise PlanError(f"spec.kind: {spec.kind.value!r} holds no blocks; valid: {valid}")
    if seq_len == 0:
        return 0
    return rule(spec, block_size, seq_len)


def blocks_for_request(group: GroupPlan, seq_len: int) -> int:
    """Peak blocks one request of ``seq_len`` tokens holds in ``group`` (its block table).

    Raises :class:`PlanError` for a ``group`` that is not a :class:`GroupPlan` and as
    :func:`spec_blocks_for_request` does."""
    if not isinstance(group, GroupPlan):
        raise PlanError(
            f"group: expected a GroupPlan (an entry of layout.groups), got {brief_repr(group)}"
        )
    return spec_blocks_for_request(group.spec, group.block_size, seq_len)
