"""Which requests of a workload a later request continues: an oracle for protected sessions.

A request *continues* an earlier one when its prompt starts with more than half of the
earlier one's prompt and reads a block the earlier request introduced (beyond the prefix that
request itself shared with the requests before it): the next turn of a conversation, a
resend.  A shared system prompt alone continues nothing, even the request that brought it.  The
first such request is the earlier one's *successor*, and a chain of successors is one
session.  :func:`continuations` reads that off a whole workload, so it knows the future:
:mod:`hybridkv.sim` uses it to play a client that knows which conversations go on
(``simulate --protect oracle``, :meth:`~hybridkv.cache.manager.KVCacheManager.protect`),
the most that client hints can add, next to the plain recency order that knows nothing.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.workloads.types import WorkloadError

__all__ = ["Continuation", "continuations"]


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...

    @property
    def output_token_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class Continuation:
    """One request's place in its session: the session's name (its first request's id) and
    the request that continues it (None: the session ends here)."""

    session: str
    successor: str | None


def _keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of ``tokens``' whole blocks of ``block_size``."""
    keys, key = [], 0
    for b in range(len(tokens) // block_size):
        key = hash((key, tuple(tokens[b * block_size : (b + 1) * block_size])))
        keys.append(key)
    return keys


def continuations(requests: Iterable[_Request], block_size: int = 16) -> dict[str, Continuation]:
    """Per request id, its session and successor (see the module doc), matching prompts at
    ``block_size`` granularity in arrival order.  Raises :class:`WorkloadError` for a block
    size below 1 or a repeated request id."""
    if not isinstance(block_size, int) or block_size < 1:
        raise WorkloadError(f"continuations: block_size must be >= 1, got {block_size!r}")
    owner: dict[int, int] = {}  # block key -> index of the latest request holding it
    ids: list[str] = []
    seen: set[str] = set()
    own_from: list[int] = []  # per request: its first block no earlier request held
    prompt_lens: list[int] = []
    successor: list[int | None] = []
    session: list[str] = []
    for j, r in enumerate(requests):
        if r.request_id in seen:
            raise WorkloadError(f"continuations: request id {r.request_id!r} repeats")
        seen.add(r.request_id)
        ids.append(r.request_id)
        prompt = tuple(r.prompt_token_ids)
        keys = _keys(prompt + tuple(r.output_token_ids), block_size)
        hittable = len(prompt) // block_size
        k = 0
        while k < hittable and keys[k] in owner:
            k += 1
        name = r.request_id
        if k:
            i = owner[keys[k - 1]]
            if k > own_from[i] and 2 * k * block_size > prompt_lens[i] and successor[i] is None:
                successor[i] = j
                name = session[i]
        own_from.append(k)
        prompt_lens.append(len(prompt))
        successor.append(None)
        session.append(name)
        for key in keys:
            owner[key] = j
    return {
        rid: Continuation(session[n], None if (s := successor[n]) is None else ids[s])
        for n, rid in enumerate(ids)
    }
