"""Recurrent-state kinds (Mamba1/2, gated DeltaNet, KDA, short conv): running state + checkpoints.

One block of a state group is one state slot (every member layer's state tensors).  A request
holds exactly one *running* slot, ``table == [running]``, that its steps read and overwrite.
*Checkpoints* are separate slots holding the state after ``L`` tokens, cached under the hash
of the block ending at ``L``; only boundaries that are multiples of the schedule alignment
are checkpointed, since no hit can land anywhere else.

Contract for the model runner, per ``allocate_slots`` result ``R`` of one step:

1. before the step, for each ``StateSlot(g, b)`` in ``R.zero_before``: zero slot ``b`` (a
   fresh request, or one resumed with no state hit);
2. before the step, for each ``StateCopy(g, src, dst)`` in ``R.copies_before``: copy slot
   ``src`` onto ``dst`` (restores a cached checkpoint into the running slot at the hit);
3. run the step: state layers read and write the running slot ``get_block_ids(id)[g][0]``;
4. after the step, for each ``StateCopy(g, src, dst)`` in ``R.copies_after``: copy ``src``
   (running) onto ``dst`` (a checkpoint of the state after ``num_computed + num_new_tokens``
   tokens, which is a block boundary).

A checkpoint is published at the next ``allocate_slots`` / ``free`` / ``preempt`` of the
request once ``request.num_computed_tokens`` has reached its boundary (else it is dropped), and
becomes unreferenced and evictable.  Under ``checkpoint_life="kv"``
(:attr:`StateManager.refresh_from`) the request remembers the checkpoints it published that
end at least that far in and refreshes those still cached when it frees its blocks, so they
age with its KV rather than from mid-prefill.  The hit checkpoint stays referenced until that
next call, so it cannot be evicted before the runner copied it.  Lookahead tokens allocate
nothing here: the runner must not advance the running state past the step's
``num_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from hybridkv.cache.admission import BEFORE_END, CHUNK, DECODE, JUNCTION, PROMPT_END
from hybridkv.cache.kinds.base import GroupState, KindManager, StepOutputs, StepPlan
from hybridkv.cache.request import Request
from hybridkv.cache.types import BlockId, StateCopy, StateSlot
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind

__all__ = ["REFRESH_SHARE", "StateManager"]

#: Under ``checkpoint_life="kv"`` a freed request's checkpoint is refreshed where its bytes
#: (every state group's part) are at most this share of the prefix-closed KV before it: a
#: checkpoint that would add more to what its prefix holds ages from its publication.
#: Measured on the Mooncake loop (docs/vllm.md, section 6, "Checkpoints that live as their
#: KV"): refreshing every one cost Nemotron-H-8B (98 MiB checkpoints) hits at 64 GiB.
REFRESH_SHARE: Final = 0.5


class StateManager(KindManager):
    """Running state per request, checkpoints at aligned block boundaries."""

    kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.STATE,)
    #: Refresh a request's own checkpoints still cached when it frees its blocks, those
    #: ending at this token or later (0: none; ``checkpoint_life="kv"``, set by the
    #: coordinator from :data:`REFRESH_SHARE`).
    refresh_from: int = 0

    def _configure(self) -> None:
        #: Reason code (:data:`~hybridkv.cache.admission.CHECKPOINT_REASONS`) of the
        #: checkpoint each slot holds, set when the slot is taken for one.
        self.reasons = bytearray(len(self.refs))

    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        # One C-level pass over the aligned boundaries below the bound; the last cached wins.
        bs, ab = self.block_size, self.align_blocks
        step = ab * self.stride
        top = bound // bs // ab  # aligned candidates 1..top
        flags = self.present(hashes[step - 1 : top * step : step])
        return (flags.rfind(1) + 1) * ab * bs

    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        if not length:
            return []
        return [self.hit_map[hashes[(length // self.block_size) * self.stride - 1]]]

    def _checkpoint_hash(self, request: Request, end: int) -> int | None:
        """Hash of the block ending at token ``end``, or None when its tokens are unknown."""
        idx = end // self.hash_block_size - 1
        hashes = request.block_hashes
        return hashes[idx] if 0 <= idx < len(hashes) else None

    def _settle(
        self, st: GroupState, request: Request, computed: int
    ) -> tuple[list[tuple[int, int, int]] | None, list[int] | None]:
        """What to publish and release of the pending checkpoint and hit source."""
        cache = None
        release: list[int] | None = None
        if st.pending:
            end = (st.pending_index + 1) * self.block_size
            if computed >= end:
                h = self._checkpoint_hash(request, end)
                if h is not None and h not in self.map:
                    cache = [(st.pending_index, st.pending, h)]
            release = [st.pending]
        if st.source:
            release = [*release, st.source] if release else [st.source]
        return cache, release

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
        cache = release = touch = None
        need = 0
        if st is None:
            need = 1
            if hit:
                touch = list(hit)
        elif st.pending or st.source:
            cache, release = self._settle(st, request, computed)
        checkpoint = reason = 0
        if step_end > num_computed and step_end % self.alignment == 0:
            h = self._checkpoint_hash(request, step_end)
            if h is not None and h not in self.map:
                reason = self.reason(request, step_end, marks)
                adm = self.admission
                if adm is None or adm.admits(reason, h):
                    checkpoint = step_end // self.block_size
                    need += 1
        if not (need or release):
            return None
        return StepPlan(cache, 0, release, 0, touch, need, checkpoint, reason)

    def reason(self, request: Request, end: int, marks: Sequence[int]) -> int:
        """Why a checkpoint at the aligned step end ``end`` may be hit (admission reason)."""
        a = self.alignment
        for m in marks:
            if end == m - m % a:
                return JUNCTION
        p = request.num_prompt_tokens
        if end >= p:
            return DECODE
        last = (p - 1) // a * a
        if end == last:
            return PROMPT_END
        return BEFORE_END if end == last - a else CHUNK

    def quiet_end(self, st: GroupState, num_computed: int) -> tuple[int, int]:
        # Nothing pending to settle, and no step may end on an aligned boundary above the
        # computed length (a checkpoint): quiet up to just below the next boundary.
        if st.pending or st.source:
            return 0, 0
        a = self.alignment
        end = (num_computed // a + 1) * a - 1
        return end, end

    def _publish(self, items: list[tuple[int, int, int]], request: Request) -> None:
        super()._publish(items, request)
        adm = self.admission
        if adm is not None:
            for _, b, _ in items:
                adm.checkpoint_published(self.reasons[b], self.block_bytes, self.credits)

    def tier_spots(
        self, hashes: Sequence[int], length: int, hit: Sequence[int]
    ) -> list[tuple[int, int]]:
        j = length // self.block_size
        return [(j - 1, hashes[j * self.stride - 1])] if hit and hit[0] < 0 else []

    def install_loaded(
        self, st: GroupState, spots: Sequence[tuple[int, int]], blocks: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        # The loaded checkpoint is the hit's source slot: copied into the running slot by
        # copies_before (after the load), released at the next allocation.
        [(j, h)], [b] = spots, blocks
        st.source = b
        return [(j, b, h)]

    def credit_hit(self, hit: Sequence[int], tokens: int) -> None:
        if hit and hit[0] > 0 and self.admission is not None and self.credits:
            self.admission.checkpoint_hit(self.reasons[hit[0]], tokens)

    def _publish_own(
        self, st: GroupState, items: list[tuple[int, int, int]], request: Request
    ) -> None:
        """Publish this request's checkpoints ``items``, noting them for :meth:`_save`."""
        self._publish(items, request)
        if self.refresh_from:
            self._save(st, items)

    def _save(self, st: GroupState, items: list[tuple[int, int, int]]) -> None:
        """Note the checkpoints ``items`` this request published that end at
        :attr:`refresh_from` or later."""
        low, bs = self.refresh_from, self.block_size
        saved = [(b, h) for j, b, h in items if (j + 1) * bs >= low]
        if not saved:
            return
        if st.saved is None:
            st.saved = saved
        else:
            st.saved += saved

    def _refresh_saved(self, st: GroupState) -> None:
        """Move the checkpoints this request published that are still cached (same slot,
        same hash) to the young end of eviction."""
        saved, st.saved = st.saved, None
        if saved:
            m = self.map
            blocks = [b for b, h in saved if m.get(h) == b]
            if blocks:
                self.pool.refresh(self.group_id, blocks)

    def apply_release(
        self, st: GroupState, plan: StepPlan, hit: Sequence[int] | None, request: Request
    ) -> None:
        if plan.cache:
            self._publish_own(st, plan.cache, request)
        st.pending = st.source = 0
        if plan.release:
            self.pool.release(self.group_id, plan.release)

    def apply_touch(self, st: GroupState, plan: StepPlan) -> None:
        if plan.touch:
            self.pool.touch(self.group_id, plan.touch)
            st.source = plan.touch[0]

    def apply_new(
        self, st: GroupState, plan: StepPlan, new: list[int], out: StepOutputs
    ) -> Sequence[int]:
        g = self.group_id
        added: Sequence[int] = ()
        if not st.table:
            running = new[0]
            st.table = [running]
            added = st.table
            if st.source:
                out.copies_before.append(StateCopy(g, BlockId(st.source), BlockId(running)))
            else:
                out.zero_before.append(StateSlot(g, BlockId(running)))
        if plan.checkpoint:
            st.pending = new[-1]
            st.pending_index = plan.checkpoint - 1
            self.reasons[st.pending] = plan.reason
            out.copies_after.append(StateCopy(g, BlockId(st.table[0]), BlockId(st.pending)))
        return added

    def release_all(self, st: GroupState, request: Request) -> None:
        cache, release = self._settle(st, request, request.num_computed_tokens)
        if cache:
            self._publish_own(st, cache, request)
        blocks = list(st.table)
        if release:
            blocks += release
        if blocks:
            self.pool.release(self.group_id, blocks)
        if st.saved is not None:
            self._refresh_saved(st)
        st.table = []
        st.pending = st.source = 0

    def protect(self, hashes: Sequence[int], marks: Sequence[int]) -> None:
        hb, m = self.hash_block_size, self.map
        blocks = []
        for mark in marks:
            idx = mark // hb - 1
            if mark % self.alignment == 0 and 0 <= idx < len(hashes):
                b = m.get(hashes[idx])
                if b is not None:
                    blocks.append(b)
        if blocks:
            self.pool.refresh(self.group_id, blocks)

    def held_blocks(self, st: GroupState) -> list[int]:
        return [b for b in (*st.table, st.pending, st.source) if b]

    def check_request(self, st: GroupState, request: Request) -> None:
        where = f"group {self.group_id}, request {request.request_id}"
        if len(st.table) > 1 or (st.table and not st.table[0]):
            raise InvariantError(f"{where}: state table {st.table} is not one running slot")
        if (st.pending or st.source) and not st.table:
            raise InvariantError(f"{where}: checkpoint held without a running slot")
        held = self.held_blocks(st)
        if len(set(held)) != len(held):
            raise InvariantError(f"{where}: one slot used twice: {held}")
        if st.pending and self.block_hashes[st.pending] is not None:
            raise InvariantError(f"{where}: pending checkpoint {st.pending} is already cached")
