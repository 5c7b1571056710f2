"""Requests in and out of the scheduler: :class:`RequestIntake`, the base of
:class:`~hybridkv.scheduler.Scheduler` that adds, imports, releases and aborts them (the
scheduler's module keeps the planning of steps and their updates).  No torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from hybridkv.cache import AllocationResult, KVCacheManager
from hybridkv.scheduler.checks import check_new_request, finish_of, token_ids
from hybridkv.scheduler.imports import place_import
from hybridkv.scheduler.types import (
    FinishReason,
    HitCheck,
    SchedulerConfig,
    SchedulerError,
    SequenceState,
    checked_int,
)

__all__ = ["RequestIntake"]


class RequestIntake:
    """Adding, importing, releasing and aborting requests (set up by the scheduler's
    ``__init__``)."""

    manager: KVCacheManager
    config: SchedulerConfig
    max_model_len: int
    hit_check: HitCheck | None
    waiting: deque[SequenceState]
    running: list[SequenceState]
    seqs: dict[str, SequenceState]
    held: dict[str, SequenceState]
    #: Requests aborted since the last schedule(): update() skips their items.
    _aborted: set[str]

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
        """Queue a request.  Raises :class:`SchedulerError` (or a cache RequestError for the
        prompt's tokens), queueing nothing, for an empty prompt, a duplicate id,
        ``max_tokens < 1``, a prompt of ``max_model_len`` or more tokens (or, with
        ``whole_prefill``, more than ``token_budget``), an ill-typed argument or a
        ``protect_as`` that is not a non-empty str.  ``hold``: keep its blocks when it
        finishes, until :meth:`release`.  ``protect_as``: when it finishes, protect its prefix
        in the lower tiers under that session name (:meth:`KVCacheManager.protect`, replacing
        the session's earlier prefix)."""
        seq = self._new_seq(
            request_id,
            prompt_token_ids,
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            arrival=arrival,
            lora_id=lora_id,
            cache_salt=cache_salt,
            hold=hold,
            protect_as=protect_as,
        )
        self.manager.retain_hit(seq.request)  # its lower-tier hit outlives the wait
        self.seqs[request_id] = seq
        self.waiting.append(seq)
        return seq

    def _new_seq(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        arrival: float = 0.0,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        hold: bool = False,
        protect_as: str | None = None,
    ) -> SequenceState:
        """A new request's state, every argument checked (see :meth:`add_request`); queues
        nothing."""
        eos = check_new_request(
            request_id,
            prompt_token_ids,
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            arrival=arrival,
            hold=hold,
            protect_as=protect_as,
        )
        if request_id in self.seqs or request_id in self.held:
            raise SchedulerError(f"request {request_id!r}: id already queued or running")
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
        seq = SequenceState(request, max_tokens, eos, arrival)
        seq.hold = hold
        seq.protect_as = protect_as
        return seq

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request added with ``hold``."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            raise SchedulerError(f"release: no finished request {request_id!r} is held")
        self.manager.free(request_id)

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting, running or held request: its blocks are freed (computed ones stay
        in the prefix cache, as when a request finishes), it leaves the queues, is not held
        (``hold``) and protects no ``protect_as`` session.  Its :attr:`SequenceState.finish_reason`
        becomes :attr:`FinishReason.ABORT`.  A held request is released (:meth:`release`).
        Call it between steps; when it is called between a :meth:`schedule` and that output's
        :meth:`update`, the update skips the request.  Raises :class:`SchedulerError`,
        changing nothing, for an id that names no waiting, running or held request (a
        finished request is gone: aborting it is a caller's error, not a no-op)."""
        if isinstance(request_id, str) and request_id in self.held:
            self.release(request_id)
            return
        seq = self.seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            raise SchedulerError(
                f"abort_request: no waiting, running or held request has id {request_id!r}"
            )
        if seq in self.running:
            self.manager.free(request_id)
            self.running.remove(seq)
        else:
            # A waiting request holds blocks only in the manager's books once admitted (it
            # was preempted since); one never admitted is unknown to the manager.
            if seq.num_preemptions:
                self.manager.free(request_id)
            self.waiting.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        del self.seqs[request_id]
        self._aborted.add(request_id)

    def import_finish(
        self,
        num_prompt_tokens: int,
        output_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
    ) -> FinishReason | None:
        """Why a request whose prompt has ``num_prompt_tokens`` tokens and whose first
        outputs (sampled by another instance) are ``output_token_ids`` is already finished
        (an EOS among them, ``max_tokens`` or ``max_model_len`` reached), as :meth:`update`
        would have said; None when it goes on.  :meth:`import_computed` refuses such a
        request: the caller completes it without importing.  Raises :class:`SchedulerError`
        for an argument of the wrong type."""
        checked_int("import_finish: num_prompt_tokens", num_prompt_tokens, 1)
        checked_int("import_finish: max_tokens", max_tokens, 1)
        return finish_of(
            token_ids(output_token_ids, "import_finish: output_token_ids"),
            num_tokens=num_prompt_tokens,
            num_outputs=0,
            max_tokens=max_tokens,
            eos_token_ids=frozenset(token_ids(eos_token_ids, "import_finish: eos_token_ids")),
            max_model_len=self.max_model_len,
        )[1]

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
        first of ``output_token_ids`` (sampled by the other instance).

        Returns None, changing nothing, when it cannot run now: ``max_num_seqs`` requests
        are running, the cache cannot hold it, or :attr:`hit_check` is still reading its
        lower-tier copies (the caller tries again later, or recomputes it).  Raises
        :class:`SchedulerError`, changing nothing, for what :meth:`add_request` refuses, no
        or bad output tokens, and a request those tokens already finish
        (:meth:`import_finish`: an EOS, ``max_tokens`` or ``max_model_len`` reached; found by
        review: it went on to generate one token too many).  When ``fill`` raises (or the
        cache refuses ``missing``), the request is freed (nothing it was to receive is
        published or read) and the error propagates."""
        seq = self._new_seq(
            request_id, prompt_token_ids, max_tokens=max_tokens, eos_token_ids=eos_token_ids
        )
        outputs = token_ids(output_token_ids, f"request {request_id!r}: output_token_ids")
        if not outputs:
            raise SchedulerError(f"request {request_id!r}: an imported request needs a token")
        _, reason = finish_of(
            outputs,
            num_tokens=seq.request.num_prompt_tokens,
            num_outputs=0,
            max_tokens=seq.max_tokens,
            eos_token_ids=seq.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if reason is not None:
            raise SchedulerError(
                f"request {request_id!r}: its imported tokens {outputs} already finish it "
                f"({reason.value}: max_tokens {max_tokens}, max_model_len "
                f"{self.max_model_len}); nothing to decode: complete it without importing"
            )
        if len(self.running) >= self.config.max_num_seqs:
            return None  # found by review: imports ran past max_num_seqs
        if not place_import(self.manager, self.hit_check, seq, outputs, fill, missing):
            return None
        self.seqs[request_id] = seq
        self.running.append(seq)
        return seq
