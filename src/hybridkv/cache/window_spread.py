"""Where a windowed group's new blocks go in an arena: transient blocks in chunks of their own.

A windowed group (sliding window, chunked local) of an arena layout with several blocks per
chunk takes, for a long prefill chunk, many blocks that leave the window when the step ends
and are released at the request's next call (uncached, bar the tails the group retains).
Placed in the free slots of chunks that still hold other requests' windows, they would stay
stranded there once released: free blocks of a chunk only that group can use.  Placed in
whole free chunks, they free those chunks again, for any group.

Only those blocks are spread, and only a whole number of chunks of them: the blocks a step's
own end pushes out of the window.  The blocks the window keeps after the step (a decode
step's one new block, a short prefill's whole allocation, a long prefill's last window and
the transient blocks short of a chunk) take the group's free blocks first, as every other
group's do.  The rule before this one took whole free chunks for every new window block
while free chunks lasted, so a windowed group carved a fresh chunk for each decoded block
and stranded the chunks other groups need: gemma-3-27b at 4 GiB and 4,096 tokens planned 5
requests and failed the first of 5 grown side by side at 416 tokens
(``tests/test_plan_runtime.py``, which now covers windowed groups).  What it cost in hits on
the Mooncake trace is in docs/vllm.md (the spread placement).

The spread happens only when :meth:`~hybridkv.cache.pool_base.BlockPool.spreads` says whole
free chunks cover it (and the rest of the call) without evicting, so
:meth:`~hybridkv.cache.pool_base.BlockPool.fits` does not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.kinds import KindManager, StepPlan, WindowedManager
from hybridkv.cache.pool_base import BlockPool

__all__ = ["WindowSpread"]


class WindowSpread:
    """The windowed groups of a chunked pool whose transient blocks take whole chunks."""

    def __init__(self, managers: Sequence[KindManager], pool: BlockPool) -> None:
        self.pool = pool
        #: Group id -> its manager, for windowed groups with several blocks per chunk (none
        #: where the pool has no chunks).
        self.groups: dict[int, WindowedManager] = {
            m.group_id: m
            for m in managers
            if isinstance(m, WindowedManager) and pool.blocks_per_chunk(m.group_id) > 1
        }
        self.bpc = {g: pool.blocks_per_chunk(g) for g in self.groups}

    def spans(
        self,
        plans: Sequence[StepPlan | None],
        loads: Sequence[int] | None,
        total: int,
        step_end: int,
    ) -> dict[int, tuple[int, int]]:
        """Per spreading group with transient blocks in this call: the range ``[a, b)`` of
        its allocation (in the order the call hands blocks out: ``loads[g]`` tier-load
        targets first, then the new table entries in position order) that leaves the window
        at ``step_end``, cut to whole chunks' worth (the rest, less than a chunk, is placed
        as the kept blocks are: a chunk carved for a few blocks would keep its other blocks
        from every other group until the request's next call).  ``{}`` unless whole free
        chunks cover every range (and the rest of the call) without evicting."""
        cut: dict[int, tuple[int, int]] = {}
        for g, m in self.groups.items():
            p = plans[g]
            if p is None or not p.need:
                continue
            k = loads[g] if loads else 0
            fresh = p.need - k  # new table entries: [first, first + fresh)
            first = -(-total // m.block_size) - fresh
            lo = max(first, m.sink_blocks)
            hi = min(m.first_kept_block(step_end), first + fresh)
            hi -= (hi - lo) % self.bpc[g] if hi > lo else 0  # whole chunks only
            if hi > lo:
                cut[g] = (k + lo - first, k + hi - first)
        if cut:
            needs = [p.need if p is not None else 0 for p in plans]
            if not self.pool.spreads(needs, {g: b - a for g, (a, b) in cut.items()}):
                return {}
        return cut

    def allocate(self, group_id: int, need: int, span: tuple[int, int]) -> list[int]:
        """``need`` blocks for ``group_id``, those in ``span`` from whole free chunks: the
        kept ones first, as every allocation takes them (so none lands in a chunk the
        transient ones carve), then the transient ones."""
        a, b = span
        pool = self.pool
        kept = pool.allocate(group_id, need - (b - a)) if need > b - a else []
        moving = pool.allocate_spread(group_id, b - a)
        return kept[:a] + moving + kept[a:]
