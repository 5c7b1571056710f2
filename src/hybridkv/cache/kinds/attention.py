"""Per-token attention kinds: full attention and MLA, sliding window, chunked local.

Block ``j`` of a group with block size ``bs`` holds tokens ``[j*bs, (j+1)*bs)``.  A request's
table has one entry per block up to its allocated slots; windowed kinds replace blocks no
future query can see with the null block (id 0) and release them before taking new ones.

Hit rules (``L`` = hit length in tokens, a multiple of the schedule alignment):

* full / MLA: every block below ``L`` cached.  Prefix-closed; scanned left to right up to
  the first miss.
* windowed (sliding window, chunked local): every block overlapping
  ``spec.kept_tokens(L)`` cached (for a window ``W``: the ``cdiv(W - 1, bs)`` blocks before
  ``L`` plus the sink blocks); candidates scanned right to left over a byte string of
  cached flags (one C-level lookup pass), jumping below each miss.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from hybridkv.cache.kinds.base import GroupState, KindManager, StepPlan
from hybridkv.cache.request import Request
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind, ChunkedLocalSpec, SlidingWindowSpec

__all__ = [
    "ChunkedLocalManager",
    "FullAttentionManager",
    "SlidingWindowManager",
    "WindowedManager",
]


#: A table range past any table's end (``keep`` of a table with no range left out).
_WHOLE = 1 << 62


def _without(
    ranges: Sequence[tuple[int, int]], indices: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """``ranges`` (sorted, disjoint) less the table ``indices`` (sorted)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for j in indices:
            if lo <= j < hi:
                out.append((lo, j))
                lo = j + 1
        out.append((lo, hi))
    return tuple(r for r in out if r[0] < r[1])


def _merged(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Non-empty ``[lo, hi)`` ranges, sorted, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


class _AttentionManager(KindManager):
    """Shared table logic of the per-token kinds."""

    publishes_scheduled: ClassVar[bool] = True

    def _cache_items(
        self,
        table: list[int],
        hashes: Sequence[int],
        lo: int,
        hi: int,
        keep: Sequence[tuple[int, int]] | None = None,
    ) -> list[tuple[int, int, int]] | None:
        """Blocks ``table[lo:hi]`` to publish: computed, not null, hash not yet cached, and
        (when ``keep`` is given) inside one of its ``[lo, hi)`` ranges."""
        m, k, held = self.map, self.stride, self.block_hashes
        out: list[tuple[int, int, int]] = []
        for a, z in keep if keep is not None else ((lo, hi),):
            for j in range(max(lo, a), min(hi, z)):
                b = table[j]
                if b and held[b] is None:
                    h = hashes[(j + 1) * k - 1]
                    if h not in m:
                        out.append((j, b, h))
        return out or None

    def _publish_upto(self, st: GroupState, request: Request, upto: int) -> None:
        """Publish what ``st`` keeps of its table entries ``[num_cached, upto)``."""
        if upto > st.num_cached:
            if st.keep is None and self.through is None and not self.events.enabled:
                n = self._cache_direct(st.table, request.block_hashes, st.num_cached, upto)
                if n and self.admission is not None:
                    self.admission.published(n * self.block_bytes)
            else:
                items = self._cache_items(
                    st.table, request.block_hashes, st.num_cached, upto, st.keep
                )
                if items:
                    self._publish(items, request)
            st.num_cached = upto

    def _cache_direct(self, table: list[int], hashes: Sequence[int], lo: int, hi: int) -> int:
        """:meth:`_cache_items` of ``table[lo:hi]`` and the pool's ``cache_many`` of them in one
        pass, where nobody needs the list (no write-through, no events); returns how many."""
        m, k, held = self.map, self.stride, self.block_hashes
        n = 0
        for j in range(lo, hi):
            b = table[j]
            if b and held[b] is None:
                h = hashes[(j + 1) * k - 1]
                if h not in m:
                    m[h] = b
                    held[b] = h
                    n += 1
        return n

    def _release_range(self, table: Sequence[int], lo: int, hi: int) -> list[int] | None:
        """Non-null blocks of ``table[lo:hi]``, last first (the tail is evicted first)."""
        out = [b for b in table[lo:hi] if b]
        out.reverse()
        return out or None

    def publish_scheduled(self, st: GroupState, request: Request, step_end: int) -> None:
        """Publish the blocks the running step fills (``[num_cached, step_end // bs)``).

        The ``scheduled`` publication mode: a request admitted later in the same step hits
        them, so the runner must write a step's new tokens before any read of them (one pass
        writes every layer's new tokens before attending; passes run writers first).
        """
        self._publish_upto(st, request, min(step_end // self.block_size, len(st.table)))

    def _unpublish_uncomputed(self, st: GroupState, request: Request, computed: int) -> None:
        """Take back what :meth:`publish_scheduled` offered beyond ``computed`` blocks: the
        step that would have written them did not run (freed or preempted before it did)."""
        table, held, refs, m = st.table, self.block_hashes, self.refs, self.map
        hashes, k = request.block_hashes, self.stride
        gone: list[int] = []
        for j in range(computed, min(st.num_cached, len(table))):
            b = table[j]
            h = hashes[(j + 1) * k - 1]
            if b and held[b] == h and refs[b] == 1:
                del m[h]
                held[b] = None
                gone.append(h)
        st.num_cached = computed
        if gone and self.events.enabled:
            self.events.removed(self.group_id, tuple(gone))  # type: ignore[arg-type]

    def release_all(self, st: GroupState, request: Request) -> None:
        computed = request.num_computed_tokens // self.block_size
        if st.num_cached > computed:
            self._unpublish_uncomputed(st, request, computed)
        self._retain_end(st, request)
        self._publish_upto(st, request, min(computed, len(st.table)))
        blocks = [b for b in reversed(st.table) if b]
        if blocks:
            self.pool.release(self.group_id, blocks)
        st.table = []

    def quiet_end(self, st: GroupState, num_computed: int) -> tuple[int, int]:
        # No new block while the table covers the slots; nothing computed to publish until
        # the block past num_cached is.
        bs = self.block_size
        return len(st.table) * bs, (st.num_cached + 1) * bs - 1

    def _retain_end(self, st: GroupState, request: Request) -> None:
        """Hook at the free, before the last publication (windowed kinds' tail retention)."""

    def held_blocks(self, st: GroupState) -> list[int]:
        return [b for b in st.table if b]


class FullAttentionManager(_AttentionManager):
    """Full causal attention and MLA: every block is kept while the request lives."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.FULL, CacheKind.MLA)
    prefix_closed: ClassVar[bool] = True

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        # Left to right in slices of 64 blocks, each looked up at C speed, up to the first miss.
        k, present = self.stride, self.present
        end = bound // self.block_size
        n = 0
        while n < end:
            hi = min(end, n + 64)
            miss = present(hashes[(n + 1) * k - 1 : hi * k : k]).find(0)
            if miss >= 0:
                n += miss
                break
            n = hi
        return (n - n % self.align_blocks) * self.block_size

    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        k = self.stride
        return self.lookup(hashes[k - 1 : (length // self.block_size) * k : k])

    def plan(
        self,
        st: GroupState | None,
        request: Request,
        computed: int,
        num_computed: int,
        step_end: int,
        total: int,
        hit: Sequence[int] | None,
        marks: Sequence[int] = (),
    ) -> StepPlan | None:
        bs = self.block_size
        if st is None:
            size = len(hit) if hit else 0
            need = -(-total // bs) - size
            return StepPlan(None, size, None, 0, list(hit) if hit else None, max(need, 0), 0)
        table = st.table
        need = -(-total // bs) - len(table)
        upto = computed // bs
        if upto <= st.num_cached:
            if need <= 0:
                return None
            return StepPlan(None, st.num_cached, None, 0, None, need, 0)
        cache = self._cache_items(table, request.block_hashes, st.num_cached, upto)
        return StepPlan(cache, upto, None, 0, None, max(need, 0), 0)


class WindowedManager(_AttentionManager):
    """Kinds that keep only the blocks overlapping ``[first_kept(n), n)`` (plus sinks)."""

    #: Leading blocks kept forever (attention sinks), and the tokens every query reads there.
    sink_blocks: int = 0
    sink_tokens: int = 0

    @abstractmethod
    def first_kept_token(self, num_computed: int) -> int:
        """First token (outside the sinks) some query at position >= num_computed reads."""

    def first_kept_block(self, num_computed: int) -> int:
        return self.first_kept_token(num_computed) // self.block_size

    @abstractmethod
    def last_keeping(self, block: int) -> int:
        """The largest ``n`` with ``first_kept_block(n) <= block`` (nothing to release)."""

    def quiet_end(self, st: GroupState, num_computed: int) -> tuple[int, int]:
        end, computed = super().quiet_end(st, num_computed)
        return end, min(computed, self.last_keeping(st.released))

    def new_state(self) -> GroupState:
        return GroupState(released=self.sink_blocks)

    def start(self, st: GroupState, request: Request, marks: Sequence[int]) -> None:
        """Tail retention: the ranges a hit at the prompt's end (a resend, or a longer
        sibling), at the request's hit or at its junction would read.  Where hits land on a
        grid coarser than the alignment (:mod:`hybridkv.cache.hit_grid`), a later request
        shares this prompt up to its last grid point, not to its end: the window kept is the
        one before that point instead."""
        if self.dense_windows:
            return
        p = request.num_prompt_tokens
        lands = self.hit_grid.grid() if self.hit_grid is not None else 0
        ends = {p - p % lands} if lands > self.alignment else {p - 1, p}
        ends.update(marks)
        grid = self.window_grid
        if grid:
            ends.update(range(grid, p, grid))
        keep = [self._tail(e) for e in ends if e > 0]
        if self.sink_blocks:
            keep.append((0, self.sink_blocks))
        st.keep = _merged(keep)

    def _retain_end(self, st: GroupState, request: Request) -> None:
        if st.keep is not None:  # tail retention: also the window before the computed end
            tail = self._tail(request.num_computed_tokens)
            keep = _merged([*st.keep, tail])
            st.keep = _without(keep, st.withheld) if st.withheld else keep
            st.num_cached = min(st.num_cached, tail[0])

    def _tail(self, end: int) -> tuple[int, int]:
        """Table range a hit at ``end`` (aligned down) reads, sinks aside."""
        j = end // self.alignment * self.alignment // self.block_size
        return (min(max(self.first_kept_block(j * self.block_size), self.sink_blocks), j), j)

    def _flags(self, hashes: Sequence[int], top: int) -> bytes:
        """``flags[i] == 1`` iff block ``i`` (< ``top``) of the request is cached here."""
        k = self.stride
        return self.present(hashes[k - 1 : top * k : k])

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        # Candidates right to left; a miss at block z rules out every candidate whose window
        # holds z, so the next candidate is the largest aligned one <= z.
        bs, ab, sb = self.block_size, self.align_blocks, self.sink_blocks
        j = bound // bs
        j -= j % ab
        if not j:
            return 0
        flags = self._flags(hashes, j)
        if sb:
            miss = flags.find(0, 0, min(sb, j))
            if miss >= 0:  # a missing sink block caps the hit below it
                return (miss - miss % ab) * bs
        while j > 0:
            lo = max(self.first_kept_block(j * bs), sb)
            if lo >= j:
                return j * bs
            miss = flags.rfind(0, lo, j)
            if miss < 0:
                return j * bs
            j = miss - miss % ab
        return 0

    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        k, m = self.stride, self.hit_map
        n = length // self.block_size
        sb = min(self.sink_blocks, n)
        lo = min(max(self.first_kept_block(length), sb), n)
        out = [m[hashes[(j + 1) * k - 1]] for j in range(sb)]
        out += [0] * (lo - sb)
        out += [m[hashes[(j + 1) * k - 1]] for j in range(lo, n)]
        return out

    def plan(
        self,
        st: GroupState | None,
        request: Request,
        computed: int,
        num_computed: int,
        step_end: int,
        total: int,
        hit: Sequence[int] | None,
        marks: Sequence[int] = (),
    ) -> StepPlan | None:
        bs = self.block_size
        upto = self.first_kept_block(num_computed)
        if st is None:
            table: Sequence[int] = hit or ()
            released = self.sink_blocks
            release = None
            if upto > released:
                release = self._release_range(table, released, upto)
                released = upto
            need = -(-total // bs) - len(table)
            touch = [b for b in hit if b] if hit else None
            return StepPlan(None, len(table), release, released, touch, max(need, 0), 0)
        table = st.table
        need = -(-total // bs) - len(table)
        computed_blocks = computed // bs
        if computed_blocks <= st.num_cached and upto <= st.released:
            if need <= 0:
                return None
            return StepPlan(None, st.num_cached, None, st.released, None, need, 0)
        cache = None
        num_cached = st.num_cached
        if computed_blocks > num_cached:
            cache = self._cache_items(
                table, request.block_hashes, num_cached, computed_blocks, st.keep
            )
            num_cached = computed_blocks
        release = None
        released = st.released
        if upto > released:
            release = self._release_range(table, released, upto)
            released = upto
        return StepPlan(cache, num_cached, release, released, None, max(need, 0), 0)

    def protect(self, hashes: Sequence[int], marks: Sequence[int]) -> None:
        # Highest position first, so the lowest ends most recently used: a window's blocks are
        # all needed for a hit at its mark, and the low ones also serve every shorter hit
        # (and lose their neighbours' protection last), so the tail is evicted first.
        k, m, bs = self.stride, self.map, self.block_size
        index: set[int] = set()
        for mark in marks:
            hi = min(mark // bs, len(hashes) // k)
            index.update(range(self.first_kept_block(hi * bs), hi))
        blocks: list[int] = []
        for j in sorted(index, reverse=True):
            b = m.get(hashes[(j + 1) * k - 1])
            if b is not None:
                blocks.append(b)
        if blocks:
            self.pool.refresh(self.group_id, blocks)

    def drop_unread(
        self,
        st: GroupState,
        num_tokens: int,
        missing: Sequence[tuple[int, int]] = (),
        start: int = 0,
    ) -> list[int]:
        # Fresh blocks only: those below num_cached came with the hit (cached data, maybe a
        # lower tier's load in flight) and leave through the normal release.
        table = st.table
        lo = max(st.released, st.num_cached)
        hi = min(self.first_kept_block(num_tokens), len(table))
        out = [b for b in table[lo:hi] if b]
        if out:
            table[lo:hi] = [0] * (hi - lo)
            self.pool.release(self.group_id, out)
        if missing:
            self._withhold(st, start, num_tokens, missing)
        return out

    def unwritable(
        self, st: GroupState, start: int, num_tokens: int, missing: Sequence[tuple[int, int]]
    ) -> tuple[int, str] | None:
        first = self.first_kept_token(num_tokens)
        for a, b in missing:
            a, b = max(a, start), min(b, num_tokens)
            if a < b and a < self.sink_tokens:
                return a, "every query reads it (an attention sink)"
            if a < b and b > first:
                return max(a, first), f"a query at or after {num_tokens} reads it"
        for j in self._holding(st, start, num_tokens, missing):
            if self.block_hashes[st.table[j]] is not None:
                bs = self.block_size
                return max(j * bs, start), f"block {st.table[j]} holding it is published"
        return None

    def _holding(
        self, st: GroupState, start: int, num_tokens: int, missing: Sequence[tuple[int, int]]
    ) -> set[int]:
        """Indices of the table entries past the hit (``start`` tokens) holding a token of
        ``missing``."""
        bs, table = self.block_size, st.table
        out: set[int] = set()
        for a, b in missing:
            lo = max(a, start) // bs
            hi = min(-(-min(b, num_tokens) // bs), len(table))
            out.update(j for j in range(lo, hi) if table[j])
        return out

    def _withhold(
        self, st: GroupState, start: int, num_tokens: int, missing: Sequence[tuple[int, int]]
    ) -> None:
        """Keep the fresh blocks holding tokens of ``missing`` out of the prefix cache: a
        hit inside their window would read the tokens the import did not write."""
        out = self._holding(st, start, num_tokens, missing) | set(st.withheld)
        if len(out) > len(st.withheld):
            st.withheld = tuple(sorted(out))
            st.keep = _without(st.keep if st.keep is not None else ((0, _WHOLE),), st.withheld)

    def check_request(self, st: GroupState, request: Request) -> None:
        super().check_request(st, request)
        for j in st.withheld:
            b = st.table[j] if j < len(st.table) else 0
            if b and self.block_hashes[b] is not None:
                raise InvariantError(
                    f"group {self.group_id}, request {request.request_id}: block {b} at "
                    f"index {j} is published, but the import did not write all its tokens"
                )
        if any(st.table[self.sink_blocks : st.released]):
            raise InvariantError(
                f"group {self.group_id}, request {request.request_id}: released positions "
                f"[{self.sink_blocks}, {st.released}) hold blocks"
            )


class SlidingWindowManager(WindowedManager):
    """Sliding window ``W`` (query ``q`` reads ``q-W+1 .. q``) with optional sink tokens."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.SLIDING,)

    def _configure(self) -> None:
        spec = self.spec
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.window
        self.sink_tokens = spec.sink_tokens
        self.sink_blocks = -(-spec.sink_tokens // self.block_size)
        #: A hit of j blocks needs blocks [max(0, j - reach), j): reach = cdiv(W - 1, bs).
        self.reach = -(-(spec.window - 1) // self.block_size)

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        # A hit of j blocks needs the sinks and blocks [max(sb, j - reach), j).  Jump over runs
        # of misses (to just above the last cached block) and over runs of hits (to below the
        # last miss inside the window), so each step costs one C-level scan.
        bs, ab, sb, reach = self.block_size, self.align_blocks, self.sink_blocks, self.reach
        j = bound // bs
        j -= j % ab
        if not j:
            return 0
        k, m = self.stride, self.hit_map
        if all(
            hashes[(i + 1) * k - 1] in m
            for i in (*range(min(sb, j)), *range(max(j - reach, sb), j))
        ):
            return j * bs  # the top candidate holds (a re-sent conversation): no scan
        flags = self._flags(hashes, j)
        if sb:
            miss = flags.find(0, 0, min(sb, j))
            if miss >= 0:
                return (miss - miss % ab) * bs
        if not reach:
            return j * bs
        while j > 0:
            last = flags.rfind(1, 0, j)
            if last + 1 < j:
                j = last + 1 - (last + 1) % ab
                continue
            lo = max(j - reach, sb)
            if lo >= j:
                return j * bs
            miss = flags.rfind(0, lo, j)
            if miss < 0:
                return j * bs
            j = miss - miss % ab
        return 0

    def first_kept_token(self, num_computed: int) -> int:
        start = num_computed - self.window + 1
        return start if start > 0 else 0

    def last_keeping(self, block: int) -> int:
        # (n - W + 1) // bs <= block  <=>  n <= (block + 1) * bs + W - 2
        return (block + 1) * self.block_size + self.window - 2


class ChunkedLocalManager(WindowedManager):
    """Chunked local attention: a query reads only its own ``chunk_size``-aligned chunk."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.CHUNKED,)

    def _configure(self) -> None:
        spec = self.spec
        assert isinstance(spec, ChunkedLocalSpec)
        self.chunk_size = spec.chunk_size

    def first_kept_token(self, num_computed: int) -> int:
        return num_computed - num_computed % self.chunk_size

    def last_keeping(self, block: int) -> int:
        # (n - n % cs) // bs <= block  <=>  n // cs * cs < (block + 1) * bs
        cs = self.chunk_size
        return -(-(block + 1) * self.block_size // cs) * cs - 1
