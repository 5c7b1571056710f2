"""Typed inputs and outputs of the continuous-batching scheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from hybridkv.cache import AllocationResult, BlockMove, ComputedBlocks, Request
from hybridkv.errors import HybridKVError, brief_repr

__all__ = [
    "ADMISSION_POLICIES",
    "FinishReason",
    "HitCheck",
    "RequestOutput",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerOutput",
    "SequenceState",
    "checked_int",
]


#: How the scheduler admits a waiting request (:attr:`SchedulerConfig.admission`).
ADMISSION_POLICIES = ("reserve", "greedy")


class SchedulerError(HybridKVError, ValueError):
    """Bad scheduler configuration or a request the scheduler can never serve."""


class FinishReason(StrEnum):
    LENGTH = "length"  # reached max_tokens
    STOP = "stop"  # sampled an end-of-sequence token
    MAX_MODEL_LEN = "max_model_len"  # the sequence reached the model's maximum length
    ABORT = "abort"  # the caller aborted it (Scheduler.abort_request)


def checked_int(field: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """Raise :class:`SchedulerError` naming ``field`` unless ``value`` is an ``int`` (not a
    bool) of at least ``minimum`` (or None, when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if optional else ""
        raise SchedulerError(f"{field}: must be an int >= {minimum}{none}, got {brief_repr(value)}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Knobs of :class:`hybridkv.scheduler.Scheduler`.

    ``token_budget``: most tokens computed in one step (all requests together).
    ``max_num_seqs``: most requests running at once.
    ``max_prefill_chunk``: most prompt tokens of one request per step (None: the budget).
    ``split_for_state``: end prefill chunks at the layout's schedule alignment and at the
    shared-prefix junction, so recurrent-state groups checkpoint exactly where later requests
    hit.  ``None`` turns it on when the layout has a state group.
    ``checkpoint_before_end``: with ``split_for_state``, also end a prefill chunk one
    alignment unit before the prompt's last aligned boundary, so a checkpoint can be saved
    there too (admission reason ``before_end``): a next turn whose prompt differs from this
    one in the last tokens before the end hits it.  ``None``: on when the schedule alignment
    is at most 512 tokens (arena and pools layouts checkpoint every 256 by default; a
    ``uniform`` layout's unified block of ~1,000 tokens makes that checkpoint cost more than
    it returns).  Measured with ``hybridkv simulate``, Qwen3-Next-80B-A3B, off -> on: agent
    workload at 8 GiB, arena 53.3% -> 53.8%, uniform 40.8% -> 37.3%; chat, arena 74.1% ->
    75.3%; Mooncake trace (2,000 requests, arena), 16 GiB + 128 GiB host 14.6% -> 15.0%,
    1 TiB 28.8% with it (26.98% before the ``before_end`` reason existed), but 16 GiB alone
    2.7% -> 2.4% with 73 -> 178 preemptions (the extra checkpoint competes for a full cache).
    ``num_lookahead_tokens``: speculative positions reserved after every decode token.
    ``collect_block_ids``: copy each scheduled request's block tables into the output (a model
    runner needs them; a simulator does not).
    ``whole_prefill``: compute every known token of a request in its first step, from token 0:
    no prefix-cache hit, no chunked prefill (for models whose recurrent state cannot resume a
    prefill, e.g. transformers' Mamba1 in Jamba); a prompt longer than ``token_budget`` is
    refused when added.  A request preempted after its prompt and outputs outgrew the budget
    resumes alone in a step, past the budget (it can only restart from token 0).
    ``admission``: ``"reserve"`` (default): a waiting request is admitted only if the
    prefix-closed groups (full attention, MLA) can take the blocks of its whole remaining
    prompt at once (``num_reserved_tokens``); its later prefill chunks then never need
    blocks there, so a running prompt does not preempt other requests halfway through (a
    request the cache cannot reserve for even alone is admitted chunk by chunk).
    ``"greedy"``: admit whenever the first chunk fits, as vLLM does; later chunks preempt the
    newest requests when the cache is full.  Measured with ``hybridkv simulate`` on the
    Mooncake trace's first 2,000 requests, greedy -> reserve: Qwen3-Next-80B-A3B at 32 GiB,
    arena TTFT p50 41.4 -> 13.2 s (697 -> 22 preemptions; 53.1 -> 13.5 s and 469 -> 21
    without ``compaction``), ``uniform`` 22.7 -> 17.0 s (500 -> 16), measured 2026-11-27
    (42.9 -> 20.1 s and 20.6 -> 17.2 s when the rule was made); the other models and sizes in
    ``docs/architecture.md`` (section 5), as measured then.
    ``compaction``: when a running request's step is refused, compact the cache
    (:meth:`KVCacheManager.compact`: an arena moves referenced blocks out of sparse chunks)
    and try again before preempting anyone; the moves are in the step's output.
    """

    token_budget: int = 8192
    max_num_seqs: int = 256
    max_prefill_chunk: int | None = None
    split_for_state: bool | None = None
    checkpoint_before_end: bool | None = None
    num_lookahead_tokens: int = 0
    collect_block_ids: bool = True
    whole_prefill: bool = False
    admission: str = "reserve"
    compaction: bool = True

    def __post_init__(self) -> None:
        """Check every field's type and range (found by review: ``whole_prefill="no"`` and
        ``token_budget=True`` were taken as set, a float chunk failed in the cache later)."""
        name = "SchedulerConfig"
        checked_int(f"{name}.token_budget", self.token_budget, 1)
        checked_int(f"{name}.max_num_seqs", self.max_num_seqs, 1)
        checked_int(f"{name}.max_prefill_chunk", self.max_prefill_chunk, 1, optional=True)
        checked_int(f"{name}.num_lookahead_tokens", self.num_lookahead_tokens, 0)
        for flag in ("collect_block_ids", "whole_prefill", "compaction"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise SchedulerError(f"{name}.{flag}: must be a bool, got {brief_repr(value)}")
        for flag in ("split_for_state", "checkpoint_before_end"):
            value = getattr(self, flag)
            if value is not None and not isinstance(value, bool):
                raise SchedulerError(
                    f"{name}.{flag}: must be a bool or None (automatic), got {brief_repr(value)}"
                )
        if not isinstance(self.admission, str) or self.admission not in ADMISSION_POLICIES:
            shown = (
                repr(self.admission)
                if isinstance(self.admission, str)
                else brief_repr(self.admission)
            )
            raise SchedulerError(
                f"{name}.admission: unknown policy {shown}; valid: {', '.join(ADMISSION_POLICIES)}"
            )


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The step computes tokens ``[start, start + num_new_tokens)`` of the request (``token_ids``
    are exactly those tokens); ``num_cached_tokens`` of them were a prefix-cache hit taken this
    step (``start`` already counts them).  ``block_ids[g]`` is the request's block table of
    group ``g`` after allocation (empty tuple when the
    scheduler does not collect block ids).  ``samples`` is True when the step reaches the end of the
    known tokens, so the runner must return a next token for it.  ``allocation`` carries the
    state copies the runner performs (see :mod:`hybridkv.cache.kinds.state`).
    ``draft_token_ids``: speculative tokens to verify after the step's one decode token; their
    slots are allocated as lookahead (not computed, never published) and the runner must
    return logits for the decode token and every draft.
    """

    request_id: str
    start: int
    num_new_tokens: int
    num_cached_tokens: int
    token_ids: tuple[int, ...]
    block_ids: tuple[list[int], ...]
    samples: bool
    allocation: AllocationResult
    is_prefill: bool
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """What one :meth:`Scheduler.schedule` call decided."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    num_batched_tokens: int = 0
    num_cached_tokens: int = 0
    skipped_waiting: int = 0
    #: Blocks compaction moved while scheduling this step, in order (after those of a
    #: schedule() that raised since the last output): copy each before anything reads or
    #: writes those blocks; ``scheduled`` tables and ``allocation.new_block_ids`` already
    #: name the new ids.  Where the manager records tier operations (``tier_ops``), the same
    #: moves are ``relocate`` operations of that stream: run the stream, in order, instead.
    moves: tuple[BlockMove, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class RequestOutput:
    """Tokens a request produced in one step (for streaming)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    num_output_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)


#: ``hit_check(request, hit)``: the hit to admit a waiting request with, or None while its
#: lower-tier copies are still being read (see :attr:`Scheduler.hit_check`).
HitCheck = Callable[[Request, ComputedBlocks], ComputedBlocks | None]


@dataclass(slots=True)
class SequenceState:
    """Scheduler-side bookkeeping of one request."""

    request: Request
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival: float
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    junction: int = 0
    finish_reason: FinishReason | None = None
    first_token_step: int | None = None
    chunk_cap: int = 0  # >0: a smaller prefill chunk the cache could hold on its own
    no_reserve: bool = False  # its prompt cannot be reserved even alone: admit chunk by chunk
    no_hit: bool = False  # refused alone with its hit (whose blocks pin memory): recompute
    hold: bool = False  # keep the blocks when it finishes (a handover reads them)
    protect_as: str | None = None  # a session protecting its prefix once it finishes

    @property
    def request_id(self) -> str:
        return self.request.request_id
