"""Argument checks of :class:`~hybridkv.scheduler.Scheduler`, made before anything changes,
and the stop conditions :meth:`~hybridkv.scheduler.Scheduler.update` and
:meth:`~hybridkv.scheduler.Scheduler.import_computed` share.  No torch.

Bad input raises :class:`SchedulerError` naming the field, the value and what is valid
(found by review: ill-typed values were taken, then failed later, after some state had
changed).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hybridkv.errors import brief_repr
from hybridkv.scheduler.types import (
    FinishReason,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
    SequenceState,
    checked_int,
)

__all__ = [
    "TOKEN_ID_END",
    "check_new_request",
    "check_scheduler_args",
    "finish_of",
    "sampled_tokens",
    "token_id",
    "token_ids",
]

#: Token ids lie in ``[0, TOKEN_ID_END)``, as a :class:`~hybridkv.cache.Request` holds them.
TOKEN_ID_END = 1 << 63


def check_scheduler_args(
    manager: object, config: object, max_model_len: object, hit_check: object
) -> None:
    """Raise :class:`SchedulerError` for a ``config`` that is not a :class:`SchedulerConfig`
    (or None), a ``max_model_len`` that is not a positive int or exceeds the manager's own
    ``max_model_len`` (requests past it would be refused by every allocation), or a
    ``hit_check`` that is not callable."""
    if config is not None and not isinstance(config, SchedulerConfig):
        raise SchedulerError(
            f"Scheduler.config: must be a SchedulerConfig or None, got {brief_repr(config)}"
        )
    checked_int("Scheduler.max_model_len", max_model_len, 1)
    assert isinstance(max_model_len, int)
    limit = getattr(manager, "max_model_len", None)
    if isinstance(limit, int) and max_model_len > limit:
        raise SchedulerError(
            f"Scheduler.max_model_len: {max_model_len} exceeds the cache manager's "
            f"max_model_len {limit}; give at most {limit}"
        )
    if hit_check is not None and not callable(hit_check):
        raise SchedulerError(
            f"Scheduler.hit_check: must be callable or None, got {brief_repr(hit_check)}"
        )


def token_id(value: object, where: str) -> int:
    """``value`` as a token id: any integer (numpy's, a 0-d integer tensor) but a bool, in
    ``[0, TOKEN_ID_END)``.  Raises :class:`SchedulerError` starting with ``where``."""
    wrong = f"{where}: a token id must be an int (not a bool) in [0, 2**63), got"
    dtype = getattr(value, "dtype", None)
    if isinstance(value, bool) or (dtype is not None and "bool" in str(dtype)):
        raise SchedulerError(f"{wrong} {brief_repr(value)}")
    try:
        token = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise SchedulerError(f"{wrong} {brief_repr(value)}") from None
    if not 0 <= token < TOKEN_ID_END:
        raise SchedulerError(f"{wrong} {token}")
    return token


def _is_sequence(value: object) -> bool:
    """A list, tuple or array-like of tokens (not a str, bytes or mapping, nor a 0-d array
    or tensor, which has no length)."""
    if isinstance(value, str | bytes | bytearray | Mapping) or not hasattr(value, "__iter__"):
        return False
    try:
        len(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def token_ids(value: object, where: str) -> list[int]:
    """``value``, a sequence of token ids (a list, a tuple, an array), as a list of ints.
    Raises :class:`SchedulerError` starting with ``where`` for anything else."""
    if not _is_sequence(value):
        raise SchedulerError(f"{where}: must be a sequence of token ids, got {brief_repr(value)}")
    assert isinstance(value, Iterable)
    return [token_id(t, where) for t in value]


def check_new_request(
    request_id: object,
    prompt_token_ids: object,
    *,
    max_tokens: object,
    eos_token_ids: object,
    arrival: object,
    hold: object,
    protect_as: object,
) -> frozenset[int]:
    """Check :meth:`Scheduler.add_request`'s arguments (the prompt's tokens are checked when
    its :class:`~hybridkv.cache.Request` is made); returns the EOS ids as a set."""
    if not isinstance(request_id, str) or not request_id:
        raise SchedulerError(
            f"add_request: request_id must be a non-empty str, got {brief_repr(request_id)}"
        )
    where = f"request {request_id!r}"
    if not _is_sequence(prompt_token_ids):
        raise SchedulerError(
            f"{where}: prompt_token_ids must be a sequence of token ids, got "
            f"{brief_repr(prompt_token_ids)}"
        )
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SchedulerError(f"{where}: max_tokens must be >= 1, got {brief_repr(max_tokens)}")
    eos = frozenset(token_ids(eos_token_ids, f"{where}: eos_token_ids"))
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        raise SchedulerError(f"{where}: arrival must be a number, got {brief_repr(arrival)}")
    if not isinstance(hold, bool):
        raise SchedulerError(f"{where}: hold must be a bool, got {brief_repr(hold)}")
    if protect_as is not None and (not isinstance(protect_as, str) or not protect_as):
        raise SchedulerError(
            f"{where}: protect_as must be None or a non-empty str naming the client session, "
            f"got {brief_repr(protect_as)}"
        )
    return eos


def finish_of(
    tokens: Sequence[int],
    *,
    num_tokens: int,
    num_outputs: int,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> tuple[int, FinishReason | None]:
    """How many of ``tokens`` (new outputs of a request that has ``num_tokens`` tokens and
    ``num_outputs`` outputs) it keeps, and why it then finishes (None: it goes on).  The first
    token that is an EOS, reaches ``max_tokens`` outputs or ``max_model_len`` tokens finishes
    it; those after it are dropped."""
    for k, token in enumerate(tokens, 1):
        if token in eos_token_ids:
            return k, FinishReason.STOP
        if num_outputs + k >= max_tokens:
            return k, FinishReason.LENGTH
        if num_tokens + k >= max_model_len:
            return k, FinishReason.MAX_MODEL_LEN
    return len(tokens), None


def sampled_tokens(
    output: SchedulerOutput,
    sampled: Mapping[str, Any],
    seqs: Mapping[str, SequenceState],
    running: set[str],
    aborted: set[str],
) -> dict[str, tuple[int, ...]]:
    """The tokens :meth:`Scheduler.update` appends, per sampling request of ``output``, every
    one checked before anything changes.  Raises :class:`SchedulerError` for a scheduled
    request that is not running at the start of its chunk (an output already applied, or not
    the last schedule()'s), a missing sample, a value that is not a token id or a sequence of
    them, or tokens that do not fit the drafts.  Requests in ``aborted`` are skipped."""
    if not isinstance(output, SchedulerOutput):
        raise SchedulerError(
            f"update: output must be the SchedulerOutput schedule() returned, got "
            f"{brief_repr(output)}"
        )
    if not isinstance(sampled, Mapping):
        raise SchedulerError(
            f"update: sampled must map request ids to tokens, got {brief_repr(sampled)}"
        )
    tokens_of: dict[str, tuple[int, ...]] = {}
    for item in output.scheduled:
        rid = item.request_id
        if rid in aborted:
            continue
        seq = seqs.get(rid)
        if seq is None or rid not in running or seq.request.num_computed_tokens != item.start:
            raise SchedulerError(
                f"update: request {rid!r} of step {output.step} is not running from token "
                f"{item.start}; pass each schedule()'s output to update() once, in order"
            )
        if not item.samples:
            continue
        if rid not in sampled:
            raise SchedulerError(f"update: no sampled token for {rid!r}")
        value = sampled[rid]
        where = f"update: request {rid!r} (a sampled token, or a sequence of them)"
        tokens = (
            tuple(token_id(t, where) for t in value)
            if _is_sequence(value)
            else (token_id(value, where),)
        )
        draft = item.draft_token_ids
        if not 1 <= len(tokens) <= len(draft) + 1 or tokens[:-1] != draft[: len(tokens) - 1]:
            raise SchedulerError(
                f"update: request {rid!r} sampled {list(tokens)} for drafts {list(draft)}; "
                "expected the accepted drafts (a prefix of them) and one token more"
            )
        tokens_of[rid] = tokens
    return tokens_of
