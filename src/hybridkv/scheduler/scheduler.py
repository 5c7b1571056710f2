"""Continuous batching over a :class:`hybridkv.cache.KVCacheManager`.  No torch.

One step, as :meth:`Scheduler.schedule` builds it:

1. **Running requests first**, oldest first: each gets the rest of its prompt (chunked to the
   token budget) or one decode token.  When ``allocate_slots`` refuses, the cache is compacted
   first (``compaction``: :meth:`~hybridkv.cache.KVCacheManager.compact` frees arena chunks by
   moving referenced blocks; the step's output lists the moves, and the tables of requests
   scheduled before it are re-read) and the step tried again; when that frees nothing, the
   newest running request is preempted (its blocks are released, computed ones stay in the
   prefix cache) and goes back to the front of the waiting queue; it is recomputed, mostly
   from cache, later.  A waiting request's refused admission does not compact: it waits.
   Prototypes that also moved blocks for refused admissions admitted requests the running
   ones then had to preempt (gemma-3-27b at 64 GiB on the Mooncake trace: 3.675% of prompt
   tokens hit against 3.707% without moves; Qwen3-Next-80B-A3B: docs/vllm.md).
2. **Waiting requests** (first come, first served) when nothing was preempted this step: a
   prefix-cache lookup, then the first prefill chunk.  One refused while nothing runs is
   tried again without reserving its prompt, then without its hit (whose blocks can pin the
   chunks the rest of it needs: it is recomputed), then with half the chunk.  Blocks that
   finished requests keep (``hold``) until :meth:`~Scheduler.release` are not an empty
   cache: a request that cannot progress beside them waits, unchanged, instead of raising
   (a running one alone takes a smaller chunk in place first).

Chunk ends.  When the layout has a recurrent-state group (or ``split_for_state`` is set), a
prefill chunk that does not finish the prompt ends on a multiple of the schedule alignment,
and a chunk that crosses the shared-prefix *junction* (where the request leaves the prefix the
attention groups already cache) ends there, rounded down to the alignment; the chunk that
reaches the end of the prompt first stops at the last aligned boundary (and, with
``checkpoint_before_end``, at the boundary before it).  A chunk with no
boundary in reach waits for a larger share of the budget, unless the token budget (or chunk
cap) is smaller than the distance to the next boundary: then it ends unaligned, so the request
still progresses (the next chunk realigns).  States are only checkpointed at chunk ends, so
without these splits a later request sharing the prefix would find no state to resume from.

The caller runs the step and passes the sampled tokens to :meth:`Scheduler.update`, which
advances every request, appends tokens, and frees finished requests.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from hybridkv.cache import (
    AllocationResult,
    BlockId,
    BlockMove,
    ComputedBlocks,
    KVCacheManager,
)
from hybridkv.scheduler.checks import check_scheduler_args, finish_of, sampled_tokens
from hybridkv.scheduler.intake import RequestIntake
from hybridkv.scheduler.types import (
    FinishReason,
    HitCheck,
    RequestOutput,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
    SequenceState,
)
from hybridkv.specs import CacheKind

__all__ = ["BEFORE_END_MAX_ALIGNMENT", "HitCheck", "Scheduler", "SequenceState"]

#: ``SchedulerConfig.checkpoint_before_end=None`` turns the split on up to this alignment.
BEFORE_END_MAX_ALIGNMENT = 512

log = logging.getLogger(__name__)


class Scheduler(RequestIntake):
    """Continuous batching with chunked prefill, prefix hits and preemption by recompute.

    ``add_request`` queues a request; ``schedule`` plans a step (and allocates its slots);
    ``update`` applies the step's sampled tokens; ``abort_request`` drops a request.
    Requests longer than ``max_model_len`` are refused at ``add_request`` with
    :class:`SchedulerError`.  The constructor raises :class:`SchedulerError` for a
    ``config`` that is not a :class:`SchedulerConfig`, a ``max_model_len`` that is not a
    positive int or exceeds the manager's, and a ``hit_check`` that is not callable.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        *,
        max_model_len: int,
        hit_check: HitCheck | None = None,
    ) -> None:
        check_scheduler_args(manager, config, max_model_len, hit_check)
        self.manager = manager
        #: Called with a waiting request and its hit before it is admitted: returns the hit
        #: to admit it with (storage may have dropped unusable lower-tier copies and looked
        #: up again) or None while its lower-tier copies are still being read and checked;
        #: the request then waits and later ones are admitted past it.
        self.hit_check = hit_check
        #: Waiting requests passed over in the last schedule() because their loads were not
        #: ready.
        self.num_loading = 0
        self.config = config or SchedulerConfig()
        self.max_model_len = max_model_len
        has_state = any(g.spec.kind is CacheKind.STATE for g in manager.layout.groups)
        split = self.config.split_for_state
        self.split_for_state = has_state if split is None else split
        self.has_state = has_state
        self.alignment = manager.schedule_alignment
        before = self.config.checkpoint_before_end
        #: Whether prefill chunks also end one alignment unit before the prompt's last
        #: aligned boundary (``None`` in the config: when the alignment is at most
        #: :data:`BEFORE_END_MAX_ALIGNMENT` tokens).
        self.before_end = self.alignment <= BEFORE_END_MAX_ALIGNMENT if before is None else before
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.seqs: dict[str, SequenceState] = {}
        self.step_index = 0
        self.num_preemptions = 0
        #: Finished requests added with ``hold``: their blocks stay until :meth:`release`.
        self.held: dict[str, SequenceState] = {}
        #: Compaction's moves of a schedule() that then raised: the manager's tables already
        #: name the new ids, so the next output lists them first (to be copied).
        self._unreported_moves: list[BlockMove] = []
        #: Requests aborted since the last schedule(): update() skips their items.
        self._aborted: set[str] = set()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- planning -------------------------------------------------------------------------
    def _chunk_end(
        self,
        seq: SequenceState,
        start: int,
        budget: int,
        *,
        cap: int | None = None,
        junction: int | None = None,
    ) -> int:
        """Where this step's chunk of ``seq`` ends (``start`` if nothing can be scheduled).
        ``cap`` and ``junction`` stand for ``seq``'s own while an admission is tried.

        ``whole_prefill``: every known token from token 0 in one step, within the budget
        left; or, when nothing else is in the step (``budget`` is the whole token budget),
        past it.  Only a request preempted after its prompt and outputs outgrew the budget
        gets there (:meth:`add_request` refuses longer prompts): it can resume only from
        token 0, so refusing it would strand it at the head of the queue (found by review:
        nothing could be scheduled any more).  It runs alone, once running requests have
        finished or leave it the whole budget, and it is at most ``max_model_len`` tokens.
        """
        req = seq.request
        total = req.num_tokens
        if self.config.whole_prefill and start == 0:  # every known token at once, or wait
            return total if total <= budget or budget == self.config.token_budget else start
        own_cap = seq.chunk_cap if cap is None else cap
        step_cap = min(budget, own_cap) if own_cap else budget
        if start < req.num_prompt_tokens and self.config.max_prefill_chunk is not None:
            step_cap = min(step_cap, self.config.max_prefill_chunk)
        end = min(total, start + step_cap)
        if not self.split_for_state or start >= req.num_prompt_tokens - 1:
            return end
        a = self.alignment
        junction = seq.junction if junction is None else junction
        junction -= junction % a
        if start < junction < end:
            return junction
        if self.before_end:
            before = (req.num_prompt_tokens - 1) // a * a - a
            if start < before < end:
                return before
        last_aligned = (total - 1) // a * a
        if end < total:
            aligned = end - end % a
            if aligned > start:
                return aligned
            # No boundary in reach.  Wait for a larger share of the budget, unless even the
            # whole cap cannot reach the next boundary (a budget or chunk cap below the
            # alignment): then an unaligned chunk, or the request would never progress.
            reach = start + self._static_cap(own_cap)
            return start if start - start % a + a <= reach else end
        if start < last_aligned < end:
            return last_aligned
        return end

    def _static_cap(self, chunk_cap: int) -> int:
        """The most prompt tokens one step could ever give a request whose chunk cap is
        ``chunk_cap`` (0: none), with the budget and ``max_prefill_chunk``."""
        cap = self.config.token_budget
        if chunk_cap:
            cap = min(cap, chunk_cap)
        if self.config.max_prefill_chunk is not None:
            cap = min(cap, self.config.max_prefill_chunk)
        return cap

    def _take_back(self, taken: list[tuple[int, SequenceState, int]]) -> None:
        """Undo this schedule()'s admissions ``(queue index, seq, cached before)`` after a
        later one raised: the step's output is lost, and with it what their allocations
        carried (a checkpoint restored into the running state, a zeroed state, tier loads), so
        each is freed (the blocks published for the step that never ran are taken back) and
        queued where it was, to be admitted again (found by review: a hit_check that raised
        left them running, and the next step computed them on a state nobody restored).  The
        manager counts each as a preemption; the scheduler does not."""
        for w, seq, cached in reversed(taken):
            self.running.remove(seq)
            self.manager.preempt(seq.request_id)
            seq.request.num_computed_tokens = 0
            seq.num_cached_tokens = cached
            self.waiting.insert(w, seq)

    def _preempt_newest(self) -> SequenceState:
        victim = self.running.pop()
        self.manager.preempt(victim.request_id)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        log.debug("preempted %s", victim.request_id)
        return victim

    def _admit(
        self, seq: SequenceState, budget: int, moves: list[BlockMove]
    ) -> tuple[int, int, AllocationResult] | Literal["loading", "budget", "refused"]:
        """Try to admit waiting ``seq`` with ``budget`` tokens left in the step: ``(cached,
        end, allocation)`` when its first chunk ``[cached, end)`` is allocated; "loading"
        while :attr:`hit_check` reads its lower-tier copies, "budget" when no chunk of it fits
        the budget left, "refused" when the cache refuses it now.

        Refused while nothing runs, it is tried again without reserving its prompt, then
        without its hit (whose blocks can pin the chunks the rest of it needs: it is
        recomputed), then with half the chunk.  In an empty cache the chunk cap that fits is
        the cache's limit, kept for the rest of this prefill; beside blocks that finished
        requests hold (``hold``) it is not, and later chunks try the whole budget again.
        The retries change ``seq`` only once one is admitted (found by review: a refusal set
        them for good, a raise left them set, and held blocks counted as an empty cache);
        refused otherwise, it waits unchanged.  Raises :class:`SchedulerError` when not even
        one token (or, with ``whole_prefill``, its whole chunk) fits an empty cache: no
        request running, none held."""
        cfg = self.config
        mgr = self.manager
        req = seq.request
        use_hit = not seq.no_hit and not cfg.whole_prefill
        reserving = cfg.admission == "reserve"
        cap = seq.chunk_cap
        while True:
            hit: ComputedBlocks | None = None
            cached = 0
            junction = seq.junction
            if not cfg.whole_prefill:
                hit = mgr.get_computed_blocks(req)
                if self.hit_check is not None and hit.num_computed_tokens:
                    hit = self.hit_check(req, hit)
                    if hit is None:
                        return "loading"
                junction = hit.junction_tokens
                if use_hit:
                    cached = hit.num_computed_tokens
                else:
                    hit = None
            end = self._chunk_end(seq, cached, budget, cap=cap, junction=junction)
            if end <= cached:
                return "budget"
            # its prompt (and outputs, if resumed)
            reserve = req.num_tokens - end if reserving else 0
            res = mgr.allocate_slots(
                req,
                end - cached,
                num_new_computed_tokens=cached,
                new_computed_blocks=hit,
                num_reserved_tokens=reserve,
            )
            if res is not None:
                break
            if self.running:
                return "refused"
            if reserve:  # alone and its prompt does not fit at once: chunk by chunk
                reserving = False
                continue
            if cached:  # alone, refused beside its own hit: the hit's blocks pin
                use_hit = False  # chunks a fresh start could use; recompute it
                continue
            # Alone and still refused: the chunk is too large for the cache (a fixed pool
            # split sized for decode, say).  Retry with half the chunk.
            if end - cached <= 1 or cfg.whole_prefill:
                if self.held:  # not an empty cache: a release may make room
                    return "refused"
                what = (
                    f"its {end} tokens, computed in one step (whole_prefill), do not"
                    if cfg.whole_prefill
                    else "not even one token does"
                )
                self._unreported_moves = moves
                raise SchedulerError(
                    f"request {req.request_id!r}: {what} fit in an empty cache; the "
                    "memory budget is too small for it"
                )
            cap = max(1, (end - cached) // 2)
        seq.junction = junction
        seq.no_hit = False  # a later re-admission looks for hits again
        seq.no_reserve = cfg.admission == "reserve" and not reserving
        if end == req.num_tokens:
            seq.chunk_cap = 0  # its prefill is done: a later one learns its own cap
        elif not self.held:  # a cap learned beside held blocks is not the cache's limit
            seq.chunk_cap = cap
        return cached, end, res

    def _scheduled(
        self,
        seq: SequenceState,
        start: int,
        end: int,
        cached: int,
        allocation: object,
    ) -> ScheduledRequest:
        req = seq.request
        tokens = req.token_ids
        return ScheduledRequest(
            request_id=req.request_id,
            start=start,
            num_new_tokens=end - start,
            num_cached_tokens=cached,
            token_ids=tuple(tokens[start:end]),
            block_ids=self.manager.get_block_ids(req.request_id)
            if self.config.collect_block_ids
            else (),
            samples=end == req.num_tokens,
            allocation=allocation,  # type: ignore[arg-type]
            is_prefill=start < req.num_prompt_tokens,
        )

    def _moved(
        self, out: list[ScheduledRequest], moves: Sequence[BlockMove]
    ) -> list[ScheduledRequest]:
        """The step's requests scheduled so far, with compaction's ``moves`` applied to their
        tables and new block ids."""
        where: dict[tuple[int, int], int] = {(m.group_id, m.src): m.dst for m in moves}
        fixed = []
        for item in out:
            alloc = item.allocation
            new_ids = tuple(
                tuple(BlockId(where.get((g, b), b)) for b in ids)
                for g, ids in enumerate(alloc.new_block_ids)
            )
            fixed.append(
                replace(
                    item,
                    block_ids=self.manager.get_block_ids(item.request_id)
                    if self.config.collect_block_ids
                    else (),
                    allocation=alloc._replace(new_block_ids=new_ids),
                )
            )
        return fixed

    def draft_room(self, seq: SequenceState) -> int:
        """How many draft tokens a decode step of running ``seq`` may verify now (0 when the
        step is not a one-token decode step).

        Accepted drafts and the token sampled after them must fit ``max_tokens`` and
        ``max_model_len``.  With a recurrent-state group, a speculative step never reaches a
        checkpoint boundary (a multiple of the schedule alignment): the state is checkpointed
        by the step that ends there, which verifies no draft, so decode checkpoints land where
        they would without speculation and a rejected draft never enters one.
        """
        req = seq.request
        start = req.num_computed_tokens
        if start != req.num_tokens - 1 or start < req.num_prompt_tokens:
            return 0
        room = min(
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
            self.config.token_budget - 1,
        )
        if self.has_state:
            a = self.alignment
            step_end = start + 1
            room = min(room, -(-step_end // a) * a - step_end - 1)
        return max(room, 0)

    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """Plan one step and allocate its slots.  Mutates the queues and the manager.

        ``drafts`` maps running request ids to speculative tokens proposed after their last
        token; a decode step verifies the first :meth:`draft_room` of them (its
        ``draft_token_ids``), allocated as lookahead.  When the cache refuses the lookahead,
        the step runs without drafts before anything is preempted.
        """
        cfg = self.config
        mgr = self.manager
        budget = cfg.token_budget
        out: list[ScheduledRequest] = []
        preempted: list[str] = []
        moves, self._unreported_moves = self._unreported_moves, []
        cached_total = 0
        stalled = False  # a running request waits for held blocks: admit nothing
        self._aborted.clear()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.request
            start = req.num_computed_tokens
            end = self._chunk_end(seq, start, budget)
            if end <= start:
                i += 1
                continue
            lookahead = cfg.num_lookahead_tokens if start >= req.num_prompt_tokens else 0
            draft: tuple[int, ...] = ()
            if drafts is not None and req.request_id in drafts:
                draft = tuple(drafts[req.request_id][: min(self.draft_room(seq), budget - 1)])
                lookahead = max(lookahead, len(draft))
            while True:
                res = mgr.allocate_slots(req, end - start, num_lookahead_tokens=lookahead)
                if res is not None:
                    break
                if draft:  # verify no draft rather than preempt anyone for it
                    draft = ()
                    lookahead = cfg.num_lookahead_tokens
                    continue
                if cfg.compaction:  # free whole chunks before anyone is preempted
                    moved = mgr.compact(
                        req, end - start, num_lookahead_tokens=lookahead, pinned=self.held
                    )
                    if moved:
                        out = self._moved(out, moved)
                        moves.extend(moved)
                        continue
                if self.running == [seq] and self.held:
                    # Alone but for blocks finished requests hold until release(): not an
                    # empty cache (found by review: it gave up, or cut its chunks for good).
                    # A smaller chunk this step if one fits (the next step tries the whole
                    # chunk again); else it waits, unchanged, and nothing is admitted past it.
                    smaller = self._chunk_end(seq, start, budget, cap=max(1, (end - start) // 2))
                    if start < smaller < end:
                        end = smaller
                        continue
                    stalled = True
                    break
                if end - start <= 1 and self.running == [seq]:
                    # Refused one token with every other block free or evictable: preempting
                    # and recomputing would reach this point again and loop forever.
                    self._unreported_moves = moves
                    raise SchedulerError(
                        f"request {req.request_id!r}: the cache cannot hold it past "
                        f"{start} tokens even alone (no free block, or no free state slot for "
                        "a checkpoint); the memory budget is too small for it"
                    )
                victim = self._preempt_newest()
                preempted.append(victim.request_id)
                if victim is seq:
                    if not self.running and end - start > 1:
                        # Refused with the cache to itself: resume with smaller chunks.
                        seq.chunk_cap = max(1, (end - start) // 2)
                    break
            if res is None:
                break
            if end == req.num_tokens:
                seq.chunk_cap = 0  # its prefill is done: a later one learns its own cap
            item = self._scheduled(seq, start, end, 0, res)
            if draft:
                item = replace(item, draft_token_ids=draft)
            out.append(item)
            budget -= end - start + len(draft)
            i += 1
        skipped = 0
        self.num_loading = 0
        if not preempted and not stalled:
            w = 0  # the first waiting request whose loads are ready, in arrival order
            taken: list[tuple[int, SequenceState, int]] = []  # (queue index, seq, cached before)
            try:
                while w < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                    seq = self.waiting[w]
                    admitted = self._admit(seq, budget, moves)
                    if admitted == "loading":  # its lower-tier copies are still being read
                        self.num_loading += 1
                        w += 1
                        continue
                    if admitted == "budget":
                        skipped += 1
                        break
                    if admitted == "refused":
                        break
                    cached, end, res = admitted
                    taken.append((w, seq, seq.num_cached_tokens))
                    del self.waiting[w]
                    self.running.append(seq)
                    if seq.num_preemptions == 0:
                        seq.num_cached_tokens = cached
                    cached_total += cached
                    seq.request.num_computed_tokens = cached
                    out.append(self._scheduled(seq, cached, end, cached, res))
                    budget -= end - cached
            except BaseException:
                self._take_back(taken)
                self._unreported_moves = moves
                raise
        self.step_index += 1
        return SchedulerOutput(
            step=self.step_index,
            scheduled=tuple(out),
            preempted=tuple(preempted),
            num_batched_tokens=cfg.token_budget - budget,
            num_cached_tokens=cached_total,
            skipped_waiting=skipped,
            moves=tuple(moves),
        )

    # -- applying a step -------------------------------------------------------------------
    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[RequestOutput]:
        """Advance every scheduled request by its computed tokens and append sampled tokens.

        ``sampled`` maps the id of every scheduled request with ``samples=True`` to its next
        token (an ``int``, or any integer but a bool: a numpy integer, a 0-d tensor).  A
        request that verified drafts gets a sequence instead: the accepted drafts and the
        token sampled after them (``1 .. len(draft_token_ids) + 1`` tokens, each accepted
        draft equal to its draft); the accepted drafts count as computed.  Tokens after one
        that finishes the request (EOS, ``max_tokens``, ``max_model_len``) are dropped.
        Finished requests are freed; requests aborted since ``output`` was planned are
        skipped.  Raises :class:`SchedulerError`, changing nothing, when a sample is missing,
        is not a token id in ``[0, 2**63)`` (or a sequence of them) or does not fit the
        drafts, or when ``output`` is not the last :meth:`schedule`'s, still unapplied (found
        by review: a bad token raised after earlier requests had changed).
        """
        running = {s.request_id for s in self.running}
        tokens_of = sampled_tokens(output, sampled, self.seqs, running, self._aborted)
        results: list[RequestOutput] = []
        for item in output.scheduled:
            if item.request_id in self._aborted:
                continue
            seq = self.seqs[item.request_id]
            req = seq.request
            req.num_computed_tokens = item.start + item.num_new_tokens
            if not item.samples:
                continue
            kept, reason = finish_of(
                tokens_of[item.request_id],
                num_tokens=req.num_tokens,
                num_outputs=seq.num_output_tokens,
                max_tokens=seq.max_tokens,
                eos_token_ids=seq.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            new = list(tokens_of[item.request_id][:kept])
            seq.num_output_tokens += kept
            req.append_token_ids(new)
            # Accepted drafts were computed by this step (their slots hold their K/V).
            req.num_computed_tokens += len(new) - 1
            if seq.first_token_step is None:
                seq.first_token_step = output.step
            if reason is not None:
                self._finish(seq, reason)
            results.append(
                RequestOutput(
                    request_id=item.request_id,
                    new_token_ids=tuple(new),
                    finished=reason is not None,
                    finish_reason=reason,
                    num_output_tokens=seq.num_output_tokens,
                )
            )
        self.manager.write_through()  # the step ran: what it published can be stored below
        return results

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        """Finish running ``seq``: its session protected first (the one call that could
        refuse, ``protect_as`` being checked when it was added), so a raise leaves it
        running with its blocks."""
        if seq.protect_as is not None:
            self.manager.protect(seq.request_id, seq.protect_as)
        seq.finish_reason = reason
        self.running.remove(seq)
        if seq.hold:
            self.held[seq.request_id] = seq
        else:
            self.manager.free(seq.request_id)
        del self.seqs[seq.request_id]
