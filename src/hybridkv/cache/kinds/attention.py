"""Per-token attention kinds: full attention and MLA, sliding window, chunked local.

Block ``j`` of a group with block size ``bs`` holds tokens ``[j*bs, (j+1)*bs)``.  A request's
table has one entry per block up to its allocated slots; windowed kinds replace blocks no
future query can see with the null block (id 0) and release them before taking new ones.

Hit rules (``L`` = hit length in tokens, a multiple of the schedule alignment):

* full / MLA: every block below ``L`` cached.  Prefix-closed; scanned left to right.
* windowed (sliding window, chunked local): every block overlapping
  ``spec.kept_tokens(L)`` cached (for a window ``W``: the ``cdiv(W - 1, bs)`` blocks before
  ``L`` plus the sink blocks); scanned right to left, jumping below each miss, so each block
  hash is looked up at most once.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from hybridkv.cache.kinds.base import GroupState, KindManager, StepPlan
from hybridkv.cache.request import Request
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind, ChunkedLocalSpec, SlidingWindowSpec

__all__ = ["ChunkedLocalManager", "FullAttentionManager", "SlidingWindowManager"]


class _AttentionManager(KindManager):
    """Shared table logic of the per-token kinds."""

    def _cache_items(
        self, table: list[int], hashes: Sequence[int], lo: int, hi: int
    ) -> list[tuple[int, int, int]] | None:
        """Blocks ``table[lo:hi]`` to publish: computed, not null, hash not yet cached."""
        m, k, held = self.map, self.stride, self.block_hashes
        out: list[tuple[int, int, int]] = []
        for j in range(lo, hi):
            b = table[j]
            if b and held[b] is None:
                h = hashes[(j + 1) * k - 1]
                if h not in m:
                    out.append((j, b, h))
        return out or None

    def _release_range(self, table: Sequence[int], lo: int, hi: int) -> list[int] | None:
        """Non-null blocks of ``table[lo:hi]``, last first (the tail is evicted first)."""
        out = [b for b in table[lo:hi] if b]
        out.reverse()
        return out or None

    def release_all(self, st: GroupState, request: Request) -> None:
        upto = min(request.num_computed_tokens // self.block_size, len(st.table))
        if upto > st.num_cached:
            items = self._cache_items(st.table, request.block_hashes, st.num_cached, upto)
            if items:
                self._publish(items, request)
            st.num_cached = upto
        blocks = [b for b in reversed(st.table) if b]
        if blocks:
            self.pool.release(self.group_id, blocks)
        st.table = []

    def held_blocks(self, st: GroupState) -> list[int]:
        return [b for b in st.table if b]


class FullAttentionManager(_AttentionManager):
    """Full causal attention and MLA: every block is kept while the request lives."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.FULL, CacheKind.MLA)
    prefix_closed: ClassVar[bool] = True

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        k, m = self.stride, self.map
        n = 0
        for h in hashes[k - 1 : (bound // self.block_size) * k : k]:
            if h not in m:
                break
            n += 1
        return (n - n % self.align_blocks) * self.block_size

    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        k, m = self.stride, self.map
        return [m[h] for h in hashes[k - 1 : (length // self.block_size) * k : k]]

    def plan(
        self,
        st: GroupState | None,
        request: Request,
        computed: int,
        num_computed: int,
        step_end: int,
        total: int,
        hit: Sequence[int] | None,
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


class _WindowedManager(_AttentionManager):
    """Kinds that keep only the blocks overlapping ``[first_kept(n), n)`` (plus sinks)."""

    #: Leading blocks kept forever (attention sinks).
    sink_blocks: int = 0

    @abstractmethod
    def first_kept_token(self, num_computed: int) -> int:
        """First token (outside the sinks) some query at position >= num_computed reads."""

    def first_kept_block(self, num_computed: int) -> int:
        return self.first_kept_token(num_computed) // self.block_size

    def new_state(self) -> GroupState:
        return GroupState(released=self.sink_blocks)

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        bs, k, ab, m = self.block_size, self.stride, self.align_blocks, self.map
        j = bound // bs
        j -= j % ab
        sb = self.sink_blocks
        if sb and j:
            lead = 0
            top = min(sb, j)
            while lead < top and hashes[(lead + 1) * k - 1] in m:
                lead += 1
            if lead < top:
                return (lead - lead % ab) * bs
            if j <= sb:
                return j * bs
        while j > 0:
            lo = max(self.first_kept_block(j * bs), sb)
            i = j - 1
            while i >= lo and hashes[(i + 1) * k - 1] in m:
                i -= 1
            if i < lo:
                return j * bs
            j = i - i % ab
        return 0

    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        k, m = self.stride, self.map
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
            cache = self._cache_items(table, request.block_hashes, num_cached, computed_blocks)
            num_cached = computed_blocks
        release = None
        released = st.released
        if upto > released:
            release = self._release_range(table, released, upto)
            released = upto
        return StepPlan(cache, num_cached, release, released, None, max(need, 0), 0)

    def protect(self, hashes: Sequence[int], marks: Sequence[int]) -> None:
        k, m, bs = self.stride, self.map, self.block_size
        blocks: list[int] = []
        for mark in marks:
            hi = min(mark // bs, len(hashes) // k)
            for j in range(self.first_kept_block(hi * bs), hi):
                b = m.get(hashes[(j + 1) * k - 1])
                if b is not None:
                    blocks.append(b)
        if blocks:
            self.pool.refresh(self.group_id, blocks)

    def check_request(self, st: GroupState, request: Request) -> None:
        super().check_request(st, request)
        if any(st.table[self.sink_blocks : st.released]):
            raise InvariantError(
                f"group {self.group_id}, request {request.request_id}: released positions "
                f"[{self.sink_blocks}, {st.released}) hold blocks"
            )


class SlidingWindowManager(_WindowedManager):
    """Sliding window ``W`` (query ``q`` reads ``q-W+1 .. q``) with optional sink tokens."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.SLIDING,)

    def _configure(self) -> None:
        spec = self.spec
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.window
        self.sink_blocks = -(-spec.sink_tokens // self.block_size)
        #: A hit of j blocks needs blocks [max(0, j - reach), j): reach = cdiv(W - 1, bs).
        self.reach = -(-(spec.window - 1) // self.block_size)

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        if self.sink_blocks:
            return super().longest_hit(hashes, bound)
        # One pass right to left over block hashes, tracking the run of cached blocks
        # [i, top): the best aligned j <= top with j - reach >= i (or i == 0) is the hit.
        bs, k, ab, m, reach = self.block_size, self.stride, self.align_blocks, self.map, self.reach
        top = bound // bs
        top -= top % ab
        if not reach:
            return top * bs
        best = top
        for i in range(top - 1, -1, -1):
            if hashes[(i + 1) * k - 1] in m:
                if best - i >= reach:
                    return best * bs
            else:
                best = i - i % ab
                if not best:
                    return 0
        return best * bs

    def first_kept_token(self, num_computed: int) -> int:
        start = num_computed - self.window + 1
        return start if start > 0 else 0


class ChunkedLocalManager(_WindowedManager):
    """Chunked local attention: a query reads only its own ``chunk_size``-aligned chunk."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.CHUNKED,)

    def _configure(self) -> None:
        spec = self.spec
        assert isinstance(spec, ChunkedLocalSpec)
        self.chunk_size = spec.chunk_size

    def first_kept_token(self, num_computed: int) -> int:
        return num_computed - num_computed % self.chunk_size
