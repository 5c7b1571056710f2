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
   chunks the rest of it needs: it is recomputed), then with half the chunk.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from hybridkv.cache import (
    AllocationResult,
    BlockId,
    BlockMove,
    ComputedBlocks,
    KVCacheManager,
)
from hybridkv.scheduler.imports import place_import
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


class Scheduler:
    """Continuous batching with chunked prefill, prefix hits and preemption by recompute.

    ``add_request`` queues a request; ``schedule`` plans a step (and allocates its slots);
    ``update`` applies the step's sampled tokens.  Requests longer than ``max_model_len`` are
    refused at ``add_request`` with :class:`SchedulerError`.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        *,
        max_model_len: int,
        hit_check: HitCheck | None = None,
    ) -> None:
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
        if max_model_len <= 0:
            raise SchedulerError(f"max_model_len: must be positive, got {max_model_len}")
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

    # -- queue ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
        arrival: float = 0.0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        hold: bool = False,
        protect_as: str | None = None,
    ) -> SequenceState:
        """Queue a request.  Raises :class:`SchedulerError` (or a cache RequestError) for an
        empty prompt, a duplicate id, ``max_tokens < 1`` or a prompt of ``max_model_len`` or
        more tokens.  ``hold``: keep its blocks when it finishes, until :meth:`release`.
        ``protect_as``: when it finishes, protect its prefix in the lower tiers under that
        session name (:meth:`KVCacheManager.protect`, replacing the session's earlier
        prefix)."""
        if request_id in self.seqs or request_id in self.held:
            raise SchedulerError(f"request {request_id!r}: id already queued or running")
        if max_tokens < 1:
            raise SchedulerError(
                f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}"
            )
        n = len(prompt_token_ids)
        if self.config.whole_prefill and n > self.config.token_budget:
            raise SchedulerError(
                f"request {request_id!r}: prompt has {n} tokens; whole_prefill computes a prompt "
                f"in one step, and the token budget is {self.config.token_budget}: raise "
                "token_budget or shorten the prompt"
            )
        if n >= self.max_model_len:
            raise SchedulerError(
                f"request {request_id!r}: prompt has {n} tokens, the maximum model length is "
                f"{self.max_model_len} (prompts must be shorter, leaving room for one output)"
            )
        request = self.manager.make_request(
            request_id, list(prompt_token_ids), lora_id=lora_id, cache_salt=cache_salt
        )
        seq = SequenceState(request, max_tokens, frozenset(eos_token_ids), arrival)
        seq.hold = hold
        seq.protect_as = protect_as
        self.seqs[request_id] = seq
        self.waiting.append(seq)
        self.manager.retain_hit(request)  # its lower-tier hit outlives the wait
        return seq

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request added with ``hold``."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            raise SchedulerError(f"release: no finished request {request_id!r} is held")
        self.manager.free(request_id)

    def import_computed(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
        fill: Callable[[tuple[list[int], ...], int, AllocationResult], None],
        missing: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    ) -> SequenceState | None:
        """Admit a request whose prompt another instance computed, straight into the running
        set: its own prefix hit is taken, slots for the rest of the prompt are allocated and
        ``fill(block_tables, hit_tokens, allocation)`` must write their data (the prompt's
        tokens from ``hit_tokens`` on, and the recurrent state at the prompt's end), but for
        ``missing`` (per group, token ranges the other instance released: see
        :meth:`~hybridkv.cache.KVCacheManager.drop_unread`).  The next step computes the
        first of ``output_token_ids`` (sampled by the other instance).  Returns None,
        changing nothing, when the cache cannot hold it now (or :attr:`hit_check` is still
        reading its lower-tier copies); when ``fill`` raises (or the cache refuses
        ``missing``), the request is freed (nothing it was to receive is published or read)
        and the error propagates.  Any other error leaves the scheduler as it was."""
        if not output_token_ids:
            raise SchedulerError(f"request {request_id!r}: an imported request needs a token")
        seq = self.add_request(
            request_id, prompt_token_ids, max_tokens=max_tokens, eos_token_ids=eos_token_ids
        )
        self.waiting.pop()
        try:
            placed = place_import(
                self.manager, self.hit_check, seq, output_token_ids, fill, missing
            )
        except BaseException:
            self.seqs.pop(request_id, None)  # found by review: a stray id refused every retry
            raise
        if not placed:
            del self.seqs[request_id]
            return None
        self.running.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- planning -------------------------------------------------------------------------
    def _chunk_end(self, seq: SequenceState, start: int, budget: int) -> int:
        """Where this step's chunk of ``seq`` ends (``start`` if nothing can be scheduled)."""
        req = seq.request
        total = req.num_tokens
        if self.config.whole_prefill and start == 0:  # every known token at once, or wait
            return total if total <= budget else start
        cap = min(budget, seq.chunk_cap) if seq.chunk_cap else budget
        if start < req.num_prompt_tokens and self.config.max_prefill_chunk is not None:
            cap = min(cap, self.config.max_prefill_chunk)
        end = min(total, start + cap)
        if not self.split_for_state or start >= req.num_prompt_tokens - 1:
            return end
        a = self.alignment
        junction = seq.junction - seq.junction % a
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
            return start if start - start % a + a <= start + self._static_cap(seq) else end
        if start < last_aligned < end:
            return last_aligned
        return end

    def _static_cap(self, seq: SequenceState) -> int:
        """The most prompt tokens one step could ever give ``seq`` (budget and chunk caps)."""
        cap = self.config.token_budget
        if seq.chunk_cap:
            cap = min(cap, seq.chunk_cap)
        if self.config.max_prefill_chunk is not None:
            cap = min(cap, self.config.max_prefill_chunk)
        return cap

    def _preempt_newest(self) -> SequenceState:
        victim = self.running.pop()
        self.manager.preempt(victim.request_id)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        log.debug("preempted %s", victim.request_id)
        return victim

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
            item = self._scheduled(seq, start, end, 0, res)
            if draft:
                item = replace(item, draft_token_ids=draft)
            out.append(item)
            budget -= end - start + len(draft)
            i += 1
        skipped = 0
        self.num_loading = 0
        if not preempted:
            w = 0  # the first waiting request whose loads are ready, in arrival order
            while w < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[w]
                req = seq.request
                hit: ComputedBlocks | None = None
                cached = 0
                if not cfg.whole_prefill:
                    hit = mgr.get_computed_blocks(req)
                    if self.hit_check is not None and hit.num_computed_tokens:
                        hit = self.hit_check(req, hit)
                        if hit is None:  # its lower-tier copies are still being read
                            self.num_loading += 1
                            w += 1
                            continue
                    seq.junction = hit.junction_tokens
                    if seq.no_hit:
                        hit = None
                    else:
                        cached = hit.num_computed_tokens
                end = self._chunk_end(seq, cached, budget)
                if end <= cached:
                    skipped += 1
                    break
                reserve = 0
                if cfg.admission == "reserve" and not seq.no_reserve:
                    reserve = req.num_tokens - end  # its prompt (and outputs, if resumed)
                res = mgr.allocate_slots(
                    req,
                    end - cached,
                    num_new_computed_tokens=cached,
                    new_computed_blocks=hit,
                    num_reserved_tokens=reserve,
                )
                if res is None:
                    if self.running:
                        break
                    if reserve:  # alone and its prompt does not fit at once: chunk by chunk
                        seq.no_reserve = True
                        continue
                    if cached:  # alone, refused beside its own hit: the hit's blocks pin
                        seq.no_hit = True  # chunks a fresh start could use; recompute it
                        continue
                    # Alone and still refused: the chunk is too large for the cache (a fixed
                    # pool split sized for decode, say).  Retry with half the chunk.
                    if end - cached <= 1 or cfg.whole_prefill:
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
                    seq.chunk_cap = max(1, (end - cached) // 2)
                    continue
                del self.waiting[w]
                self.running.append(seq)
                seq.no_hit = False  # a later re-admission looks for hits again
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
                cached_total += cached
                req.num_computed_tokens = cached
                out.append(self._scheduled(seq, cached, end, cached, res))
                budget -= end - cached
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
        token.  A request that verified drafts gets a sequence instead: the accepted drafts
        and the token sampled after them (``1 .. len(draft_token_ids) + 1`` tokens, each
        accepted draft equal to its draft); the accepted drafts count as computed.  Tokens
        after one that finishes the request (EOS, ``max_tokens``, ``max_model_len``) are
        dropped.  Finished requests are freed.  Raises :class:`SchedulerError`, changing
        nothing, when a sample is missing or does not fit the drafts.
        """
        tokens_of: dict[str, tuple[int, ...]] = {}
        for item in output.scheduled:
            if not item.samples:
                continue
            if item.request_id not in sampled:
                raise SchedulerError(f"update: no sampled token for {item.request_id!r}")
            value = sampled[item.request_id]
            tokens = (value,) if isinstance(value, int) else tuple(value)
            draft = item.draft_token_ids
            if not 1 <= len(tokens) <= len(draft) + 1 or tokens[:-1] != draft[: len(tokens) - 1]:
                raise SchedulerError(
                    f"update: request {item.request_id!r} sampled {list(tokens)} for drafts "
                    f"{list(draft)}; expected the accepted drafts (a prefix of them) and one "
                    "token more"
                )
            tokens_of[item.request_id] = tokens
        results: list[RequestOutput] = []
        for item in output.scheduled:
            seq = self.seqs[item.request_id]
            req = seq.request
            req.num_computed_tokens = item.start + item.num_new_tokens
            if not item.samples:
                continue
            new: list[int] = []
            reason: FinishReason | None = None
            for token in tokens_of[item.request_id]:
                new.append(token)
                seq.num_output_tokens += 1
                if token in seq.eos_token_ids:
                    reason = FinishReason.STOP
                elif seq.num_output_tokens >= seq.max_tokens:
                    reason = FinishReason.LENGTH
                elif req.num_tokens + len(new) >= self.max_model_len:
                    reason = FinishReason.MAX_MODEL_LEN
                if reason is not None:
                    break
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
        seq.finish_reason = reason
        self.running.remove(seq)
        if seq.protect_as is not None:
            self.manager.protect(seq.request_id, seq.protect_as)
        if seq.hold:
            self.held[seq.request_id] = seq
        else:
            self.manager.free(seq.request_id)
        del self.seqs[seq.request_id]
